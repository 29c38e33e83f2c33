"""The sink interface: where one worker stream's bytes go."""

from __future__ import annotations

__all__ = ["Sink"]


class Sink:
    """Receives a stream's bytes in order: ``feed(data)`` calls on the event-loop
    thread, then one ``aclose()``. A sink never blocks the loop."""

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    def wanted(self) -> bool:
        """Whether this sink needs bytes now (a stream nobody needs is not read)."""
        return True

    def skip(self) -> None:
        """Bytes went by unread (nobody wanted them): resume at a line boundary."""

    async def aclose(self) -> None:
        """Flush everything fed so far and release resources. Idempotent."""
