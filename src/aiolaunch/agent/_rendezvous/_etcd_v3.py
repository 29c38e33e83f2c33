"""``--rdzv-backend etcd-v3``: torch's dynamic rendezvous over etcd's v3 API.

torch's etcd backends (``etcd``, ``etcd-v2``) speak etcd's v2 API, which
etcd 3.4 turns off by default and etcd 3.6 removed. This one speaks v3
through etcd's own JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``,
``/v3/watch``, ``/v3/lease/*`` on the client URL; served by every etcd since
3.4) with the standard library's ``http.client``: no new dependency.

- :class:`EtcdV3RendezvousBackend`: torch's ``RendezvousBackend`` (the state
  of the rendezvous under ``{key_prefix}/rendezvous/{run_id}``), set with a
  compare-and-swap on the key's ``mod_revision`` (the fencing token).
  torch's ``DynamicRendezvousHandler`` does the rest, with aiolaunch's
  rounds as for ``c10d`` (``_rounds.py``: spares, liveness, a fresh
  workers' store per round): ``--nnodes MIN:MAX``, nodes joining,
  heartbeats, re-rendezvous after a failure.
- :class:`EtcdV3Store`: the ``Store`` the handler hands out (rank
  assignment, the exit barrier, the address of the workers' store), keys
  under ``{key_prefix}/store/{run_id}/``; a ``get`` of a missing key waits
  on an etcd watch, not a poll.
- The workers' own store is the TCPStore the agent of node rank 0 hosts
  (``TORCHELASTIC_USE_AGENT_STORE=True``), as torch does for c10d.

Every key carries a lease of ``ttl`` seconds (default 7200, torch's
etcd-v2 default), renewed while the agent writes: what a job leaves in etcd
goes away by itself.

``--rdzv-conf`` keys: ``read_timeout`` (seconds, default 60), ``ttl``,
``key_prefix`` (default ``/torch/elastic``), and those of torch's dynamic
rendezvous (``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``heartbeat``, ``keep_alive_interval``, ``keep_alive_max_attempt``).

Registered with torch's rendezvous registry by :func:`register` (aiolaunch
calls it) and, when aiolaunch is installed, by its ``torchrun.handlers`` entry
point, so ``torchrun --rdzv-backend etcd-v3`` and
``rendezvous.registry.get_rendezvous_handler`` work too.

Imports torch: load it lazily (``_torch.py`` does), never from ``import aiolaunch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datetime import timedelta


# Defined before the torch imports below: importing torch's rendezvous
# package loads the entry points, which may come back here mid-import.
def torchrun_handler() -> Any:
    """The ``torchrun.handlers`` entry point: torch registers what this returns."""
    return _create


def _create(params: Any) -> Any:
    """The registry's creator for ``etcd-v3``."""
    return create_handler(params)


import base64  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    RendezvousBackend,
    Token,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint  # noqa: E402

__all__ = [
    "EtcdV3Client",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "create_handler",
    "register",
    "torchrun_handler",
]

BACKEND = "etcd-v3"
DEFAULT_PORT = 2379
DEFAULT_TTL = 7200
DEFAULT_PREFIX = "/torch/elastic"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class EtcdError(ConnectionError):
    """etcd cannot be reached, or answered with an error."""


class EtcdV3Client:
    """The few calls of etcd's v3 JSON gateway the rendezvous needs; thread-safe
    (each call its own connection: the handler's heartbeat thread calls too)."""

    def __init__(self, host: str, port: int, *, timeout: float, ttl: int) -> None:
        self.host, self.port = host, port
        self._timeout = timeout
        self._ttl = ttl
        self._lease = 0
        self._lease_at = 0.0

    def __repr__(self) -> str:
        return f"EtcdV3Client({self.host}:{self.port})"

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call of the gateway (``path``, a JSON ``body``); its JSON answer."""
        return self._request(path, body)

    def _request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        # A connection per request: the rendezvous makes a few requests a
        # second at most, and nothing stays open between them (no fd, no
        # lock between the heartbeat thread and the agent's).
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self._timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise EtcdError(f"etcd at {self.host}:{self.port}: {exc}") from exc
        finally:
            conn.close()
        try:
            answer: dict[str, Any] = json.loads(data)
        except ValueError:
            answer = {"error": data[:200].decode(errors="replace")}
        if resp.status != 200 or "error" in answer:
            raise EtcdError(
                f"etcd at {self.host}:{self.port} {path}: HTTP {resp.status}: "
                f"{answer.get('error') or answer.get('message') or answer}"
            )
        return answer

    def status(self) -> dict[str, Any]:
        """The server's status (``/v3/maintenance/status``): a reachability check."""
        return self._request("/v3/maintenance/status", {})

    def range(self, key: bytes, *, prefix: bool = False) -> tuple[list[dict[str, Any]], int]:
        """``(kvs, revision)``: the key (or every key under ``prefix``) and the store's revision."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_prefix_end(key))
        answer = self._request("/v3/kv/range", body)
        return list(answer.get("kvs", [])), int(answer["header"]["revision"])

    def lease(self) -> int:
        """This client's lease id; granted on first use, renewed past a third of its TTL."""
        now = time.monotonic()
        if self._lease and now - self._lease_at < self._ttl / 3:
            return self._lease
        if self._lease:
            answer = self._request("/v3/lease/keepalive", {"ID": str(self._lease)})
            if int(answer.get("result", {}).get("TTL", 0)) > 0:
                self._lease_at = now
                return self._lease
        answer = self._request("/v3/lease/grant", {"TTL": str(self._ttl)})
        self._lease, self._lease_at = int(answer["ID"]), now
        return self._lease

    def put_op(self, key: bytes, value: bytes) -> dict[str, Any]:
        """A txn operation that writes ``key`` with this client's lease."""
        return {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(self.lease())}}

    def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], key: bytes
    ) -> tuple[bool, int, list[dict[str, Any]]]:
        """Run ``success`` if every ``compare`` holds, else read ``key``.

        :returns: ``(succeeded, revision, kvs of key when it failed)``.
        """
        body = {"compare": compare, "success": success, "failure": [_range_op(key)]}
        try:
            answer = self._request("/v3/kv/txn", body)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            self._lease = 0  # expired (a long pause): a new lease, once
            success = [self.put_op(*_put_args(op)) if "request_put" in op else op for op in success]
            body["success"] = success
            answer = self._request("/v3/kv/txn", body)
        revision = int(answer["header"]["revision"])
        if answer.get("succeeded"):
            return True, revision, []
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, revision, list(kvs)

    def put(self, key: bytes, value: bytes) -> None:
        """Write ``key`` (with this client's lease)."""
        self.txn([], [self.put_op(key, value)], key)

    def delete(self, key: bytes) -> int:
        """Delete ``key``; how many keys went."""
        answer = self._request("/v3/kv/deleterange", {"key": _b64(key)})
        return int(answer.get("deleted", 0))

    def wait_put(self, key: bytes, revision: int, deadline: float) -> bytes | None:
        """The value of the first write of ``key`` from ``revision`` on, or ``None``
        at ``deadline`` (monotonic) or when etcd ended the watch (compaction).

        An etcd watch (a streamed HTTP response, one JSON line per event): no polling.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn = http.client.HTTPConnection(self.host, self.port, timeout=remaining)
        try:
            body = {"create_request": {"key": _b64(key), "start_revision": str(revision)}}
            conn.request("POST", "/v3/watch", json.dumps(body))
            resp = conn.getresponse()
            if resp.status != 200:
                raise EtcdError(f"etcd at {self.host}:{self.port} /v3/watch: HTTP {resp.status}")
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if conn.sock is not None:
                    conn.sock.settimeout(remaining)
                line = resp.readline()
                if not line:
                    return None
                result = json.loads(line).get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return None
                for event in result.get("events", []):
                    if event.get("type", "PUT") == "PUT":
                        return _unb64(event["kv"].get("value", ""))
        except TimeoutError:
            return None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise EtcdError(f"etcd at {self.host}:{self.port} /v3/watch: {exc}") from exc
        finally:
            conn.close()


def _prefix_end(key: bytes) -> bytes:
    """The ``range_end`` of every key that starts with ``key`` (etcd's rule)."""
    end = bytearray(key)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _range_op(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def _put_args(op: dict[str, Any]) -> tuple[bytes, bytes]:
    put = op["request_put"]
    return _unb64(put["key"]), _unb64(put.get("value", ""))


def _absent(key: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def _unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The rendezvous state in one etcd key; its ``mod_revision`` is the fencing token."""

    def __init__(self, client: EtcdV3Client, run_id: str, key_prefix: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = f"{key_prefix.rstrip('/')}/{run_id}".encode()

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kvs, _ = self._client.range(self._key)
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            current = self.get_state()  # not one of ours: it cannot match
            return None if current is None else (*current, False)
        guard = _absent(self._key) if token is None else _unchanged(self._key, token)
        try:
            ok, revision, kvs = self._client.txn(
                [guard], [self._client.put_op(self._key, state)], self._key
            )
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if ok:
            return state, revision, True
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]), False


class EtcdV3Store(dist.Store):  # type: ignore[misc,name-defined]
    """torch's ``Store`` over etcd keys ``{prefix}{key}`` (what the rendezvous hands out)."""

    def __init__(self, client: EtcdV3Client, prefix: str, timeout: timedelta | None = None):
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix.encode() + _bytes(key)

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait([key], self.timeout)[0]

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        self._wait(keys, self.timeout if override_timeout is None else override_timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self._client.range(self._key(k))[0] for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key in one request (a txn of reads); a missing one is waited for."""
        body = {"success": [_range_op(self._key(k)) for k in keys]}
        responses = self._client.request("/v3/kv/txn", body).get("responses", [])
        values: list[bytes] = []
        for key, response in zip(keys, responses or [{}] * len(keys), strict=True):
            kvs = response.get("response_range", {}).get("kvs", [])
            values.append(_unb64(kvs[0].get("value", "")) if kvs else self.get(key))
        return values

    def add(self, key: str, num: int) -> int:
        k = self._key(key)
        kvs, _ = self._client.range(k)
        while True:  # compare-and-swap; a lost race means another writer won: read again
            old = int(_unb64(kvs[0]["value"])) if kvs else 0
            new = old + int(num)
            guard = _unchanged(k, int(kvs[0]["mod_revision"])) if kvs else _absent(k)
            ok, _, kvs = self._client.txn([guard], [self._client.put_op(k, str(new).encode())], k)
            if ok:
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        k = self._key(key)
        want, value = _bytes(expected), _bytes(desired)
        if want:
            guard = {"key": _b64(k), "target": "VALUE", "result": "EQUAL", "value": _b64(want)}
        else:
            guard = _absent(k)
        ok, _, kvs = self._client.txn([guard], [self._client.put_op(k, value)], k)
        if ok:
            return value
        return _unb64(kvs[0].get("value", "")) if kvs else want

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        return len(self._client.range(self._prefix.encode(), prefix=True)[0])

    def _wait(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        values: list[bytes] = []
        for key in keys:
            k = self._key(key)
            while True:
                kvs, revision = self._client.range(k)
                if kvs:
                    values.append(_unb64(kvs[0].get("value", "")))
                    break
                value = self._client.wait_put(k, revision + 1, deadline)
                if value is not None:
                    values.append(value)
                    break
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(  # TCPStore's error for the same
                        f"etcd-v3 store: key {key!r} not set within {timeout.total_seconds()} s"
                    )
        return values


def create_handler(params: RendezvousParameters) -> Any:
    """A torch ``DynamicRendezvousHandler`` over etcd v3 (the ``etcd-v3`` creator).

    :raises ValueError: a bad ``--rdzv-conf`` value.
    :raises RendezvousConnectionError: etcd does not answer at the endpoint.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", 60)
    ttl = params.get_as_int("ttl", DEFAULT_TTL)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"--rdzv-conf read_timeout={read_timeout} must be > 0 (seconds)")
    if ttl is None or ttl <= 0:
        raise ValueError(f"--rdzv-conf ttl={ttl} must be > 0 (seconds)")
    protocol = str(params.get("protocol", "http")).lower()
    if protocol != "http":
        raise ValueError(
            f"--rdzv-conf protocol={protocol}: the etcd-v3 backend speaks plain http only"
        )
    prefix = str(params.get("key_prefix", DEFAULT_PREFIX)).rstrip("/")
    client = EtcdV3Client(host, port, timeout=float(read_timeout), ttl=ttl)
    try:
        client.status()
    except EtcdError as exc:
        raise RendezvousConnectionError(
            f"the etcd-v3 rendezvous cannot reach etcd at {host}:{port} ({exc}); "
            "check --rdzv-endpoint"
        ) from exc
    backend = EtcdV3RendezvousBackend(client, params.run_id, f"{prefix}/rendezvous")
    store = EtcdV3Store(client, f"{prefix}/store/{params.run_id}")
    from ._rounds import create_rounds_handler

    return create_rounds_handler(store, backend, params)


def register() -> None:
    """Register ``etcd-v3`` with torch's rendezvous registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
