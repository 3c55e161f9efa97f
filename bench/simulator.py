"""Discrete-event simulator of a Potluck pipeline over weak links.

Runs the real decision code on a simulated clock: the head's own scheduler
(engine.core.scheduler.Scheduler: admission, micro-batch count and formation, prompt
chunks), one engine.core.link_scheduler.LinkScheduler per link, engine.core.profile.interp
for the compute curves. Everything else is a model, kept close to the engine's code:

  compute    every stage (the head included) computes one step at a time: in the order
             they were handed over, or (policy cut_in, engine/core/step_gate.py) decode steps
             first, cutting into a running prompt step (class Compute). A step's time
             comes from its stage's profile: T_d(decode rows) + T_p(padded prompt
             tokens), the two sub-batches one after the other (StageModel._step). Stages have a machine
             each, or (validating against bench/weaklink.py, whose stage processes
             share one CPU) share its cores: steps that overlap slow each other by the
             contention bench/contention.py measures (Cpu, processor sharing).
  links      each hop is a serial FIFO wire: bandwidth B, one-way delay d. The sender is
             engine/pipeline/link.py's LinkSender (its own `cap` and `piece_bytes` code runs here):
             the scheduler's decisions are cut into pieces (20 ms of link time) and
             written while fewer than cap (about B_est x RTT_min + a piece) bytes are
             unacknowledged; goodput (from acks) and RTT (1 s pings, which queue behind
             the wire's backlog) feed the scheduler's LinkEstimate as they do live; a
             busy receiver (ack_hold) answers both late, as its one event loop does. By
             default the estimates start at the true link figures (a warmed-up service).
  receivers  stage_server.py: pieces are acknowledged on arrival; completed volumes queue
             for the compute thread, which takes decode volumes that queued up together
             as one batch (up to 64 rows). The last stage returns token frames to the
             head over its own uplink (B, d; no scheduler).
  the head   engine/pipeline/head.py around the same Scheduler: its decisions are the
             engine's; here each step's compute is a job on the head's simulated CPU and
             each volume goes to the head's Link; compression as engine/core/compression.py
             decides it (the real should_compress), bytes as its int8 blocks.

Policies (as bench/weaklink.py configures the head): fifo (whole volumes first come
first served, whole prompts in the step: no chunking anywhere), fifo-chunk (FIFO links,
prompts streamed in 64-token chunks), fixed and jit (decode-first link scheduling),
dynamic (jit and K in M..2M), compress (dynamic and compress="auto": prefill volumes as
int8 blocks while the link is clearly slower than compute), cut-in (dynamic, and decode steps
cut into prompt steps).

Speculative decoding (issue 34; simulate(..., spec=Spec(...)), off by default): the head asks
engine/core/speculation.py's SpecPolicy for k per decoding sequence, as head.py does, and
feeds it the simulated clock's measurements (plain trips, the extra tokens' cost, the
draft's cost, the load); a round drafting k carries 1 + k tokens, charged as 1 + k decode
rows, and keeps a seeded truncated-geometric number of them (see Spec).

Context: a decode row attending to c tokens costs ctx_cost x T_d(1) x (c - 8) more than
the profile's (its probes attend to 8 tokens); bench/weaklink.py measures ctx_cost
(engine.core.profile.context_cost) and records it. Omitted: the same for prompt chunks (a
chunk's T_p does not depend on its position), sampling and tokenizer time, EOS (every
request produces exactly n_out tokens), cancellations and errors, the bytes of control traffic (acks, pings, frees:
the acks' timing is modelled), TCP itself (the emulated links terminate TCP and behave
as ideal FIFO pipes, as testkit/linkemu.py does), the stage inbox's 64-frame bound,
compression's compute cost, and a discarded warm-up period (every request counts).

    .venv/bin/python bench/simulator.py                     # 70B over home GPUs, all cells
    .venv/bin/python bench/simulator.py --stages 4 --mbits 20 --loads medium
    .venv/bin/python bench/simulator.py --validate results.json   # bench/weaklink.py --json
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.core import scheduler as core  # noqa: E402
from engine.core.compression import q8_ratio, should_compress  # noqa: E402
from engine.core.link_scheduler import GoodputMeter, LinkScheduler, next_rtt_min  # noqa: E402
from engine.core.profile import PROFILE_CONTEXT, interp  # noqa: E402
from engine.core.speculation import SpecConfig, SpecPolicy  # noqa: E402
from engine.core.step_gate import MAX_CUT_INS  # noqa: E402
from engine.pipeline.link import LinkSender  # noqa: E402
from engine.pipeline.stage_server import MAX_MERGED_ROWS  # noqa: E402

# ---- workload ---------------------------------------------------------------------------
# Lengths shaped like the Azure LLM inference trace's conversation requests as MoLink uses
# it (prompts broad, median ~1k tokens, many under 500; outputs mostly under 200), with
# its filter: prompts over 2048 and outputs over 1024 tokens are dropped (redrawn here).
IN_MEDIAN, IN_SIGMA, IN_MAX = 900, 0.8, 2048
OUT_MEDIAN, OUT_SIGMA, OUT_MAX = 130, 1.0, 1024


def _lognormal(rng: random.Random, median: float, sigma: float, hi: int) -> int:
    while True:
        x = round(rng.lognormvariate(math.log(median), sigma))
        if 1 <= x <= hi:
            return x


def workload(rate: float, n: int, seed: int = 0, scale: float = 1.0) -> list[tuple[float, int, int]]:
    """n requests as (arrival time s, prompt tokens, output tokens): Poisson arrivals at
    `rate` requests/s; `scale` multiplies both lengths (e.g. 0.25 for a CPU-sized run).
    The same (rate, n, seed, scale) gives the same requests everywhere."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        n_in = _lognormal(rng, IN_MEDIAN, IN_SIGMA, IN_MAX)
        n_out = _lognormal(rng, OUT_MEDIAN, OUT_SIGMA, OUT_MAX)
        out.append((t, max(1, round(n_in * scale)), max(1, round(n_out * scale))))
    return out


# ---- what is simulated ------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    link: str = "jit"                 # LinkScheduler mode: fifo | fixed | jit
    prompt_chunk: int | str | None = 64  # the head streams prompts in chunks of this many tokens
                                         # ("auto": engine/core/prompt_chunk.py's)
    dynamic: bool = False             # K from microbatch.choose (else fixed) ...
    micro_batches: int | None = None  # ... the fixed K (None: the number of stages)
    compress: str = "off"             # engine/core/compression.py policy: off | auto | prefill | all
    cut_in: bool = False              # decode steps cut into prompt steps (Head compute="decode-first")


POLICIES = {
    "fifo": Policy("fifo", prompt_chunk=None),        # whole volumes, first come first served
    "fifo-chunk": Policy("fifo"),                     # ... of prompts computed in 64-token chunks
    "fixed": Policy("fixed"),                         # decode first, fixed prefill chunks (20 ms of link)
    "jit": Policy("jit"),                             # decode first, just-in-time chunks
    "dynamic": Policy("jit", dynamic=True),           # ... and K in M..2M
    "compress": Policy("jit", dynamic=True, compress="auto"),
    "cut-in": Policy("jit", dynamic=True, cut_in=True),   # dynamic, and decode steps cut into prompt steps
}


@dataclass(frozen=True)
class Spec:
    """Speculative decoding on the simulated head (issue 34), decided by the engine's own
    engine/core/speculation.py SpecPolicy, fed the simulated clock's measurements as head.py
    feeds it the wall clock's: each decode row's k from k_for (capped so no row drafts past
    its n_out), a round drafting k carries 1 + k tokens and is charged as 1 + k decode rows
    (T_d of the step's decode tokens: the weights are read once), the host drafts k tokens
    for `draft` seconds each on the head's compute before the step, and the number that
    stand is drawn per round from a seeded truncated geometric (each drafted token stands
    with probability `accept`, given the ones before it stood; at most k). The round emits
    that many + 1 tokens; the rejected ones' KV is rolled back (nothing to simulate: the
    position advances by what stood)."""
    accept: float                       # per-token acceptance of the draft
    draft: float = 0.0                  # host seconds per drafted token
    seed: int = 0
    config: SpecConfig | None = None    # the policy's settings (None: SpecConfig())
    k: int | None = None                # draft this many every round instead of asking the policy

    def __post_init__(self):
        if not 0.0 <= self.accept <= 1.0 or self.draft < 0.0 or (self.k is not None and self.k < 0):
            raise ValueError(f"speculation settings out of range: {self}")


ALIASES = {"fifo+c64": "fifo-chunk", "jit+dyn": "dynamic", "+auto-chunk": "dynamic", "+cut-in": "cut-in",
           "+compress": "compress"}   # bench/weaklink.py's names


@dataclass
class Pipeline:
    profiles: list[dict]              # per stage, head first: {"decode": [[rows, s]..], "prefill": [[tokens, s]..]}
    bandwidth: float                  # bytes/s of every stage's uplink
    delay: float                      # one-way seconds
    hidden_bytes: int                 # activation bytes per token per hop
    dtype_bytes: int = 2              # bytes per activation value (compression's ratio)
    kv_capacity: int = 1 << 18        # tokens of KV the pipeline holds (min over stages)
    max_batch: int = 32
    piece: int | None = None          # LinkSender's piece and in-flight floor in bytes
    min_in_flight: int | None = None  # (None: they follow the measured bandwidth, as live)
    n_wait: int = 30
    warm: bool = True                 # links start with their bandwidth and RTT measured
    cores: int | None = None          # compute threads share this many cores (None: a machine each)
    contention: float = 0.0           # slowdown per extra step running at once (shared memory bus)
    ctx_cost: float = 0.0             # decode cost of context (engine.core.profile.context_cost; 0: ignored)
    ack_hold: float = 0.0             # s a receiver's loop takes to acknowledge a piece (a busy CPU) ...
    hold_pongs: bool = True           # ... and to answer a ping, as the live loop does (False: an RTT
                                      # figure that leaves the hold out)
    hold_from: float = 0.0            # s into the run the hold begins (a friend starts a game)
    work_profiles: list[dict] | None = None  # what steps take, if not what `profiles` (the head's
                                             # and schedulers' view) say: see validate()

    @property
    def n_stages(self) -> int:
        return len(self.profiles)

    def hold_at(self, now: float) -> float:
        return self.ack_hold if now >= self.hold_from else 0.0


# wire overheads (bytes): frame header, per row in the meta, a new sequence's prompt ids
# and sampling parameters in the meta, a CHUNK frame's own header per piece
FRAME_HEADER, ROW_META, PROMPT_META, NEW_META, PIECE_HEADER = 64, 20, 6, 120, 80


class Curve:
    """engine.core.profile.interp through a profile's points, remembered per n (it is called a lot)."""

    def __init__(self, points: list):
        self.points, self._memo = points, {}

    def __call__(self, n: float) -> float:
        t = self._memo.get(n)
        if t is None:
            t = self._memo[n] = interp(self.points, n)
        return t


def decode_row(s, n: int) -> bool:
    """A decode row: one token, or (speculation) the last token and the k drafted after it."""
    return n == 1 or (n == getattr(s, "drafted", 0) + 1)


def step_time(decode: Curve, prefill: Curve, rows: list, ctx_cost: float = 0.0) -> float:
    """A step's compute as the stage runs it (StageModel._step): decode rows and prompt
    rows go as two sub-batches one after the other, prompt rows left-padded to the
    longest of them; a verification row of 1 + k tokens counts as 1 + k decode rows
    (speculation: the step reads the weights once). The decode profile was taken at a context of PROFILE_CONTEXT
    tokens; each decode row's longer context adds ctx_cost (engine.core.profile.context_cost)
    of a 1-row step per token."""
    n_decode = sum(n for s, n in rows if decode_row(s, n))
    prompts = [n for s, n in rows if not decode_row(s, n)]
    t = decode(n_decode) if n_decode else 0.0
    if ctx_cost and n_decode:
        extra = sum(n * max(0, s.n_in + s.generated - PROFILE_CONTEXT) for s, n in rows if decode_row(s, n))
        t += ctx_cost * decode(1) * extra
    if prompts:
        t += prefill(len(prompts) * max(prompts))
    return t


# ---- the event loop ---------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0
        self.stopped = False
        self._q: list = []
        self._n = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._q, (t, next(self._n), fn, args))

    def run(self) -> None:
        while self._q and not self.stopped:
            self.now, _, fn, args = heapq.heappop(self._q)
            fn(*args)


class Wire:
    """A serial FIFO pipe: bytes leave one after another at `bandwidth`, arrive `delay` later."""

    def __init__(self, clock: Clock, bandwidth: float, delay: float):
        self.clock, self.bandwidth, self.delay = clock, bandwidth, delay
        self.free_at = 0.0
        self.bytes = 0

    def put(self, nbytes: int, fn, *args) -> None:
        self.free_at = max(self.clock.now, self.free_at) + nbytes / self.bandwidth
        self.bytes += nbytes
        self.clock.at(self.free_at + self.delay, fn, *args)

    def backlog(self) -> float:
        return max(0.0, self.free_at - self.clock.now)


class Cpu:
    """The compute threads' processors. Each stage (the head too) owns one by default:
    a job of w seconds (its profile, measured alone) ends w seconds after it starts.

    On one machine -- bench/weaklink.py's stage processes, one torch thread each, on
    a 2-core box -- the threads share `cores` and one memory bus: while n jobs run at
    once, each progresses at rate(n) = min(1, cores / n) / (1 + contention * (m - 1)),
    m = min(n, cores) of them on a core at a time (processor sharing). `contention`
    is measured (bench/contention.py): decode steps are bound by reading weights, and
    two at once share the bus."""

    def __init__(self, clock: Clock, cores: int | None = None, contention: float = 0.0):
        self.clock, self.cores, self.contention = clock, cores, contention
        self.shared = cores is not None
        self._jobs: list[list] = []   # [remaining work, version, fn, args, suspended]
        self._t = 0.0

    def rate(self, n: int) -> float:
        if n <= 1 or not self.shared:
            return 1.0
        m = min(n, self.cores)
        return min(1.0, self.cores / n) / (1 + self.contention * (m - 1))

    def run(self, work: float, fn, *args) -> list:
        """Start a job; returns its handle (for suspend/resume)."""
        self._advance()
        job = [work, 0, fn, args, False]   # remaining work, version, callback, args, suspended
        self._jobs.append(job)
        self._reschedule()
        return job

    def suspend(self, job: list) -> None:
        """A prompt step parked at a layer while a decode step cuts in (step_gate.py)."""
        self._advance()
        job[4] = True
        self._reschedule()

    def resume(self, job: list) -> None:
        self._advance()
        job[4] = False
        self._reschedule()

    def _running(self) -> list:
        return [j for j in self._jobs if not j[4]]

    def _advance(self) -> None:
        running = self._running()
        done = (self.clock.now - self._t) * (self.rate(len(running)) if self.shared else 1.0)
        for j in running:
            j[0] = max(0.0, j[0] - done)
        self._t = self.clock.now

    def _reschedule(self) -> None:
        running = self._running()
        r = self.rate(len(running)) if self.shared else 1.0
        for j in self._jobs:
            j[1] += 1   # earlier finish events of this job are stale now
            if not j[4]:
                self.clock.at(self.clock.now + j[0] / r, self._finish, j, j[1])

    def _finish(self, job: list, version: int) -> None:
        if version != job[1] or job not in self._jobs:
            return
        self._advance()
        self._jobs.remove(job)
        self._reschedule()
        job[2](*job[3])


@dataclass(eq=False)
class Seq(core.Seq):
    """A simulated request: the scheduler's sequence (prompt_len = n_in tokens in,
    max_tokens = n_out tokens out, every one generated), and when its tokens came."""
    arrival: float = 0.0
    generated: int = 0
    first: float | None = None
    last: float | None = None
    times: list = field(default_factory=list)   # each token's time (to compare timelines)
    drafted: int = 0     # tokens drafted in its step now in flight (speculation; 0: none)

    @property
    def n_in(self) -> int:
        return self.prompt_len

    @property
    def n_out(self) -> int:
        return self.max_tokens


@dataclass(eq=False)
class Step:
    """What one volume carries: rows of (sequence, tokens) of a group's step, or a prompt chunk."""
    group: core.Group
    rows: list
    partial: bool
    meta: int       # meta bytes

    @property
    def decode(self) -> bool:
        return not self.partial and all(decode_row(s, n) for s, n in self.rows)


class Link:
    """engine/pipeline/link.py's LinkSender on a Wire: decisions cut into pieces, a capped number of
    unacknowledged bytes, goodput and RTT measured and fed to the scheduler."""

    # the sender's own sizing code: it reads sched, piece, min_in_flight, max_in_flight, rtt_min
    cap = LinkSender.cap
    piece_bytes = LinkSender.piece_bytes
    piece_for = LinkSender.piece_for

    def __init__(self, clock: Clock, sched: LinkScheduler, wire: Wire, receiver: "Stage", piece: int | None,
                 min_in_flight: int | None, warm: bool, max_in_flight: int = 16 << 20, ping_interval: float = 1.0):
        self.clock, self.sched, self.wire, self.receiver = clock, sched, wire, receiver
        self.piece, self.min_in_flight, self.max_in_flight = piece, min_in_flight, max_in_flight
        self.ping_interval = ping_interval
        self._ids = itertools.count(1)
        self._steps: dict[int, Step] = {}
        self.committed: deque = deque()
        self.in_flight = 0
        self.rtt_min: float | None = None
        self.goodput = GoodputMeter(sched.link)
        if warm:
            sched.link.observe_goodput(wire.bandwidth)
            sched.link.observe_rtt(2 * wire.delay)
            self.rtt_min = 2 * wire.delay
        clock.at(ping_interval, self._ping)

    def submit(self, nbytes: int, kind: str, step: Step) -> None:
        vid = next(self._ids)
        self._steps[vid] = step
        self.sched.enqueue(vid, kind, nbytes, self.clock.now)
        self._pump()

    def _pump(self) -> None:
        while self.in_flight < self.cap:
            if not self.committed:
                s = self.sched.next_send(self.clock.now)
                if s is None:
                    break
                end, piece = s.offset + s.length, self.piece_for(s.kind)
                for off in range(s.offset, end, piece):
                    n = min(piece, end - off)
                    done = self._steps.pop(s.volume_id) if s.last and off + n == end else None
                    self.committed.append((n, done))
            n, done = self.committed.popleft()
            self.in_flight += n
            self.wire.put(n + PIECE_HEADER, self.receiver.piece_arrived, self, n, done)

    def on_ack(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        backlog = bool(self.sched.pending or self.committed or self.in_flight >= self.cap // 2)
        self.goodput.on_ack(self.clock.now, nbytes, backlog)
        self._pump()

    def _ping(self) -> None:
        # the ping queues behind the wire's bytes, and the receiver's loop answers it as late
        # as it acknowledges
        pipe = self.receiver.sim.pipe
        rtt = 2 * self.wire.delay + self.wire.backlog() + (pipe.hold_at(self.clock.now) if pipe.hold_pongs else 0.0)
        ahead = self.in_flight / max(1.0, self.sched.link.bandwidth)
        self.clock.at(self.clock.now + rtt, self._pong, rtt, ahead)

    def _pong(self, rtt: float, ahead: float) -> None:
        self.sched.link.observe_rtt(rtt)
        self.rtt_min = next_rtt_min(self.rtt_min, rtt, ahead)
        self.clock.at(self.clock.now + self.ping_interval, self._ping)


def _merge(steps: list) -> list:
    """Decode steps that queued up together go as one batch, up to MAX_MERGED_ROWS rows."""
    out = steps[:1]
    for x in steps[1:]:
        if sum(len(y.rows) for y in out) >= MAX_MERGED_ROWS:
            break
        out.append(x)
    return out


class Compute:
    """A stage's compute (the head's too), as stage_server.py and head.py run it.

    In order (compute="in-order", and every FIFO configuration): one step at a time,
    in the order handed over. With cut-ins (engine/core/step_gate.py): decode steps go
    before waiting prompt steps, and one that arrives while a prompt step runs cuts
    in -- the prompt step is suspended and resumes once no decode step waits (at most
    MAX_CUT_INS per prompt step). The engine parks a prompt step at its next layer
    boundary; here it parks at once (a layer of a 64-token chunk is ~7-11 ms on this CPU:
bench/weaklink.py's profile, 108 tokens in 184-290 ms over 15 layers).
    """

    def __init__(self, sim: "Simulation"):
        self.sim, self.cut_in = sim, sim.policy.cut_in
        self.running: list | None = None     # the Cpu job computing now
        self.running_decode = False
        self.parked: list | None = None      # a prompt step a decode step cut into
        self.cut_ins = 0

    def next_kind(self, decode_waits: bool, any_waits: bool) -> bool | None:
        """What to start now: True (the waiting decode steps), False (the first waiting
        step), or None (nothing: busy, or nothing waits). Parks or resumes a prompt step."""
        if not self.cut_in:
            return None if self.running is not None or not any_waits else False
        if self.running is None and self.parked is None:
            return True if decode_waits else (False if any_waits else None)
        if self.running is None:                      # a prompt step is parked
            if decode_waits and self.cut_ins < MAX_CUT_INS:
                self.cut_ins += 1
                return True
            self.sim.cpu.resume(self.parked)
            self.running, self.parked, self.running_decode = self.parked, None, False
            return None
        if decode_waits and not self.running_decode and self.cut_ins < MAX_CUT_INS:
            self.sim.cpu.suspend(self.running)
            self.parked, self.running = self.running, None
            self.cut_ins += 1
            return True
        return None

    def start(self, seconds: float, decode: bool, fn, *args) -> None:
        if not decode:
            self.cut_ins = 0                  # a new prompt step
        self.running_decode = decode
        self.running = self.sim.cpu.run(seconds, fn, *args)

    def finished(self) -> None:
        self.running, self.running_decode = None, False


class Stage:
    """A stage server: pieces are acknowledged as they arrive; completed volumes wait for
    the compute thread, which takes decode volumes that queued up together as one batch;
    outputs go to the next link (or, from the last stage, token frames to the head)."""

    def __init__(self, sim: "Simulation", index: int):
        self.sim, self.index = sim, index
        self.decode, self.prefill = sim.work[index]
        self.out: Link | None = None
        self.inbox: deque = deque()
        self.compute = Compute(sim)

    def piece_arrived(self, link: Link, nbytes: int, step: Step | None) -> None:
        now = self.sim.clock.now
        self.sim.clock.at(now + link.wire.delay + self.sim.pipe.hold_at(now), link.on_ack, nbytes)
        if step is not None:
            self.inbox.append(step)
            self._serve()

    def _serve(self) -> None:
        pick = self.compute.next_kind(any(x.decode for x in self.inbox), bool(self.inbox))
        if pick is None:
            return
        if pick:   # the decode lane: every decode step queued
            steps = [x for x in self.inbox if x.decode]
        else:      # the first waiting step, and decode steps queued right behind a decode step
            steps = [self.inbox[0]]
            if steps[0].decode:
                steps += itertools.takewhile(lambda x: x.decode, itertools.islice(self.inbox, 1, None))
        steps = _merge(steps)
        for x in steps:
            self.inbox.remove(x)
        decode = steps[0].decode
        rows = [r for x in steps for r in x.rows]
        now = self.sim.clock.now
        if decode and self.out is not None:
            self.out.sched.decode_compute_started(now, len(rows))
        self.compute.start(step_time(self.decode, self.prefill, rows, self.sim.pipe.ctx_cost), decode, self._done, steps, now)

    def _done(self, steps: list, started: float) -> None:
        self.compute.finished()
        now = self.sim.clock.now
        if self.out is not None and steps[0].decode:
            self.out.sched.decode_compute_finished(now)
        for step in steps:
            if self.out is not None:
                kind = "decode" if step.decode else "prefill"
                self.out.submit(self.sim.volume_bytes(step, kind, self.out, now - started), kind, step)
            elif not step.partial:
                # a token per row, and per drafted position of a verification row
                entries = sum(n if s.drafted and n == s.drafted + 1 else 1 for s, n in step.rows)
                self.sim.back.put(FRAME_HEADER + ROW_META * entries, self.sim.head.on_tokens, step)
        self._serve()


class Head:
    """engine/pipeline/head.py on the simulated clock: the engine's own Scheduler decides;
    the head's compute (stage 0) runs each step as a job, then hands its volume to the link."""

    def __init__(self, sim: "Simulation"):
        self.sim = sim
        self.pipe, self.policy = sim.pipe, sim.policy
        self.decode, self.prefill = sim.work[0]
        self.link: Link | None = None
        fixed = None if self.policy.dynamic else (self.policy.micro_batches or self.pipe.n_stages)
        self.sched = core.Scheduler(self.pipe.n_stages, self.pipe.kv_capacity, micro_batches=fixed,
                                    max_batch=self.pipe.max_batch, prompt_chunk=self.policy.prompt_chunk,
                                    hop_bytes=self.pipe.hidden_bytes, dtype_bytes=self.pipe.dtype_bytes,
                                    compress=self.policy.compress)
        self.remaining = 0
        self.k_samples: list[int] = []
        self._jobs: deque = deque()          # the head's compute: (seconds, decode?, generator)
        self.compute = Compute(sim)
        # speculative decoding (Spec): the engine's policy, fed the simulated clock
        self.spec: Spec | None = sim.spec
        self.spec_policy = SpecPolicy(self.spec.config) if self.spec is not None else None
        self.rng = random.Random(self.spec.seed if self.spec is not None else 0)
        self._trips: dict[int, tuple] = {}   # group id -> (launch time, tokens drafted, decode?)

    @property
    def micro_batches(self) -> int:
        return self.sched.micro_batches

    # -- the compute: generators yield (seconds of compute, decode?), resumed when it is done
    def _drive(self, gen) -> None:
        try:
            seconds, decode = next(gen)
        except StopIteration:
            return
        self._jobs.append((seconds, decode, gen))
        self._next_job()

    def _next_job(self) -> None:
        pick = self.compute.next_kind(any(j[1] for j in self._jobs), bool(self._jobs))
        if pick is None:
            return
        job = next(j for j in self._jobs if j[1]) if pick else self._jobs[0]
        self._jobs.remove(job)
        self.compute.start(job[0], job[1], self._job_done, job[2])

    def _job_done(self, gen) -> None:
        self.compute.finished()
        self._drive(gen)
        self._next_job()

    # -- requests and scheduling, as Head._kick / _launch / _on_tokens
    def arrive(self, s: Seq) -> None:
        self.sched.add(s)
        self._kick()

    def _kick(self) -> None:
        now = self.sim.clock.now
        if self.sched.retune_due(now):
            self.sched.retune(now, self.pipe.profiles, self.link.sched.link)
            if self.sched.dynamic:
                self.k_samples.append(len([g for g in self.sched.groups if not g.retiring]))
        for g in self.sched.schedule():
            self._drive(self._launch(g))

    def _launch(self, g: core.Group):
        for s in list(g.seqs):
            if not s.opened:
                s.in_flight = s.n_in - s.pos
                c = self.sched.prompt_chunk(s, self.pipe.profiles[0]["prefill"], self.link.sched.link.bandwidth)
                while c and s.n_in - s.pos > c:
                    chunk = Step(g, [(s, c)], True, FRAME_HEADER + ROW_META)
                    t0 = self.sim.clock.now
                    yield step_time(self.decode, self.prefill, chunk.rows), False
                    nbytes = self.sim.volume_bytes(chunk, "prefill", self.link, self.sim.clock.now - t0)
                    self.link.submit(nbytes, "prefill", chunk)
                    s.pos += c
                    s.in_flight -= c
        rows, meta = [], FRAME_HEADER
        step_rows = self.sched.step_rows(g)
        spec, drafted = self.spec, 0
        if spec is not None:   # as head.py: every sequence the pipeline holds, all micro-batches
            busy_groups = sum(1 for x in self.sched.groups if any(not s.done for s in x.seqs))
            self.spec_policy.set_load(sum(1 for x in self.sched.groups for s in x.seqs if not s.done),
                                      full=self.pipe.n_stages > 1 and busy_groups >= self.pipe.n_stages)
        for r in step_rows:
            n = r.n
            r.seq.drafted = 0
            if r.new:
                meta += NEW_META + PROMPT_META * r.seq.n_in
            elif spec is not None:
                k = self._k_for(r.seq)
                if k:   # checked in this one step: the last token and the draft
                    r.seq.drafted = k
                    n = r.seq.in_flight = 1 + k
                    drafted += k
            rows.append((r.seq, n))
            meta += ROW_META
        step = Step(g, rows, False, meta)
        if drafted:   # the host drafts on its own device, beside stage 0, before the step
            self.spec_policy.observe_draft(spec.draft)
            if spec.draft:
                yield drafted * spec.draft, True
        sched = self.link.sched
        t0 = self.sim.clock.now
        if spec is not None:
            self._trips[g.id] = (t0, drafted, step.decode)
        if step.decode:   # head.py tells the scheduler when it hands the step to its thread
            sched.decode_compute_started(t0, len(rows))
        yield step_time(self.decode, self.prefill, rows, self.pipe.ctx_cost), step.decode
        if step.decode:
            sched.decode_compute_finished(self.sim.clock.now)
        kind = "decode" if step.decode else "prefill"
        self.link.submit(self.sim.volume_bytes(step, kind, self.link, self.sim.clock.now - t0), kind, step)

    def _k_for(self, s: Seq) -> int:
        """Tokens to draft for a decoding sequence (head.py's _draft): the policy's k (or
        the fixed one), never past its n_out."""
        k = self.spec.k if self.spec.k is not None else self.spec_policy.k_for(s.id)
        return max(0, min(k, s.n_out - s.generated - 1))

    def _accepted(self, k: int) -> int:
        """Drafted tokens that stand: a seeded truncated geometric (each with probability
        accept, given the ones before it stood; at most k)."""
        n = 0
        while n < k and self.rng.random() < self.spec.accept:
            n += 1
        return n

    def _measure_trip(self, step: Step, now: float) -> None:
        """head.py's _measure_trip: a plain decode step's trip feeds the policy's trip, one
        with drafts the extra tokens' cost over it."""
        t0, drafted, decode = self._trips.pop(step.group.id, (None, 0, False))
        if t0 is None or not decode:
            return
        pol = self.spec_policy
        if not drafted:
            pol.observe_trip(now - t0)
        elif pol.trip is not None:
            pol.observe_verify_extra((now - t0 - pol.trip) / drafted, drafted)

    def on_tokens(self, step: Step) -> None:
        now = self.sim.clock.now
        if self.spec is not None:
            self._measure_trip(step, now)
        for s, n in step.rows:
            emitted = 1
            if s.drafted and n == s.drafted + 1:
                accepted = self._accepted(s.drafted)
                self.spec_policy.observe_round(s.id, s.drafted, accepted)
                s.in_flight = accepted + 1   # what stays in every stage's KV
                emitted = accepted + 1
            elif self.spec is not None and s.generated:   # a plain decode round
                self.spec_policy.observe_round(s.id, 0, 0)
            s.drafted = 0
            self.sched.advance(s)
            for _ in range(emitted):
                s.generated += 1
                s.first = now if s.first is None else s.first
                s.last = now
                s.times.append(now)
            if s.generated >= s.n_out:
                s.done = True
                self.sched.release(s)
                self.remaining -= 1
                if self.spec is not None:
                    self.spec_policy.drop(s.id)
        self.sched.on_result(step.group)
        if self.remaining == 0:
            self.sim.clock.stopped = True
            return
        self._kick()


class Simulation:
    def __init__(self, pipe: Pipeline, policy: Policy, spec: Spec | None = None):
        if pipe.n_stages < 2:
            raise ValueError("a pipeline to simulate has at least two stages")
        self.pipe, self.policy, self.spec = pipe, policy, spec
        self.clock = Clock()
        self.cpu = Cpu(self.clock, pipe.cores, pipe.contention)
        # decisions (micro-batch count, just-in-time windows) from the profiles the head
        # was given; step durations from work_profiles where the machine ran otherwise
        self.curves = [(Curve(p["decode"]), Curve(p["prefill"])) for p in pipe.profiles]
        self.work = [(Curve(p["decode"]), Curve(p["prefill"])) for p in pipe.work_profiles] \
            if pipe.work_profiles else self.curves
        self.head = Head(self)
        self.stages = [Stage(self, i) for i in range(1, pipe.n_stages)]
        self.links = []     # link i leaves stage i (the head is stage 0) for stage i + 1
        for i, receiver in enumerate(self.stages):
            sched = LinkScheduler(mode=policy.link, n_wait=pipe.n_wait, decode_time=self.curves[i][0])
            link = Link(self.clock, sched, Wire(self.clock, pipe.bandwidth, pipe.delay), receiver,
                        pipe.piece, pipe.min_in_flight, pipe.warm)
            if i == 0:
                self.head.link = link
            else:
                self.stages[i - 1].out = link
            self.links.append(link)
        self.back = Wire(self.clock, pipe.bandwidth, pipe.delay)   # last stage -> head: tokens

    def volume_bytes(self, step: Step, kind: str, link: Link, compute_seconds: float) -> int:
        tensor = sum(n for _, n in step.rows) * self.pipe.hidden_bytes
        if should_compress(self.policy.compress, kind, tensor, link.sched.link.bandwidth, compute_seconds):
            tensor = math.ceil(tensor * q8_ratio(self.pipe.dtype_bytes))
        return tensor + step.meta

    def run(self, requests: list[tuple[float, int, int]]) -> list[Seq]:
        seqs = [Seq(i, n_in, n_out, arrival=t) for i, (t, n_in, n_out) in enumerate(requests)]
        too_big = [s.id for s in seqs if s.n_in + s.n_out > self.pipe.kv_capacity]
        if too_big:
            raise ValueError(f"requests {too_big[:5]} need more KV than the pipeline's {self.pipe.kv_capacity} tokens")
        self.head.remaining = len(seqs)
        for s in seqs:
            self.clock.at(s.arrival, self.head.arrive, s)
        self.clock.at(max(s.arrival for s in seqs) + 1e6, self._stuck)
        self.clock.run()
        return seqs

    def _stuck(self) -> None:
        raise RuntimeError(f"simulation stuck: {self.head.remaining} requests unfinished 1e6 s after the last arrival")


def simulate(pipe: Pipeline, policy: Policy | str, requests: list[tuple[float, int, int]],
             counted: list[bool] | None = None, spec: Spec | None = None) -> dict:
    """Runs the requests through the pipeline; returns summary metrics (see summarize) over
    all requests, or over those marked in `counted` (all of them still load the pipeline).
    spec: speculative decoding (Spec); then also tokens_per_trip, acceptance and the
    policy's measured trip / verify_extra."""
    if isinstance(policy, str):
        policy = POLICIES[ALIASES.get(policy, policy)]
    sim = Simulation(pipe, policy, spec)
    seqs = sim.run(requests)
    out = summarize([s for i, s in enumerate(seqs) if counted is None or counted[i]])
    ks = sim.head.k_samples
    out["k_mean"] = sum(ks) / len(ks) if ks else float(sim.head.micro_batches)
    out["link_bytes"] = [link.wire.bytes for link in sim.links]
    if spec is not None:
        st = sim.head.spec_policy.stats()
        out.update(tokens_per_trip=st["tokens_per_trip"], acceptance=st["acceptance"], spec_rounds=st["rounds"],
                   trip=st["trip"], verify_extra=st["verify_extra"])
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo = math.floor(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def summarize(seqs: list[Seq]) -> dict:
    """TTFT = first token - arrival; TPOT = (last - first) / (n_out - 1) over requests
    with two or more tokens; latency = last token - arrival; throughput = output tokens /
    (last token - first arrival)."""
    ttft = [s.first - s.arrival for s in seqs]
    tpot = [(s.last - s.first) / (s.n_out - 1) for s in seqs if s.n_out > 1]
    lat = [s.last - s.arrival for s in seqs]
    span = max(s.last for s in seqs) - min(s.arrival for s in seqs)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"ttft_mean": mean(ttft), "ttft_p90": _pct(ttft, 0.9),
            "tpot_mean": mean(tpot), "tpot_p90": _pct(tpot, 0.9),
            "latency_mean": mean(lat), "latency_p90": _pct(lat, 0.9),
            "throughput": sum(s.n_out for s in seqs) / span, "n": len(seqs)}


# ---- scenario 1: a 70B Llama over home GPUs ----------------------------------------------
def roofline_profile(params: float, weight_bytes: float, kv_bytes_per_row: float,
                     mem_bw: float = 1e12, flops: float = 150e12) -> dict:
    """A stage's curves from a roofline: a step reads all weights (mem_bw) or is compute
    bound (2 x params FLOPs per token at `flops`), whichever is slower; a decode row also
    reads its KV cache."""
    w = weight_bytes / mem_bw
    per_token = 2 * params / flops
    knee = max(2, round(w / per_token))
    decode = [[n, max(w, per_token * n) + n * kv_bytes_per_row / mem_bw] for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    prefill = [[n, max(w, per_token * n)] for n in sorted({16, 64, knee, 256, 512, 1024, 2048, 4096})]
    return {"decode": decode, "prefill": prefill}


def llama70b(n_stages: int, bandwidth_bps: float, delay: float, weight_bytes: float = 2.0,
             context: int = 1024) -> Pipeline:
    """Llama-70B-shaped (80 layers, hidden 8192, 8 KV heads of 128) split evenly over
    RTX 4090-class GPUs (1 TB/s, 150 TFLOP/s effective), fp16 activations."""
    params = 70e9 / n_stages
    kv_row = 80 / n_stages * 2 * 8 * 128 * 2 * context
    prof = roofline_profile(params, params * weight_bytes, kv_row)
    return Pipeline([prof] * n_stages, bandwidth_bps / 8, delay, hidden_bytes=8192 * 2, dtype_bytes=2)


def mean_lengths(scale: float = 1.0) -> tuple[float, float]:
    reqs = workload(1.0, 20000, seed=12345, scale=scale)
    return sum(r[1] for r in reqs) / len(reqs), sum(r[2] for r in reqs) / len(reqs)


LOADS = {"low": 0.3, "medium": 0.6, "high": 0.9}


def _run_cell(args) -> dict:
    m, mbits, delay, weight_bytes, rate, n, seed, policy = args
    return simulate(llama70b(m, mbits * 1e6, delay, weight_bytes), policy, workload(rate, n, seed))


def scenario(stages: list[int], mbits: list[float], loads: list[str], policies: list[str], n: int,
             seed: int, delay: float, weight_bytes: float, jobs: int = 1) -> None:
    mean_in, mean_out = mean_lengths()
    print(f"workload: Poisson arrivals, {n} requests, seed {seed}; prompt mean {mean_in:.0f} tokens, "
          f"output mean {mean_out:.0f} tokens (Azure-conversation-like, lognormal)")
    print("load = fraction of one uplink's capacity for fp16 activations of (prompt + output) tokens;\n"
          "(x%) = ratio to fifo; times in seconds; K = mean micro-batch count\n")
    cells = {}
    for m in stages:
        for mb in mbits:
            cap = mb * 1e6 / 8 / ((mean_in + mean_out) * 8192 * 2)
            for load in loads:
                for pol in policies:
                    cells[m, mb, load, pol] = (m, mb, delay, weight_bytes, LOADS[load] * cap, n, seed, pol)
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs) as ex:
            results = dict(zip(cells, ex.map(_run_cell, cells.values())))
    else:
        results = {k: _run_cell(v) for k, v in cells.items()}
    for m in stages:
        for mb in mbits:
            td1 = llama70b(m, mb * 1e6, delay, weight_bytes).profiles[0]["decode"][0][1]
            print(f"== Llama-70B, {m} stages x 4090-class (decode step {td1 * 1e3:.0f} ms/stage), "
                  f"{mb:g} Mbit/s uplinks, {delay * 1e3:.0f} ms one-way ==")
            print(f"{'load':<7}{'req/s':>6}  {'policy':<11}{'TTFT':>13}{'p90':>7}{'TPOT':>14}{'p90':>7}"
                  f"{'latency':>14}{'p90':>7}{'tok/s':>7}{'K':>5}")
            for load in loads:
                base = results.get((m, mb, load, "fifo"))
                for j, pol in enumerate(policies):
                    r = results[m, mb, load, pol]

                    def val(key, fmt):
                        v = fmt.format(r[key])
                        return v + (f" ({r[key] / base[key]:3.0%})" if base is not None and pol != "fifo" else "      ")
                    rate = cells[m, mb, load, pol][4]
                    lead = f"{load:<7}{rate:>6.3f}" if j == 0 else " " * 13
                    print(f"{lead}  {pol:<11}{val('ttft_mean', '{:.1f}'):>13}{r['ttft_p90']:>7.1f}"
                          f"{val('tpot_mean', '{:.2f}'):>14}{r['tpot_p90']:>7.2f}{val('latency_mean', '{:.0f}'):>14}"
                          f"{r['latency_p90']:>7.0f}{r['throughput']:>7.1f}{r['k_mean']:>5.1f}")
            print()
    base, others = "fifo-chunk", [p for p in policies if p not in ("fifo", "fifo-chunk")]
    if base not in policies or not others:
        return
    print(f"Paper-shaped summary: ratio of mean TTFT / TPOT / latency to {base} (prompts chunked, links FIFO:\n"
          "the analogue of vLLM or Helix with chunked prefill, what the scheduler alone adds)")
    print(f"{'stages':>6}{'Mbit/s':>7}  {'load':<7}" + "".join(f"{p:>19}" for p in others))
    for m in stages:
        for mb in mbits:
            for load in loads:
                b = results[m, mb, load, base]
                cols = ["/".join(f"{results[m, mb, load, p][k] / b[k]:.0%}"
                                 for k in ("ttft_mean", "tpot_mean", "latency_mean")) for p in others]
                print(f"{m:>6}{mb:>7g}  {load:<7}" + "".join(f"{c:>19}" for c in cols))


# ---- validation against bench/weaklink.py --json -----------------------------------------
def load_cells(path: str) -> list[dict]:
    """Measured cells, normalised. Two formats:

    * the agreed one: a list of cells with stages, bandwidth_bps, delay_s, policy, rate_rps,
      n_requests, seed, scale (the requests are workload(rate_rps, n_requests, seed, scale)),
      profiles, hidden_bytes_per_token and the measured ttft_mean, tpot_mean, latency_mean;
    * bench/weaklink.py --json as written: {"bytes_per_token", "cells": [{stages, config,
      head_args, rate_bps, delay_s, arrival_rate, profiles, per_request, ttft, tpot, lat}]};
      the requests are the cell's own (submit time, n_in, n_out); the simulated means cover
      the requests the measured ones do (those that finished), all of them load the pipeline.
    Optional in both: head_args (Head's link_mode / micro_batches / prefill_chunk / compress /
    compute; files without compute are from an engine that computed in order),
    dtype_bytes (default 4: the head's default float32), kv_capacity_tokens, max_batch."""
    data = json.loads(Path(path).read_text())
    out = []
    if isinstance(data, list):
        for c in data:
            out.append(dict(c, requests=workload(c["rate_rps"], c["n_requests"], c["seed"], c["scale"]),
                            measured={k: c.get(k) for k in ("ttft_mean", "tpot_mean", "latency_mean")}))
        return out
    for c in data["cells"]:
        if not c.get("done") or not c.get("profiles") or not c.get("per_request"):
            continue    # a cell that failed or was skipped
        per = sorted((r for r in c["per_request"] if r), key=lambda r: r["submit"])
        reqs = [(r["submit"], r["n_in"], r["n_out"]) for r in per]
        out.append(dict(c, cpu=c.get("cpu", data.get("cpu")), bandwidth_bps=c["rate_bps"], policy=c["config"], rate_rps=c.get("arrival_rate") or 0,
                        n_requests=len(reqs), requests=reqs, hidden_bytes_per_token=data["bytes_per_token"],
                        counted=[r.get("finish") == "length" for r in per],  # what its means cover
                        ctx_cost=c.get("ctx_cost", data.get("ctx_cost", 0.0)),
                        measured={"ttft_mean": c.get("ttft"), "tpot_mean": c.get("tpot"),
                                  "latency_mean": c.get("lat")}))
    return out


def pipeline_for_cell(cell: dict) -> tuple[Pipeline, Policy]:
    """A measured cell's pipeline and policy (head_args override the named policy)."""
    pol = POLICIES[ALIASES.get(cell["policy"], cell["policy"])]
    args = cell.get("head_args") or {}
    over = {}
    if "link_mode" in args:
        over["link"] = args["link_mode"]
    if "prefill_chunk" in args:
        over["prompt_chunk"] = args["prefill_chunk"]
    if "micro_batches" in args:
        over["dynamic"] = args["micro_batches"] is None
        over["micro_batches"] = args["micro_batches"]
    if "compress" in args:
        over["compress"] = args["compress"]
    if args:   # files from before Head(compute=...) computed in order
        over["cut_in"] = args.get("compute") == "decode-first"
    if over:
        pol = Policy(**{**pol.__dict__, **over})
    if len(cell["profiles"]) != cell["stages"]:
        raise ValueError(f"cell has {cell['stages']} stages but {len(cell['profiles'])} profiles")
    cpu = cell.get("cpu") or {}
    pipe = Pipeline(cell["profiles"], cell["bandwidth_bps"] / 8, cell["delay_s"], cell["hidden_bytes_per_token"],
                    dtype_bytes=cell.get("dtype_bytes", 4), kv_capacity=cell.get("kv_capacity_tokens", 1 << 18),
                    max_batch=cell.get("max_batch", 32), cores=cpu.get("cores"),
                    contention=cpu.get("contention", 0.0), ctx_cost=cell.get("ctx_cost") or 0.0,
                    work_profiles=cell.get("work_profiles"))
    return pipe, pol


def run_median_profiles(cells: list[dict]) -> dict:
    """Per pipeline length, each stage's profile point by point: the median over the
    run's cells. Every cell profiles its stages afresh at its start, twice per point
    (engine/core/profile.py); on a machine whose speed swings by a third within minutes such
    a snapshot can read 50-80% slow (bench/weaklink.py's JSON), while the cell runs at
    whatever speed the minutes after bring."""
    import statistics

    out = {}
    for n in sorted({c["stages"] for c in cells}):
        group = [c["profiles"] for c in cells if c["stages"] == n]
        med = []
        for i in range(n):
            prof = {}
            for key in ("decode", "prefill"):
                xs = [tuple(x for x, _ in p[i][key]) for p in group]
                if len(set(xs)) != 1:
                    return {}   # different probe points: nothing to pool
                prof[key] = [[x, statistics.median(p[i][key][j][1] for p in group)]
                             for j, x in enumerate(xs[0])]
            med.append(prof)
        out[n] = med
    return out


def validate(path: str, tolerance: float = 0.15, cpu: dict | None = None,
             ctx_cost: float | None = None, work: str = "auto") -> list[dict]:
    """cpu: {"cores", "contention"} to model the stages sharing one machine (None: as the
    file says -- weaklink.py records what bench/contention.py measured -- or dedicated).
    ctx_cost: decode cost of context (None: as the file says; files from before
    weaklink.py measured it say nothing, and the context is then ignored).
    work: what the simulated steps take -- "cell": each cell's own startup profiles (what
    its head decided from, too); "run": the median over the run's cells (run_median_profiles),
    while decisions still follow the cell's own; "observed": the profiles the cell's stages
    reported in service (engine.core.profile.StepLog; weaklink.py records their median over the
    cell as profiles_observed), for decisions and durations alike, as the live head used
    them. Those times already include what sharing the CPU and attending to the cell's
    contexts cost, so the contention and context models are off. "auto": observed where
    every cell has them, else cell."""
    cells = load_cells(path)
    if work == "auto":
        work = "observed" if cells and all(c.get("profiles_observed") for c in cells) else "cell"
    if work == "observed":
        if not all(c.get("profiles_observed") for c in cells):
            print("some cells have no profiles_observed (a weaklink.py file from before them): "
                  "step durations from each cell's own startup profiles")
            work = "cell"
        else:
            cells = [dict(c, profiles=c["profiles_observed"], ctx_cost=0.0,
                          cpu=dict(c.get("cpu") or {}, contention=0.0)) for c in cells]
    if work == "run":
        med = run_median_profiles(cells)
        if not med:
            print("the run's cells profiled different points: step durations from each cell's own")
            work = "cell"
        cells = [dict(c, work_profiles=med.get(c["stages"])) for c in cells]
    if ctx_cost is not None:
        cells = [dict(c, ctx_cost=ctx_cost) for c in cells]
    costs = sorted({c.get("ctx_cost") or 0.0 for c in cells})
    print("step durations from " + {"cell": "each cell's own startup profiles",
                                     "run": "the run's median profiles (decisions from each cell's own)",
                                     "observed": "the profiles each cell's stages reported in service "
                                                 "(decisions too; contention and context costs are in them)"}[work])
    print("decode cost of context: " + (", ".join(f"{x:.2e}" for x in costs) + " of a 1-row step per row and "
                                         "context token" if any(costs) else "not modelled (no ctx_cost)"))
    if cpu is not None:
        cells = [dict(c, cpu=cpu) for c in cells]
    synthetic = any(c.get("synthetic") for c in cells)
    print(f"validation against {path}" + (" (SYNTHETIC measurements, not from weaklink.py)" if synthetic else ""))
    for cores, contention in sorted({((c.get("cpu") or {}).get("cores"), (c.get("cpu") or {}).get("contention"))
                                     for c in cells}, key=str):
        print("compute: " + ("a machine per stage" if cores is None else
                             f"stages share {cores} cores, contention {contention:.3f}"))
    print(f"{'stages':>6}{'Mbit/s':>8}{'ms':>6}  {'policy':<10}{'req/s':>6}{'n':>5} |"
          f"{'TTFT sim':>9}{'meas':>8}{'err':>6}    |{'TPOT sim':>9}{'meas':>8}{'err':>6}    |"
          f"{'lat sim':>8}{'meas':>8}{'err':>6}")
    rows = []
    for c in cells:
        pipe, pol = pipeline_for_cell(c)
        r = simulate(pipe, pol, c["requests"], c.get("counted"))
        out = {"cell": c, "sim": r}
        n = sum(c["counted"]) if c.get("counted") else c["n_requests"]
        line = (f"{c['stages']:>6}{c['bandwidth_bps'] / 1e6:>8.3g}{c['delay_s'] * 1e3:>6.1f}  {c['policy']:<10}"
                f"{c['rate_rps']:>6.3g}{n:>5} |")
        for key, width in (("ttft_mean", 9), ("tpot_mean", 9), ("latency_mean", 8)):
            pred, meas = r[key], c["measured"].get(key)
            if meas is None:
                line += f"{pred:>{width}.3f}{'-':>8}{'':>6}    |"
                continue
            err = (pred - meas) / meas
            ok = abs(err) <= tolerance
            out[key] = {"sim": pred, "measured": meas, "error": err, "ok": ok}
            line += f"{pred:>{width}.3f}{meas:>8.3f}{err:>+6.0%} {'ok ' if ok else 'OFF'}|"
        print(line.rstrip("|"))
        rows.append(out)
    checked = [row[k]["ok"] for row in rows for k in ("ttft_mean", "tpot_mean") if k in row]
    print(f"TTFT and TPOT within {tolerance:.0%}: {sum(checked)} of {len(checked)}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", metavar="FILE.json", help="compare with bench/weaklink.py --json results")
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mbits", type=float, nargs="+", default=[20, 50, 100])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--weight-bits", type=float, default=16, help="bits per weight (decode reads them all)")
    ap.add_argument("-n", "--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-j", "--jobs", type=int, default=2, help="processes for the scenario cells")
    ap.add_argument("--contention", type=float, default=None,
                    help="with --validate: the stages share this machine's cores with this slowdown per "
                         "concurrent step (bench/contention.py measures it; weaklink.py --json records it)")
    ap.add_argument("--dedicated", action="store_true",
                    help="with --validate: model every stage on a machine of its own (no shared cores)")
    ap.add_argument("--ctx-cost", type=float, default=None,
                    help="with --validate: decode cost of context, per row and context token, as a fraction "
                         "of a 1-row step (engine.core.profile.context_cost; weaklink.py --json records it)")
    ap.add_argument("--work", choices=("auto", "observed", "cell", "run"), default="auto",
                    help="with --validate: step durations from the profiles the stages reported in service "
                         "(observed; the default where the file has them), each cell's startup profiles "
                         "(cell), or their median over the run (run_median_profiles)")
    a = ap.parse_args(argv)
    if a.validate:
        cpu = {"cores": None, "contention": 0.0} if a.dedicated else None
        if a.contention is not None:
            cpu = {"cores": os.cpu_count(), "contention": a.contention}
        validate(a.validate, cpu=cpu, ctx_cost=a.ctx_cost, work=a.work)
        return 0
    policies = ["fifo"] + [p for p in a.policies if p != "fifo"]
    scenario(a.stages, a.mbits, a.loads, policies, a.requests, a.seed, a.delay_ms / 1e3, a.weight_bits / 8,
             a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
