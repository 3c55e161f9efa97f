"""An ended reply's KV kept on every stage for its follow-up: KeptReplies (a mixin of Head).

The decisions are core/kept_prefixes.py's; this is where they meet the sequences and the
stages. A reply that ends well leaves its sequence cached everywhere instead of freeing
it; a new request whose prompt starts with the same tokens takes that sequence over
(submit), and its first frame tells every stage to cut the sequence's KV back to where
the prompts part (`rewind`), so the stages compute only what is new. Kept replies that a
request needs the room of go in that request's first frame (`drop`): on the same path,
ahead of its step, so the room is there when the step arrives (and on the control
connection, so that they go even where that frame never gets).

On the wire (protocol 23) an activation frame may carry `rewind` {seq_id: n} and `drop`
[seq_id, ...]; every stage applies them before it computes the frame (apply_opening).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from engine.core.kept_prefixes import KeptPrefixes

if TYPE_CHECKING:
    from engine.pipeline.requests import Sequence

log = logging.getLogger("potluck.head")

KEEP_AFTER = ("stop", "length", "cancelled")   # an error's KV may be half written: it goes


def apply_opening(meta: dict, stage, sampler) -> None:
    """A frame's `drop` and `rewind`, on this stage (its compute thread, before the
    frame's step): kept replies let go, taken-over sequences cut back. A rewind this
    stage cannot do (the sequence is not here, or shorter) is left: the row's step then
    fails with the reason, as any row that does not fit the cache does."""
    for sid in meta.get("drop", ()):
        stage.free(sid)
        if sampler is not None:
            sampler.close(sid)
    for k, n in meta.get("rewind", {}).items():
        sid = int(k)
        if stage.kv.has(sid) and n <= stage.kv.length(sid):
            stage.kv.truncate(sid, n)
        else:
            log.warning("sequence %d: %d kept tokens to resume from, but %s here", sid, n,
                        f"{stage.kv.length(sid)} are cached" if stage.kv.has(sid) else "none is cached")


class KeptReplies:
    """Head's kept replies (self.sched, self.recovery, self.stage0, self.sampler, self._ahead,
    self._kick and self._free_everywhere are Head's)."""

    def _init_kept(self, most: int | None):
        if most is None:   # POTLUCK_KEEP_REPLIES=0 keeps none (bench/follow_up.py's "before")
            env = os.environ.get("POTLUCK_KEEP_REPLIES", "").strip()
            if env.isdigit():
                most = int(env)
            elif env:
                log.warning("POTLUCK_KEEP_REPLIES=%r is not a number of replies: keeping the default", env)
        self.kept = KeptPrefixes() if most is None else KeptPrefixes(most=most)
        self._kept_timer: asyncio.TimerHandle | None = None

    def _kept_changed(self):
        """The scheduler counts what is kept, and the oldest kept reply is let go once it
        has been unused long enough (_room_for_waiting, on the kick this timer gives)."""
        self.sched.kept = self.kept.tokens
        if self._kept_timer is not None:
            self._kept_timer.cancel()
            self._kept_timer = None
        oldest = self.kept.next_expiry()
        if oldest is not None and not self.recovery.closed:
            wait = max(0.0, oldest + self.kept.idle_s - time.monotonic()) + 0.5
            self._kept_timer = asyncio.get_running_loop().call_later(wait, self._kick)

    def _take_kept(self, seq: "Sequence"):
        """A new request whose prompt starts as a kept reply's tokens: it takes that
        sequence over, and only the rest of its prompt is computed."""
        if self.recovering or self.error:
            return   # the stages are being rearranged: what they kept is gone
        # a greedy or seeded reply computes the kept prompt's step again as it was
        # (kept_prefixes.py take): the same request sent twice reads the same reply
        p = seq.params
        hit = self.kept.take(seq.prompt, same_step=p.is_greedy or p.seed is not None)
        if hit is None:
            return
        seq.id, seq.pos = hit
        seq.rewind_to = seq.pos
        self._kept_changed()

    def _opening(self, seqs) -> dict:
        """What the stages must do before the first step of these sequences (the frame's
        `drop` and `rewind`); each sequence says it once."""
        ops: dict = {}
        for s in seqs:
            if s.drops:
                drop = ops.setdefault("drop", [])
                drop.extend(d for d in s.drops if d not in drop)
                s.drops = []
            if s.rewind_to is not None:
                ops.setdefault("rewind", {})[str(s.id)] = s.rewind_to
                s.rewind_to = None
        return ops

    def _apply_opening(self, ops: dict):
        """The head's own stage does what the frame will tell the others (compute thread)."""
        if not ops:
            return
        if self._ahead is not None:   # a position launched ahead for a sequence that ended is void
            self._ahead.forget([*ops.get("drop", ()), *(int(k) for k in ops.get("rewind", {}))])
        apply_opening(ops, self.stage0, self.sampler)

    def _room_for_waiting(self):
        """Kept replies go, least recently used first, when the next request needs their room."""
        short = self.sched.room_wanted()
        if short:
            ids = self.kept.evict(short)
            self._kept_changed()
            # in the first frame of whichever waiting request starts first (the scheduler
            # may start one behind a long prompt that waits for the prompt lane), ahead of
            # its step on every stage; and on the control connection too, so that they go
            # even where that frame never gets (a stage before it failed the step): a
            # second free is nothing
            for w in self.sched.waiting:
                w.drops.extend(ids)
            asyncio.ensure_future(self._free_everywhere(ids))
        gone = self.kept.expired(time.monotonic())
        if gone:
            self._kept_changed()
            asyncio.ensure_future(self._free_everywhere(gone))

    def _end_kv(self, s: "Sequence"):
        """A sequence ended and no step of it is on any stage: its KV is kept for a
        follow-up, or freed. What went into the model is its first `pos` tokens."""
        free, s.drops = [], []   # (those were freed when they were let go)
        if s.finish in KEEP_AFTER and not self.recovering and not self.error:
            # prompt + generated is the stream a replay starts over from too
            free += self.kept.keep(s.id, (s.prompt + s.generated)[:s.pos], time.monotonic(), len(s.prompt),
                                   s.opened_at)
            self._kept_changed()
        else:
            free.append(s.id)
        if free:
            asyncio.ensure_future(self._free_everywhere(free))

    def _forget_kept(self):
        """The stages are being rearranged, or the pipeline closes: nothing kept survives it."""
        self.kept.clear()
        self._kept_changed()

    async def drop_kept(self):
        """Every kept reply let go now, on every stage (the stages then hold only live
        sequences: what the tests' leak checks count)."""
        ids = self.kept.clear()
        self._kept_changed()
        if ids:
            await self._free_everywhere(ids)

    def kept_info(self) -> dict:
        k = self.kept
        return {"replies": len(k), "tokens": k.tokens, "hits": k.hits, "reused_tokens": k.reused_tokens}
