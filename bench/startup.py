"""How long `potluck serve` takes until the chat answers, with and without the warm-up.

Importing transformers' config, tokenizer and model code takes seconds on a small CPU. A
stage process now does it while it waits for the head's configure
(engine/pipeline/stage_server.py warm_up), and the head while its stage processes start
(engine/pipeline/launch.py _prepare_head), where both used to do it only when they first
needed it, one after the other. This starts `potluck serve --stages N` as a user would
and times, from the process start, the API answering and the first token of a short
greedy reply; the "cold" rows run the same command with both switched off (a
sitecustomize in a temporary folder, so the product has no switch for it). Runs alternate warm and cold so that a
machine that slows down mid-run slows both.

    .venv/bin/python bench/startup.py                  # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_cpu import free_port, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

COLD = """\
import engine.pipeline.launch
from engine.pipeline.stage_server import StageServer
StageServer.warm_up = lambda self: None
engine.pipeline.launch._prepare_head = lambda source: None
"""


def first_token(port: int) -> None:
    body = json.dumps({"model": "default", "stream": True, "temperature": 0, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"content"' in line:
                return
    raise RuntimeError("no token came back")


def one_start(stages: int, cold_dir: str | None) -> tuple[float, float]:
    """(seconds to the API answering, seconds to the first token), from the process start."""
    port = free_port()
    path = os.pathsep.join(p for p in (cold_dir, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONPATH=path)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--stages", str(stages), "--port", str(port)],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc, poll=0.1)   # the differences measured here are a second or two
        ready = time.perf_counter() - t0
        first_token(port)
        return ready, time.perf_counter() - t0
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="2,3", help="pipelines to start (comma-separated)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    stage_counts = [int(x) for x in args.stages.split(",")]
    rows: dict = {}
    with tempfile.TemporaryDirectory() as cold_dir:
        Path(cold_dir, "sitecustomize.py").write_text(COLD)
        print(f"potluck serve on the default model, {os.cpu_count()} cores, median of {args.repeat}", flush=True)
        for stages in stage_counts:
            for i in range(args.repeat):
                for name, folder in (("warm", None), ("cold", cold_dir)):
                    ready, token = one_start(stages, folder)
                    rows.setdefault((stages, name), []).append((ready, token))
                    print(f"  --stages {stages} {name}: API {ready:5.2f} s, first token {token:5.2f} s", flush=True)
    print()
    print("| pipeline | warm-up | API answers (s) | first token (s) | first token, cold / warm |")
    print("|---|---|---|---|---|")
    for stages in stage_counts:
        med = {name: [statistics.median(x[k] for x in rows[(stages, name)]) for k in (0, 1)]
               for name in ("warm", "cold")}
        for name in ("warm", "cold"):
            ratio = f"{med['cold'][1] / med['warm'][1]:.2f}" if name == "warm" else ""
            print(f"| serve --stages {stages} | {'on' if name == 'warm' else 'off'} | {med[name][0]:.2f} | "
                  f"{med[name][1]:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
