"""On a CPU alone: one process against two (and more) stage processes, as `potluck serve`
starts them with no --threads (the stages lease the cores, engine/model/cores.py).

`potluck chat`, `serve` and the app run one process (engine/core/local_stages.py), as this
measured on 2 cores. This measures what that choice gives on the machine it runs on, side by
side in one run: the aggregate decode rate (completion tokens over the wall time of
concurrent non-streamed greedy replies, their prompts included) at 1, 4 and 8 users, for
each --stages, alternating the pipelines --repeat times (these machines drift).

    .venv/bin/python bench/cpu_stages.py                 # ~4 minutes on 2 cores
    .venv/bin/python bench/cpu_stages.py --stages 1,2,3 --users 1,8 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_cpu import free_port, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def reply(port: int, tokens: int, out: list) -> None:
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out.append(json.load(r)["usage"]["completion_tokens"])


def aggregate(port: int, users: int, tokens: int) -> float:
    out: list[int] = []
    threads = [threading.Thread(target=reply, args=(port, tokens, out)) for _ in range(users)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(out) / (time.monotonic() - t0)


def measure(stages: int, users: list[int], tokens: int) -> dict[int, float]:
    port = free_port()
    # every request asks the same prompt: with none kept, each computes it (the work the
    # figures count), not a token of the last one's kept reply
    env = dict(os.environ, HF_HUB_OFFLINE="1", POTLUCK_KEEP_REPLIES="0")
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--stages", str(stages), "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        reply(port, 8, [])          # a warm-up reply: first calls pick their kernels
        return {u: aggregate(port, u, tokens) for u in users}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="1,2", help="stage processes to compare (comma-separated)")
    ap.add_argument("--users", default="1,4,8", help="concurrent users per cell (comma-separated)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    stages = [int(x) for x in a.stages.split(",")]
    users = [int(x) for x in a.users.split(",")]
    got: dict[int, dict[int, list[float]]] = {s: {u: [] for u in users} for s in stages}
    for r in range(a.repeat):
        for s in stages:
            for u, rate in measure(s, users, a.tokens).items():
                got[s][u].append(rate)
            print(f"  round {r + 1}, --stages {s}: " + ", ".join(f"{u} users {got[s][u][-1]:.1f} tok/s"
                                                              for u in users), flush=True)
    base = stages[0]
    print(f"\n`potluck serve --stages N` on this CPU ({os.cpu_count()} cores), aggregate decode tok/s "
          f"(median of {a.repeat}), {a.tokens}-token greedy replies\n")
    print("| stages | " + " | ".join(f"{u} users" for u in users) + " |")
    print("|---:|" + "---:|" * len(users))
    for s in stages:
        cells = []
        for u in users:
            med = statistics.median(got[s][u])
            ratio = med / statistics.median(got[base][u])
            cells.append(f"{med:.1f}" + ("" if s == base else f" ({ratio:.2f}x)"))
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
