"""How much do two stage processes slow each other on this machine's shared CPU?

bench/weaklink.py runs its pipeline's stages as processes of one torch thread each on
one machine; bench/simulator.py, validating against it, needs to know what a step
costs while another stage computes at the same time. Two processes each hold half
of the default model's layers (as a 2-stage pipeline's do) and run steps -- decode
steps of one row, or 64-token prompt chunks -- first alone, then both at once,
started together. The slowdown of the pair over alone, minus one, is `contention`
(bench/simulator.py's Cpu: rate = 1 / (1 + contention) for two jobs on two cores).

    .venv/bin/python bench/contention.py          # prints the table, ~1 minute
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("decode", "prefill")
PREFILL_TOKENS = 64


def _worker(half: int, kind: str, seconds: float, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    from engine.model.sources import DEFAULT_MODEL, resolve
    from engine.model.stage import StageBatch, StageModel

    source = resolve(DEFAULT_MODEL)
    n = source.config().num_hidden_layers
    a, b = (0, n // 2) if half == 0 else (n // 2, n)
    stage = StageModel(source, a, b)

    def inputs(rows: int):
        if stage.first:
            return torch.randint(0, 1000, (rows,))
        return torch.randn(rows, stage.hidden_size)

    def steps(until: float) -> list[float]:
        times, seq = [], 0
        while time.perf_counter() < until:
            seq += 1
            if kind == "decode":  # a 100-token context, then one row at a time
                stage.forward(StageBatch([seq], [0], [100]), inputs(100))
                for k in range(20):
                    t = time.perf_counter()
                    stage.forward(StageBatch([seq], [100 + k], [1]), inputs(1))
                    times.append(time.perf_counter() - t)
            else:
                t = time.perf_counter()
                stage.forward(StageBatch([seq], [0], [PREFILL_TOKENS]), inputs(PREFILL_TOKENS))
                times.append(time.perf_counter() - t)
            stage.free(seq)
        return times

    steps(time.perf_counter() + 1.0)  # warm-up
    barrier.wait()
    out.put((half, kind, statistics.median(steps(time.perf_counter() + seconds))))


def _run(jobs: list[tuple[int, str]], seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(h, k, seconds, barrier, out)) for h, k in jobs]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        half, kind, t = out.get(timeout=300)
        results[(half, kind)] = t
    for p in procs:
        p.join()
    return results


def measure(seconds: float = 4.0) -> dict:
    """Per-step medians alone and in pairs; returns {"contention", "pairs": [...]}."""
    alone = {}
    for kind in KINDS:
        for half in (0, 1):
            alone[(half, kind)] = _run([(half, kind)], seconds)[(half, kind)]
    pairs = []
    for k0, k1 in (("decode", "decode"), ("prefill", "decode"), ("prefill", "prefill")):
        both = _run([(0, k0), (1, k1)], seconds)
        for half, kind in ((0, k0), (1, k1)):
            pairs.append({"with": f"{k0}+{k1}", "stage": half, "kind": kind, "alone": alone[(half, kind)],
                          "together": both[(half, kind)]})
    slowdowns = [p["together"] / p["alone"] for p in pairs]
    return {"cores": os.cpu_count(), "contention": max(0.0, statistics.mean(slowdowns) - 1), "pairs": pairs}


def main() -> int:
    r = measure()
    print(f"two 1-thread stage processes of the default model on {r['cores']} cores")
    print(f"{'steps at once':<16}{'stage':>6}{'kind':>9}{'alone ms':>10}{'together ms':>13}{'slowdown':>10}")
    for p in r["pairs"]:
        print(f"{p['with']:<16}{p['stage']:>6}{p['kind']:>9}{p['alone'] * 1e3:>10.1f}{p['together'] * 1e3:>13.1f}"
              f"{p['together'] / p['alone']:>9.2f}x")
    print(f"contention (mean slowdown - 1): {r['contention']:.3f}")
    print(json.dumps({"cores": r["cores"], "contention": round(r["contention"], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
