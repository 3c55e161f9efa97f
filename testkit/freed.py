"""The leak check of the pipeline tests: every stage lets go of every sequence.

Ended replies stay cached on purpose (engine/pipeline/kept_replies.py), so a stage
first holds exactly the head's kept replies; once the head lets those go, nothing."""

from __future__ import annotations

import asyncio
import time


async def all_freed(head, timeout: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:   # no live sequence left: only the kept ones
        stats = await head.stage_stats()
        if all(s["seqs"] == len(head.kept) for s in stats):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"stages hold {stats}, the head keeps {len(head.kept)} replies")
        await asyncio.sleep(0.05)
    await head.drop_kept()
    while True:
        stats = await head.stage_stats()
        if all(s["seqs"] == 0 and s["kv_tokens"] == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held after {timeout}s: {stats}")
        await asyncio.sleep(0.05)
