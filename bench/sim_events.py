"""bench/simulator.py's event loop: a simulated clock, serial wires, shared CPUs, and
the stages, links and head that run the engine's own decision code on it (the module
docstring of bench/simulator.py says what is modelled and what is left out)."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.core import scheduler as core  # noqa: E402
from engine.core.compression import q8_ratio, should_compress  # noqa: E402
from engine.core.link_scheduler import GoodputMeter, LinkScheduler, next_rtt_min  # noqa: E402
from engine.core.speculation import SpecPolicy  # noqa: E402
from engine.core.step_gate import MAX_CUT_INS  # noqa: E402
from engine.pipeline.link import LinkSender  # noqa: E402
from engine.pipeline.stage_server import MAX_MERGED_ROWS  # noqa: E402
from sim_parts import (ALIASES, FRAME_HEADER, NEW_META, PIECE_HEADER, POLICIES, PROMPT_META, ROW_META,  # noqa: E402
                       Curve, Pipeline, Policy, Spec, decode_row, step_time)

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

