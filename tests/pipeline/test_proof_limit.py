"""Nothing big before a proof: until a connection to a stage has proven its key it may
send only its hello (stage_server.PROOF_MAX). Many strangers sending large first frames
at once are refused from the frame header, so the owner's memory stays flat, and a
proven peer still sends full-size frames afterwards."""

from __future__ import annotations

import asyncio
import json
import sys

import psutil

from engine.pipeline.stage_server import PROOF_MAX, StageServer, connect_stage
from engine.wire import frames
from engine.wire.stage_auth import new_secret

BIG = 8 << 20   # 8 MiB: accepted before this limit (the old one was ~1 GiB)
STRANGERS = 50


# the strangers run in their own process: their 8 MiB frames must not count as the stage's memory
STRANGERS_SCRIPT = r"""
import asyncio, json, os, sys
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

async def stranger(url, big):
    try:
        async with connect(url, max_size=1 << 20, open_timeout=30, close_timeout=5) as ws:
            await asyncio.wait_for(ws.recv(), 30)          # the challenge: a nonce, nothing else
            try:
                await ws.send(big)
            except ConnectionClosed:
                pass
            try:
                await asyncio.wait_for(ws.recv(), 30)
                return "answered"
            except ConnectionClosed as exc:
                return str(exc.rcvd.code if exc.rcvd else exc)
    except Exception as exc:   # websockets' client may trip over the abort (not the stage's doing)
        return type(exc).__name__

async def main(url, n, size):
    big = os.urandom(size)
    print(json.dumps(await asyncio.gather(*(stranger(url, big) for _ in range(n)))))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def test_fifty_strangers_with_large_first_frames_cost_nothing_and_a_proven_peer_goes_on():
    secret = new_secret()
    server = await StageServer("127.0.0.1", 0, pipeline="lan", threads=1, secret=secret).start()
    try:
        url = f"ws://127.0.0.1:{server.port}"
        me = psutil.Process()
        before = me.memory_info().rss
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", STRANGERS_SCRIPT, url, str(STRANGERS),
                                                    str(BIG), stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
        results = json.loads(out.decode().strip().splitlines()[-1])
        grew = me.memory_info().rss - before
        assert "answered" not in results, results
        for _ in range(100):   # the stage logs each refusal as its handler returns
            if server.rejected_frames >= STRANGERS:
                break
            await asyncio.sleep(0.1)
        assert server.rejected_frames >= STRANGERS, (server.rejected_frames, results)
        # 50 x 8 MiB would be 400 MiB buffered; refused from their headers it is noise
        assert grew < 64 << 20, f"the stage grew {grew / 2**20:.0f} MiB for strangers"

        # the owner's head proves the secret, then (after the welcome, as the head does)
        # sends a message far larger than a hello
        ws = await connect_stage(f"{url}#{secret}", "control", "lan")
        try:
            assert frames.parse_control(await asyncio.wait_for(ws.recv(), 30))["type"] == "welcome"
            big = frames.control("free", seq_ids=list(range(100_000, 103_000)))
            assert len(big) > 4 * PROOF_MAX
            await ws.send(big)
            await ws.send(frames.control("get_stats"))
            kinds = []
            while "stats" not in kinds:   # (the big one was read, or the link closed with 1009)
                kinds.append(frames.parse_control(await asyncio.wait_for(ws.recv(), 30))["type"])
        finally:
            await ws.close()
    finally:
        await server.close("test over")
