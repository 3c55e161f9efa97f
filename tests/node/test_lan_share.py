"""A stage shared on the LAN, attacked from another machine on it (a second network
namespace): without the share's secret a stranger learns nothing about the machine and
can neither configure it, run a step on it nor shut it down, while the owner's own
pipeline over that stage keeps answering."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from testkit.netns import emulated_network, netns_available
from test_across_homes import CHAT, PROMPT, Lines

ok, why = netns_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")

SUBNET = 83

# Run by the stranger, in its own namespace: every way in it has, with what it can know
# (the address, the protocol, the pipeline name) but not the secret.
STRANGER = r"""
import asyncio, json, sys
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from engine.pipeline.stage_server import PROTOCOL_VERSION
from engine.wire import frames
from engine.wire.stage_auth import proof

URL = sys.argv[1]

def hello(role, auth, pipeline="local"):
    return frames.control("hello", role=role, version=PROTOCOL_VERSION, pipeline=pipeline, auth=auth)

CONFIGURE = frames.control("configure", model="/etc/passwd", start=0, end=30, fingerprint=None, next=None,
                           dtype="float32", kv_budget_tokens=None, threads=None, link=None, compress=None,
                           compute=None, acks=True, weights="bf16", profile=None, route="0" * 32)
STEP = frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[1, 0, 1]]}, torch.zeros(1, 576))

CASES = {
    "control hello, no proof, then configure": lambda n: [hello("control", ""), CONFIGURE],
    "control hello, a guessed secret, then shutdown": lambda n: [hello("control", proof("potluck", "control", "local", n)),
                                                                 frames.control("shutdown")],
    "data hello, no proof, then a step": lambda n: [hello("data", ""), STEP],
    "data hello, a guessed route, then a step": lambda n: [hello("data", proof("0" * 32, "data", "local", n)), STEP],
    "configure without hello": lambda n: [CONFIGURE],
    "shutdown without hello": lambda n: [frames.control("shutdown")],
    "a step without hello": lambda n: [STEP],
}

async def attempt(make):
    got = []
    try:
        async with connect(URL, max_size=None) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 10))
            for m in make(first.get("nonce", "")):
                await ws.send(m)
            while True:
                got.append(await asyncio.wait_for(ws.recv(), 15))
    except ConnectionClosed as exc:
        return {"first": first, "after": [str(g)[:80] for g in got],
                "code": exc.rcvd.code if exc.rcvd else None, "reason": exc.rcvd.reason if exc.rcvd else ""}
    except asyncio.TimeoutError:
        return {"first": first, "after": [str(g)[:80] for g in got], "code": "open", "reason": ""}

async def main():
    out = {}
    for name, make in CASES.items():
        out[name] = await attempt(make)
    print(json.dumps(out))

asyncio.run(main())
"""


def _env(tmp_path, who):
    home = tmp_path / who
    home.mkdir(exist_ok=True)
    return dict(os.environ, POTLUCK_HOME=str(home), HOME=str(home), HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
                PYTHONPATH=os.pathsep.join(sys.path))


def test_a_stranger_on_the_lan_cannot_drive_a_shared_stage(tmp_path):
    py = sys.executable
    with emulated_network(2, "line", subnet=SUBNET) as net:
        owner = net.addr(0)
        # the owner shares with `potluck stage` on every interface and no --secret: it makes one
        stage = net.popen(0, [py, "-m", "engine", "stage", "--host", "0.0.0.0", "--port", "7860", "--threads", "1"],
                          env=_env(tmp_path, "stage"), text=True)
        serve = None
        try:
            said = Lines(stage.stderr).wait_for(lambda s: "Give the head this address" in s, 120)
            secret = re.search(r"#(\w+)\s*$", said).group(1)
            assert len(secret) >= 20

            # the owner's own pipeline over it: the address carries the secret
            serve = net.popen(0, [py, "-m", "engine", "serve", "--stage-addr", f"ws://{owner}:7860#{secret}",
                                  "--port", "8000", "--threads", "1"], env=_env(tmp_path, "head"), text=True)
            Lines(serve.stderr).wait_for(lambda s: s.startswith("OpenAI-compatible API"), 300)

            res = net.exec(1, [py, "-c", STRANGER, f"ws://{owner}:7860"], timeout=300)
            results = json.loads(res.stdout.strip().splitlines()[-1])
            for name, r in results.items():
                # before any proof the stage says only "prove it": no memory, speed, device or paths
                assert set(r["first"]) == {"type", "nonce"} and r["first"]["type"] == "challenge", (name, r)
                assert r["code"] == 1008, (name, r)
                assert r["after"] == [], (name, r)          # nothing was answered, so nothing ran
            reasons = {name: r["reason"] for name, r in results.items()}
            assert reasons["control hello, no proof, then configure"] == "not authorized"
            assert reasons["control hello, a guessed secret, then shutdown"] == "not authorized"
            assert reasons["data hello, a guessed route, then a step"] == "not authorized"
            assert "hello" in reasons["configure without hello"]

            assert stage.poll() is None, "the stranger's shutdown reached the stage"
            answer = json.loads(net.exec(0, [py, "-c", CHAT, PROMPT], timeout=300).stdout)
            assert "Paris" in answer["choices"][0]["message"]["content"]
        finally:
            for p in (serve, stage):
                if p is not None:
                    p.terminate()
            for p in (serve, stage):
                if p is not None:
                    try:
                        p.wait(20)
                    except Exception:  # noqa: BLE001
                        p.kill()


def test_a_stage_beyond_loopback_will_not_start_without_a_secret():
    from engine.pipeline.stage_server import StageServer

    with pytest.raises(ValueError, match="needs a secret"):
        StageServer("0.0.0.0", 0)
    with pytest.raises(ValueError, match="needs a secret"):
        StageServer("192.168.1.5", 0, secret="")
