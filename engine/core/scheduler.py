"""The head's scheduling decisions, sans-I/O: which sequences run, in which micro-batch,
how a new prompt is cut into chunks. The head (engine/pipeline/head.py) drives it on
the wall clock with real sockets; bench/simulator.py drives the very same object on a
simulated clock, so the simulator validates the scheduler that runs.

    sched = Scheduler(n_stages=3, capacity=kv_tokens, prompt_chunk="auto", hop_bytes=...)
    sched.add(seq)                                   # a request arrives
    if sched.retune_due(now):
        sched.retune(now, profiles, link_estimate)   # micro-batch count from the measurements
    for group in sched.schedule():                   # micro-batches to launch now
        c = sched.prompt_chunk(seq, prefill_curve, bandwidth)   # stream a new prompt ahead
        rows = sched.step_rows(group)                # what the step computes
        ...                                          # (the driver computes and sends)
    sched.advance(seq)                               # its step's token came back
    sched.release(seq)                               # it finished: its KV reservation returns
    sched.on_result(group)                           # the micro-batch is back at the head

Requests wait until the pipeline's KV budget can hold them (prompt + max_tokens on
every stage), then join one of K micro-batches at an iteration boundary (continuous
batching). Each micro-batch cycles head -> stage 1 -> ... -> last stage -> head; with K
>= the number of stages every stage has work while the others compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.core import microbatch
from engine.core.profile import interp
from engine.core.prompt_chunk import CAP as CHUNK_CAP
from engine.core.prompt_chunk import prompt_chunk_tokens

RETUNE_EVERY_S = 0.5   # the micro-batch count is re-picked at most this often


@dataclass(eq=False)
class Seq:
    """What the scheduler knows of a sequence; the head and the simulator extend it."""
    id: int
    prompt_len: int
    max_tokens: int
    pos: int = 0                 # tokens cached on the stages
    in_flight: int = 0           # tokens of the step now in the pipeline (0: none)
    opened: bool = False         # its prompt has gone into a step (the last stage knows it)
    opened_at: int = 0           # the position that step began at (what was cached before)
    done: bool = False
    # A request's other choices (n > 1) wait here rather than in the queue: the step that
    # completes this sequence's prompt copies its KV to them on every stage (a fork) and
    # the last stage samples their first tokens from its logits, so the prompt is
    # computed and sent over the links once. From that step on they are sequences of
    # their own, in this one's micro-batch.
    forks: list = field(default_factory=list)
    parent: "Seq | None" = None  # the sequence whose forks this one waits in

    @property
    def reservation(self) -> int:
        return self.prompt_len + self.max_tokens

    @property
    def need(self) -> int:
        """KV tokens it reserves at admission: its own and its waiting forks' (a fork holds
        a copy of the prompt's KV: the stages' KV keeps one slot per sequence)."""
        return self.reservation + sum(f.reservation for f in self.forks)


@dataclass(eq=False)
class Group:
    """A micro-batch: its members travel the pipeline together, one step at a time."""
    id: int
    seqs: list = field(default_factory=list)
    in_flight: bool = False
    step: int = 0                # counts its steps: a frame of another step is stale
    retiring: bool = False       # the count went down: admit nobody, go when empty


@dataclass
class Row:
    """One sequence's share of a step: n tokens from position pos."""
    seq: Seq
    pos: int
    n: int
    new: bool                    # the step opens the sequence (its whole remaining prompt)
    forks: list = field(default_factory=list)   # sequences forked from it after this step


class Scheduler:
    def __init__(self, n_stages: int, capacity: int = 0, *, micro_batches: int | None = None,
                 shared_cpu: bool = False, max_batch: int = 32, prompt_chunk: int | str | None = "auto",
                 hop_bytes: int = 0, dtype_bytes: int = 4, compress: str = "off"):
        self.n_stages = n_stages
        self.capacity = capacity          # KV tokens every stage can hold (the minimum)
        # Stages that share this machine's CPU (engine/model/cores.py) are one compute
        # resource: every step runs on all the idle cores, so one micro-batch keeps the
        # whole CPU busy, stage after stage, and every extra micro-batch only re-reads the
        # weights. On separate machines each stage is its own resource: as many
        # micro-batches as there are stages, at least.
        self.shared_cpu = shared_cpu
        self.micro_batches = micro_batches or (1 if shared_cpu else n_stages)
        # With no fixed count, microbatch.choose picks M..2M from the measured compute and
        # link figures and re-picks as they change. Not for stages sharing this CPU: over
        # loopback there are no transmission bubbles to fill.
        self.dynamic = micro_batches is None and n_stages > 1 and not shared_cpu
        self.max_batch = max_batch
        # Long prompts travel in chunks so stage 1 computes chunk k while the head computes
        # chunk k+1 (None: whole prompts). "auto": sized to the measured link (prompt_chunk.py).
        if not (prompt_chunk is None or prompt_chunk == "auto"
                or (type(prompt_chunk) is int and prompt_chunk > 0)):
            raise ValueError("prefill_chunk must be a positive number of tokens, 'auto' or None")
        self.prefill_chunk = prompt_chunk if n_stages > 1 else None
        self.hop_bytes = hop_bytes        # activation bytes per token per hop
        self.dtype_bytes = dtype_bytes
        self.compress = compress
        self.groups = [Group(i) for i in range(self.micro_batches)]
        self.waiting: list[Seq] = []
        # on one machine: tokens per piece of a long prompt computed in the prompt lane
        # ahead of its micro-batch (core/prompt_chunk.py lane_chunk_tokens; None: no lane), and
        # the one sequence in the lane
        self.lane_chunk: int | None = None
        self.lane: Seq | None = None
        self._lane_need = 0      # what the lane's sequence reserved (its prompt may be cut short)
        self.reserved = 0
        # KV tokens that ended replies leave on every stage for their follow-up
        # (core/kept_prefixes.py): the head sets it, and lets them go when a request needs
        # the room (room_wanted)
        self.kept = 0
        self._retuned_at = -math.inf
        self._last_steps: dict[int, int] = {}  # step counters of removed micro-batches (stale frames)

    # ---- requests ---------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        """Queue a sequence; its `forks` (the request's other choices) come with it."""
        for f in seq.forks:
            f.parent = seq
        self.waiting.append(seq)

    def withdraw(self, seq: Seq) -> bool:
        """Take a sequence that has not started out of the queue (cancelled)."""
        if seq.parent is not None:
            self._detach(seq)
            return True
        if seq in self.waiting:
            i = self.waiting.index(seq)
            heir = self._orphan(seq)
            self.waiting[i:i + 1] = [heir] if heir is not None else []
            return True
        return False

    def _detach(self, fork: Seq) -> None:
        """A fork leaves before its parent's prompt step (cancelled): an admitted parent's
        reservation for it returns."""
        parent = fork.parent
        fork.parent = None
        parent.forks.remove(fork)
        if any(parent in g.seqs for g in self.groups):
            self.reserved -= fork.reservation

    @staticmethod
    def _orphan(seq: Seq) -> Seq | None:
        """A sequence leaves with forks still waiting for its prompt: the first of them
        takes its place, the others wait on it (still one prefill)."""
        if not seq.forks:
            return None
        heir, rest = seq.forks[0], seq.forks[1:]
        seq.forks = []
        heir.parent, heir.forks = None, rest
        for f in rest:
            f.parent = heir
        return heir

    def active(self) -> int:
        """Sequences running or waiting (a waiting request's forks too, and the prompt lane's)."""
        laned = 0 if self.lane is None else 1 + len(self.lane.forks)
        return self.running() + sum(1 + len(s.forks) for s in self.waiting) + laned

    def running(self) -> int:
        return sum(len(g.seqs) for g in self.groups)

    def release(self, seq: Seq) -> bool:
        """A sequence finished: its KV reservation returns, and a micro-batch that is not
        in flight lets it go now (one in flight drops it when its step is back).
        Returns whether it had been admitted (the prompt lane counts: it holds KV)."""
        if seq.parent is not None:
            self._detach(seq)
            return False
        if seq is self.lane:
            self.lane = None
            self.reserved -= self._lane_need
            return True
        admitted = any(seq in g.seqs for g in self.groups)
        if admitted:
            self.reserved -= seq.reservation
            heir = self._orphan(seq)
            if heir is not None:
                # its forks never got their prompt: the first of them goes to the front
                # of the queue in its place and is admitted again, like any prompt
                self.reserved -= heir.need
                self.waiting.insert(0, heir)
            for g in self.groups:
                if seq in g.seqs and not g.in_flight:
                    g.seqs.remove(seq)
        return admitted

    # ---- decisions --------------------------------------------------------------------
    def retune_due(self, now: float) -> bool:
        return now - self._retuned_at >= RETUNE_EVERY_S

    def retune(self, now: float, profiles: list[dict], link) -> None:
        """Re-pick the micro-batch count from every stage's profile and the first link's
        estimate (core/link_scheduler.py's LinkEstimate; None: no link)."""
        self._retuned_at = now
        if not self.dynamic or link is None:
            return
        stage_curves = [(lambda b, p=p: interp(p["decode"], b)) for p in profiles]
        busy = [(lambda b: b * self.hop_bytes / link.bandwidth)] * (self.n_stages - 1)
        # path delay only: queueing behind our own volumes is what `busy` models
        one_way = (link.rtt_min if link.rtt_min != float("inf") else link.rtt) / 2
        latency = [one_way] * self.n_stages  # the last hop carries tokens: a few bytes
        k = microbatch.choose(self.n_stages, self.active(), stage_curves, busy, latency)
        for g in self.groups:
            g.retiring = g.id >= k
        while len(self.groups) < k:
            self.groups.append(Group(len(self.groups), step=self._last_steps.get(len(self.groups), 0)))
        self._drop_trailing(k)
        self.micro_batches = len([g for g in self.groups if not g.retiring])

    def schedule(self) -> list[Group]:
        """The micro-batches to launch now: idle ones that admitted or hold sequences,
        each marked in flight with its step counted."""
        # trailing micro-batches beyond the count, empty and idle, go (ids stay valid)
        self._drop_trailing(max(1, self.micro_batches))
        idle = [g for g in self.groups if not g.in_flight]
        # A newcomer that joins a decoding micro-batch holds its members' next token
        # until its whole prompt has crossed every link and stage (on a weak link, most
        # of a second, once per newcomer). So newcomers fill empty micro-batches first,
        # and when every micro-batch is decoding, a dynamic count (M..2M) opens one more
        # for them: it fills the links' bubbles meanwhile and leaves when its requests
        # finish. (A fixed count -- the FIFO baseline, --micro-batches, stages sharing
        # this CPU -- keeps vLLM's behaviour: newcomers join decoding batches.)
        if self.waiting and self.dynamic \
                and all(g.seqs and not g.retiring for g in self.groups) and len(self.groups) < 2 * self.n_stages:
            g = Group(len(self.groups), step=self._last_steps.get(len(self.groups), 0))
            self.groups.append(g)
            idle.append(g)
        for g in sorted(idle, key=lambda g: bool(g.seqs)):
            self._admit(g)
        launch = [g for g in idle if g.seqs]
        for g in launch:
            g.in_flight = True
            g.step += 1
        return launch

    def room_wanted(self) -> int:
        """KV tokens the first waiting request lacks while ended replies are kept for
        their follow-ups: that many of them must go before it can start (0: none waits,
        or it fits)."""
        if not self.waiting or not self.kept:
            return 0
        return max(0, min(self.kept, self.reserved + self.kept + self.waiting[0].need - self.capacity))

    def _drop_trailing(self, k: int) -> None:
        while len(self.groups) > k and not self.groups[-1].seqs and not self.groups[-1].in_flight:
            self._last_steps[self.groups[-1].id] = self.groups[-1].step
            self.groups.pop()

    def _laned(self, seq: Seq) -> bool:
        """Whether this waiting prompt goes through the prompt lane first (the head set a
        piece size; more than two pieces of it left; a request of n choices goes whole,
        its forks with it)."""
        return self.lane_chunk is not None and not seq.forks and seq.prompt_len - seq.pos > 2 * self.lane_chunk

    def take_for_lane(self) -> Seq | None:
        """The next waiting prompt long enough for the prompt lane, if the lane is free
        (its KV reserved): the head computes all but its last piece, then lane_done."""
        if self.lane is not None:
            return None
        for i, seq in enumerate(self.waiting):
            if self._laned(seq):
                if self.reserved + self.kept + seq.need > self.capacity:
                    return None  # wait for KV memory to come back
                self.waiting.pop(i)
                self._lane_need = seq.need
                self.reserved += seq.need
                self.lane = seq
                return seq
        return None

    def lane_done(self, seq: Seq) -> None:
        """Its prompt is down to its last piece: it waits, first in the queue, to join a
        micro-batch as any newcomer does (its reservation is taken again there)."""
        if seq is self.lane:
            self.lane = None
            self.reserved -= self._lane_need
            self.waiting.insert(0, seq)

    def _admit(self, g: Group) -> None:
        if g.retiring:
            return
        fair = max(1, math.ceil(self.active() / max(1, self.micro_batches)))
        limit = min(fair, self.max_batch)
        size = sum(1 + len(s.forks) for s in g.seqs)
        i = 0
        while i < len(self.waiting):
            seq = self.waiting[i]
            if self._laned(seq):
                i += 1   # waits for the prompt lane; shorter prompts behind it go on
                continue
            # a request and its forks join together; alone in a micro-batch, whatever n
            if size and size + 1 + len(seq.forks) > limit:
                break
            if self.reserved + self.kept + seq.need > self.capacity:
                break  # wait for KV memory to come back
            self.waiting.pop(i)
            self.reserved += seq.need
            size += 1 + len(seq.forks)
            g.seqs.append(seq)

    def chunk_size(self, prefill: list | None, bandwidth: float | None) -> int | None:
        """Tokens per prompt chunk for the next prompt (None: whole prompts): fixed, or
        sized to the first link's measured bandwidth, or the cap where there is no link
        between machines to measure (stages sharing this CPU talk over loopback)."""
        c = self.prefill_chunk
        if c != "auto":
            return c
        if self.shared_cpu or bandwidth is None or not prefill:
            return CHUNK_CAP
        return prompt_chunk_tokens(prefill, self.hop_bytes, self.dtype_bytes, bandwidth, compress=self.compress)

    def prompt_chunk(self, seq: Seq, prefill: list | None, bandwidth: float | None) -> int | None:
        """Tokens per chunk in which this new prompt streams ahead of its step (None:
        it goes whole, in the step)."""
        c = self.chunk_size(prefill, bandwidth)
        if not c:
            return None
        if self.active() <= 1:
            if self.shared_cpu:
                # alone, with stages sharing this CPU (one machine, over loopback): the
                # whole prompt in one step, each stage in turn borrowing every core, beats
                # chunks that each pay a step's fixed cost (reading the weights) again
                return None
            # alone in the pipeline: cut the prompt finer so every stage works on it at
            # once (time to first token), though each chunk pays a step's fixed cost
            c = min(c, max(16, math.ceil(seq.prompt_len / (2 * self.n_stages))))
        return c

    def step_rows(self, g: Group) -> list[Row]:
        """What a micro-batch's step computes: each new sequence's remaining prompt, one
        token for each decoding one. Marks them opened and in flight. A new sequence's
        forks join the micro-batch here, in flight with it: its step forks them."""
        rows = []
        for s in list(g.seqs):
            if s.done:
                continue
            new = not s.opened
            n = s.prompt_len - s.pos if new else 1
            if new:
                s.opened_at = s.pos
            s.opened = True
            s.in_flight = n
            forks = []
            if new and s.forks:
                forks, s.forks = s.forks, []
                for f in forks:
                    f.parent, f.opened, f.pos, f.in_flight, f.opened_at = None, True, s.pos, n, s.pos
                g.seqs.extend(forks)
            rows.append(Row(s, s.pos, n, new, forks))
        return rows

    # ---- results ----------------------------------------------------------------------
    @staticmethod
    def advance(seq: Seq) -> None:
        """Its step came back: the step's tokens are cached on every stage."""
        seq.pos += seq.in_flight
        seq.in_flight = 0

    def on_result(self, g: Group) -> None:
        """A micro-batch is back at the head: finished members leave it, it is idle."""
        for s in g.seqs:
            s.in_flight = 0
        g.seqs = [s for s in g.seqs if not s.done]
        g.in_flight = False
