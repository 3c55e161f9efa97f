"""Startup compute profile of a stage: how long a decode step of n rows and a prefill
of n tokens take on this machine. The link scheduler predicts its windows from it and
the head sizes its micro-batches from everyone's."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from contextlib import contextmanager

# Decode cost is not linear in rows between 1 and 4: on one thread (bench/weaklink.py's
# stages) a step of the default model's second half took 37 / 49 / 58 / 53 ms for
# 1 / 2 / 3 / 4 rows, where a line through 1 and 4 says 42 and 48. Steps of 2-3 rows
# are what a weak link's micro-batches carry, so each of those counts is measured.
DECODE_BATCHES = (1, 2, 3, 4, 8, 16)
PREFILL_LENGTHS = (32, 256)
PROFILE_CONTEXT = 8  # tokens each decode probe's rows attend to (bench/simulator.py reads it)
_PROBE_ID = 1 << 50  # far from any real sequence id


@contextmanager
def machine_turn(exclusive: bool, path: str | None = None):
    """Take this machine's turn for loading (shared) or profiling (exclusive).

    A profile times this machine's compute, so it must run alone on it. Stages on
    separate machines never meet here; stages that share one CPU (a local pipeline,
    bench/weaklink.py's emulated homes) otherwise load and profile all at once: with
    3 one-thread stages on 2 cores the profiles read up to 2x slow, at random points
    (one 3-stage run: a stage's 1-row step 63 ms, its 2-row step 41), and every
    decision taken from them with it. Loads share the lock, so stages still load side
    by side; a profile waits until no other process on the machine is loading or
    profiling. flock(2) on a file in the temp directory (released if a process dies);
    where there is no flock (Windows), stages on one machine are not this product's
    setup, and the turn is free.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    path = path or os.path.join(tempfile.gettempdir(), f"potluck-profile-{os.getuid()}.lock")
    # a shared temp directory: never follow a link someone else put at that name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def load_and_measure(build):
    """build() a stage side by side with other loads on this machine, then profile it
    alone (machine_turn); returns (stage, profile)."""
    with machine_turn(exclusive=False):
        stage = build()
    with machine_turn(exclusive=True):
        prof = measure(stage)
    stage.step_log = StepLog(prof)
    return stage, prof


@contextmanager
def _probing(stage):
    """Probe sequences live outside the KV budget (tiny, freed at once) and are all
    freed afterwards, whatever happens; yields run(batch) -> seconds of one forward."""
    # torch only here: interp() stays importable by the simulator without it
    import torch

    def run(batch) -> float:
        if stage.first:
            x = torch.zeros(batch.n_tokens, dtype=torch.long)
        else:
            x = torch.zeros((batch.n_tokens, stage.hidden_size), dtype=stage.dtype)
        t0 = time.perf_counter()
        stage.forward(batch, x)
        return time.perf_counter() - t0

    budget = stage.kv.budget_tokens
    stage.kv.budget_tokens = 1 << 40
    try:
        yield run
    finally:
        stage.kv.budget_tokens = budget
        for i in list(stage.kv.seqs):
            if i >= _PROBE_ID:
                stage.free(i)


def _decode_step(run, stage, rows: int, context: int, repeats: int) -> list[float]:
    """Times of `repeats` decode steps of `rows` rows that attend to `context` tokens."""
    from .stage_model import StageBatch

    ids = [_PROBE_ID + i for i in range(rows)]
    run(StageBatch(ids, [0] * rows, [context] * rows))
    ts = [run(StageBatch(ids, [context + r] * rows, [1] * rows)) for r in range(repeats)]
    for i in ids:
        stage.free(i)
    return ts


def measure(stage, repeats: int = 2) -> dict:
    from .stage_model import StageBatch

    prof = {"decode": [], "prefill": []}
    with _probing(stage) as run:
        for n in DECODE_BATCHES:
            prof["decode"].append([n, min(_decode_step(run, stage, n, PROFILE_CONTEXT, repeats))])
        for n in PREFILL_LENGTHS:
            t = run(StageBatch([_PROBE_ID], [0], [n]))
            stage.free(_PROBE_ID)
            prof["prefill"].append([n, t])
    return prof


def context_cost(stage, rows: int = 16, context: int = 256, repeats: int = 3) -> float:
    """What attending to a longer context adds to a decode step, per row and per token of
    context beyond PROFILE_CONTEXT, as a fraction of a 1-row step. measure() profiles
    decode steps at PROFILE_CONTEXT tokens; real rows attend to their prompt and output
    so far, and at 16 rows of 256 tokens a step of the default model took 19% longer
    than at 8 (this machine, one thread). bench/simulator.py adds it to its decode steps
    (Pipeline.ctx_cost)."""
    def median(ts):
        return sorted(ts)[len(ts) // 2]

    with _probing(stage) as run:
        one, short, long = (median(_decode_step(run, stage, n, c, repeats))
                            for n, c in ((1, PROFILE_CONTEXT), (rows, PROFILE_CONTEXT), (rows, context)))
    return max(0.0, (long - short) / (rows * (context - PROFILE_CONTEXT) * one))


def interp(points: list, n: float) -> float:
    """Piecewise-linear in n through measured (n, seconds); linear beyond the ends."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if not pts:
        return 0.0
    if len(pts) == 1:
        return pts[0][1] * max(n, 1) / max(pts[0][0], 1)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if n <= x1 or (x1, y1) == pts[-1]:
            return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))
    return pts[-1][1]


# ---- the profile in service -----------------------------------------------------------
# A startup profile is a snapshot: probes of 8-token contexts on a freshly loaded stage,
# timed alone on the machine. In service the same steps attend to hundreds of tokens,
# share the machine, and the machine itself drifts. One bench/weaklink.py FIFO cell
# (2 stages at ~60 Mbit/s-equivalent, this 2-core machine) profiled a 1-row step at
# 29 / 51 ms on its two stages and then ran them at 44 / 62 ms (2 rows: 45 / 64 ->
# 73 / 86 ms); every decision taken from the snapshot was taken for a faster machine.
# So each stage keeps timing its own steps and its profile follows what it measures.
MAX_POINTS = 32          # points per curve a peer may send (we send 6 and 2)
MAX_STEP_SECONDS = 3600.0


def check_profile(p) -> dict:
    """A profile from the network: {"decode": [[n, s]..], "prefill": [[n, s]..]}, each
    curve 1..MAX_POINTS points of a positive whole n and a finite time in [0, an hour].
    Raises ValueError; returns it unchanged."""
    if not isinstance(p, dict) or set(p) != {"decode", "prefill"}:
        raise ValueError("a profile has exactly the curves 'decode' and 'prefill'")
    for name, curve in p.items():
        if not isinstance(curve, list) or not 1 <= len(curve) <= MAX_POINTS:
            raise ValueError(f"profile curve {name!r} must hold 1..{MAX_POINTS} points")
        for pt in curve:
            if not (isinstance(pt, list) and len(pt) == 2):
                raise ValueError(f"profile curve {name!r}: each point is [n, seconds]")
            n, s = pt
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= 1 << 20:
                raise ValueError(f"profile curve {name!r}: n must be a positive whole number")
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= MAX_STEP_SECONDS:
                raise ValueError(f"profile curve {name!r}: seconds must be a number in [0, 3600]")
    return p


class StepLog:
    """A stage's step times in service, and the profile they make. Pure: fed
    (kind, n, seconds), it answers a profile with the startup one's points.

    A decode point with enough steps of exactly its row count takes their median;
    the others are the startup value times the median ratio of all recent decode
    steps to what the startup curve predicted for them (so 5- and 6-row steps move
    the 4- and 8-row points too). Prefill likewise, by ratio. Medians over a window
    of recent steps: one step that met a page fault or a neighbour's burst moves
    nothing."""

    def __init__(self, startup: dict, window: int = 32, min_steps: int = 3):
        self.startup = {k: [list(pt) for pt in v] for k, v in startup.items()}
        self.window = window
        self.min_steps = min_steps
        self._points = {n for n, _ in self.startup.get("decode", [])}
        self._exact: dict[int, list[float]] = {}
        self._ratio: dict[str, list[float]] = {"decode": [], "prefill": []}
        self.steps = 0

    def observe(self, kind: str, n: int, seconds: float) -> None:
        curve = self.startup.get(kind)
        if not curve or n <= 0 or not 0 <= seconds <= MAX_STEP_SECONDS:
            return
        predicted = interp(curve, n)
        if predicted > 0:
            self._push(self._ratio[kind], seconds / predicted)
        if kind == "decode" and n in self._points:
            self._push(self._exact.setdefault(n, []), seconds)
        self.steps += 1

    def _push(self, xs: list, x: float) -> None:
        xs.append(x)
        if len(xs) > self.window:
            del xs[0]

    def profile(self) -> dict:
        out = {}
        for kind, curve in self.startup.items():
            ratios = self._ratio.get(kind, [])
            scale = statistics.median(ratios) if len(ratios) >= self.min_steps else 1.0
            pts = []
            for n, s in curve:
                own = self._exact.get(n, []) if kind == "decode" else []
                pts.append([n, statistics.median(own) if len(own) >= self.min_steps else s * scale])
            out[kind] = pts
        return out


def differs(a: dict, b: dict, rel: float = 0.05) -> bool:
    """Whether any point of profile a is more than `rel` off b's (or the points differ)."""
    for kind in set(a) | set(b):
        pa, pb = a.get(kind, []), b.get(kind, [])
        if [n for n, _ in pa] != [n for n, _ in pb]:
            return True
        for (_, x), (_, y) in zip(pa, pb):
            if abs(x - y) > rel * max(abs(y), 1e-9):
                return True
    return False
