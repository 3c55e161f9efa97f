"""What a peer holding the route token (every friend stage of a pipeline holds it) costs a
stage's memory by sending large messages on its data links.

A `potluck stage` process is configured with the default model's last layers; a peer
then opens --links data links and sends one --mib MiB message on each at once (not a
frame: the stage refuses it). The table gives the stage process's peak RSS before and
after, with the data link's message limit as it is (engine/pipeline/stage_protocol.py
DATA_MAX, a link's piece) and as it was (1 GiB), side by side in one run.

    .venv/bin/python bench/link_memory.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model.sources import resolve  # noqa: E402
from engine.pipeline.stage_protocol import connect_stage  # noqa: E402
from engine.wire import frames  # noqa: E402

SECRET = "bench-secret"
ROUTE = "r" * 32


def peak_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(old: bool, links: int, mib: int) -> tuple[float, float, set]:
    code = ("import sys, engine.pipeline.stage_server as ss\n"
            + ("ss.DATA_MAX = ss.WS_OPTIONS['max_size']\n" if old else "")
            + "from engine.cli import main\n"
              "sys.exit(main(['stage', '--host', '127.0.0.1', '--port', '0', '--announce', '--threads', '1']))")
    env = dict(os.environ, POTLUCK_STAGE_SECRET=SECRET, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        while True:
            line = proc.stdout.readline().decode()
            if not line:
                raise RuntimeError("the stage process ended before it was ready")
            if line.startswith("POTLUCK_STAGE_PORT="):
                port = int(line.split("=")[1])
                break
        address = f"ws://127.0.0.1:{port}#{SECRET}"
        head = await connect_stage(address, "control", "local")
        await head.recv()
        await head.send(frames.control(
            "configure", model="default", start=20, end=30, dtype="float32", kv_budget_tokens=None, threads=None,
            link=None, compress=None, compute=None, acks=True, weights="bf16", profile=None, route=ROUTE,
            fingerprint=resolve("default").fingerprint(), next=None))
        while frames.parse_control(await head.recv())["type"] != "configured":
            pass
        before = peak_mb(proc.pid)
        peers = [await connect_stage(address, "data", "local", key=ROUTE) for _ in range(links)]
        blob = b"\0" * (mib << 20)

        async def push(link) -> str:
            try:
                await asyncio.wait_for(link.send(blob), 120)
                await asyncio.wait_for(link.recv(), 120)
                return "answered"
            except Exception as exc:   # noqa: BLE001 -- how the stage ended it is the row's
                return type(exc).__name__

        ends = set(await asyncio.gather(*(push(p) for p in peers)))
        await asyncio.sleep(1.0)
        after = peak_mb(proc.pid)
        await head.close()
        return before, after, ends
    finally:
        proc.stdin.close()
        proc.terminate()
        proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", type=int, default=4, help="data links at once (a stage holds 4)")
    p.add_argument("--mib", type=int, default=200, help="the message sent on each, MiB")
    a = p.parse_args(argv)
    print(f"{a.links} data links x one {a.mib} MiB message each, to a stage holding layers 21-30 of the default model")
    print(f"{'message limit':<26}{'peak RSS before':>16}{'after':>10}{'growth':>10}  links ended by")
    for old in (False, True):
        before, after, ends = asyncio.run(one(old, a.links, a.mib))
        name = "1 GiB (before)" if old else "a link's piece (now)"
        print(f"{name:<26}{before:>13.0f} MB{after:>7.0f} MB{after - before:>7.0f} MB  {', '.join(sorted(ends))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
