"""`potluck serve` on a CPU its owner is using: default stages against one-thread stages.

A home machine is never idle. This starts `potluck serve --stages 3` (the issue's
pipeline) with no --threads, as a user would (the stages lease the cores,
engine/model/cores.py; `--stages 1`: the head alone, as it computes when its stages are
friends' machines; `--stages 0`: no --stages, one process, as serve starts), and the same
with `--threads 1`, and streams one user's greedy reply on each, first on a quiet
machine, then beside one and two busy programs (plain Python loops at normal priority, what a browser
tab or a game puts on a core). Each cell is the median time per output token (TPOT) over
--repeat replies; the table gives each cell's slowdown over the same pipeline quiet, and
default over one-thread. The pipelines are all up at once, idle but for the one replying,
and take turns reply by reply, so this machine's drift over minutes falls on each alike.
With --compare, a third pipeline runs the default with the busy-program policy off
(POTLUCK_CPU_SHARE=0: every step borrows every idle core, as before
engine/core/cpu_share.py), side by side in the same run.

What should hold: the default never slower than one-thread stages (quiet or busy), and
beside one busy program on a 2-core machine no slower than 2x its quiet pace (it lost
half the machine).

    .venv/bin/python bench/busy_cpu.py --compare        # ~6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(poll)
    raise RuntimeError("serve did not answer in time")


def stop(proc: subprocess.Popen) -> None:
    """As Ctrl-C would, then for good if it does not go within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stream_tpot(port: int, tokens: int) -> tuple[float, int]:
    """One streamed greedy reply: (seconds per token after the first, tokens received)."""
    body = json.dumps({"model": "default", "stream": True, "temperature": 0, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                stamps.append(time.perf_counter())
    if len(stamps) < 3:
        raise RuntimeError(f"only {len(stamps)} chunks came back")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), len(stamps)


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def start_pipeline(name: str, extra: list[str], env_over: dict, stages: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", **env_over)
    count = ["--stages", str(stages)] if stages else []   # 0: as it starts (one process)
    with open(ROOT / "build" / f"busy_cpu-{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", *count, "--port", str(port), *extra],
                                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    return proc, port


def measure(pipes: dict[str, int], loads: list[int], tokens: int, repeat: int) -> dict:
    """Every pipeline is up (idle but for the one replying); at each load they take turns,
    reply by reply, so the machine's drift over minutes falls on all of them alike."""
    tpots: dict = {}
    for n in loads:
        hogs = busy(n)
        try:
            time.sleep(2.0)                        # the policy's reading has seen them
            for _ in range(repeat):
                for name, port in pipes.items():
                    tpots.setdefault((name, n), []).append(stream_tpot(port, tokens)[0])
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        for name in pipes:
            ts = tpots[(name, n)]
            print(f"  {name:<22} busy {n}: TPOT {statistics.median(ts) * 1000:7.1f} ms "
                  f"({', '.join(f'{t * 1000:.0f}' for t in ts)})", flush=True)
        time.sleep(1.0)
    return {k: statistics.median(v) for k, v in tpots.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--busy", default="0,1,2", help="busy programs per cell (comma-separated)")
    ap.add_argument("--compare", action="store_true", help="also the default with the policy off")
    ap.add_argument("--stages", type=int, default=3,
                    help="stage processes, head included (default 3, the issue's pipeline; 1: the head "
                         "alone, as a host whose stages are friends' machines computes; 0: no --stages, "
                         "serve as it starts: one process)")
    args = ap.parse_args()
    loads = [int(x) for x in args.busy.split(",")]
    (ROOT / "build").mkdir(exist_ok=True)
    pipes = [("default", [], {}), ("--threads 1", ["--threads", "1"], {})]
    if args.compare:
        pipes.insert(1, ("default, policy off", [], {"POTLUCK_CPU_SHARE": "0"}))
    how = f"--stages {args.stages}" if args.stages else "(no --stages: one process)"
    print(f"potluck serve {how}, one user, {args.tokens}-token greedy reply, {os.cpu_count()} cores, "
          f"median of {args.repeat}", flush=True)
    procs = {name: start_pipeline(name, extra, env_over, args.stages) for name, extra, env_over in pipes}
    try:
        for name, (proc, port) in procs.items():
            wait_ready(port, proc)
            stream_tpot(port, 16)                  # warm-up: first-call costs out of the cells
        rows = measure({name: port for name, (_, port) in procs.items()}, loads, args.tokens, args.repeat)
    finally:
        for proc, _ in procs.values():
            stop(proc)

    print()
    head = "| pipeline | " + " | ".join(f"busy {n}: TPOT ms (x quiet)" for n in loads) + " | vs --threads 1 |"
    print(head)
    print("|" + "---|" * (len(loads) + 2))
    verdicts = []
    for name, _, _ in pipes:
        quiet = rows[(name, loads[0])]
        cells = [f"{rows[(name, n)] * 1000:.0f} ({rows[(name, n)] / quiet:.2f}x)" for n in loads]
        vs = " / ".join(f"{rows[(name, n)] / rows[('--threads 1', n)]:.2f}" for n in loads)
        print(f"| {name} | " + " | ".join(cells) + f" | {vs} |")
    d, t1 = "default", "--threads 1"
    for n in loads:
        ratio = rows[(d, n)] / rows[(t1, n)]
        verdicts.append((f"default / --threads 1, busy {n}", ratio, 1.10, ratio <= 1.10))
    if 1 in loads and 0 in loads:
        slow = rows[(d, 1)] / rows[(d, 0)]
        verdicts.append(("default busy 1 / quiet (lost half of 2 cores)", slow, 2.0, slow <= 2.0))
    print()
    for what, value, limit, ok in verdicts:
        print(f"{'PASS' if ok else 'MISS'}  {what}: {value:.2f} (target <= {limit:.2f}; noise ~10%)")


if __name__ == "__main__":
    main()
