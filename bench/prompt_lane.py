"""A long prompt beside short requests: the prompt lane against the prompt in one go.

`potluck serve` as it starts on a CPU (its stages sharing the cores) and `potluck serve
--stages 1` (as a GPU host serves) each get a long prompt (--long tokens, greedy, 4 tokens out); a moment later a short request (a few
tokens in and out) is sent beside it, and, in a second round, the long request is given
up on (the client disconnects) and a short one sent right after. Each round runs with
the prompt lane (the default: the long prompt computed a piece at a time between the
decode steps, engine/pipeline/head.py _prompt_lane) and with POTLUCK_PROMPT_LANE=0 (the
whole prompt in one step, or in link-sized chunks ahead of its micro-batch's step, as
before), side by side in one run; the table gives each cell's median over --repeat
rounds and the ratio.

What should hold: the short request beside a long prompt answered within a piece or two
of the lane (about a second on a CPU), not after the whole prompt; a prompt given up on
no longer holds the next request; the long prompt itself no slower than in one step.

    .venv/bin/python bench/prompt_lane.py                 # ~8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_cpu import free_port, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The history of the world is long, and nobody has read all of it. "   # ~15 tokens


PASTES = itertools.count()


def paste(long_tokens: int) -> dict:
    """A long prompt the server has not seen: one it had would take its kept reply over
    (engine/core/kept_prefixes.py) and compute a token of it, and the lane would have
    nothing to do."""
    return {"prompt": f"Document {next(PASTES)}. " + SENTENCE * max(1, long_tokens // 15), "max_tokens": 4,
            "temperature": 0}


async def one_round(url: str, long_tokens: int) -> dict:
    short = {"prompt": "One, two,", "max_tokens": 3, "temperature": 0}
    out = {}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        big = asyncio.ensure_future(s.post(url + "/v1/completions", json=paste(long_tokens)))
        await asyncio.sleep(1.0)
        t1 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=short) as r:
            await r.read()
        out["short beside a long prompt (s)"] = time.perf_counter() - t1
        r = await big
        body = await r.json()
        out["long prompt's reply (s)"] = time.perf_counter() - t0
        out["long prompt tokens"] = body["usage"]["prompt_tokens"]
        given_up = asyncio.ensure_future(s.post(url + "/v1/completions", json=paste(long_tokens)))
        await asyncio.sleep(1.0)
        given_up.cancel()
        await asyncio.gather(given_up, return_exceptions=True)
        t2 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=short) as r:
            await r.read()
        out["short after one given up on (s)"] = time.perf_counter() - t2
    return out


def run(lane: bool, stages: str, args) -> list[dict]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", POTLUCK_PROMPT_LANE="1" if lane else "0")
    cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port)]
    cmd += [] if stages == "default" else ["--stages", stages]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(one_round(url, 256))   # warm: the first prompt's allocations
        rounds = []
        for _ in range(args.repeat):
            rounds.append(asyncio.run(one_round(url, args.long)))
            print(f"  stages {stages}, lane {'on' if lane else 'off'}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1].items()), flush=True)
        return rounds
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", type=int, default=4000, help="tokens in the long prompt (default 4000)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stages", default="default,1",
                   help="comma-separated: 'default' (as `potluck serve` starts) and/or stage counts")
    args = p.parse_args()
    results = {st: (run(True, st, args), run(False, st, args)) for st in args.stages.split(",")}
    print(f"\nMedian of {args.repeat} rounds (seconds):\n")
    print("| `potluck serve` | | prompt lane (default) | before (POTLUCK_PROMPT_LANE=0) | lane / before |")
    print("|---|---|---:|---:|---:|")
    for st, (on, off) in results.items():
        name = "as it starts" if st == "default" else f"--stages {st}"
        for k in [k for k in on[0] if k != "long prompt tokens"]:
            a = statistics.median(r[k] for r in on)
            b = statistics.median(r[k] for r in off)
            print(f"| {name} ({on[0]['long prompt tokens']}-token prompt) | {k} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
