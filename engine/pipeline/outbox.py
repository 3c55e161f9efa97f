"""The frames a stage computed, waiting for its sender task (engine/pipeline/stage_server.py)."""

from __future__ import annotations

import asyncio


class Outbox:
    """The frames a stage computed, in order, for its sender task: bounded, so a head or
    next stage that reads slowly holds the compute lanes (and through their inboxes, TCP,
    the stage before) instead of frames piling up in memory. Retired when the route
    changes: a lane still putting into it is let go, what it held is dropped."""

    def __init__(self, maxsize: int):
        self._q: asyncio.Queue = asyncio.Queue(maxsize)
        self.retired = False

    async def put(self, item) -> None:
        if not self.retired:
            await self._q.put(item)

    async def get(self):
        return await self._q.get()

    def empty(self) -> bool:
        return self._q.empty()

    def retire(self) -> None:
        self.retired = True
        while not self._q.empty():   # each frees a slot: a lane waiting to put goes on
            self._q.get_nowait()
