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

Three files: bench/sim_parts.py (the workload, policies, pipeline and step costs),
bench/sim_events.py (the clock, wires, CPUs, links, stages and head), and this one (the
scenarios, the validation against a live run, the command line; its names are the other
two's as well, as the tests and bench/northstar.py read them).

    .venv/bin/python bench/simulator.py                     # 70B over home GPUs, all cells
    .venv/bin/python bench/simulator.py --stages 4 --mbits 20 --loads medium
    .venv/bin/python bench/simulator.py --validate results.json   # bench/weaklink.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the parts and the event loop live beside this file; their names are this module's too,
# as bench/northstar.py, bench/ack_hold.py and the tests read them (sim.Spec, sim.simulate...)
from engine.core.profile import PROFILE_CONTEXT, interp  # noqa: E402,F401
from engine.core.step_gate import MAX_CUT_INS  # noqa: E402,F401
from sim_events import (Clock, Compute, Cpu, Head, Link, Seq, Simulation, Stage, Step, Wire,  # noqa: E402,F401
                        simulate, summarize)
from sim_parts import (ALIASES, FRAME_HEADER, NEW_META, PIECE_HEADER, POLICIES, PROMPT_META,  # noqa: E402,F401
                       ROW_META, Curve, Pipeline, Policy, Spec, decode_row, step_time, workload)

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
