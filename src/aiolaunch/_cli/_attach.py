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
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import TYPE_CHECKING

from ._live import ControlConnection

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["attach_main"]

WAITING = b"\0"  # the rank's pdb waits for a line (after its prompt)


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
    """Relay the session until the rank's side closes it."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - Python built without readline
        pass
    out = sys.stdout
    pending = first
    done = False
    sock.settimeout(None)
    while True:
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
                return
            pending += chunk
            continue
        before, _, pending = pending.partition(WAITING)
        text, nl, prompt = before.rpartition(b"\n")
        out.write((text + nl).decode("utf-8", "replace"))
        out.flush()
        if done:
            continue  # already said goodbye: the rank's side closes
        line = _input(prompt.decode("utf-8", "replace"))
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
        except OSError as exc:
            print(f"aiolaunch attach: {exc}", file=sys.stderr)
            return 1
    print(f"aiolaunch attach: detached from rank {args.rank}; it goes on", file=sys.stderr)
    return 0
