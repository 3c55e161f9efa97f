"""What does the pipeline cost? Potluck single-process vs local pipelines vs HF generate.

Runs the default model (SmolLM2-135M-Instruct, float32, CPU) through

  * single    our engine in one process (a Head with no remote stages, all 30 layers),
              torch threads = os.cpu_count();
  * single1t  the same with 1 torch thread: what each stage process of a pipeline on a
              2-core machine gets, so the pipelines' pure transport cost shows;
  * pipe2/3   a 2- and a 3-stage pipeline on loopback, built exactly as `potluck chat`
              builds it (engine/pipeline/launch.py: LocalStages + Head; the machine's cores
              are split between the stage processes, threads = max(1, cores // stages);
              layers split by launch's speed measurement, or evenly with --split even);
  * hf        transformers' own `generate` (greedy, left-padded batch), all cores:
              what a user would otherwise reach for;

on the same chat prompts, greedy, at 1 concurrent request (the prompts one after
another) and at 8 (all submitted at once). Each system runs in a worker process of its
own, loaded once and kept up for the whole run; the systems take turns one
measurement at a time, the single process first and last in each round (so a slow
minute of this shared machine hits them all, and a ratio is taken between measurements
seconds apart, bracketed by the reference), each does a warm-up first, and
every request generates exactly --tokens tokens: EOS does not stop generation (the
head's eos_ids are cleared; HF runs with eos_token_id=None), so all systems do the
same work and their token ids can be compared one for one.

Metrics, per system and concurrency (median over --repeat rounds):
  decode tok/s  tokens after each request's first one, over the time during which some
                request was decoding (the union of its [first token, last token] spans)
  steady tok/s  the same, counted only while every request of a burst has its first
                token (so a batch mate's prefill does not count against decode)
  TTFT          mean over requests of submit -> first token
  e2e tok/s     all generated tokens over first submit -> last token
Greedy outputs are checked token for token against our single-process engine at
concurrency 1 (the reference). Ratios are printed two ways: of the median figures, and
paired (the median over rounds of each round's ratio); the verdicts use paired.

On a shared machine, other processes' CPU use is measured around every run (the
"other load" column): a run is repeated (--retries) when it exceeded --max-foreign
cores, after waiting up to --wait-quiet seconds for the machine to go quiet, and the
quietest attempt is kept. Two OpenMP threads sharing a core with a foreign process
stall at every barrier, so this matters more than it seems.

    .venv/bin/python bench/overhead.py            # full: 8 prompts, 64 tokens, 5 rounds
    .venv/bin/python bench/overhead.py --quick    # smoke run: 4 prompts, 16 tokens, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.cpuprobe import CpuProbe  # noqa: E402
from testkit.timed import timed_request  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYSTEMS = ("single", "single1t", "pipe2", "pipe3", "hf")
LABELS = {"single": "potluck 1 stage", "single1t": "potluck 1 stage, 1 thread", "pipe2": "potluck 2 stages",
          "pipe3": "potluck 3 stages", "hf": "HF generate"}
CONCURRENCY = (1, 8)
TARGET_PIPE_DECODE = 0.90   # pipeline / single decode throughput at 8 concurrent, at least
TARGET_PIPE_TTFT = 1.2      # pipeline TTFT / single TTFT, at most
TARGET_VS_HF = 1.0          # our single process / HF generate decode throughput, at least

# Varied chat prompts: short questions to a long pasted passage (the chat template adds
# a ~30-token system prompt, so these come out at roughly 35-150 tokens).
PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling into a quiet river.",
    "Explain in simple terms why the sky is blue during the day and red at sunset.",
    "List five tips for staying productive while working from home, with one sentence each.",
    "I have a list of numbers: 4, 8, 15, 16, 23, 42. Write a short Python function that returns "
    "their mean and median, and explain how it works step by step for a beginner.",
    "Summarize the following paragraph in two sentences. The printing press, invented by Johannes "
    "Gutenberg around 1440, transformed the spread of information in Europe. Before it, books were "
    "copied by hand, which made them rare and expensive. Movable type allowed texts to be produced "
    "quickly and cheaply, which helped literacy grow, spread new scientific ideas, and fueled the "
    "Reformation. Within decades, printing shops appeared in hundreds of cities.",
    "You are helping me plan a weekend trip. I live in Lyon, I like hiking and good food, I do not own "
    "a car, and my budget is about 300 euros for two days including transport and one night of "
    "accommodation. I would prefer somewhere reachable by train in less than three hours, with a "
    "marked trail of 10 to 20 kilometres and a few restaurants nearby. Suggest two destinations, and "
    "for each give the train time, a trail, where to sleep and a rough cost breakdown.",
]


# ---- prompts ------------------------------------------------------------------
def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def workload(n_prompts: int) -> list[str]:
    if n_prompts >= len(PROMPTS):
        return list(PROMPTS)
    # spread the kept ones over the length range
    step = (len(PROMPTS) - 1) / max(1, n_prompts - 1)
    return [PROMPTS[round(i * step)] for i in range(n_prompts)]


def requests_for(c: int, n_prompts: int) -> list[list[int]]:
    """Which prompt indices each round sends: c=1 all prompts one by one, else c at once."""
    if c == 1:
        return [[i] for i in range(n_prompts)]
    return [[i % n_prompts for i in range(c)]]


# ---- metrics ------------------------------------------------------------------
def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def metrics(records: list[dict]) -> dict:
    """records: one per request: t_submit, times (one per token), tokens, round."""
    decode_tokens = sum(len(r["tokens"]) - 1 for r in records)
    span = union_length([(r["times"][0], r["times"][-1]) for r in records])
    wall = max(r["times"][-1] for r in records) - min(r["t_submit"] for r in records)
    # steady state: within each round of concurrent requests, only the time when every
    # one of them has its first token (no prefill of a batch mate in the way)
    steady_tokens, steady_span = 0, 0.0
    for rnd in sorted({r["round"] for r in records}):
        rs = [r for r in records if r["round"] == rnd]
        t0, t1 = max(r["times"][0] for r in rs), max(r["times"][-1] for r in rs)
        steady_tokens += sum(1 for r in rs for t in r["times"] if t0 < t <= t1)
        steady_span += t1 - t0
    return {
        "decode_tps": decode_tokens / span if span > 0 else float("nan"),
        "steady_tps": steady_tokens / steady_span if steady_span > 0 else float("nan"),
        "ttft": statistics.mean(r["times"][0] - r["t_submit"] for r in records),
        "e2e_tps": sum(len(r["tokens"]) for r in records) / wall,
    }


# ---- workers (each system in its own process) -----------------------------------
def log(msg: str):
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quiet_window(probe: CpuProbe, max_foreign: float, waited: float, max_wait: float, start):
    """One 0.5 s look at the machine: True when it is quiet enough (or we waited enough)."""
    return CpuProbe.foreign(start, probe.sample()) <= max_foreign or waited >= max_wait


def wait_quiet(probe: CpuProbe, max_foreign: float, max_wait: float) -> float:
    t0 = time.perf_counter()
    while True:
        a = probe.sample()
        time.sleep(0.5)
        if quiet_window(probe, max_foreign, time.perf_counter() - t0, max_wait, a):
            return time.perf_counter() - t0


async def wait_quiet_async(probe: CpuProbe, max_foreign: float, max_wait: float) -> float:
    t0 = time.perf_counter()
    while True:
        a = probe.sample()
        await asyncio.sleep(0.5)  # keeps the websockets' pings answered
        if quiet_window(probe, max_foreign, time.perf_counter() - t0, max_wait, a):
            return time.perf_counter() - t0


def report_attempt(system: str, rep: int, c: int, attempts: list) -> None:
    foreign, recs = attempts[-1]
    m = metrics(recs)
    log(f"{system} rep {rep + 1} c={c} try {len(attempts)}: decode {m['decode_tps']:.1f} tok/s, "
        f"TTFT {m['ttft'] * 1e3:.0f} ms, other processes used {foreign:.2f} cores")


def keep_quiet_attempt(attempts: list[tuple[float, list[dict]]]) -> dict:
    foreign, recs = min(attempts, key=lambda x: x[0])
    return {"foreign": foreign, "attempts": len(attempts), "recs": recs}


async def engine_worker(system: str, prompts: list[list[int]], n_tokens: int, max_foreign: float,
                        retries: int, max_wait: float, split: str, channel: "Channel") -> dict:
    import torch

    from engine import cli
    from engine.cli import parser as cli_parser
    from engine.pipeline.launch import launch
    from engine.model.sources import DEFAULT_MODEL, resolve

    stages = {"single": 1, "single1t": 1, "pipe2": 2, "pipe3": 3}[system]
    cores = os.cpu_count() or 1
    # the single process uses every core (single1t: one, as each stage of a pipeline on a
    # 2-core machine has); pipelines keep launch's own split of the cores
    threads = {"single": cores, "single1t": 1}.get(system)
    layers = None  # --split auto: launch's own speed-proportional partition
    if split == "even" and stages > 1:
        n = resolve(DEFAULT_MODEL).config().num_hidden_layers
        layers = ",".join(str(n // stages + (i < n % stages)) for i in range(stages))
    # the CLI's own options and defaults, as `potluck chat --stages N` would get them
    parser = argparse.ArgumentParser()
    cli_parser.add_pipeline_args(parser)
    argv = ["--model", DEFAULT_MODEL, "--stages", str(stages), "--dtype", "float32"]
    argv += ["--threads", str(threads)] if threads else []
    argv += ["--layers", layers] if layers else []
    args = parser.parse_args(argv)
    probe = CpuProbe()
    await wait_quiet_async(probe, max_foreign, max_wait)  # the stage split is measured at start
    t0 = time.perf_counter()
    # every round asks the same prompts: none kept, so each computes its prompt as
    # generate does (a kept reply taken over would compute one token of it)
    pipe = await launch(dataclasses.replace(cli.pipeline_config(args), keep_replies=0))
    head = pipe.head
    log(f"{system}: pipeline up in {time.perf_counter() - t0:.1f}s: {head.info()['stages']}")
    try:
        head.eos_ids = set()  # run every request to max_tokens: equal work, comparable ids
        head_threads = await head._run(torch.get_num_threads)  # as the head's compute thread sees it

        async def one(prompt: list[int], n: int) -> dict:
            return await timed_request(head, prompt, n, system)

        rounds = itertools.count()
        busy_groups = {c: 0 for c in CONCURRENCY}  # most micro-batches seen holding requests at once

        async def watch(c: int):
            while True:
                busy_groups[c] = max(busy_groups[c], sum(1 for g in head.groups if g.seqs))
                await asyncio.sleep(0.05)

        async def round_(idx: list[int], n: int) -> list[dict]:
            watcher = asyncio.ensure_future(watch(len(idx)))
            try:
                recs = await asyncio.gather(*(one(prompts[i], n) for i in idx))
            finally:
                watcher.cancel()
            rnd = next(rounds)
            for r, i in zip(recs, idx):
                r["prompt"], r["round"] = i, rnd
            return recs

        # warm-up: one request alone, then a short concurrent burst
        await round_([0], min(8, n_tokens))
        await round_(list(range(len(prompts))), 4)
        busy_groups.update({c: 0 for c in CONCURRENCY})

        async def measure(c: int, rep: int) -> dict:
            attempts = []
            while True:
                await wait_quiet_async(probe, max_foreign, max_wait)
                a0 = probe.sample()
                recs = []
                for idx in requests_for(c, len(prompts)):
                    recs += await round_(idx, n_tokens)
                attempts.append((CpuProbe.foreign(a0, probe.sample()), recs))
                report_attempt(system, rep, c, attempts)
                if attempts[-1][0] <= max_foreign or len(attempts) > retries:
                    return keep_quiet_attempt(attempts)

        await channel.serve_async(measure)
        info = {"processes": stages, "threads": head_threads,
                "stage_threads": None if stages == 1 else pipe.local.threads,
                "micro_batches": busy_groups.get(max(CONCURRENCY)),
                "layers": [tuple(s["layers"]) for s in head.info()["stages"]]}
    finally:
        await pipe.close()
    return {"info": info}


def hf_worker(prompts: list[list[int]], n_tokens: int, max_foreign: float, retries: int,
              max_wait: float, channel: "Channel") -> dict:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.utils import logging as hf_logging

    from engine.model.sources import DEFAULT_MODEL, resolve
    from testkit.reference import full_model

    hf_logging.set_verbosity_error()
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    source = resolve(DEFAULT_MODEL)
    model = full_model(source)
    tok = source.tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # As the head with eos_ids cleared: run to max_new_tokens. generate() fills every
    # unset parameter from the model's own generation config, so clear EOS there
    # (min_new_tokens would instead mask EOS out of the logits and change the argmax).
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = pad
    gc.do_sample = False

    class Clock(StoppingCriteria):
        """Called once per generated token (after the whole batch's step): timestamps."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    rounds = itertools.count()

    def round_(idx: list[int], n: int) -> list[dict]:
        batch = [prompts[i] for i in idx]
        L = max(len(p) for p in batch)
        ids = torch.full((len(batch), L), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding
            ids[r, L - len(p):] = torch.tensor(p)
            mask[r, L - len(p):] = 1
        clock = Clock()
        t_submit = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        gen = out[:, L:].tolist()
        if any(len(g) != n for g in gen):
            raise RuntimeError(f"HF generate returned {[len(g) for g in gen]} tokens, expected {n}")
        rnd = next(rounds)
        return [{"tokens": g, "t_submit": t_submit, "times": clock.times, "prompt": i, "round": rnd}
                for g, i in zip(gen, idx)]

    round_([0], min(8, n_tokens))
    round_(list(range(len(prompts))), 4)
    probe = CpuProbe()

    def measure(c: int, rep: int) -> dict:
        attempts = []
        while True:
            wait_quiet(probe, max_foreign, max_wait)
            a0 = probe.sample()
            recs = []
            for idx in requests_for(c, len(prompts)):
                recs += round_(idx, n_tokens)
            attempts.append((CpuProbe.foreign(a0, probe.sample()), recs))
            report_attempt("hf", rep, c, attempts)
            if attempts[-1][0] <= max_foreign or len(attempts) > retries:
                return keep_quiet_attempt(attempts)

    channel.serve(measure)
    return {"info": {"processes": 1, "threads": torch.get_num_threads(), "stage_threads": None,
                     "micro_batches": None,
                     "layers": [(0, model.config.num_hidden_layers)]}}


def engine_version() -> str:
    """Git commit plus a hash of engine/*.py as this worker imported them (others may be editing)."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted((ROOT / "engine").glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "engine"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "?", ""
    return f"{head or '?'}{' + uncommitted engine changes' if dirty else ''} (engine/*.py sha1 {h.hexdigest()[:10]})"


REPLY = "@@overhead-worker "  # marks the worker's replies among anything else on its stdout


class Channel:
    """The worker's side: commands ("C REP": measure concurrency C, or "quit") come on
    stdin; each reply is a JSON file in the run's folder, named on a stdout line."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self._n = itertools.count()

    def reply(self, obj) -> None:
        path = self.folder / f"reply-{os.getpid()}-{next(self._n)}.json"
        path.write_text(json.dumps(obj))
        print(REPLY + str(path), flush=True)

    @staticmethod
    def _command(line: str):
        parts = line.split()
        return None if not parts or parts[0] == "quit" else (int(parts[0]), int(parts[1]))

    def serve(self, measure) -> None:
        self.reply("ready")
        while (cmd := self._command(sys.stdin.readline())) is not None:
            self.reply(measure(*cmd))

    async def serve_async(self, measure) -> None:
        loop = asyncio.get_running_loop()
        self.reply("ready")
        while (cmd := self._command(await loop.run_in_executor(None, sys.stdin.readline))) is not None:
            self.reply(await measure(*cmd))


def worker_main(a) -> int:
    if a.worker != "hf":
        # as `potluck chat` does before torch loads (engine/cli/): a pipeline's
        # processes take turns on the cores, so OpenMP's idle threads spin only briefly
        from engine.model.cores import apply_openmp_env

        apply_openmp_env(os.environ)
    from engine.model.sources import DEFAULT_MODEL, resolve

    version = engine_version()
    channel = Channel(a.out)
    tok = resolve(DEFAULT_MODEL).tokenizer()
    prompts = [chat_ids(tok, t) for t in workload(a.prompts)]
    if a.worker == "hf":
        res = hf_worker(prompts, a.tokens, a.max_foreign, a.retries, a.wait_quiet, channel)
    else:
        res = asyncio.run(engine_worker(a.worker, prompts, a.tokens, a.max_foreign, a.retries,
                                        a.wait_quiet, a.split, channel))
    res["prompt_lens"] = [len(p) for p in prompts]
    res["engine"] = version
    channel.reply(res)
    return 0


# ---- driver -------------------------------------------------------------------
class Worker:
    """One system's worker process, kept up for the whole run: loaded once, then told
    to measure one concurrency at a time, taking turns with the other systems."""

    def __init__(self, system: str, a, folder: str):
        self.system = system
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--out", folder,
               "--tokens", str(a.tokens), "--prompts", str(a.prompts),
               "--max-foreign", str(a.max_foreign), "--retries", str(a.retries), "--wait-quiet", str(a.wait_quiet),
               "--split", a.split]
        self.seconds = 0.0
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._read() != "ready":
            raise SystemExit(f"the {system} worker did not start")
        self.seconds += time.perf_counter() - t0

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(Path(line[len(REPLY):].strip()).read_text())
            sys.stderr.write(line)  # anything else the worker printed
        raise SystemExit(f"the {self.system} worker exited (code {self.proc.wait()})")

    def ask(self, line: str):
        t0 = time.perf_counter()
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        try:
            return self._read()
        finally:
            self.seconds += time.perf_counter() - t0

    def measure(self, c: int, rep: int) -> dict:
        return self.ask(f"{c} {rep}")

    def finish(self) -> dict:
        res = self.ask("quit")
        self.proc.wait()
        return res

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def fmt(cells):
        return "  ".join(str(c).ljust(w) if al == "l" else str(c).rjust(w)
                         for c, w, al in zip(cells, widths, align))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def compare(tokens: list[int], ref: list[int]) -> int | None:
    """Index of the first differing token, or None when equal."""
    for k, (x, y) in enumerate(zip(tokens, ref)):
        if x != y:
            return k
    return None if len(tokens) == len(ref) else min(len(tokens), len(ref))


def report(results: dict, a) -> None:
    ref = {r["prompt"]: r["tokens"] for r in results["single"]["runs"][1][0]["recs"]}
    lens = next(iter(results.values()))["prompt_lens"]
    print(f"\nModel: SmolLM2-135M-Instruct (float32, CPU), {os.cpu_count()} cores; {len(lens)} prompts of "
          f"{min(lens)}-{max(lens)} tokens ({', '.join(map(str, lens))}); {a.tokens} new tokens per "
          f"request, greedy, EOS ignored; median of {a.repeat} round(s) after a warm-up.\n")

    # the hash of engine/*.py decides: a commit elsewhere (README, tests) during the run is no change
    versions = sorted({r.get("engine", "?").rsplit("(", 1)[-1] for r in results.values()})
    print(f"Engine: {next(iter(results.values())).get('engine', '?')}" if len(versions) == 1 else
          "WARNING: the engine changed between systems (someone edited engine/ during the run):\n  "
          + "\n  ".join(f"{LABELS[s]}: {r.get('engine', '?')}" for s, r in results.items()))
    print()
    rows = []
    for s, r in results.items():
        i = r["info"]
        layers = ", ".join(f"{x}-{y - 1}" for x, y in i["layers"])
        if i["stage_threads"] is None:
            thr = f"{i['threads']}"
        elif i["stage_threads"] == i["threads"]:
            thr = f"{i['threads']} x {i['processes']}"
        else:
            thr = f"{i['threads']} + {i['stage_threads']} x {i['processes'] - 1}"
        mb = "-" if i.get("micro_batches") is None else str(i["micro_batches"])
        rows.append([LABELS[s], str(i["processes"]), thr, layers, mb, f"{r['seconds']:.0f}s"])
    print(table(["system", "processes", "torch threads", "layers per stage", f"busy micro-batches @{max(CONCURRENCY)}",
                 "bench wall"], rows, "lrrlrl"))

    # per-run metrics, then the median
    med: dict = {}
    noisy = False
    rows = []
    for c in CONCURRENCY:
        for s, r in results.items():
            ms = [metrics(run["recs"]) for run in r["runs"][c]]
            foreign = statistics.median(run["foreign"] for run in r["runs"][c])
            noisy |= any(run["foreign"] > a.max_foreign for run in r["runs"][c])
            m = {k: statistics.median(x[k] for x in ms) for k in ms[0]}
            spread = (max(x["decode_tps"] for x in ms) - min(x["decode_tps"] for x in ms)) / m["decode_tps"]
            med[s, c] = m
            bad, total = [], 0
            for run in r["runs"][c]:
                for rec in run["recs"]:
                    total += 1
                    k = compare(rec["tokens"], ref[rec["prompt"]])
                    if k is not None:
                        bad.append(k)
            match = "✓" if not bad else f"✗ {total - len(bad)}/{total} (first diff @{min(bad)})"
            rows.append([LABELS[s], str(c), f"{m['decode_tps']:.1f}", f"{m['steady_tps']:.1f}",
                         f"±{spread * 50:.0f}%", f"{m['ttft'] * 1e3:.0f}", f"{m['e2e_tps']:.1f}",
                         f"{foreign:.2f}", match])
    print()
    print(table(["system", "conc", "decode tok/s", "steady tok/s", "spread", "TTFT ms", "e2e tok/s",
                 "other load", "greedy = ref"], rows, "lrrrrrrrl"))
    print("decode: tokens after each request's first, over the time any request was decoding; steady: only "
          "while every\nrequest of a burst had its first token; spread: half the min-max range of decode tok/s "
          "over the runs;\nother load: cores other processes used during the run (median).")
    if noisy:
        print(f"WARNING: other processes used more than {a.max_foreign} cores during some runs even after "
              f"{a.retries} retries: treat these numbers as noisy.")

    rows = []

    def ratio(name, num, den, target=None, higher_better=True):
        if num not in med or den not in med:
            return
        key = "decode_tps" if higher_better else "ttft"
        if higher_better:
            v, vs = (med[num][k] / med[den][k] for k in ("decode_tps", "steady_tps"))
        else:
            v = vs = med[num]["ttft"] / med[den]["ttft"]
        # paired: the ratio within each round (the single process measured at its start
        # and its end: their mean), then the median over rounds; drift cancels out of it
        def in_round(system, c, rnd):
            return statistics.mean(metrics(x["recs"])[key] for i, x in enumerate(results[system]["runs"][c])
                                   if x.get("round", i) == rnd)

        rounds = sorted({x.get("round", i) for i, x in enumerate(results[num[0]]["runs"][num[1]])})
        pairs = [in_round(*num, r) / in_round(*den, r) for r in rounds]
        paired = statistics.median(pairs)
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if len(pairs) > 1 else ""
        if target is None:
            rows.append([name, f"{num[1]}", f"{v:.2f}", f"{paired:.2f}", spread, f"{vs:.2f}", "", "(info)"])
            return
        ok = paired >= target if higher_better else paired <= target
        rows.append([name, f"{num[1]}", f"{v:.2f}", f"{paired:.2f}", spread, f"{vs:.2f}",
                     ("≥ " if higher_better else "≤ ") + f"{target:.2f}", "PASS" if ok else "MISS"])

    for p in ("pipe2", "pipe3"):
        for c in CONCURRENCY:
            ratio(f"{p} / single decode tok/s", (p, c), ("single", c), TARGET_PIPE_DECODE if c > 1 else None)
    for p in ("pipe2", "pipe3"):
        for c in CONCURRENCY:
            ratio(f"{p} / single TTFT", (p, c), ("single", c), TARGET_PIPE_TTFT, False)
    for c in CONCURRENCY:
        ratio("single / HF generate decode tok/s", ("single", c), ("hf", c), TARGET_VS_HF, True)
    for p in ("single", "pipe2", "pipe3"):
        for c in CONCURRENCY:
            ratio(f"{p} / single 1-thread decode tok/s", (p, c), ("single1t", c))
    print()
    print(table(["ratio", "conc", "of medians", "paired", "rounds", "steady", "target", ""], rows, "lrrrrrrl"))
    print("(of medians: the ratio of the systems' median figures; paired: the median over rounds of the\n"
          "ratio within a round, the single process measured at the round's start and end (rounds: the\n"
          "range); verdicts use paired (decode tok/s, or TTFT for TTFT rows); steady: of medians, steady\n"
          "tok/s. At 1 request a pipeline has one stage busy at a time, so its decode row is informational.\n"
          "Against the 1-thread single process, a pipeline's ideal is 1.0 at 1 request and its process\n"
          "count at 8: the shortfall is transport and scheduling.)")

    # per-prompt token agreement (first run of each)
    rows = []
    cols = [(s, c) for c in CONCURRENCY for s in results if not (s == "single" and c == 1)]
    for p, n in enumerate(lens):
        row = [str(p), str(n)]
        for s, c in cols:
            recs = [x for x in results[s]["runs"][c][0]["recs"] if x["prompt"] == p]
            ks = [compare(x["tokens"], ref[p]) for x in recs]
            row.append("✓" if all(k is None for k in ks) else "✗@" + str(min(k for k in ks if k is not None)))
        rows.append(row)
    print("\nGreedy token ids vs our single-process engine at 1 request (✗@k: first differing token index)")
    print(table(["prompt", "tokens"] + [f"{s}@{c}" for s, c in cols], rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 prompts, 16 tokens, 1 repeat, 1 retry")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 64; quick 16)")
    p.add_argument("--prompts", type=int, default=None, help=f"prompts used (default {len(PROMPTS)}; quick 4)")
    p.add_argument("--repeat", type=int, default=None, help="rounds: measurements per system and concurrency, median reported (default 5; quick 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="retry a measurement when other processes used more than this many cores meanwhile")
    p.add_argument("--retries", type=int, default=None,
                   help="retries per measurement on a busy machine (default 2; quick 1)")
    p.add_argument("--wait-quiet", type=float, default=None,
                   help="before each measurement, wait up to this many seconds for the machine to go quiet "
                        "(default 30; quick 10)")
    p.add_argument("--split", choices=["auto", "even"], default="auto",
                   help="pipeline layer split: auto (launch's speed-based partition, the default) or even")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.tokens = a.tokens or (16 if a.quick else 64)
    a.prompts = min(a.prompts or (4 if a.quick else len(PROMPTS)), len(PROMPTS))
    a.repeat = a.repeat or (1 if a.quick else 5)
    a.retries = a.retries if a.retries is not None else (1 if a.quick else 2)
    a.wait_quiet = a.wait_quiet if a.wait_quiet is not None else (10.0 if a.quick else 30.0)
    if a.worker:
        return worker_main(a)

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if "single" not in systems:
        systems.insert(0, "single")  # the reference for every ratio and token check
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown system(s): {', '.join(sorted(unknown))}")
    from engine.model.sources import DEFAULT_MODEL, resolve

    resolve(DEFAULT_MODEL)  # convert the default model once, before the workers race to
    # Every system's worker stays up for the whole run, and the systems take turns one
    # measurement at a time (single @1, pipe2 @1, ..., single @8, pipe2 @8, ..., then the
    # next repeat, in a rotated order): this machine's speed drifts by 10-50% over
    # minutes (other tenants' memory traffic), so a ratio is taken between measurements
    # seconds apart, and a system measured all at once would carry its own minutes' luck
    # into every ratio. Idle workers wait on a pipe: their processes take no CPU.
    results = {s: {"runs": {c: [] for c in CONCURRENCY}} for s in systems}
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory() as folder:
        try:
            for s in systems:
                print(f"starting {LABELS[s]}...", file=sys.stderr, flush=True)
                workers[s] = Worker(s, a, folder)
            others = [s for s in systems if s != "single"]
            for rep in range(a.repeat):
                # the reference brackets each round (measured first and last), so a
                # drift during the round moves both sides of a paired ratio alike
                k = rep % max(1, len(others))
                order = ["single"] + others[k:] + others[:k] + ["single"]
                for c in CONCURRENCY:
                    for s in order:
                        print(f"measuring {LABELS[s]} at {c} concurrent (round {rep + 1} of {a.repeat})...",
                              file=sys.stderr, flush=True)
                        run = workers[s].measure(c, rep)
                        run["round"] = rep
                        results[s]["runs"][c].append(run)
            for s, w in workers.items():
                results[s].update(w.finish())
                results[s]["seconds"] = w.seconds
        finally:
            for w in workers.values():
                w.kill()
    if a.json:
        Path(a.json).write_text(json.dumps({k: v for k, v in results.items()}, default=str))
    report(results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
