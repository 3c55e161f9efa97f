"""Startup compute profile of a stage: how long a decode step of n rows and a prefill
of n tokens take on this machine. The link scheduler predicts its windows from it and
the head sizes its micro-batches from everyone's."""

from __future__ import annotations

import time

DECODE_BATCHES = (1, 4, 16)
PREFILL_LENGTHS = (32, 256)
_PROBE_ID = 1 << 50  # far from any real sequence id


def measure(stage, repeats: int = 2) -> dict:
    # torch only here: interp() stays importable by the simulator without it
    import torch

    from .stage_model import StageBatch
    def run(batch: StageBatch) -> float:
        if stage.first:
            x = torch.zeros(batch.n_tokens, dtype=torch.long)
        else:
            x = torch.zeros((batch.n_tokens, stage.hidden_size), dtype=stage.dtype)
        t0 = time.perf_counter()
        stage.forward(batch, x)
        return time.perf_counter() - t0

    prof = {"decode": [], "prefill": []}
    budget = stage.kv.budget_tokens
    stage.kv.budget_tokens = 1 << 40  # probes are tiny and freed at once: outside the budget
    try:
        for n in DECODE_BATCHES:
            ids = [_PROBE_ID + i for i in range(n)]
            run(StageBatch(ids, [0] * n, [8] * n))  # a little context to attend to
            best = min(run(StageBatch(ids, [8 + r] * n, [1] * n)) for r in range(repeats))
            prof["decode"].append([n, best])
            for i in ids:
                stage.free(i)
        for n in PREFILL_LENGTHS:
            t = run(StageBatch([_PROBE_ID], [0], [n]))
            stage.free(_PROBE_ID)
            prof["prefill"].append([n, t])
    finally:
        stage.kv.budget_tokens = budget
        for i in list(stage.kv.seqs):
            if i >= _PROBE_ID:
                stage.free(i)
    return prof


def context_cost(stage, rows: int = 16, context: int = 256, repeats: int = 3) -> float:
    """What attending to a longer context adds to a decode step, per row and per token of
    context, as a fraction of a 1-row step. measure() profiles decode steps at a context
    of 8 tokens; real rows attend to their prompt and output so far, and at 16 rows of
    256 tokens a step of the default model took 19% longer than at 8 (this machine, one
    thread). bench/simulator.py adds it to its decode steps (Pipeline.ctx_cost)."""
    import torch

    from .stage_model import StageBatch

    def x(n):
        if stage.first:
            return torch.zeros(n, dtype=torch.long)
        return torch.zeros((n, stage.hidden_size), dtype=stage.dtype)

    def step(n: int, ctx: int) -> float:
        ids = [_PROBE_ID + i for i in range(n)]
        try:
            stage.forward(StageBatch(ids, [0] * n, [ctx] * n), x(n * ctx))
            ts = []
            for r in range(repeats):
                t0 = time.perf_counter()
                stage.forward(StageBatch(ids, [ctx + r] * n, [1] * n), x(n))
                ts.append(time.perf_counter() - t0)
        finally:
            for i in ids:
                stage.free(i)
        return sorted(ts)[len(ts) // 2]

    budget = stage.kv.budget_tokens
    stage.kv.budget_tokens = 1 << 40
    try:
        one, short, long = step(1, 8), step(rows, 8), step(rows, context)
    finally:
        stage.kv.budget_tokens = budget
    return max(0.0, (long - short) / (rows * (context - 8) * one))


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
