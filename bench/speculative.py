"""Speculative decoding across homes (issue 34): what drafting k tokens per trip buys
one person, and what it costs eight.

Three stages of the default model (SmolLM2-135M-Instruct, float32, CPU, one torch thread
per process, layers 0-9 / 10-19 / 20-29) with every hop crossing an emulated link
(testkit/linkemu.py ShapedLink, 100 Mbit/s, one-way delay 1, 15 or 30 ms):

    head (stage 0) --link 1--> stage 1 --link 2--> stage 2 --link 2 (down)--> head

(the head is given the proxies' addresses as the stage addresses, as bench/weaklink.py
does: stage 1's `next` is link 2's proxy, and the last stage's tokens come back over the
head's connection to it, i.e. link 2's down direction: three one-way delays per trip).
The proxies run in a child process of their own, so their timers do not share the
head's event loop, and take a new delay at runtime: ONE head and ONE pair of stage
processes serve the whole run, so every mode is measured on the same pipeline.

Modes (the head's own switches, set between requests):
    off      Head.speculate = "off": one token per trip
    lookup   Head.speculate = "auto": prompt-lookup drafts (engine/core/drafts.py), k per
             sequence from engine/core/speculation.py's SpecPolicy (one policy per link
             delay, kept across that delay's requests as a serving head keeps it)
    draft    Head.speculate = "auto" with the stand-in draft model beside stage 0: the
             default model itself at int8 (PipelineConfig.draft = "default@int8": on a
             CPU torch's weight-only int8 kernel, bfloat16 activations, run by the lean
             decode loop -- engine/model/cpu_linear.py, engine/model/lean_decoder.py).
             It is the target's own size, so a drafted position costs about what the
             whole ring's compute does (~55-65 ms on one thread here). `--draft
             default@bf16 --round-draft int8` runs the earlier stand-in instead (float32
             kernels on weights rounded to int8). Its own policy per delay.
             One head holds it; the lookup mode parks it (Head.drafter = None) so every
             mode shares the pipeline. Drafting ahead on (the default).
    draft-sync  the same with Head.draft_ahead = False (POTLUCK_DRAFT_AHEAD=0): the
             overlap table (issue 34 item 4) compares the two; single user only

Workloads, greedy (temperature 0), EOS honoured (a reply ends where plain decoding ends
it: speculation must not change what is said, so every mode does the same work):
    chat     open questions (little to copy: prompt lookup rarely has a guess)
    quote    "edit this code" and "summarise with quotes" prompts (replies copy their prompt)
    8 users  eight requests at once (four of each kind), speculation on vs off

Interleaving (this machine is shared and drifts by 10-50% over minutes): each round
visits the delays in a rotated order; within a delay, each prompt runs in every mode
back to back (the mode order rotated per prompt), then the 8-user burst in both modes
(rotated). A ratio is taken within a round (sum of decode tokens over sum of decode time
for that round's prompts, mode over off), and the verdicts use the median over rounds of
those paired ratios. "other load" is the CPU (in cores) processes not ours used while
measuring: the two other engineers' test runs on this 2-core machine show up there.

Metrics:
    decode tok/s   per request (tokens after the first) / (last token - first token);
                   summed over a cell's requests (tokens over time)
    8-user tok/s   decode tokens of the burst / (last token - first token of the burst)
    acceptance     drafted tokens that stood / drafted (the policy's own counts)
    tok/trip       tokens emitted per decode trip of a speculating sequence (1.00: none)
    same text      every reply token-identical to the same round's `off` reply

Targets (issue 34): >= 2x single-user tok/s at 30 ms with the draft on chat prompts;
>= 1.5x with prompt lookup on quoting prompts; never below 0.95x anywhere (8 users and
the 1 ms link included).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/speculative.py           # 3 rounds, ~25 min
    HF_HUB_OFFLINE=1 .venv/bin/python bench/speculative.py --quick   # 1 round, short replies, ~4 min

(on this 2-core machine shared with two other engineers' test runs; the full run's size
-- 2 prompts of each kind, 40 tokens, 3 rounds, three modes -- is what fits in about 20 minutes here)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from testkit.cpuprobe import CpuProbe  # noqa: E402

DELAYS_MS = (1, 15, 30)
RATE_MBIT = 100.0
LAYERS = "0:10,10:20,20:30"          # the default model's 30 layers over 3 stages, evenly
USERS = 8
TARGET_DRAFT_CHAT_30 = 2.0
TARGET_LOOKUP_QUOTE_30 = 1.5
TARGET_FLOOR = 0.95
NO_DRAFT = "n/a (no draft drafter yet)"

CHAT = [
    "Explain in simple terms why the sky is blue during the day and red at sunset.",
    "List five tips for staying productive while working from home, with one sentence each.",
    "What are the main differences between a cat and a dog as a pet? Answer in a short paragraph.",
    "Describe how a bicycle works, from the pedals to the wheels.",
]

CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def spread(values):
    low = min(values)
    high = max(values)
    return high - low
'''

PASSAGE = ("The printing press, invented by Johannes Gutenberg around 1440, transformed the spread of "
           "information in Europe. Before it, books were copied by hand, which made them rare and "
           "expensive. Movable type allowed texts to be produced quickly and cheaply, which helped "
           "literacy grow, spread new scientific ideas, and fueled the Reformation. Within decades, "
           "printing shops appeared in hundreds of cities.")

CODE2 = '''import json


def load_settings(path):
    with open(path) as f:
        settings = json.load(f)
    if "name" not in settings:
        settings["name"] = "default"
    return settings


def save_settings(path, settings):
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)
'''

# The quoting prompts are ones this 135M model does answer by copying (checked offline by
# running prompt lookup over its greedy replies at k = 4: the two summaries ~4 tokens a
# trip, the code edits 1.5-1.9 -- it rewrites the function it edits and copies the rest).
QUOTE = [
    "Edit this code: rename the function mean to average and keep everything else the same. "
    "Reply with the whole edited code.\n\n" + CODE,
    "Summarise the following text with quotes: repeat its most important sentences word for word.\n\n"
    + PASSAGE,
    "Here is my Python file. Add a comment line above each function saying what it does, and change "
    "nothing else. Show the full file.\n\n" + CODE2,
    "Repeat the following text exactly, then say in one sentence what it is about.\n\n" + PASSAGE,
]


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the emulated links, in a child process -------------------------------------------------
async def proxy_host(spec: dict) -> None:
    """ShapedLinks to the given ports; prints their ports; then obeys stdin: 'delay S' sets
    every link's one-way delay (both directions) and answers OK; EOF closes them."""
    from testkit.linkemu import ShapedLink

    links = []
    for port in spec["targets"]:
        link = ShapedLink("127.0.0.1", 0, "127.0.0.1", port, spec["rate_bps"], spec["delay_s"], spec["queue_bytes"])
        await link.start()
        links.append(link)
    print("PORTS " + json.dumps([link.port for link in links]), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = line.split()
        if cmd and cmd[0] == "delay":
            for link in links:
                link.set_delay(float(cmd[1]))
            print("OK", flush=True)
    for link in links:
        await link.close()


class Proxies:
    def __init__(self, targets: list[int], rate_bps: float, delay_s: float):
        self.spec = dict(targets=targets, rate_bps=rate_bps, delay_s=delay_s,
                         queue_bytes=max(64 << 10, int(rate_bps / 8 * 0.1)))
        self.proc = None
        self.delay_s = delay_s

    async def start(self) -> list[str]:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--proxy-host", json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
        if not line.startswith("PORTS "):
            raise RuntimeError(f"the link proxies did not start: {line!r}")
        return [f"ws://127.0.0.1:{p}" for p in json.loads(line[6:])]

    async def set_delay(self, delay_s: float) -> None:
        self.proc.stdin.write(f"delay {delay_s}\n".encode())
        await self.proc.stdin.drain()
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 10)).decode()
        if line.strip() != "OK":
            raise RuntimeError(f"the link proxies did not take the delay: {line!r}")
        self.delay_s = delay_s

    async def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            await asyncio.wait_for(self.proc.wait(), 10)
        except (asyncio.TimeoutError, OSError):
            self.proc.kill()
            await self.proc.wait()
        self.proc = None


def counting_policy():
    """A SpecPolicy that also counts rounds, emitted and drafted tokens since `reset()`:
    the acceptance and tokens per trip of one cell, however long the policy lives."""
    from engine.core.speculation import SpecPolicy

    class Counting(SpecPolicy):
        def __init__(self):
            super().__init__()
            self.reset()

        def reset(self):
            self.c_rounds = self.c_tokens = self.c_proposed = self.c_accepted = self.c_drafting = 0
            self.c_k = 0

        def k_for(self, seq_id, free=0):
            k = super().k_for(seq_id, free)
            self.c_k += k
            return k

        def observe_round(self, seq_id, proposed, accepted):
            super().observe_round(seq_id, proposed, accepted)
            self.c_rounds += 1
            self.c_tokens += accepted + 1
            self.c_proposed += proposed
            self.c_accepted += accepted
            self.c_drafting += proposed > 0

        def counts(self) -> dict:
            return dict(rounds=self.c_rounds, tokens=self.c_tokens, proposed=self.c_proposed,
                        accepted=self.c_accepted, drafting=self.c_drafting)

    return Counting()


def round_weights(drafter, kind: str) -> None:
    """The stand-in draft's decoder weights rounded to the int8 grid (one absmax scale per
    output row, bitsandbytes' int8 layout) and kept as float32: a quantized model's guesses
    at float32 kernels' speed -- bitsandbytes' CPU kernels draft 3-4x slower than float32
    on this machine (~200 ms a token against ~60), which a GPU's would not."""
    import torch

    if kind != "int8":
        raise SystemExit(f"--round-draft {kind!r}: only int8")
    n = 0
    with torch.no_grad():
        for name, mod in drafter.model.model.named_modules():   # StageModel.model: the nn.Module
            if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
                w = mod.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
                w.copy_((w / scale).round().clamp(-127, 127) * scale)
                n += 1
    if not n:
        raise RuntimeError("the draft model has no Linear layers to round")
    drafter.name += " (int8-rounded)"
    log(f"draft model: {n} decoder matrices rounded to int8")


# ---- requests -----------------------------------------------------------------------------
async def one_request(head, prompt: list[int], max_tokens: int) -> dict:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Done

    t_submit = time.perf_counter()
    handle = head.submit(prompt, SamplingParams(greedy=True, max_tokens=max_tokens))
    done, times = None, []
    async for ev in handle:
        if isinstance(ev, Done):
            done = ev
        else:
            times += [time.perf_counter()] * len(ev.token_ids)
    if done is None or done.error:
        raise RuntimeError(f"request failed: {done}")
    toks = list(handle.seq.generated)
    while len(times) < len(toks):        # a last token that added no text sent no Delta
        times.append(time.perf_counter())
    return {"tokens": toks, "t_submit": t_submit, "times": times[:len(toks)], "finish": done.finish_reason}


def decode_of(recs: list[dict]) -> tuple[int, float]:
    """Decode tokens (after each request's first) and their time, summed over requests."""
    toks = sum(max(0, len(r["times"]) - 1) for r in recs)
    span = sum(r["times"][-1] - r["times"][0] for r in recs if len(r["times"]) > 1)
    return toks, span


def burst_rate(recs: list[dict]) -> float:
    """Aggregate decode tok/s of concurrent requests: tokens after each one's first, over
    the burst's first token to its last."""
    toks = sum(max(0, len(r["times"]) - 1) for r in recs)
    t0 = min(r["times"][0] for r in recs if r["times"])
    t1 = max(r["times"][-1] for r in recs if r["times"])
    return toks / (t1 - t0) if t1 > t0 else float("nan")


# ---- the run ------------------------------------------------------------------------------
class Bench:
    def __init__(self, a):
        self.a = a
        self.head = None
        self.policies: dict[float, object] = {}     # one per delay, kept across its requests
        self.modes = ["off", "lookup"] + (["draft", "draft-sync"] if a.draft_ok else [])
        self.drafter = None       # the draft model, parked while another mode runs

    def set_mode(self, mode: str, delay_ms: float) -> None:
        head = self.head
        if mode == "off":
            head.speculate = "off"
            return
        head.speculate = "auto"
        head.spec_policy = self.policies.setdefault((delay_ms, mode), counting_policy())
        head.drafter = self.drafter if mode.startswith("draft") else None
        head.draft_ahead = mode != "draft-sync"

    async def single(self, mode: str, delay_ms: float, prompt: list[int]) -> dict:
        self.set_mode(mode, delay_ms)
        pol = self.head.spec_policy if mode != "off" else None
        if pol is not None:
            pol.reset()
        d = self.drafter
        before = (d.drafted, d.from_chain) if d is not None else (0, 0)
        rec = await one_request(self.head, prompt, self.a.tokens)
        rec["counts"] = pol.counts() if pol is not None else None
        if d is not None and mode.startswith("draft"):   # guesses the model handed out, and of them drafted ahead
            rec["chain"] = [d.drafted - before[0], d.from_chain - before[1]]
        return rec

    async def burst(self, mode: str, delay_ms: float, prompts: list[list[int]]) -> dict:
        self.set_mode(mode, delay_ms)
        pol = self.head.spec_policy if mode != "off" else None
        if pol is not None:
            pol.reset()
        recs = await asyncio.gather(*(one_request(self.head, p, self.a.burst_tokens) for p in prompts))
        return {"recs": list(recs), "counts": pol.counts() if pol is not None else None}


async def run(a) -> dict:
    from engine.model.sources import DEFAULT_MODEL, resolve
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.local import LocalStages

    source = resolve(DEFAULT_MODEL)
    tok = source.tokenizer()

    def ids(text: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    chat = [ids(t) for t in CHAT[:a.prompts]]
    quote = [ids(t) for t in QUOTE[:a.prompts]]
    users = [ids(t) for t in (CHAT + QUOTE)]
    users = [users[i % len(users)] for i in (0, 4, 1, 5, 2, 6, 3, 7)][:USERS]

    bench = Bench(a)
    probe = CpuProbe()
    stages = LocalStages(2, threads=1)
    await stages.start()
    proxies = Proxies(stages.ports, RATE_MBIT * 1e6, a.delays[0] / 1e3)
    results: dict = {"single": [], "burst": [], "rounds": a.rounds}
    try:
        shaped = stages.reached_through(await proxies.start())
        extra = {"draft": a.draft} if a.draft_ok else {}
        # keep_replies=0: each prompt runs in every mode back to back, and a kept reply
        # taken over would leave the next mode one token of its prompt (and its draft model
        # a new context to read behind that one-token trip)
        cfg = PipelineConfig(model=DEFAULT_MODEL, stage_addr=shaped, threads=1, layers=LAYERS, dtype="float32",
                             speculate="off", keep_replies=0, **extra)
        t0 = time.perf_counter()
        pipe = await launch(cfg)
        bench.head = head = pipe.head
        bench.drafter, head.drafter = head.drafter if a.draft_ok else None, None
        if a.draft_ok and bench.drafter is None:
            raise RuntimeError("the head loaded no draft model")
        if a.draft_ok and a.round_draft:
            round_weights(bench.drafter, a.round_draft)
        log(f"pipeline up in {time.perf_counter() - t0:.1f}s: "
            f"{[tuple(s['layers']) for s in head.info()['stages']]}")
        results["stages"] = [tuple(s["layers"]) for s in head.info()["stages"]]
        try:
            # warm-up: the code paths, the link estimates, the first compute
            await one_request(head, chat[0], 8)
            for r in range(a.rounds):
                k = r % len(a.delays)
                for delay in a.delays[k:] + a.delays[:k]:
                    await proxies.set_delay(delay / 1e3)
                    # the link estimates and each mode's policy see this delay before measuring
                    for mode in bench.modes:
                        bench.set_mode(mode, delay)
                        await one_request(head, chat[0], 8)
                    i = 0
                    for kind, prompts in (("chat", chat), ("quote", quote)):
                        for p_idx, prompt in enumerate(prompts):
                            order = bench.modes[i % len(bench.modes):] + bench.modes[:i % len(bench.modes)]
                            i += 1
                            for mode in order:
                                s0 = probe.sample()
                                rec = await bench.single(mode, delay, prompt)
                                rec.update(round=r, delay=delay, kind=kind, prompt=p_idx, mode=mode,
                                           foreign=CpuProbe.foreign(s0, probe.sample()))
                                results["single"].append(rec)
                                n, span = decode_of([rec])
                                c = rec["counts"]
                                log(f"round {r + 1} {delay:g} ms {kind}#{p_idx} {mode}: {len(rec['tokens'])} tokens, "
                                    f"{n / span if span else float('nan'):.2f} tok/s"
                                    + (f", {c['tokens']}/{c['rounds']} tok/trip, {c['accepted']}/{c['proposed']} kept"
                                       if c else "") + f", other {rec['foreign']:.2f} cores")
                    bmodes = [m for m in bench.modes if m != "draft-sync"]   # 8 users: above the busy cut-off
                    j = (r + 1) % len(bmodes)
                    burst_modes = bmodes[j:] + bmodes[:j]
                    for mode in burst_modes:
                        s0 = probe.sample()
                        b = await bench.burst(mode, delay, users)
                        b.update(round=r, delay=delay, mode=mode, foreign=CpuProbe.foreign(s0, probe.sample()))
                        results["burst"].append(b)
                        log(f"round {r + 1} {delay:g} ms {USERS} users {mode}: {burst_rate(b['recs']):.2f} tok/s"
                            + (f", {b['counts']['tokens']}/{b['counts']['rounds']} tok/trip" if b["counts"] else "")
                            + f", other {b['foreign']:.2f} cores")
            results["policies"] = {f"{d}/{m}": {k: v for k, v in p.stats().items() if k != "sequences"}
                                   for (d, m), p in bench.policies.items()}
        finally:
            await pipe.close()
    finally:
        await proxies.stop()
        await stages.stop()
    return results


# ---- the report ---------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def fmt(cells):
        return "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    return "\n".join([fmt(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows])


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(res: dict, a) -> dict:
    single, bursts = res["single"], res["burst"]
    rounds = sorted({r["round"] for r in single})
    modes = ["off", "lookup"] + (["draft"] if a.draft_ok else [])
    verdicts = []
    overlap_rows = []
    floor_rows = []   # (where, paired ratio)

    def cell(delay, kind, mode, r):
        return [x for x in single if x["delay"] == delay and x["kind"] == kind and x["mode"] == mode and x["round"] == r]

    def rate(recs):
        n, span = decode_of(recs)
        return n / span if span > 0 else float("nan")

    def same(delay, kind, mode):
        bad = total = 0
        for r in rounds:
            ref = {x["prompt"]: x["tokens"] for x in cell(delay, kind, "off", r)}
            for x in cell(delay, kind, mode, r):
                total += 1
                bad += x["tokens"] != ref.get(x["prompt"])
        return "yes" if bad == 0 else f"NO ({total - bad}/{total})"

    rows = []
    for delay in a.delays:
        for kind in ("chat", "quote"):
            off = [rate(cell(delay, kind, "off", r)) for r in rounds]
            row = [f"{delay:g} ms", kind, f"{med(off):.2f}"]
            for mode in ("lookup", "draft"):
                if mode not in modes:
                    row += [NO_DRAFT, "", "", "", ""]
                    continue
                on = [rate(cell(delay, kind, mode, r)) for r in rounds]
                paired = [x / y for x, y in zip(on, off)]
                ratio = med(paired)
                floor_rows.append((f"{delay:g} ms {kind} {mode}", ratio))
                cs = [x["counts"] for r in rounds for x in cell(delay, kind, mode, r)]
                prop, acc = sum(c["proposed"] for c in cs), sum(c["accepted"] for c in cs)
                trips, toks = sum(c["rounds"] for c in cs), sum(c["tokens"] for c in cs)
                spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 else ""
                row += [f"{med(on):.2f}", f"{ratio:.2f}x{spread}", f"{acc / prop:.2f}" if prop else "-",
                        f"{toks / trips:.2f}" if trips else "-", same(delay, kind, mode)]
            other = med([x["foreign"] for x in single if x["delay"] == delay and x["kind"] == kind])
            row.append(f"{other:.2f}")
            rows.append(row)
    print(f"\nSingle user: decode tok/s, 3 stages of SmolLM2-135M-Instruct (float32, CPU, 1 thread each, layers "
          f"{LAYERS}), {RATE_MBIT:g} Mbit/s links; {len(rounds)} round(s), {a.prompts} prompt(s) of each kind a round, "
          f"up to {a.tokens} new tokens each (greedy, EOS honoured)\n")
    print(table(["one-way", "prompts", "off tok/s", "lookup tok/s", "lookup / off", "accept", "tok/trip",
                 "same text", "draft tok/s", "draft / off", "accept", "tok/trip", "same text", "other load"],
                rows))
    print("(x / off: the median over rounds of the ratio within a round (range); accept: drafted tokens that "
          "stood / drafted;\n tok/trip: tokens per decode trip of the speculating requests; other load: cores "
          "used by processes not ours, median)")

    if a.draft_ok:   # item 4: drafting ahead while a verification is in flight, on vs off
        for delay in a.delays:
            for kind in ("chat", "quote"):
                sync = [rate(cell(delay, kind, "draft-sync", r)) for r in rounds]
                ahead = [rate(cell(delay, kind, "draft", r)) for r in rounds]
                paired = [x / y for x, y in zip(ahead, sync)]
                spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 else ""
                tt = []
                for mode in ("draft-sync", "draft"):
                    cs = [x["counts"] for r in rounds for x in cell(delay, kind, mode, r)]
                    trips, toks = sum(c["rounds"] for c in cs), sum(c["tokens"] for c in cs)
                    tt.append(f"{toks / trips:.2f}" if trips else "-")
                # of the guesses sent for verification, those drafted ahead (the chain's)
                recs = [x for r in rounds for x in cell(delay, kind, "draft", r)]
                handed = sum(x["counts"]["proposed"] for x in recs)
                served = sum((x.get("chain") or [0, 0])[1] for x in recs)
                overlap_rows.append([f"{delay:g} ms", kind, f"{med(sync):.2f}", f"{med(ahead):.2f}",
                                     f"{med(paired):.2f}x{spread}", tt[0], tt[1],
                                     f"{served / handed:.0%}" if handed else "-", same(delay, kind, "draft-sync")])
        print("\nOverlap (issue 34 item 4): the draft model drafting on while a verification is in flight "
              "(draft) vs not (draft-sync: POTLUCK_DRAFT_AHEAD=0)\n")
        print(table(["one-way", "prompts", "sync tok/s", "ahead tok/s", "ahead / sync", "tok/trip sync",
                     "tok/trip ahead", "guesses drafted ahead", "sync same text"], overlap_rows))

    brows = []
    for delay in a.delays:
        off = {b["round"]: b for b in bursts if b["delay"] == delay and b["mode"] == "off"}
        for mode in modes[1:]:
            on = {b["round"]: b for b in bursts if b["delay"] == delay and b["mode"] == mode}
            both = [r for r in rounds if r in on and r in off]
            paired = [burst_rate(on[r]["recs"]) / burst_rate(off[r]["recs"]) for r in both]
            ratio = med(paired)
            floor_rows.append((f"{delay:g} ms {USERS} users {mode}", ratio))
            cs = [on[r]["counts"] for r in both]
            trips, toks = sum(c["rounds"] for c in cs), sum(c["tokens"] for c in cs)
            prop, acc = sum(c["proposed"] for c in cs), sum(c["accepted"] for c in cs)
            bad = sum(x["tokens"] != y["tokens"] for r in both for x, y in zip(on[r]["recs"], off[r]["recs"]))
            n = sum(len(on[r]["recs"]) for r in both)
            spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 else ""
            brows.append([f"{delay:g} ms", mode, f"{med([burst_rate(off[r]['recs']) for r in both]):.2f}",
                          f"{med([burst_rate(on[r]['recs']) for r in both]):.2f}", f"{ratio:.2f}x{spread}",
                          f"{acc / prop:.2f}" if prop else "-", f"{toks / trips:.2f}" if trips else "-",
                          "yes" if not bad else f"NO ({n - bad}/{n})",
                          f"{med([b['foreign'] for b in bursts if b['delay'] == delay]):.2f}"])
    print(f"\n{USERS} concurrent users (4 chat + 4 quoting prompts, up to {a.burst_tokens} new tokens each): aggregate "
          "decode tok/s, speculation (policy auto) on vs off\n")
    print(table(["one-way", "drafts", "off tok/s", "on tok/s", "on / off", "accept", "tok/trip", "same text",
                 "other load"], brows))

    def find(name):
        return next((v for k, v in floor_rows if k == name), float("nan"))

    if a.draft_ok:
        v = find("30 ms chat draft")
        verdicts.append(["draft / off, chat, 30 ms", f"{v:.2f}", f">= {TARGET_DRAFT_CHAT_30}",
                         "PASS" if v >= TARGET_DRAFT_CHAT_30 else "MISS"])
    else:
        verdicts.append(["draft / off, chat, 30 ms", NO_DRAFT, f">= {TARGET_DRAFT_CHAT_30}", "n/a"])
    v = find("30 ms quote lookup")
    verdicts.append(["lookup / off, quote, 30 ms", f"{v:.2f}", f">= {TARGET_LOOKUP_QUOTE_30}",
                     "PASS" if v >= TARGET_LOOKUP_QUOTE_30 else "MISS"])
    worst = min(floor_rows, key=lambda x: x[1] if x[1] == x[1] else 9)
    for name, v in floor_rows:
        verdicts.append([f"floor: {name}", f"{v:.2f}", f">= {TARGET_FLOOR}", "PASS" if v >= TARGET_FLOOR else "MISS"])
    print("\nTargets (issue 34), paired ratios\n")
    print(table(["target", "value", "target", "verdict"], verdicts))
    print(f"worst cell: {worst[0]} at {worst[1]:.2f}x")
    identical = all(c in ("yes", "") for r in rows for c in (r[7], r[12])) and all(r[7] == "yes" for r in brows)
    print(f"greedy replies token-identical to speculation off in every cell: {'yes' if identical else 'NO'}")
    pols = res.get("policies") or {}
    if pols:
        print("\nWhat each policy measured at the end (per delay/mode): trip = plain decode trip, head to head; "
              "draft = s per drafted token; verify_extra = s per extra token in a step")
        print(table(["delay/mode", "trip ms", "draft us", "verify_extra ms", "tok/trip", "accept", "rounds"],
                    [[k, f"{(p['trip'] or 0) * 1e3:.1f}", f"{p['draft'] * 1e6:.0f}", f"{p['verify_extra'] * 1e3:.2f}",
                      f"{p['tokens_per_trip'] or 0:.2f}", f"{p['acceptance'] or 0:.2f}", str(p["rounds"])]
                     for k, p in sorted(pols.items(), key=lambda kv: (float(kv[0].split('/')[0]), kv[0]))]))
    return {"verdicts": verdicts}


def draft_support() -> str | None:
    """Whether the engine has a draft-model drafter this bench can switch on (None: not yet)."""
    from engine.pipeline.head import Head
    from engine.pipeline.launch import PipelineConfig

    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    if "draft" in fields and "draft" in inspect.signature(Head).parameters:
        return "PipelineConfig.draft"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, 24 tokens a reply, 16 in the burst (~4 min)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument("--prompts", type=int, default=None, help="prompts of each kind per round (default 2)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per single-user reply at most (default 40; quick 24)")
    p.add_argument("--burst-tokens", type=int, default=None, help="new tokens per reply of the 8-user burst (default 24; quick 16)")
    p.add_argument("--delays", default=",".join(map(str, DELAYS_MS)), help="one-way delays, ms")
    p.add_argument("--draft", default="default@int8",
                   help="the stand-in draft model (MODEL@WEIGHTS; 'none': no draft column)")
    p.add_argument("--round-draft", default="none",
                   help="round the draft's decoder weights to this grid, kept at float32 ('int8', or 'none')")
    p.add_argument("--json", default=None, help="also write the raw results here")
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.prompts = min(a.prompts or 2, len(CHAT))
    a.tokens = a.tokens or (24 if a.quick else 40)
    a.burst_tokens = a.burst_tokens or (16 if a.quick else 24)
    a.delays = [float(x) for x in a.delays.split(",")]
    a.draft_kind = draft_support()
    a.draft_ok = bool(a.draft_kind) and a.draft != "none"
    a.round_draft = None if a.round_draft == "none" else a.round_draft
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(f"bench/speculative.py {'--quick ' if a.quick else ''}on {os.cpu_count()} cores "
          f"({time.strftime('%Y-%m-%d %H:%M')}); this machine is shared with other engineers' test runs: "
          f"see 'other load'. Draft model: {a.draft if a.draft_ok else NO_DRAFT}"
          + (f", weights rounded to {a.round_draft}" if a.draft_ok and a.round_draft else ""), flush=True)
    res = asyncio.run(run(a))
    if a.json:
        Path(a.json).write_text(json.dumps(res, default=str))
    report(res, a)
    print(f"\nwall: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--proxy-host":
        asyncio.run(proxy_host(json.loads(sys.argv[2])))
        sys.exit(0)
    sys.exit(main())
