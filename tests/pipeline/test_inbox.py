"""A lane's inbox holds a bounded number of frames and of bytes (engine/pipeline/inbox.py)."""

from __future__ import annotations

import asyncio

import torch

from engine.pipeline.inbox import Inbox
from engine.wire import frames


def frame(rows: int, width: int = 256):
    return frames.Frame(frames.FrameType.ACTIVATIONS, 0, 0, {}, torch.zeros(rows, width))


async def test_an_inbox_full_of_bytes_holds_the_sender_until_a_frame_is_taken():
    inbox = Inbox(maxsize=64, max_bytes=3 * 1024 * 4 * 256 // 2)     # room for one and a half
    await inbox.put(frame(1024))
    await inbox.put(frame(1024))          # the first left room: in, and now over
    third = asyncio.ensure_future(inbox.put(frame(1024)))
    await asyncio.sleep(0.05)
    assert not third.done() and inbox.qsize() == 2
    inbox.get_nowait()
    assert inbox.bytes == 1024 * 256 * 4
    await asyncio.wait_for(third, 1)      # room again
    assert inbox.qsize() == 2


async def test_a_frame_larger_than_the_bound_goes_in_alone():
    inbox = Inbox(maxsize=64, max_bytes=1000)
    await asyncio.wait_for(inbox.put(frame(64)), 1)
    second = asyncio.ensure_future(inbox.put(frame(1)))
    await asyncio.sleep(0.05)
    assert not second.done()
    assert inbox.peek().tensor.shape[0] == 64
    await inbox.get()
    await asyncio.wait_for(second, 1)
    assert inbox.bytes == 256 * 4
