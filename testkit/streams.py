"""Small waits for tests that drive a head directly: a reply's tokens, a condition."""

from __future__ import annotations

import asyncio
import time


async def tokens(handle) -> tuple[list[int], object]:
    """A request's token ids as they stream, and its Done."""
    from engine.pipeline.head import Delta

    toks = []
    async for ev in handle:
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
        else:
            return toks, ev
    raise AssertionError("the stream ended without a Done")


async def until(what, timeout: float = 60.0, every: float = 0.05):
    """Wait until what() is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(every)


async def tiny_head(source, addrs, **kw):
    """A started head over `addrs` on the CPU in float32 (a tiny model's tests), every
    reply running its full length."""
    from engine.pipeline.head import Head

    head = Head(source, addrs, dtype="float32", device="cpu", **kw)
    try:
        await head.start()
    except BaseException:
        await head.close()
        raise
    head.eos_ids = set()
    return head
