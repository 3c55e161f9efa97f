"""Measuring a loaded stage's compute profile (engine/core/profile.py holds the curves).

A profile times this machine's compute, so it is taken alone on it (machine_turn)."""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager

from engine.core.profile import PROFILE_CONTEXT, StepLog
from engine.model.stage import StageBatch

# Decode cost is not linear in rows between 1 and 4: on one thread (bench/weaklink.py's
# stages) a step of the default model's second half cost clearly more at 2 and 3 rows than a
# line through 1 and 4 says -- 3 rows even more than 4 (see bench/RESULTS.md). Steps of
# 2-3 rows are what a weak link's micro-batches carry, so each of those counts is measured.
DECODE_BATCHES = (1, 2, 3, 4, 8, 16)
PREFILL_LENGTHS = (32, 256)
_PROBE_ID = 1 << 50  # far from any real sequence id


@contextmanager
def machine_turn(exclusive: bool, path: str | None = None):
    """Take this machine's turn for loading (shared) or profiling (exclusive).

    A profile times this machine's compute, so it must run alone on it. Stages on
    separate machines never meet here; stages that share one CPU (a local pipeline,
    bench/weaklink.py's emulated homes) otherwise load and profile all at once: with
    3 one-thread stages on 2 cores the profiles read up to twice as slow, at random
    points (in one 3-stage run a stage's 1-row step read slower than its 2-row step),
    and every decision taken from them with it. Loads share the lock, so stages still
    load side by side; a profile waits until no other process on the machine is loading
    or profiling. flock(2) on a file in the temp directory (released if a process
    dies); where there is no flock (Windows), stages on one machine are not this
    product's setup, and the turn is free.
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


def load_and_measure(build, profile: dict | None = None):
    """build() a stage side by side with other loads on this machine, then profile it
    alone (machine_turn); returns (stage, profile). Given a profile (a re-plan after a
    stage left: this machine's last one, scaled to its new layers) it starts from that
    instead: the pipeline is waiting, and the steps in service correct it."""
    with machine_turn(exclusive=False):
        stage = build()
    if profile is not None:
        prof = profile
    else:
        with machine_turn(exclusive=True):
            prof = measure(stage)
    stage.step_log = StepLog(prof)
    return stage, prof


@contextmanager
def _probing(stage):
    """Probe sequences live outside the KV budget (tiny, freed at once) and are all
    freed afterwards, whatever happens; yields run(batch) -> seconds of one forward."""
    import torch

    def run(batch) -> float:
        if stage.first:
            x = torch.zeros(batch.n_tokens, dtype=torch.long)
        else:
            x = torch.zeros((batch.n_tokens, stage.hidden_size), dtype=stage.dtype)
        t0 = time.perf_counter()
        stage.forward(batch, x)
        if stage.device.type == "cuda":
            # the step's time, not its launch's (a GPU step returns before it is done)
            torch.cuda.current_stream(stage.device).synchronize()
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
    ids = [_PROBE_ID + i for i in range(rows)]
    run(StageBatch(ids, [0] * rows, [context] * rows))
    ts = [run(StageBatch(ids, [context + r] * rows, [1] * rows)) for r in range(repeats)]
    for i in ids:
        stage.free(i)
    return ts


def measure(stage, repeats: int = 2) -> dict:
    prof = {"decode": [], "prefill": []}
    with _probing(stage) as run:
        # The largest batch's rows get their context in one prompt step, and each smaller
        # batch is their first rows, a few tokens on: a prompt step per batch size took a
        # quarter of the profile (of every pipeline start) for the same figures.
        top = max(DECODE_BATCHES)
        ids = [_PROBE_ID + i for i in range(top)]
        run(StageBatch(ids, [0] * top, [PROFILE_CONTEXT] * top))
        pos = [PROFILE_CONTEXT] * top
        best = {}
        for n in sorted(DECODE_BATCHES, reverse=True):
            ts = []
            for _ in range(repeats):
                ts.append(run(StageBatch(ids[:n], pos[:n], [1] * n)))
                pos[:n] = [p + 1 for p in pos[:n]]
            best[n] = min(ts)
        for i in ids:
            stage.free(i)
        prof["decode"] = [[n, best[n]] for n in DECODE_BATCHES]
        for n in PREFILL_LENGTHS:
            t = run(StageBatch([_PROBE_ID], [0], [n]))
            stage.free(_PROBE_ID)
            prof["prefill"].append([n, t])
    return prof


def context_cost(stage, rows: int = 16, context: int = 256, repeats: int = 3) -> float:
    """What attending to a longer context adds to a decode step, per row and per token of
    context beyond PROFILE_CONTEXT, as a fraction of a 1-row step. measure() profiles
    decode steps at PROFILE_CONTEXT tokens; real rows attend to their prompt and output
    so far, and at 16 rows of 256 tokens a step of the default model takes noticeably
    longer than at 8 (bench/weaklink.py --json records this cost per run; see
    bench/RESULTS.md). bench/simulator.py adds it to its decode steps (Pipeline.ctx_cost)."""
    def median(ts):
        return sorted(ts)[len(ts) // 2]

    with _probing(stage) as run:
        one, short, long = (median(_decode_step(run, stage, n, c, repeats))
                            for n, c in ((1, PROFILE_CONTEXT), (rows, PROFILE_CONTEXT), (rows, context)))
    return max(0.0, (long - short) / (rows * (context - PROFILE_CONTEXT) * one))
