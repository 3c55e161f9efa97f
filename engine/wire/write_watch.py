"""A peer that has read nothing of what we sent for a while is cut: a frozen or hostile
head would otherwise hold a stage's one head slot for as long as its socket lives.
websockets cannot tell on its own: its keepalive ping waits behind the same full send
buffer, and a close it starts waits for that buffer to drain before the connection ends,
so a handler reading (or sending) on it waits for ever. The decision is WriteStall
(pure); watch_writes runs it beside a connection."""

from __future__ import annotations

import asyncio


class WriteStall:
    """Fed (now, bytes still waiting to be written) now and then: whether nothing has left
    for `stall_s` seconds (the bytes waiting never fell, and never reached zero)."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._since: float | None = None
        self._last = 0

    def stalled(self, now: float, waiting: int) -> bool:
        if waiting == 0:
            self._since = None           # all of it read
        elif self._since is None or waiting < self._last:
            self._since = now            # waiting from now (the peer read some: counted afresh)
        self._last = waiting
        return self._since is not None and now - self._since >= self.stall_s


async def watch_writes(transport, stall_s: float, tick: float = 1.0) -> None:
    """Aborts `transport` once WriteStall says so; cancel it when the connection ends."""
    stall = WriteStall(stall_s)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(tick, stall_s / 4))
        if stall.stalled(loop.time(), transport.get_write_buffer_size()):
            transport.abort()
            return
