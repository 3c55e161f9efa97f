"""A stage's lanes of frames waiting to be computed, bounded in frames and in bytes."""

from __future__ import annotations

import asyncio


class Inbox(asyncio.Queue):
    """A lane's queue of frames to compute, whose next frame can be looked at without
    taking it: decode frames that queued up together are computed as one batch. It holds
    at most `max_bytes` of activations (one frame over it, if alone): 64 frames of the
    largest a stage takes were gigabytes parked by whoever holds the route token, where
    an honest head's prompt steps are a few megabytes. A full inbox stops reading the
    link (TCP holds the stage before)."""

    def __init__(self, maxsize: int, max_bytes: int | None = None):
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._roomy = asyncio.Event()
        self._roomy.set()

    @staticmethod
    def _size(frame) -> int:
        return frame.tensor.nbytes if getattr(frame, "tensor", None) is not None else 0

    def _put(self, item):
        super()._put(item)
        self.bytes += self._size(item)
        if self.max_bytes is not None and self.bytes >= self.max_bytes:
            self._roomy.clear()

    def _get(self):
        item = super()._get()
        self.bytes -= self._size(item)
        if self.max_bytes is None or self.bytes < self.max_bytes:
            self._roomy.set()
        return item

    async def put(self, item):
        await self._roomy.wait()
        await super().put(item)

    def peek(self):
        return self._queue[0]
