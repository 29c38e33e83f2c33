"""A real etcd (Debian's ``etcd-server``, 3.4: the v2 API off, as by default)
started by the tests: on loopback, or inside a network namespace."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["etcd_server", "free_port", "require_etcd"]


def require_etcd() -> str:
    """The etcd binary, or skip with the reason."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if shutil.which("/usr/bin/etcd") else None)
    if path is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; .ci/run does)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def etcd_server(
    data: Path, host: str = "127.0.0.1", port: int | None = None, netns: str | None = None
) -> Iterator[str]:
    """Run etcd serving ``host:port`` (a free port on loopback by default); yield
    ``HOST:PORT``. Ready when its log says it serves clients; killed and reaped after."""
    binary = require_etcd()
    client = port or free_port()
    peer = free_port() if netns is None else client + 1
    data.mkdir(parents=True, exist_ok=True)
    log = data / "etcd.log"
    argv = [
        binary,
        "--name=aiolaunch-test",
        f"--data-dir={data / 'member'}",
        f"--listen-client-urls=http://{host}:{client}",
        f"--advertise-client-urls=http://{host}:{client}",
        f"--listen-peer-urls=http://{host}:{peer}",
        f"--initial-advertise-peer-urls=http://{host}:{peer}",
        f"--initial-cluster=aiolaunch-test=http://{host}:{peer}",
        "--enable-v2=false",
    ]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"ready to serve client requests" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"etcd did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        yield f"{host}:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
