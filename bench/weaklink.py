"""Weak links: FIFO vs decode-first / just-in-time chunks / dynamic micro-batches.

The MoLink setting (shared/reference/molink-transmission-paper-analysis.txt), scaled to
this CPU: a pipeline of 2 or 3 stages on the default model (SmolLM2-135M, float32:
576 x 4 = 2304 bytes per token per hop), every inter-stage byte crossing an emulated
link (testkit/linkemu.py ShapedLink: rate, one-way delay, FIFO queue):

    head --proxy1--> stage1 --proxy2--> stage2 ... ; last stage --proxyN(down)--> head

(the head is given the proxies' addresses as the stage addresses, so it tells each
stage that its `next` is the next stage's proxy; the last stage's tokens go back to
the head over its control connection, i.e. through the last proxy's down direction).
The proxies run in a child process of their own so their event loop does not share
the head's.

Workload: Poisson arrivals; input/output lengths drawn (seeded) from lognormals shaped
like the Azure LLM inference *conversation* trace the papers used (inputs: median ~1k
tokens, heavy right tail, cut at 2048 as the paper did; outputs: median ~200, cut at
1024), multiplied by --scale (default 1/8) so a request costs what this CPU can serve.
Prompts are random token ids; sampling is greedy; the head's eos_ids are cleared so
every request generates exactly its drawn output length.

Link settings are chosen by *ratio*, not by Mbit/s: the paper's 7B model on RTX 4090s
over 100 Mbit/s moves a 1k-token prefill (8 KiB/token/hop = 8 MiB) in ~0.67 s while a
decode step takes ~25 ms: prefill-transfer / decode-compute ~ 27. We measure our stages'
decode step and pick the bandwidth giving the same ratio for our (scaled) median
prompt; 60/100/200 Mbit/s in the paper map to ratios ~45/27/13. Delays map the same way
(10 ms and 30 ms relative to a 25 ms decode step).

Configurations (the head's link_mode / micro_batches / prefill_chunk / compute), each
adding one thing to the one before, as the paper's Table 5 does (none of them speculates,
as the paper's systems do not):
    fifo      whole volumes first-come-first-served (vLLM, Helix): link_mode=fifo,
              micro_batches=M (= stages), prefill_chunk=None; every stage computes its
              steps in arrival order (compute="in-order"), as vLLM does
    fifo+c64  FIFO links, but prompts computed and sent in 64-token chunks as the
              others do: separates the link scheduling from the compute chunking
    fixed     decode-first, fixed-size prefill chunks: link_mode=fixed, M, chunk 64
    jit       decode-first, just-in-time chunks: link_mode=jit, M, chunk 64
    jit+dyn   + dynamic micro-batch count (M..2M): link_mode=jit, micro_batches=None
              (the Head's defaults, but fixed 64-token prompt chunks)
    +compress + activation compression (compress="auto": int8 prefill volumes while the
              link is the bottleneck), only if Head takes a `compress` argument
and one beside the chain:
    +cut-in   jit+dyn, and decode first on the compute too: a decode step cuts into a
              running prompt step between two layers (compute="decode-first",
              engine/core/step_gate.py; an option, not the default: it trades TTFT for TPOT)
    +auto-chunk jit+dyn with prompt chunks sized to the measured link
              (prefill_chunk="auto", engine/core/prompt_chunk.py: the Head's default since it
              beat 64-token chunks here; at the reference point only)
    defaults  the Head's defaults as `potluck serve` runs them: +auto-chunk, and
              speculative decoding where its policy says it pays (speculate="auto")

Metrics per request: TTFT = submit -> first token; TPOT = (last token - first token) /
(n_out - 1); latency = submit -> done. Per cell: mean and p90 of each, throughput =
generated tokens / (first submit -> last done), and the ratio to FIFO's value. Also:
M = the micro-batch count at the end; dwait = mean of how long a decode volume waited on
the head's outbound link (queued -> last byte handed to the socket: the head-of-line
blocking the scheduler removes); other = CPU cores used by processes not ours.
Arrival rates are fractions of a measured saturation throughput (a burst through the
reference link), so they follow the machine's speed; the same seeded requests and
arrival pattern are replayed for every configuration.

    .venv/bin/python bench/weaklink.py --quick              # ~5 min
    .venv/bin/python bench/weaklink.py                      # full, ~30-40 min
    .venv/bin/python bench/weaklink.py --json out.json      # also dump per-cell metrics

This is a benchmark, not a test: it reports, it does not assert. Two CPU cores shared
with whatever else runs: the "other" column is the CPU (in cores) used by processes
that are not ours during the cell; anything above ~0.2 makes that cell noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ---- the paper's setting ----------------------------------------------------------------
PAPER_BYTES_PER_TOKEN = 8192        # 7B: hidden 4096 x fp16
PAPER_PROMPT = 1024                 # tokens: the trace's median input
PAPER_DECODE_S = 0.025              # a 4090 decode step for a 7B stage (~20-30 ms)
PAPER_RATES_MBIT = {"60": 60e6, "100": 100e6, "200": 200e6}
PAPER_DELAYS_MS = (10, 30)

# ---- the workload's shape (Azure LLM inference trace, conversation) ----------------------
IN_MEDIAN, IN_SIGMA, IN_MAX = 1024, 0.9, 2048
OUT_MEDIAN, OUT_SIGMA, OUT_MAX = 200, 0.8, 1024
# x the measured saturation throughput. The paper's "medium" rates are where FIFO's TPOT
# is already 2-6x its light-load value (Table 2: 0.50 s and 1.69 s vs 0.28 s), i.e. well
# into the loaded regime, not a lightly used pipeline.
LOADS = {"low": 0.25, "medium": 0.6, "high": 0.9}
# Requests in the saturation burst. A burst's throughput is requests / makespan, and its
# makespan ends with a nearly empty pipeline draining the longest outputs: 8 requests
# read 0.567 req/s where 24 read 0.783 (2 stages, the reference link, one machine, one
# session), and at "0.9x" of the 8-request figure FIFO's TPOT was only 1.7x its
# light-load value and its latency 1.3x medium's -- not a pipeline near saturation.
CALIB_REQUESTS = 24


def paper_ratio(rate_bps: float) -> float:
    return PAPER_PROMPT * PAPER_BYTES_PER_TOKEN * 8 / rate_bps / PAPER_DECODE_S


# ---- workload ----------------------------------------------------------------------------
def draw_requests(n: int, seed: int, scale: float, vocab: int) -> list[dict]:
    """n requests: unit-rate Poisson gaps (divide by the rate), lengths, prompt ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_in = min(IN_MAX, max(32, round(rng.lognormvariate(math.log(IN_MEDIAN), IN_SIGMA))))
        n_out = min(OUT_MAX, max(8, round(rng.lognormvariate(math.log(OUT_MEDIAN), OUT_SIGMA))))
        n_in, n_out = max(4, round(n_in * scale)), max(2, round(n_out * scale))
        out.append({"gap": rng.expovariate(1.0), "n_in": n_in, "n_out": n_out,
                    "prompt": [rng.randrange(200, vocab - 200) for _ in range(n_in)]})
    return out


# ---- CPU accounting: how much of the machine other processes took ------------------------
class CpuMeter:
    def __init__(self, pids_fn):
        self.pids_fn = pids_fn
        self.tick = os.sysconf("SC_CLK_TCK")

    def _total_busy(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]
        return (sum(v[:8]) - idle) / self.tick

    def _ours(self) -> float:
        t = 0.0
        for pid in self.pids_fn():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                t += (int(parts[11]) + int(parts[12])) / self.tick
            except (OSError, IndexError, ValueError):
                pass
        return t

    def start(self):
        self._t0, self._b0, self._o0 = time.monotonic(), self._total_busy(), self._ours()

    def stop(self) -> tuple[float, float]:
        dt = max(1e-6, time.monotonic() - self._t0)
        busy, ours = self._total_busy() - self._b0, self._ours() - self._o0
        return ours / dt, max(0.0, busy - ours) / dt


async def wait_quiet(pids_fn, max_wait: float, threshold: float) -> float:
    """Wait (up to max_wait s) until other processes use < threshold cores; returns their use."""
    meter = CpuMeter(pids_fn)
    t_end = time.monotonic() + max_wait
    while True:
        meter.start()
        await asyncio.sleep(2.0)
        other = meter.stop()[1]
        if other < threshold or time.monotonic() >= t_end:
            return other


# ---- proxies in a child process ----------------------------------------------------------
async def proxy_host(spec: dict):
    from testkit.linkemu import ShapedLink

    links = []
    for port in spec["targets"]:
        link = ShapedLink("127.0.0.1", 0, "127.0.0.1", port, spec["rate_bps"], spec["delay_s"],
                          spec["queue_bytes"])
        await link.start()
        links.append(link)
    print("PORTS " + json.dumps([link.port for link in links]), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)        # until the parent closes stdin
    print("STATS " + json.dumps([link.stats() for link in links]), flush=True)
    for link in links:
        await link.close()


class Proxies:
    def __init__(self, targets: list[int], rate_bps: float, delay_s: float, queue_bytes: int):
        self.spec = dict(targets=targets, rate_bps=rate_bps, delay_s=delay_s, queue_bytes=queue_bytes)
        self.proc = None
        self.ports: list[int] = []
        self.stats = None

    async def start(self) -> list[str]:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--proxy-host", json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode()
        if not line.startswith("PORTS "):
            raise RuntimeError(f"proxy host did not start: {line!r}")
        self.ports = json.loads(line[6:])
        return [f"ws://127.0.0.1:{p}" for p in self.ports]

    async def stop(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            line = (await asyncio.wait_for(self.proc.stdout.readline(), 10)).decode()
            if line.startswith("STATS "):
                self.stats = json.loads(line[6:])
            await asyncio.wait_for(self.proc.wait(), 10)
        except (asyncio.TimeoutError, OSError):
            self.proc.kill()
            await self.proc.wait()
        self.proc = None


# ---- configurations ----------------------------------------------------------------------
def configs(names: list[str], m: int, compress_ok: bool) -> list[tuple[str, dict]]:
    # The chain adds one scheduling feature at a time to the paper's systems, which do not
    # speculate: the head's prompt-lookup drafts (on by default) shorten FIFO's long steps
    # more than the others' short ones (bench/RESULTS.md 2026-12-03), so left on they blur
    # what each feature adds. "defaults" is what `potluck serve` runs.
    in_order = dict(compute="in-order", speculate="off")
    table = {
        "fifo": dict(link_mode="fifo", micro_batches=m, prefill_chunk=None, **in_order),
        "fifo+c64": dict(link_mode="fifo", micro_batches=m, prefill_chunk=64, **in_order),
        "fixed": dict(link_mode="fixed", micro_batches=m, prefill_chunk=64, **in_order),
        "jit": dict(link_mode="jit", micro_batches=m, prefill_chunk=64, **in_order),
        "jit+dyn": dict(link_mode="jit", micro_batches=None, prefill_chunk=64, **in_order),
        "+compress": dict(link_mode="jit", micro_batches=None, prefill_chunk=64, compress="auto", **in_order),
        "+cut-in": dict(link_mode="jit", micro_batches=None, prefill_chunk=64, compute="decode-first",
                        speculate="off"),
        # beside the chain: jit+dyn with prompt chunks sized to the measured link
        # (engine/core/prompt_chunk.py)
        "+auto-chunk": dict(link_mode="jit", micro_batches=None, prefill_chunk="auto", **in_order),
        # the Head's own defaults, as `potluck serve` starts it: the above, speculating
        "defaults": dict(link_mode="jit", micro_batches=None, prefill_chunk="auto", compute="in-order",
                         speculate="auto"),
    }
    return [(n, table[n]) for n in names if n != "+compress" or compress_ok]


def even_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(cuts, cuts[1:]))


# ---- what the head's link does with decode volumes (diagnostics, this process only) --------
class LinkTrace:
    """Enqueue time and kind of each volume on the head's outbound link, and when its last
    piece was handed to the socket: a decode volume's wait is the head-of-line blocking
    the scheduler is there to remove (stage-to-stage links live in the stage processes)."""

    def __init__(self):
        import engine.pipeline.link as L

        self.queued: dict[int, tuple[str, float, int]] = {}
        self.written: dict[int, float] = {}
        self._orig = L.encode_chunk

        def traced(vid, kind, off, total, piece):
            if off + len(piece) >= total:
                self.written[vid] = time.monotonic()
            return self._orig(vid, kind, off, total, piece)

        L.encode_chunk = traced

    def attach(self, head):
        self.queued.clear()
        self.written.clear()
        if head.link is None:
            return
        sched = head.link.sched
        orig = sched.enqueue

        def enqueue(vid, kind, nbytes, now):
            self.queued[vid] = (kind, now, nbytes)
            return orig(vid, kind, nbytes, now)

        sched.enqueue = enqueue
        self.chunks: list[tuple] = []
        orig_next = sched.next_send

        def next_send(now):
            window = sched.window(now) if sched.mode == "jit" else None
            x = orig_next(now)
            if x is not None and x.kind == "prefill":
                self.chunks.append((now, x.length, x.length / sched.link.bandwidth, window, sched._loop_ewma))
            return x

        sched.next_send = next_send

    def summary(self) -> dict:
        import numpy as np

        out = {}
        if getattr(self, "chunks", None):
            d = [c[2] for c in self.chunks]
            out["prefill_sends"] = dict(n=len(d), link_s_mean=float(np.mean(d)), link_s_p90=float(np.percentile(d, 90)),
                                        link_s_max=float(max(d)),
                                        loop_ewma_max=max((c[4] or 0.0) for c in self.chunks))
        for kind in ("decode", "prefill"):
            w = [self.written[v] - t for v, (k, t, _) in self.queued.items() if k == kind and v in self.written]
            nb = [b for v, (k, _, b) in self.queued.items() if k == kind]
            if w:
                out[kind] = dict(n=len(w), wait_mean=float(np.mean(w)), wait_p90=float(np.percentile(w, 90)),
                                 wait_max=float(max(w)), bytes_mean=float(np.mean(nb)))
        return out


# ---- one cell ----------------------------------------------------------------------------
async def start_head(source, addrs, layers, cfg: dict):
    from engine.pipeline.head import Head, PipelineError

    last = None
    for attempt in range(4):
        head = Head(source, addrs, layers=layers, **cfg)
        try:
            await head.start()
            head.eos_ids = set()
            return head
        except (PipelineError, OSError) as exc:   # a stage still holds the last head: retry
            last = exc
            await head.close()
            await asyncio.sleep(1.0 + attempt)
    raise RuntimeError(f"head did not start: {last}")


async def run_requests(head, reqs: list[dict], rate: float | None, cap_s: float) -> dict:
    """Submit reqs (Poisson at `rate`, or all at once when rate is None); time them."""
    from engine.core.sampling import SamplingParams

    results = [None] * len(reqs)
    handles = []

    async def consume(i, h, t_sub):
        t_first = None
        n = 0
        arrivals = []   # (time, tokens) per streamed event: where a request's time went
        async for ev in h:
            now = time.perf_counter()
            if hasattr(ev, "token_ids"):
                n += len(ev.token_ids)
                arrivals.append((now, len(ev.token_ids)))
                if t_first is None:
                    t_first = now
            else:
                if t_first is None and ev.completion_tokens:
                    t_first = now
                results[i] = dict(t_submit=t_sub, t_first=t_first, t_done=now, n_in=reqs[i]["n_in"],
                                  n_out=ev.completion_tokens, finish=ev.finish_reason, error=ev.error,
                                  arrivals=arrivals)

    t0 = time.perf_counter()
    tasks = []
    t_arr = 0.0
    for i, r in enumerate(reqs):
        if rate:
            t_arr += r["gap"] / rate if i else 0.0
            delay = t0 + t_arr - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        if time.perf_counter() - t0 > 0.7 * cap_s:
            break        # the rest of the cap is for draining: count what was submitted
        t_sub = time.perf_counter()
        h = head.submit(list(r["prompt"]), SamplingParams(temperature=0.0, max_tokens=r["n_out"]))
        handles.append(h)
        tasks.append(asyncio.ensure_future(consume(i, h, t_sub)))
    remaining = max(1.0, cap_s - (time.perf_counter() - t0))
    done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    if pending:
        for h in handles:
            h.cancel()
        await asyncio.wait(pending, timeout=10)
    return dict(t0=t0, requests=[r for r in results], submitted=len(tasks))


async def sample_profiles(head, out: list, every: float = 1.0) -> None:
    """Append a copy of the head's view of every stage's profile each `every` seconds."""
    while True:
        await asyncio.sleep(every)
        out.append(json.loads(json.dumps(head.profiles)))


def median_profiles(samples: list) -> list:
    """Point by point median over samples of [profile per stage] (same points each)."""
    if not samples:
        return []
    out = []
    for i, first in enumerate(samples[0]):
        prof = {}
        for kind, curve in first.items():
            prof[kind] = [[n, statistics.median(s[i][kind][j][1] for s in samples)] for j, (n, _) in enumerate(curve)]
        out.append(prof)
    return out


def summarize(run: dict, n_total: int) -> dict:
    import numpy as np

    ok = [r for r in run["requests"] if r and r["finish"] == "length" and r["t_first"] is not None]
    if not ok:
        return dict(done=0, total=n_total)
    ttft = [r["t_first"] - r["t_submit"] for r in ok]
    tpot = [(r["t_done"] - r["t_first"]) / (r["n_out"] - 1) for r in ok if r["n_out"] > 1]
    lat = [r["t_done"] - r["t_submit"] for r in ok]
    span = max(r["t_done"] for r in ok) - min(r["t_submit"] for r in ok)
    toks = sum(r["n_out"] for r in ok)

    def mp(v):
        return (float(np.mean(v)), float(np.percentile(v, 90))) if v else (float("nan"),) * 2

    m = dict(done=len(ok), total=n_total)
    m["ttft"], m["ttft_p90"] = mp(ttft)
    m["tpot"], m["tpot_p90"] = mp(tpot)
    m["lat"], m["lat_p90"] = mp(lat)
    m["tput"] = toks / span if span > 0 else float("nan")
    m["req_s"] = len(ok) / span if span > 0 else float("nan")
    return m


async def run_cell(ctx, n_stages: int, cfg_name: str, cfg: dict, rate_bps: float, delay_s: float,
                   reqs: list[dict], rate: float | None, cap_s: float, warmup: list[dict]) -> dict:
    import torch

    stages = ctx["stages"][n_stages]
    targets = stages.ports
    queue = max(32 << 10, int(rate_bps / 8 * 0.1))          # ~100 ms of link time
    proxies = Proxies(targets, rate_bps, delay_s, queue)
    addrs = stages.reached_through(await proxies.start())
    head = None
    pids = lambda: [os.getpid()] + [p.pid for p in stages.procs] + ([proxies.proc.pid] if proxies.proc else [])
    meter = CpuMeter(pids)
    if ctx["wait_quiet"]:
        await wait_quiet(pids, ctx["wait_quiet"], 0.3)
    cell = dict(stages=n_stages, config=cfg_name, head_args={k: v for k, v in cfg.items()},
                rate_bps=rate_bps, delay_s=delay_s, proxy_queue_bytes=queue,
                arrival_rate=rate, n_requests=len(reqs))
    try:
        torch.set_num_threads(1)
        head = await start_head(ctx["source"], addrs, even_layers(ctx["n_layers"], n_stages), cfg)
        cell["profiles"] = head.profiles
        await run_requests(head, warmup, None, 120)          # the link gets measured, as in service
        ctx["trace"].attach(head)
        meter.start()
        samples: list = []
        sampler = asyncio.ensure_future(sample_profiles(head, samples))
        run = await run_requests(head, reqs, rate, cap_s)
        sampler.cancel()
        ours, other = meter.stop()
        # the stages' profiles as their steps timed them in service (profile.StepLog),
        # the median of a sample a second: what bench/simulator.py --validate runs on
        cell["profiles_observed"] = median_profiles(samples) or None
        cell["head_link_waits"] = ctx["trace"].summary()
        cell.update(summarize(run, run["submitted"]))
        cell["cpu_ours"], cell["cpu_other"] = ours, other
        cell["per_request"] = [
            None if r is None else dict(n_in=r["n_in"], n_out=r["n_out"], finish=r["finish"],
                                        submit=r["t_submit"] - run["t0"],
                                        ttft=None if r["t_first"] is None else r["t_first"] - r["t_submit"],
                                        latency=r["t_done"] - r["t_submit"], error=r["error"],
                                        tokens=[[round(t - r["t_submit"], 4), k] for t, k in r["arrivals"]])
            for r in run["requests"]]
        cell["final_micro_batches"] = head.micro_batches
        if head.link is not None:
            est = head.link.sched.link
            cell["head_link"] = dict(est_bandwidth_Bps=est.bandwidth, est_rtt_s=est.rtt,
                                     rtt_min_s=head.link.rtt_min, cap_bytes=head.link.cap,
                                     bytes_sent=head.link.bytes_sent, failed=head.link.failed)
        cell["error"] = head.error
    except Exception as exc:   # a broken cell is reported, the others still run
        cell["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if head is not None:
            await head.close()
        await proxies.stop()
        cell["proxy_stats"] = proxies.stats
        await asyncio.sleep(0.5)     # let the stages see the old head go
    return cell


# ---- printing ----------------------------------------------------------------------------
def fmt(v, spec=".3f"):
    return "   -  " if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_cells(title: str, cells: list[dict]):
    print(f"\n{title}")
    hdr = (f"{'config':<10} {'done':>5} {'TTFT':>7} {'p90':>7} {'TPOT':>7} {'p90':>7} {'lat':>7} {'p90':>7} "
           f"{'tok/s':>6} | {'TTFT%':>6} {'TPOT%':>6} {'lat%':>6} {'tput%':>6} | {'M':>2} {'dwait':>6} {'other':>5}")
    print(hdr)
    print("-" * len(hdr))
    base = next((c for c in cells if c["config"] == "fifo" and c.get("done")), None)
    for c in cells:
        if not c.get("done"):
            print(f"{c['config']:<10} {c.get('done', 0):>2}/{c['n_requests']:<2} ERROR {c.get('error')}")
            continue
        r = ratios(c, base)
        print(f"{c['config']:<10} {c['done']:>2}/{c['total']:<2} {fmt(c['ttft']):>7} {fmt(c['ttft_p90']):>7} "
              f"{fmt(c['tpot']):>7} {fmt(c['tpot_p90']):>7} {fmt(c['lat']):>7} {fmt(c['lat_p90']):>7} "
              f"{fmt(c['tput'], '.1f'):>6} | {pct(r.get('ttft')):>6} {pct(r.get('tpot')):>6} {pct(r.get('lat')):>6} "
              f"{pct(r.get('tput')):>6} | {str(c.get('final_micro_batches', '')):>2} "
              f"{fmt(c.get('head_link_waits', {}).get('decode', {}).get('wait_mean')):>6} {fmt(c.get('cpu_other'), '.2f'):>5}"
              + (f"  [{c['error']}]" if c.get("error") else ""))


def ratios(c: dict, base: dict | None) -> dict:
    if not base or not c.get("done"):
        return {}
    return {k: c[k] / base[k] for k in ("ttft", "tpot", "lat", "tput", "ttft_p90", "tpot_p90", "lat_p90")
            if base.get(k) and not math.isnan(base[k]) and not math.isnan(c[k])}


def pct(v):
    return "  -  " if v is None else f"{100 * v:.0f}%"


# ---- main --------------------------------------------------------------------------------
async def main(a):
    from engine.pipeline.head import Head
    from engine.pipeline.local import LocalStages
    from engine.model.sources import resolve

    t_start = time.monotonic()
    source = resolve("default")
    cfg = source.config()
    hidden, n_layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    bytes_tok = hidden * 4
    compress_ok = "compress" in inspect.signature(Head).parameters
    ctx = dict(source=source, n_layers=n_layers, stages={}, wait_quiet=a.wait_quiet, trace=LinkTrace())
    stage_counts = [2] if a.quick else [2, 3]
    print(f"# weak-link benchmark ({'quick' if a.quick else 'full'}), model {source.name}: hidden {hidden}, "
          f"{n_layers} layers, float32 -> {bytes_tok} B/token/hop; seed {a.seed}; "
          f"{os.cpu_count()} CPU cores (shared: see 'other'); 1 torch thread per process")
    print(f"# Head(compress=...) {'available' if compress_ok else 'NOT available: the +compress column is skipped'}")
    cpu = None
    if a.json:
        # for bench/simulator.py --validate: what the stages' steps cost each other on
        # this shared CPU (measured before anything else runs)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from contention import measure

        cpu = {k: v for k, v in measure().items() if k in ("cores", "contention")}
        print(f"# stage processes on this CPU slow each other by {cpu['contention']:.0%} per concurrent step "
              f"(bench/contention.py; recorded for bench/simulator.py --validate)")
    try:
        for n in stage_counts:
            ls = LocalStages(n - 1, threads=1)
            await ls.start()
            ctx["stages"][n] = ls

        # -- workload
        reqs = draw_requests(a.requests, a.seed, a.scale, vocab)
        ins, outs = [r["n_in"] for r in reqs], [r["n_out"] for r in reqs]
        med_in = statistics.median(ins)
        print(f"\n## Workload: Azure LLM inference trace (conversation) shape, scaled x{a.scale:g}")
        print(f"inputs  ~ lognormal(median {IN_MEDIAN}, sigma {IN_SIGMA}) cut to [32, {IN_MAX}] (heavy right tail, "
              f"as the trace; the paper drops > 2048) -> x{a.scale:g}")
        print(f"outputs ~ lognormal(median {OUT_MEDIAN}, sigma {OUT_SIGMA}) cut to [8, {OUT_MAX}] (shorter, "
              f"mostly < 200 in the trace) -> x{a.scale:g}")
        print(f"why scaled: a CPU stage prefills ~1-2 ms/token; unscaled 1k-token prompts would make one "
              f"request cost seconds and a cell hours")
        print(f"drawn ({len(reqs)} requests, seed {a.seed}): input median {med_in:.0f} mean {statistics.mean(ins):.0f} "
              f"max {max(ins)}; output median {statistics.median(outs):.0f} mean {statistics.mean(outs):.0f} "
              f"max {max(outs)}")
        warm = draw_requests(3, a.seed + 1000, a.scale, vocab)
        for w in warm:
            w["n_out"] = 4

        # -- decode time on this CPU -> link settings with the paper's ratios
        probe = await start_head(source, ctx["stages"][2].addresses, even_layers(n_layers, 2),
                                 dict(link_mode="jit", micro_batches=2))
        from engine.core.profile import interp
        td = [interp(p["decode"], 1) for p in probe.profiles]
        tp = [interp(p["prefill"], med_in) for p in probe.profiles]
        # the startup profiles ran while every process was loading; the head's stage again,
        # alone and idle, is the better figure for the decode step (best of 3 x 2 repeats)
        from engine.model.measure import measure
        td0 = [interp(measure(probe.stage0)["decode"], 1) for _ in range(3)]
        td = [min(td0)] + td[1:] if min(td0) < td[0] else td
        # what a row's context adds to a decode step (the profiles attend to 8 tokens):
        # bench/simulator.py --validate models it from this figure
        from engine.core.profile import PROFILE_CONTEXT
        from engine.model.measure import context_cost
        ctx_cost = statistics.median(context_cost(probe.stage0) for _ in range(3))
        print(f"decode cost of context: {ctx_cost:.2e} of a 1-row step per row and token of context "
              f"(16 rows of 256 tokens: +{ctx_cost * 16 * (256 - PROFILE_CONTEXT) * td[0] * 1e3:.0f} ms "
              f"on the head's stage)")
        await probe.close()
        await asyncio.sleep(0.5)
        td_mean = a.decode_ms / 1e3 if a.decode_ms else min(td)
        prefill_bytes = med_in * bytes_tok
        bws = {}
        for name, rbps in PAPER_RATES_MBIT.items():
            ratio = paper_ratio(rbps)
            bws[name] = prefill_bytes * 8 / (ratio * td_mean)
        delays = {ms: ms / 1e3 / PAPER_DECODE_S * td_mean for ms in PAPER_DELAYS_MS}
        print("\n## Link mapping: same prefill-transfer / decode-compute ratio as the paper")
        print(f"paper: 7B, fp16, {PAPER_BYTES_PER_TOKEN} B/token/hop, {PAPER_PROMPT}-token prefill = "
              f"{PAPER_PROMPT * PAPER_BYTES_PER_TOKEN / 2**20:.0f} MiB, 4090 decode step ~{PAPER_DECODE_S * 1e3:.0f} ms")
        print(f"ours : SmolLM2-135M, fp32, {bytes_tok} B/token/hop, {med_in:.0f}-token median prefill = "
              f"{prefill_bytes / 1024:.0f} KiB, stage decode step (batch 1) "
              + ", ".join(f"{t * 1e3:.1f}" for t in td) + f" ms ({'given' if a.decode_ms else 'min'} "
              f"{td_mean * 1e3:.1f}), stage prefill of "
              f"{med_in:.0f} tokens " + ", ".join(f"{t * 1e3:.0f}" for t in tp) + " ms")
        print(f"{'paper link':>12} {'paper xfer':>10} {'ratio':>6} | {'our link':>10} {'our xfer':>9}")
        for name, rbps in PAPER_RATES_MBIT.items():
            ratio = paper_ratio(rbps)
            print(f"{name + ' Mbit/s':>12} {PAPER_PROMPT * PAPER_BYTES_PER_TOKEN * 8 / rbps:>9.2f}s {ratio:>6.1f} | "
                  f"{bws[name] / 1e6:>6.2f} Mbit/s {prefill_bytes * 8 / bws[name]:>8.2f}s")
        for ms, d in delays.items():
            print(f"{f'{ms} ms delay':>12} {'':>10} {ms / 1e3 / PAPER_DECODE_S:>6.2f} | {d * 1e3:>6.1f} ms one-way")
        print("caveat: prompts are scaled but batch sizes are not, so a decode volume (rows x 2304 B) is ~"
              f"{PAPER_PROMPT / med_in * bytes_tok / PAPER_BYTES_PER_TOKEN:.1f}x larger relative to a prefill "
              "than in the paper")

        mid_bw, mid_delay = bws["100"], delays[30]

        # -- saturation throughput (per pipeline length) -> arrival rates
        capacity, rates = {}, {}
        if a.rate:
            rates = {n: {"medium": a.rate} for n in stage_counts}
            print(f"\n## Load: given, {a.rate:.3f} req/s (medium only)")
        else:
            print(f"\n## Load: saturation throughput = a burst of {a.calib} requests through the ~100 Mbit/s, "
                  f"~30 ms link (jit, M = stages); rates are fractions of it")
            for n in stage_counts:
                calib = draw_requests(a.calib, a.seed + 7, a.scale, vocab)
                cc = await run_cell(ctx, n, "jit", dict(link_mode="jit", micro_batches=n, prefill_chunk=64),
                                    mid_bw, mid_delay, calib, None, a.cap, warm)
                if not cc.get("req_s"):
                    raise RuntimeError(f"calibration failed: {cc.get('error')}")
                capacity[n] = cc["req_s"]
                rates[n] = {k: f * capacity[n] for k, f in LOADS.items()}
                print(f"{n} stages: {capacity[n]:.3f} req/s ({cc['tput']:.1f} tok/s; other CPU "
                      f"{cc['cpu_other']:.2f} cores) -> " + ", ".join(f"{k} {LOADS[k]:.2f}x = {v:.3f} req/s"
                                                               for k, v in rates[n].items()))

        # -- the plan, most important first: the full ablation at the paper's reference
        # point, 3 stages there, the bandwidth x delay grid, then the other loads
        if a.quick:
            names = ["fifo", "jit+dyn", "defaults"]
            bw, d = a.point.split("/") if a.point else ("100", "30")
            plan = [(2, bw, int(d), "medium", names)]
        else:
            names = ["fifo", "fifo+c64", "fixed", "jit", "jit+dyn", "+compress", "+cut-in", "+auto-chunk", "defaults"]
            grid = ["fifo", "jit+dyn", "+compress"]
            plan = [(2, "100", 30, "medium", names),
                    (3, "100", 30, "medium", ["fifo", "jit+dyn", "+cut-in", "+auto-chunk", "defaults"])]
            plan += [(2, bw, d, "medium", grid) for d in PAPER_DELAYS_MS for bw in ("60", "100", "200")
                     if (bw, d) != ("100", 30)]
            plan += [(2, "100", 30, "high", ["fifo", "jit+dyn", "+cut-in"]),
                     (2, "100", 30, "low", ["fifo", "jit+dyn", "+cut-in"])]
        if a.only:
            plan = plan[:a.only]
        if a.configs:
            names = a.configs.split(",")
            plan = [(n, bw, d, load, names) for n, bw, d, load, _ in plan]
        all_cells = []

        def dump():
            if a.json:
                out = dict(model=source.name, bytes_per_token=bytes_tok, scale=a.scale, seed=a.seed, cpu=cpu,
                           decode_step_s=td, decode_step_used_s=td_mean, ctx_cost=ctx_cost, capacity_req_s=capacity, rates=rates,
                           bandwidths_bps=bws, delays_s={str(k): v for k, v in delays.items()}, workload=[
                               dict(gap=r["gap"], n_in=r["n_in"], n_out=r["n_out"]) for r in reqs],
                           cells=all_cells)
                Path(a.json).write_text(json.dumps(out, indent=1, default=str))

        for n, bw, dms, load, cfg_names in plan:
            if load not in rates.get(n, {}):
                continue
            group = []
            for name, hcfg in configs(cfg_names, n, compress_ok):
                if time.monotonic() - t_start > a.budget:
                    print(f"(time budget of {a.budget:.0f} s spent: skipping {n} stages {bw}/{dms} {load} {name})")
                    continue
                c = await run_cell(ctx, n, name, hcfg, bws[bw], delays[dms], reqs, rates[n][load], a.cap, warm)
                c.update(paper_link=f"{bw} Mbit/s", paper_delay_ms=dms, load=load)
                group.append(c)
                all_cells.append(c)
                dump()
            if group:
                print_cells(f"## {n} stages, link {bws[bw] / 1e6:.2f} Mbit/s (~paper {bw} Mbit/s), one-way "
                            f"{delays[dms] * 1e3:.1f} ms (~paper {dms} ms), {load} load {rates[n][load]:.3f} req/s "
                            f"[s; % = ratio to FIFO]", group)
            sys.stdout.flush()

        report(all_cells, names)
        print(f"\n(total {time.monotonic() - t_start:.0f} s)")
        dump()
        if a.json:
            print(f"wrote {a.json}")
    finally:
        for ls in ctx["stages"].values():
            await ls.stop()


def report(cells: list[dict], names: list[str]):
    # Table 5-style ablation at the paper's reference point
    ref = [c for c in cells if c["stages"] == 2 and c["paper_link"] == "100 Mbit/s" and c["paper_delay_ms"] == 30
           and c["load"] == "medium" and c.get("done")]
    labels = {"fifo": "no optimizations (FIFO)", "fifo+c64": "FIFO links, 64-token prompt chunks",
              "fixed": "+ decode-first, fixed chunks",
              "jit": "+ just-in-time chunks", "jit+dyn": "+ dynamic micro-batches",
              "+compress": "+ compression", "+cut-in": "jit+dyn, decode steps cut in",
              "+auto-chunk": "jit+dyn, chunks sized to the link",
              "defaults": "the defaults (+ speculation)"}
    if ref:
        print("\n## Ablation (paper Table 5 style): 2 stages, ~100 Mbit/s, ~30 ms, medium load")
        print(f"{'':<36} {'TTFT (s)':>9} {'TPOT (s)':>9} {'latency (s)':>12} {'tok/s':>7}")
        for c in ref:
            print(f"{labels[c['config']]:<36} {c['ttft']:>9.3f} {c['tpot']:>9.3f} {c['lat']:>12.3f} {c['tput']:>7.1f}")
        if "+compress" in names and not any(c["config"] == "+compress" for c in ref):
            print(f"{labels['+compress']:<36}   (skipped: Head has no `compress` option)")

    print("\n## Target check")
    groups: dict[tuple, list] = {}
    for c in cells:
        groups.setdefault((c["stages"], c["paper_link"], c["paper_delay_ms"], c["load"]), []).append(c)
    worst = []
    for key, g in groups.items():
        base = next((c for c in g if c["config"] == "fifo" and c.get("done")), None)
        for c in g:
            if key[3] != "medium" or c is base or not base or not c.get("done"):
                continue
            r = ratios(c, base)
            ok = r["tpot"] <= 0.75 and r["ttft"] <= 0.85
            print(f"{key[0]} stages, ~{key[1]}, ~{key[2]} ms, medium: {c['config']:<9} TPOT {pct(r['tpot']):>5} "
                  f"(target <= 75%), TTFT {pct(r['ttft']):>5} (target <= 85%) of FIFO -> {'MET' if ok else 'NOT met'}")
        for c in g:
            if c is base or not c.get("done") or not base:
                if not c.get("done"):
                    worst.append((f"{c['config']} @ {key}", "failed", c.get("error")))
                continue
            r = ratios(c, base)
            for k in ("ttft", "tpot", "lat"):
                if r.get(k, 0) > 1.05:
                    worst.append((f"{c['config']} @ {key}", k, f"{pct(r[k])} of FIFO"))
            if r.get("tput", 1) < 0.95:
                worst.append((f"{c['config']} @ {key}", "tput", f"{pct(r['tput'])} of FIFO"))
    if worst:
        print("cells worse than FIFO by more than 5% (mean metrics): ")
        for w in worst:
            print("   ", *w)
    else:
        print("no cell worse than FIFO by more than 5% on mean TTFT, TPOT, latency or throughput")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--proxy-host":
        asyncio.run(proxy_host(json.loads(sys.argv[2])))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 stages, ~100 Mbit/s / ~30 ms equivalent, medium "
                    "load, FIFO vs jit+dyn vs the defaults (~5 min)")
    ap.add_argument("--point", default=None, choices=[f"{b}/{d}" for b in PAPER_RATES_MBIT for d in PAPER_DELAYS_MS],
                    help="with --quick: the paper's link as MBIT/MS (default 100/30)")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default 16 full, 12 quick)")
    ap.add_argument("--calib", type=int, default=None, help=f"requests in the saturation burst "
                    f"(default {CALIB_REQUESTS})")
    ap.add_argument("--scale", type=float, default=1 / 8, help="length scale vs the trace (default 1/8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="skip calibration: this arrival rate (req/s), "
                    "medium load only")
    ap.add_argument("--cap", type=float, default=None, help="seconds a cell may run, then the rest is "
                    "cancelled (default 150, quick 90)")
    ap.add_argument("--decode-ms", type=float, default=None, help="map links with this stage decode step "
                    "instead of the measured one (the measurement is inflated on a busy machine)")
    ap.add_argument("--budget", type=float, default=None, help="stop starting cells after this many seconds")
    ap.add_argument("--only", type=int, default=0, help="run only the first N groups of the plan")
    ap.add_argument("--wait-quiet", type=float, default=10.0, help="before each cell, wait up to this many "
                    "seconds for other processes to use < 0.3 cores (0: don't)")
    ap.add_argument("--configs", default=None, help="comma-separated configurations for every group "
                    "(fifo,fifo+c64,fixed,jit,jit+dyn,+compress,+cut-in,+auto-chunk,defaults)")
    ap.add_argument("--json", default=None, help="write per-cell metrics here")
    a = ap.parse_args()
    a.requests = a.requests or (12 if a.quick else 16)
    a.calib = a.calib or CALIB_REQUESTS
    a.budget = a.budget or (420 if a.quick else 2400)
    a.cap = a.cap or (100.0 if a.quick else 120.0)
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(a))
