"""The head's speculative decoding (issue 34): SpeculationDriver (a mixin of Head), SPECULATE_CHOICES.
Drafts per round (prompt lookup or the draft model, on its own thread, drafting ahead), k, trip timing.

The decisions (k, whether a draft pays, drafting ahead) are the policy's
(engine/core/speculation.py); the head's steps carry the drafts and _on_tokens
(engine/pipeline/token_bookkeeping.py) verifies them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from engine.core.drafts import PromptLookup
from engine.core.scheduler import Group
from engine.core.sizes import size_words
from engine.core.speculation import describe as describe_speculation
from engine.model import catalog
from engine.model.draft import DraftModel
from engine.pipeline.requests import Sequence

log = logging.getLogger("potluck.head")

SPECULATE_CHOICES = ("auto", "off")   # speculative decoding: the policy decides, or never


def _yielding_thread(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task of its own),
    where the system allows it; elsewhere it runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


class SpeculationDriver:
    """Head's drafting: the draft model, each round's drafts, drafting ahead while a step is
    in flight, and the trips' measurements for the policy (a mixin of Head)."""

    async def _load_draft(self):
        """The draft model, on this machine's device before stage 0 loads (its memory is
        taken from what stage 0 may hold)."""
        spec = self.draft_spec
        if spec == "auto":   # the catalog's pairing for this model
            spec = catalog.draft_for(self.source.spec) or catalog.draft_for(self.source.name)
            if not spec:
                self.say(f"No draft model is paired with {self.source.name} in the catalog: prompt lookup drafts")
                return
        self.progress(0, 0, 1, "loading the model that guesses ahead")
        self.drafter = await self._run(lambda: DraftModel.load(
            spec, dtype=self.dtype, device=self.device, target_tokenizer=self.tokenizer,
            target_name=self.source.name, target_vocab=self.config.vocab_size))
        self.progress(0, 1, 1, "loading the model that guesses ahead")
        self.say(f"Draft model: {self.drafter.name} on {self.device_name}, "
                 f"{size_words(self.drafter.param_bytes)}; it drafts where speculation pays"
                 + ("" if self.speculate != "off" else " (speculation is off: --speculate auto turns it on)"))

    def speculation(self) -> dict:
        """The switch, who drafts, and tokens per trip and acceptance so far (status, the
        chat window)."""
        st = self.spec_policy.stats()
        out = {"mode": self.speculate, "draft": self.drafter.name if self.drafter is not None else "prompt lookup",
                "tokens_per_trip": st["tokens_per_trip"], "acceptance": st["acceptance"], "rounds": st["rounds"]}
        out["summary"] = describe_speculation(out)
        return out

    def _speculates(self, s: Sequence) -> bool:
        return self.speculate != "off" and s.spec and not s.cancelled

    def _k(self, s: Sequence, free: int = 0) -> int:
        """Tokens to draft after a decoding sequence this round, k from the policy (0: a
        plain step), `free` of them drafted ahead already. Never past its max_tokens: the
        KV its admission reserved holds the draft, and nothing past the window is drafted."""
        if not self._speculates(s):
            return 0
        return max(0, min(self.spec_policy.k_for(s.id, free), s.params.max_tokens - len(s.generated) - 1))

    async def _on_draft_thread(self, fn):
        """Run fn on the draft model's thread, ahead of any drafting-ahead: that yields to a
        waiting round at its next position (_draft_on's enough())."""
        def run():
            with self._drafts_lock:
                self._drafts_waiting -= 1
            return fn()

        with self._drafts_lock:
            self._drafts_waiting += 1
        return await asyncio.get_running_loop().run_in_executor(self._draft_exec, run)

    async def _drafts(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """This round's drafts for the decoding sequences of a step: seq id -> tokens."""
        if self.drafter is None:
            ks = {s.id: k for s in seqs if (k := self._k(s)) > 0}
            return {s.id: self._draft(s, ks[s.id]) for s in seqs if s.id in ks}
        if not any(self._speculates(s) for s in seqs):
            return {}
        if self._draft_reading:
            return {}   # the draft thread reads a new context (a prompt's compute): no waiting on it
        drafter = self.drafter
        # what the draft model guessed ahead during the last trip (its chains are settled
        # once this round has the draft thread: jobs run in order, ahead-drafting first),
        # and how much of each context it has yet to read
        ctxs = {s.id: s.prompt + s.generated for s in seqs}
        try:
            seen = await self._on_draft_thread(
                lambda: {sid: (drafter.ahead_of(sid, c), drafter.unread(sid, c)) for sid, c in ctxs.items()})
        except RuntimeError:   # the thread is shut down: the head is closing
            return {}
        ks = {}
        for s in seqs:
            free, unread = seen[s.id]
            k = self._k(s, free)
            if k <= 0:
                continue
            k_max = self.spec_policy.config.k_max
            if unread > k_max + 2 and self.draft_ahead:
                # more than a round's catch-up: a context new to the draft model. Reading it
                # is a prompt's compute, no round should wait on: it is read while this
                # step is in flight, and drafts start the round after -- where the sequence
                # has two whole rounds of guesses left to pay for it (a burst's last tokens
                # do not: there it would only take the host's cores from everyone's stage 0)
                s.draft_unread = s.params.max_tokens - len(s.generated) >= 2 * k_max
                continue
            ks[s.id] = k
        if not ks:
            return {}
        asks = [(sid, ctxs[sid], k) for sid, k in ks.items()]
        # kept replies too: a follow-up that takes one over reads only its new tokens
        live = [sid for sid, x in self.seqs.items() if not x.done] + self.kept.ids()

        def run():
            drafter.retain(live)   # sequences that finished since (and were not kept): their draft KV goes
            return drafter.draft(asks), drafter.seconds_per_token

        try:
            out, cost = await self._on_draft_thread(run)
        except (ValueError, RuntimeError) as exc:   # a guess is never worth a failed reply
            log.warning("the draft model failed: %s; plain steps this round", exc)
            return {}
        # the batch's drafting per computed guess (core/speculation.py's model), without the
        # prefill of a prompt new to the draft model, which is no guess's cost (guesses
        # drafted ahead the policy counts apart)
        if cost is not None:
            self.spec_policy.observe_draft(cost)
        return out

    def _draft_on(self, g: Group, seqs: list[Sequence], prompts: list[Sequence] = ()):
        """Overlap: the step checking these sequences' drafts (or a plain step) is on its
        way; the draft model drafts on after it, as if all of the draft stands, until the
        step comes back (_on_tokens stops it). If every guess stood and the target's own
        next token is the draft's next guess, the next round's guesses are ready
        (DraftModel.chain) and cost it only their verification (SpecPolicy's `free`); if
        not, they are dropped and it was the draft thread's idle time that paid.

        `prompts`, the sequences whose prompt this step carries: the prompt's trip is the
        time to read it into the draft model (one step, however long), which their first
        decode round would otherwise wait for -- where drafting ahead is known to pay at
        this load (a prompt is too dear a step to try it with). Not for a busy pipeline,
        where nobody drafts."""
        if self.drafter is None or not self.draft_ahead or self.spec_policy.busy:
            return
        ahead = self.spec_policy.config.k_max + 1   # the target's token, then a whole round
        policy = self.spec_policy
        asks, reading = [], False
        for s in seqs:
            if not self._speculates(s) or s.done:
                continue
            pays = policy.ahead_pays(s.id)
            if s.draft_unread:   # its context, read now (then guesses on, where that pays)
                s.draft_unread, reading = False, True
                asks.append((s.id, s.prompt + s.generated + s.draft, ahead if pays else 1))
            elif pays:
                asks.append((s.id, s.prompt + s.generated + s.draft, ahead))
        for s in prompts:
            if self._speculates(s) and not s.done and policy.ahead_pays(s.id, untried=False):
                asks.append((s.id, s.prompt + s.generated, ahead))
                reading = True
        if not asks:
            return
        stop = self._ahead_stop[g.id] = threading.Event()
        drafter = self.drafter

        def enough() -> bool:   # its step came back, or another micro-batch waits to draft
            return stop.is_set() or self._drafts_waiting > 0

        def run():   # queued behind other micro-batches' drafts, it may find its step back already
            drafter.draft(asks, stop=enough)
            return drafter.seconds_per_position

        def done(fut):
            if reading:
                self._draft_reading -= 1
            if fut.cancelled():
                return
            if fut.exception() is not None:
                log.warning("drafting ahead failed: %s", fut.exception())
            elif fut.result() is not None:   # how many guesses a trip has time for (ahead_pays)
                self.spec_policy.observe_ahead(fut.result())

        asyncio.get_running_loop().run_in_executor(self._draft_exec, run).add_done_callback(done)
        if reading:   # counted once it is queued: done() runs on this loop, after this
            self._draft_reading += 1

    def _stop_drafting_ahead(self, group_id: int | None = None):
        for gid in ([group_id] if group_id is not None else list(self._ahead_stop)):
            ev = self._ahead_stop.pop(gid, None)
            if ev is not None:
                ev.set()

    def _draft(self, s: Sequence, k: int) -> list[int]:
        """Prompt lookup's guess of up to k tokens after a decoding sequence."""
        t0 = time.perf_counter()
        if s.lookup is None:
            s.lookup = PromptLookup()
        known = len(s.lookup)
        if known < len(s.prompt):
            s.lookup.extend(s.prompt[known:])
            known = len(s.prompt)
        s.lookup.extend(s.generated[known - len(s.prompt):])
        draft = s.lookup.propose(k)
        self.spec_policy.observe_draft((time.perf_counter() - t0) / k)
        return draft

    def _measure_trip(self, group_id: int, errors: list) -> None:
        """A decode step's trip, head to head, for the speculation policy: a plain one
        times the ring, one with drafts the extra tokens' cost (over the plain trip)."""
        t0, drafted, decode = self._trips.pop(group_id, (None, 0, False))
        if t0 is None or not decode or errors:
            return
        seconds = time.monotonic() - t0
        if self.spec_policy.busy:
            return   # a busy pipeline's steps queue behind each other: no trip one person would see
        if not drafted:
            self.spec_policy.observe_trip(seconds)
        elif self.spec_policy.trip is not None:
            self.spec_policy.observe_verify_extra((seconds - self.spec_policy.trip) / drafted, drafted)
