"""The head's token bookkeeping: TokenBookkeeping (a mixin of Head).
A step's tokens back (drafts verified), each token appended and streamed, a sequence finished and freed.
"""

from __future__ import annotations

import logging
import time

from websockets.exceptions import ConnectionClosed

from engine.wire import frames
from engine.model.detok import Detokenizer
from engine.core.spec_verify import verify_greedy
from engine.core.stop_text import StopText
from engine.pipeline.requests import Delta, Done, Sequence, TokenLogprob

log = logging.getLogger("potluck.head")


class TokenBookkeeping:
    """Head's tokens in: a step's answer, each token streamed, a sequence's end (a mixin of Head)."""

    def _on_tokens(self, group_id: int, step: int, tokens: list, errors: list):
        if not (0 <= group_id < len(self.groups)):
            log.warning("tokens for unknown micro-batch %d ignored", group_id)
            return
        g = self.groups[group_id]
        if step == 0:  # a prompt chunk failed on some stage
            for sid, msg in errors:
                s = self.seqs.get(sid)
                if s is not None:
                    self._finish(s, "error", msg)
            return
        if not g.in_flight or step != g.step:
            log.warning("stale tokens for micro-batch %d step %d ignored", group_id, step)
            return
        self._stop_drafting_ahead(group_id)   # its answer is here: no more guessing past it
        self._measure_trip(group_id, errors)
        members = {s.id: s for s in g.seqs}
        for sid, msg in errors:
            s = members.get(sid)
            if s is not None and not s.done:
                s.in_flight = 0
                self._finish(s, "error", msg)
        by_seq: dict[int, list] = {}   # a verification step answers one entry per position
        for entry in tokens:
            by_seq.setdefault(entry[0], []).append(entry)
        for sid, entries in by_seq.items():
            s = members.get(sid)
            if s is None or s.done or not s.in_flight:
                continue
            draft, s.draft = s.draft, []
            if draft:
                if len(entries) != len(draft) + 1:
                    s.in_flight = 0
                    self._finish(s, "error", f"a verification of {len(draft)} drafted tokens came back with "
                                             f"{len(entries)} tokens")
                    continue
                # the last stage drew what plain decoding would after each prefix of the
                # draft: the draft stands while it agrees (engine/core/spec_verify.py)
                verdict = verify_greedy(draft, [e[1] for e in entries])
                s.in_flight = verdict.n_accepted + 1   # what stays in every stage's KV
                self.spec_policy.observe_round(sid, len(draft), verdict.n_accepted)
                emitted = [(t, None) for t in draft[:verdict.n_accepted]] + [(verdict.next_token, None)]
            else:
                if s.spec and s.generated and self.speculate != "off":   # a plain decode round
                    self.spec_policy.observe_round(sid, 0, 0)
                entry = entries[0]
                lp = None
                if len(entry) == 4 and s.params.logprobs:
                    lp = TokenLogprob(entry[1], entry[2], [(t, v) for t, v in entry[3][:s.params.top_logprobs]])
                emitted = [(entry[1], lp)]
            self.sched.advance(s)
            if s.cancelled:
                self._finish(s, "cancelled")
                continue
            for tok, lp in emitted:
                if s.done:
                    break   # a stop, the end or max_tokens: what the draft guessed after it is not said
                self._append(s, tok, lp)
        for s in g.seqs:
            if s.in_flight and not s.done:
                # the step came back without it: a fork whose parent's step failed (every
                # row of a step gets a token or an error; forks ride on their parent's)
                s.in_flight = 0
                self._finish(s, "error", "the step that was to start this choice failed")
        for s in g.seqs:
            if s.needs_free:
                s.needs_free = False
                self._end_kv(s)
        self.sched.on_result(g)
        self._kick()

    def _append(self, s: Sequence, tok: int, lp: TokenLogprob | None = None):
        if s.t_first is None:
            s.t_first = time.perf_counter()
        self.tokens_served += 1
        if tok in self.eos_ids:
            self._finish(s, "stop")
            return
        s.generated.append(tok)
        if s.detok is None:
            s.detok = Detokenizer(self.tokenizer)
            s.stop_text = StopText(s.params.stop)
        # "" while the token ends inside a UTF-8 character: it comes with the next one;
        # held while the reply could be running into a stop sequence (engine/core/stop_text.py)
        for text, (toks, lps) in s.stop_text.add(s.detok.add(tok), ([tok], None if lp is None else [lp])):
            s.queue.put_nowait(Delta(text, toks, lps))
        if s.stop_text.stopped:
            self._finish(s, "stop")
        elif len(s.generated) >= s.params.max_tokens or len(s.prompt) + len(s.generated) >= self.context_length:
            self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str, error: str | None = None, free: bool = True):
        if s.done:
            return
        s.done = True
        s.finish = reason
        if s.stop_text is not None:
            for text, (toks, lps) in s.stop_text.flush():   # what was held for a stop that never came
                s.queue.put_nowait(Delta(text, toks, lps))
        self.seqs.pop(s.id, None)
        self.spec_policy.drop(s.id)
        in_group = self.sched.release(s)
        if free and in_group:
            if s.in_flight:
                s.needs_free = True  # its step is still on some stage
            else:
                self._end_kv(s)
        elif s.rewind_to is not None:
            # it took a kept reply over but never went out: the stages still hold that
            # reply (kept again, or freed)
            self._end_kv(s)
        now = time.perf_counter()
        s.queue.put_nowait(Done(reason, len(s.prompt), len(s.generated), error,
                                None if s.t_first is None else s.t_first - s.t_submit, now - s.t_submit))
        self._kick()

    async def _free_everywhere(self, ids: list[int]):
        if self.stage0 is None or self.recovery.closed:
            return  # mid-rearrangement (every stage starts afresh anyway), or closed

        stage0 = self.stage0

        def local():
            if self.stage0 is not stage0:
                return  # a rearrangement began while this waited for the executor
            with stage0.gate.step(decode=False):  # never under a parked step's feet
                for i in ids:
                    stage0.free(i)
                    self.sampler.close(i)

        await self._run(local)
        for r in self.remotes:
            try:
                await r.ws.send(frames.control("free", seq_ids=ids))
            except ConnectionClosed:
                pass
