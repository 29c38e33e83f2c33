"""``aiolaunch attach RANK [LOG_DIR]``: a pdb prompt inside a running rank, from another terminal.

The control socket's ``attach`` command answers one JSON line; from then on
the connection carries the rank's pdb session (``_attach.py`` has the
supervisor's side, ``_child/_attach.py`` the rank's). The rank's side
sends a NUL byte each time pdb waits for a line, right after its prompt: the
text between the last newline and the NUL is the prompt, which this side
reads with :func:`input` (so readline edits and remembers the lines here, in
the user's terminal).

``continue`` (or ``quit``, or Ctrl-D) detaches: the rank goes on; so does
closing this client in any way (the rank's pdb reads end-of-file). Ctrl-C at
the prompt clears the line; while the rank runs (after ``next``) it detaches.

A session that closes without the rank's detach byte ended with the rank
(killed, exited, its job stopped): the client says so and exits 1 - also
while it shows the prompt (the socket's hang-up interrupts ``input()``), so
no live-looking ``(Pdb)`` stays behind for a rank that is gone.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

from .._child._attach import DETACHED
from ._live import ControlConnection

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["attach_main"]

WAITING = b"\0"  # the rank's pdb waits for a line (after its prompt)
#: interrupts ``input()`` when the session hangs up (this process's own use)
_GONE_SIGNAL = signal.SIGUSR1


class RankGone(Exception):
    """The session closed without a detach: the rank is gone."""


def _input_or_gone(prompt: str, sock: socket.socket) -> str | None:
    """:func:`_input`, given up when ``sock`` hangs up (:class:`RankGone`).

    A thread polls the socket while the main thread waits in ``input()``
    (readline's, which only a signal interrupts): on a hang-up it signals
    the main thread, whose handler raises.
    """
    if threading.current_thread() is not threading.main_thread():
        return _input(prompt)  # pragma: no cover - the CLI runs in the main thread
    stop_r, stop_w = os.pipe()
    main = threading.get_ident()

    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP | getattr(select, "POLLRDHUP", 0))
        poller.register(stop_r, select.POLLIN)
        if any(fd != stop_r for fd, _ in poller.poll()):
            signal.pthread_kill(main, _GONE_SIGNAL)

    def gone(signum: int, frame: object) -> None:
        raise RankGone

    previous = signal.signal(_GONE_SIGNAL, gone)
    watcher = threading.Thread(target=watch, name="aiolaunch-attach-watch", daemon=True)
    watcher.start()
    try:
        return _input(prompt)
    finally:
        os.write(stop_w, b"x")
        watcher.join()
        os.close(stop_r)
        os.close(stop_w)
        signal.signal(_GONE_SIGNAL, previous)


def _input(prompt: str) -> str | None:
    """One line from the user (``None``: end of input)."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            sys.stdout.write("\n")  # as pdb does at its prompt: a fresh line, nothing sent


def _session(sock: socket.socket, first: bytes) -> None:
    """Relay the session until the rank's side closes it.

    :raises RankGone: it closed without detaching (the rank is gone).
    """
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - Python built without readline
        pass
    out = sys.stdout
    pending = first
    done = detached = False
    sock.settimeout(None)
    while True:
        if DETACHED in pending:
            detached = True
            pending = pending.replace(DETACHED, b"")
        if WAITING not in pending:
            # Print all but a trailing partial line (it may be the prompt).
            text, nl, rest = pending.rpartition(b"\n")
            if nl:
                out.write((text + nl).decode("utf-8", "replace"))
                out.flush()
                pending = rest
            chunk = sock.recv(1 << 16)
            if not chunk:
                out.write(pending.decode("utf-8", "replace"))
                out.flush()
                if not detached:
                    raise RankGone
                return
            pending += chunk
            continue
        before, _, pending = pending.partition(WAITING)
        text, nl, prompt = before.rpartition(b"\n")
        out.write((text + nl).decode("utf-8", "replace"))
        out.flush()
        if done:
            continue  # already said goodbye: the rank's side closes
        line = _input_or_gone(prompt.decode("utf-8", "replace"), sock)
        if line is None:
            out.write("\n")
            done = True
            # The rank's pdb reads EOF: it detaches, says so and closes.
            sock.shutdown(socket.SHUT_WR)
            continue
        sock.sendall(line.encode("utf-8", "replace") + b"\n")


def attach_main(argv: Sequence[str]) -> int:
    """Run ``aiolaunch attach``: 0 once detached, 1 if the rank could not be attached."""
    p = argparse.ArgumentParser(
        prog="aiolaunch attach",
        description="Open a pdb prompt inside a running Python rank; `continue` (or Ctrl-D) "
        "detaches and the rank goes on. The other ranks keep running meanwhile.",
    )
    p.add_argument("rank", type=int, help="the local rank to attach to")
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        help="the job's --log-dir (searched up to 3 levels down); default: your one running job",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long the rank's main thread has to take the signal (default 10)",
    )
    args = p.parse_args(list(argv))
    if not args.timeout > 0:
        print(f"aiolaunch attach: --timeout {args.timeout} must be > 0", file=sys.stderr)
        return 2
    with ControlConnection(args.log_dir) as conn:
        try:
            answer = conn.request(
                {"cmd": "attach", "rank": args.rank, "timeout": args.timeout},
                timeout=args.timeout + 30,
            )
        except (OSError, ValueError) as exc:
            print(f"aiolaunch attach: {exc}", file=sys.stderr)
            return 1
        if not answer.get("ok"):
            print(f"aiolaunch attach: {answer.get('error')}", file=sys.stderr)
            return 1
        print(
            f"aiolaunch attach: rank {args.rank} (pid {answer.get('pid')}) of "
            f"{answer.get('name', 'the job')}; `continue` or Ctrl-D detaches, the rank goes on",
            file=sys.stderr,
        )
        assert conn.sock is not None
        try:
            _session(conn.sock, conn.take_buffered())
        except KeyboardInterrupt:
            sys.stdout.write("\n")
        except RankGone:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(
                f"aiolaunch attach: rank {args.rank} (pid {answer.get('pid')}) is gone: the "
                "session ended without a detach (the rank exited or was killed, or the job "
                "stopped)",
                file=sys.stderr,
            )
            return 1
        except OSError as exc:
            print(f"aiolaunch attach: {exc}", file=sys.stderr)
            return 1
    print(f"aiolaunch attach: detached from rank {args.rank}; it goes on", file=sys.stderr)
    return 0
