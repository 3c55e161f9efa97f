"""A conversation's follow-ups: kept replies against every turn computed from scratch.

`potluck serve` as it starts (one process) is sent a
conversation the way a chat client sends one, the whole of it every turn: a long first
message (a pasted document, --paste tokens) and then short follow-ups, each after the
reply before it. Two servers run side by side, one as it starts (an ended reply's KV
stays on every stage and the next turn takes it over: engine/pipeline/kept_replies.py)
and one with POTLUCK_KEEP_REPLIES=0 (every turn's prompt computed on every stage again,
as before); their turns alternate, so each runs alone on the cores. The table gives each
turn's median time to first token over --repeat conversations, and the ratio; the
replies must be the same text (greedy).

What should hold: a follow-up's first token in about the time of its new message, not
of the whole conversation; the first turn no slower.

--people N: N conversations at once on each server, their turns taking turns (friends
sharing one host): every conversation starts with the same chat template and system
prompt, and one's new conversation must not take another's kept reply over.

--link MBIT,MS: instead, a head and one stage process with every byte between them
crossing an emulated home line (testkit/linkemu.py, as bench/weaklink.py builds it: the
rate each way and the one-way delay), as a host and a friend's computer are. One head
runs both modes, a conversation at a time: kept replies, then none kept (nothing of the
other conversation matches).

    .venv/bin/python bench/follow_up.py                 # ~4 minutes on 2 cores
    .venv/bin/python bench/follow_up.py --people 2      # two conversations taking turns
    .venv/bin/python bench/follow_up.py --link 20,15    # a 20 Mbit/s line, 15 ms each way
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_cpu import free_port, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "The river town kept its records in a ledger by the mill, one line a day. "   # ~17 tokens
FOLLOW_UPS = ["Summarize that in one sentence.", "What is the ledger for?", "Say it again, shorter."]


def turn(port: int, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """One streamed greedy reply: (seconds to its first token, its text)."""
    body = json.dumps({"model": "default", "stream": True, "temperature": 0, "max_tokens": max_tokens,
                       "messages": messages}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - t0
            text.append(delta)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def conversation(i: int, paste_tokens: int) -> list[dict]:
    # a new document each conversation: nothing of the last one is taken over
    paste = f"Document {i}. " + SENTENCE * max(1, paste_tokens // 17)
    return [{"role": "user", "content": paste + " What happens in the town?"}]


def table(times: dict, args, where: str, scratch: str = "from scratch (POTLUCK_KEEP_REPLIES=0)") -> None:
    people = f", {args.people} at once taking turns" if args.people > 1 else ""
    print(f"\nTime to first token, median of {args.repeat * args.people} conversations{people} (a {args.paste}-token "
          f"first message, then short follow-ups; {where}):\n")
    print(f"| turn | kept replies (default) | {scratch} | kept / scratch |")
    print("|---|---:|---:|---:|")
    for t in range(1 + len(FOLLOW_UPS)):
        a, b = statistics.median(times["kept"][t]), statistics.median(times["scratch"][t])
        print(f"| {t + 1}{' (the paste)' if t == 0 else ''} | {a:.2f} s | {b:.2f} s | {a / b:.2f} |")


async def over_a_line(args) -> int:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Delta, Head
    from engine.pipeline.local import LocalStages
    from engine.model.sources import resolve
    from weaklink import Proxies

    mbit, ms = (float(x) for x in args.link.split(","))
    stage = LocalStages(1, threads=1)
    await stage.start()
    line = Proxies(stage.ports, mbit * 1e6, ms / 1000, 4 << 20)
    head = None
    try:
        head = Head(resolve("default"), stage.reached_through(await line.start()))
        await head.start()

        async def ask(msgs) -> tuple[float, str]:
            t0, first, toks = time.perf_counter(), None, []
            async for ev in head.submit(head.chat_prompt(msgs), SamplingParams(greedy=True,
                                                                               max_tokens=args.max_tokens)):
                if isinstance(ev, Delta):
                    if first is None and ev.token_ids:
                        first = time.perf_counter() - t0
                    toks += ev.token_ids
            return first or time.perf_counter() - t0, head.tokenizer.decode(toks, skip_special_tokens=True)

        await ask([{"role": "user", "content": "Hello."}])   # warm
        times = {name: [[] for _ in range(1 + len(FOLLOW_UPS))] for name in ("kept", "scratch")}
        same = True
        for i in range(args.repeat):
            texts = {}
            for name in ("kept", "scratch"):
                await head.drop_kept()
                head.kept.most = 8 if name == "kept" else 0
                conv = conversation(i, args.paste)
                texts[name] = []
                for t in range(1 + len(FOLLOW_UPS)):
                    ttft, text = await ask(conv)
                    times[name][t].append(ttft)
                    texts[name].append(text)
                    conv.append({"role": "assistant", "content": text})
                    if t < len(FOLLOW_UPS):
                        conv.append({"role": "user", "content": FOLLOW_UPS[t]})
                print(f"  conversation {i + 1}, {name}: " + ", ".join(f"{x:.2f}" for x in
                                                                     (ts[-1] for ts in times[name])) + " s",
                      flush=True)
            same &= texts["kept"] == texts["scratch"]
    finally:
        if head is not None:
            await head.close()
        await line.stop()
        await stage.stop()
    table(times, args, f"a head and a stage process over an emulated {mbit:g} Mbit/s line, {ms:g} ms each way",
          "from scratch (none kept)")
    print(f"\nreplies the same text: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paste", type=int, default=1500, help="tokens in the first message (default 1500)")
    p.add_argument("--repeat", type=int, default=3, help="conversations per server (default 3)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--people", type=int, default=1, help="conversations at once, taking turns (default 1)")
    p.add_argument("--link", default=None, metavar="MBIT,MS",
                   help="a head and a stage over an emulated line of MBIT Mbit/s and MS ms each way")
    args = p.parse_args()
    if args.link and args.people > 1:
        p.error("--people runs on two servers side by side, not over --link")
    if args.link:
        import asyncio

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        sys.path.insert(0, str(ROOT))
        return asyncio.run(over_a_line(args))
    servers = {}
    for name, keep in (("kept", None), ("scratch", "0")):
        port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("POTLUCK_KEEP_REPLIES", None)
        if keep is not None:
            env["POTLUCK_KEEP_REPLIES"] = keep
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(port)], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers[name] = (port, proc)
    try:
        for port, proc in servers.values():
            wait_ready(port, proc)
            turn(port, [{"role": "user", "content": "Hello."}], 4)   # warm: the first allocations
        times = {name: [[] for _ in range(1 + len(FOLLOW_UPS))] for name in servers}
        same = True
        for i in range(args.repeat):
            people = range(i * args.people, (i + 1) * args.people)
            convs = {name: {j: conversation(j, args.paste) for j in people} for name in servers}
            for t in range(1 + len(FOLLOW_UPS)):
                for j in people:
                    texts = {}
                    for name, (port, _) in servers.items():
                        ttft, texts[name] = turn(port, convs[name][j], args.max_tokens)
                        times[name][t].append(ttft)
                        convs[name][j].append({"role": "assistant", "content": texts[name]})
                        if t < len(FOLLOW_UPS):
                            convs[name][j].append({"role": "user", "content": FOLLOW_UPS[t]})
                    same &= texts["kept"] == texts["scratch"]
                    print(f"  conversation {j + 1}, turn {t + 1}: "
                          + ", ".join(f"{n} {times[n][t][-1]:.2f} s" for n in servers), flush=True)
    finally:
        for _, proc in servers.values():
            stop(proc)
    table(times, args, "`potluck serve` as it starts")
    print(f"\nreplies the same text: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
