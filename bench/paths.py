"""What sealing the stage links costs (issue 33): sealed vs plain, side by side.

Two parts, both in this one process (2 cores: nothing else runs beside them):

  * seal      one message sealed and opened (engine/wire/stage_auth.py Seal) at the
              sizes the links carry: a decode step's activations (576 floats), a
              prompt piece of 64 KiB and of 256 KiB (link.py's largest); µs per
              message and MB/s.
  * link      the default model's 2-stage pipeline (the head holds stage 0, an
              in-process StageServer the rest) over one emulated link, a
              testkit.linkemu.ShapedLink (50 Mbit/s, 20 ms one way by default):
              TTFT and TPOT of greedy replies, with the links sealed (as shipped)
              and plain (Seal's seal/open swapped for a copy that keeps its framing
              but skips the cipher: the links as they were before protocol 13).
              Each round launches a fresh pipeline per mode, alternating which goes
              first, so the machine's drift falls on both; the median round is kept.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/paths.py                  # ~3 min
    HF_HUB_OFFLINE=1 .venv/bin/python bench/paths.py --rate 0 --delay 0  # plain loopback, no shaping

The target (issue 33): sealing costs at most 5% of decode tok/s. The ratio printed is
sealed / plain decode tok/s, so >= 0.95 passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.",
           "Write one sentence about the sea.", "How many legs does a spider have?"]


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seal_micro(repeat: int) -> list[tuple[str, float, float]]:
    from engine.wire.stage_auth import Seal

    a, b = Seal(b"k" * 32, b"l" * 32), Seal(b"l" * 32, b"k" * 32)
    rows = []
    for name, size in (("decode step (576 floats)", 576 * 4 + 120), ("prompt piece 64 KiB", 64 << 10),
                       ("prompt piece 256 KiB", 256 << 10)):
        msg = os.urandom(size)
        n = max(50, repeat * (1 << 20) // size)
        t0 = time.perf_counter()
        for _ in range(n):
            b.open(a.seal(msg))
        dt = (time.perf_counter() - t0) / n
        rows.append((name, dt * 1e6, size / dt / 1e6))
    return rows


class PlainSeal:
    """Seal's framing without the cipher: what the links cost before they were sealed."""

    def seal(self, msg):
        return b"\x01" + msg.encode() if isinstance(msg, str) else b"\x02" + bytes(msg)

    def open(self, message):
        return message[1:].decode() if message[0] == 1 else message[1:]


async def one_mode(mode: str, a) -> dict:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Done
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.stage_server import StageServer
    from engine.wire import stage_auth
    from testkit.linkemu import ShapedLink

    saved = stage_auth.Seal.seal, stage_auth.Seal.open
    if mode == "plain":
        stage_auth.Seal.seal, stage_auth.Seal.open = PlainSeal.seal, PlainSeal.open
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=1).start()
    link = None
    port = server.port
    if a.rate > 0:
        link = ShapedLink("127.0.0.1", 0, "127.0.0.1", server.port, rate_bps=a.rate * 1e6, delay_s=a.delay / 1e3)
        port = await link.start()
    pipe = None
    try:
        pipe = await launch(PipelineConfig(stage_addr=[f"ws://127.0.0.1:{port}"], threads=1))
        head = pipe.head
        ttft, tpot = [], []
        for text in PROMPTS:
            prompt = head.chat_prompt([{"role": "user", "content": text}])
            handle = head.submit(prompt, SamplingParams(greedy=True, max_tokens=a.tokens))
            times = []
            t0 = time.perf_counter()
            async for ev in handle:
                if isinstance(ev, Done):
                    break
                times += [time.perf_counter()] * len(ev.token_ids)
            ttft.append(times[0] - t0)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
        return {"ttft": statistics.mean(ttft), "tpot": statistics.mean(tpot)}
    finally:
        if pipe is not None:
            await pipe.close()
        if link is not None:
            await link.close()
        await server.close()
        stage_auth.Seal.seal, stage_auth.Seal.open = saved


async def link_rounds(a) -> dict:
    results = {"sealed": [], "plain": []}
    for r in range(a.rounds):
        order = ("sealed", "plain") if r % 2 == 0 else ("plain", "sealed")
        for mode in order:
            m = await one_mode(mode, a)
            results[mode].append(m)
            log(f"round {r + 1} {mode}: TTFT {m['ttft'] * 1e3:.0f} ms, TPOT {m['tpot'] * 1e3:.1f} ms")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=50.0, help="link rate, Mbit/s each way (0: no shaping)")
    p.add_argument("--delay", type=float, default=20.0, help="one-way delay, ms")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per reply")
    p.add_argument("--rounds", type=int, default=4, help="rounds of (sealed, plain), alternating order")
    p.add_argument("--repeat", type=int, default=8, help="MiB sealed per size in the seal part")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    print("\nSealing one message (seal + open, this process)\n")
    print(f"| {'message':<26} | {'µs':>8} | {'MB/s':>7} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 9}|")
    for name, us, mbs in seal_micro(a.repeat):
        print(f"| {name:<26} | {us:>8.1f} | {mbs:>7.0f} |")

    shaped = f"{a.rate:g} Mbit/s, {a.delay:g} ms one way" if a.rate > 0 else "loopback, unshaped"
    log(f"2-stage pipeline over {shaped}, {a.rounds} rounds")
    res = asyncio.run(link_rounds(a))
    med = {m: {k: statistics.median(x[k] for x in res[m]) for k in ("ttft", "tpot")} for m in res}
    print(f"\nThe default model's 2-stage pipeline over one link ({shaped}); "
          f"{len(PROMPTS)} replies of {a.tokens} tokens a round, median of {a.rounds} rounds\n")
    print(f"| {'links':<8} | {'TTFT ms':>8} | {'TPOT ms':>8} | {'decode tok/s':>12} |")
    print(f"|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 14}|")
    for mode in ("plain", "sealed"):
        m = med[mode]
        print(f"| {mode:<8} | {m['ttft'] * 1e3:>8.0f} | {m['tpot'] * 1e3:>8.1f} | {1 / m['tpot']:>12.2f} |")
    ratio = med["plain"]["tpot"] / med["sealed"]["tpot"]
    print(f"\nsealed / plain decode tok/s: {ratio:.3f}  (target >= 0.95: {'PASS' if ratio >= 0.95 else 'MISS'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
