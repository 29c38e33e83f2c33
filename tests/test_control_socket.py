"""The control socket exists and answers whatever the log dir's length.

Regression test for issue #27 item 4: where ``{log_dir}/control.sock`` was
105-107 bytes long (the CLI's ``--log-dir`` of 36-38 characters under
/home/alice), binding failed - the temporary name was 3 bytes longer than the
final one - and ``aiolaunch status`` found no job (or another one).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import pytest

import aiolaunch
from aiolaunch import Std

SUN_PATH_MAX = 107  # 108 bytes with the trailing NUL


def _ask(path: Path, request: dict[str, object]) -> dict[str, object]:
    # The wire protocol itself: one JSON object per line each way.
    target = os.readlink(path) if path.is_symlink() else str(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(target)
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    answer: dict[str, object] = json.loads(buf)
    return answer


def _log_dir(tmp_path: Path, sock_len: int) -> Path:
    base = str(tmp_path.resolve())
    pad = sock_len - len(base) - len("/control.sock") - 1
    assert pad > 0
    return Path(base) / ("d" * pad)


@pytest.mark.parametrize("sock_len", [100, 104, 105, 106, 107, 108, 120])
async def test_control_socket_at_any_path_length(tmp_path: Path, sock_len: int) -> None:
    log_dir = _log_dir(tmp_path, sock_len)
    sock = log_dir / "control.sock"
    assert len(os.fsencode(str(sock))) == sock_len
    async with aiolaunch.start_processes(
        "s", "sleep", {0: (30,)}, {0: {}}, log_dir=log_dir, redirects=Std.ALL
    ) as ctx:
        for _ in range(200):  # made by a task once start_processes returned
            if sock.exists() or sock.is_symlink():
                break
            await asyncio.sleep(0.01)  # allowed: the socket has no event
        assert sock.is_symlink() == (sock_len > SUN_PATH_MAX)
        answer = await asyncio.to_thread(_ask, sock, {"cmd": "status"})  # the loop serves it
        assert answer["ok"] is True and answer["v"] == 1
        assert answer["workers"][0]["pid"] == ctx.pids()[0]  # type: ignore[index]
    assert not sock.exists() and not sock.is_symlink()
    leftovers = [p.name for p in log_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == [], f"private folders left behind: {leftovers}"
