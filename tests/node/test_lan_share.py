"""A stage shared on the LAN, attacked from another machine on it (a second network
namespace): without the share's secret a stranger learns nothing about the machine and
can neither configure it, run a step on it nor shut it down, while the owner's own
pipeline over that stage keeps answering."""

from __future__ import annotations

import json
import os
import re
import subprocess
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
from engine.wire.stage_auth import HelloOpener

URL = sys.argv[1]

def hello(role, auth, pipeline="local"):
    return frames.control("hello", role=role, version=PROTOCOL_VERSION, pipeline=pipeline, auth=auth)

CONFIGURE = frames.control("configure", model="/etc/passwd", start=0, end=30, fingerprint=None, next=None,
                           dtype="float32", kv_budget_tokens=None, threads=None, link=None, compress=None,
                           compute=None, acks=True, weights="bf16", profile=None, route="0" * 32)
STEP = frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[1, 0, 1]]}, torch.zeros(1, 576))

CASES = {
    "control hello, no proof, then configure": lambda n: [hello("control", ""), CONFIGURE],
    "control hello, a guessed secret, then shutdown": lambda n: [hello("control", HelloOpener("potluck", "control", "local", n).auth),
                                                                 frames.control("shutdown")],
    "data hello, no proof, then a step": lambda n: [hello("data", ""), STEP],
    "data hello, a guessed route, then a step": lambda n: [hello("data", HelloOpener("0" * 32, "data", "local", n).auth), STEP],
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
            stage_said = Lines(stage.stderr)
            said = stage_said.wait_for(lambda s: "Give the head this address" in s, 120)
            secret = re.search(r"#(\w+)\s*$", said).group(1)
            assert len(secret) >= 20

            # the owner's own pipeline over it: the address carries the secret
            serve = net.popen(0, [py, "-m", "engine", "serve", "--stage-addr", f"ws://{owner}:7860#{secret}",
                                  "--port", "8000", "--threads", "1"], env=_env(tmp_path, "head"), text=True)
            Lines(serve.stderr).wait_for(lambda s: s.startswith("OpenAI-compatible API"), 300)
            # its owner's terminal says it was taken in, and with what (it said nothing)
            stage_said.wait_for(lambda s: "in the pipeline: this computer computes layers" in s, 60)

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


# Runs inside a namespace: one call to that node's control API (it listens on loopback there)
CTL = r"""
import json, sys, urllib.request, urllib.error
port, token, method, path, body = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                             data=None if body == "-" else body.encode(),
                             headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        print(json.dumps([r.status, json.loads(r.read() or b"null")]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, json.loads(e.read() or b"null")]))
"""

TOKEN = "lan-share-test-token-0123456789"


def test_hosting_from_one_home_over_a_friends_app_share_on_the_lan(tmp_path):
    """Two computers on a LAN, each running the app's node, driven through the control
    API the way the app drives it: one switches "Share this GPU" on, the other hosts the
    default model with that share's address (as Pipeline status shows it, secret and
    all), and answers."""
    import time

    py = sys.executable
    with emulated_network(2, "line", subnet=SUBNET + 1) as net:
        nodes = []
        try:
            for i in (0, 1):
                p = net.popen(i, [py, "-m", "engine", "node", "--share-host", "0.0.0.0", "--share-port", "7860",
                                  "--threads", "1", "--poll", "0.3", "--token-stdin", "--port", "9000"],
                              env=_env(tmp_path, f"node{i}"), text=True, stdin=subprocess.PIPE)
                p.stdin.write(TOKEN + "\n")
                p.stdin.flush()
                Lines(p.stdout).wait_for(lambda s: s.startswith("POTLUCK_NODE_PORT="), 120)
                nodes.append(p)

            def ctl(i, method, path, body=None):
                out = net.exec(i, [py, "-c", CTL, "9000", TOKEN, method, path,
                                   "-" if body is None else json.dumps(body)], timeout=320).stdout
                return json.loads(out.strip().splitlines()[-1])

            def wait(i, pred, timeout=300):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    st = ctl(i, "GET", "/status")[1]
                    if pred(st):
                        return st
                    time.sleep(0.5)
                raise AssertionError(f"node {i} status never matched: {st}")

            ctl(1, "POST", "/activity", {"idle_seconds": None})
            assert ctl(1, "POST", "/share", {"on": True})[0] == 200
            address = wait(1, lambda s: s["sharing"]["running"])["sharing"]["address"]
            # what the friend reads off Pipeline status: its LAN address and the secret
            assert address.startswith(f"ws://{net.addr(1)}:7860#"), address

            # someone watching the LAN: every packet on the host's side of the wire
            capture = tmp_path / "lan.bin"
            observer = net.popen(0, [py, "-m", "testkit.sniff", "right", str(capture)], text=True,
                                 stdout=subprocess.PIPE)
            Lines(observer.stdout).wait_for(lambda s: s.startswith("sniffing"), 30)
            status, r = ctl(0, "POST", "/host", {"model": "default", "stages": 1, "stage_addr": [address]})
            assert status == 200, r
            st = wait(0, lambda s: s["state"] in ("serving", "error"))
            assert st["state"] == "serving", st
            assert "#" not in json.dumps(st["hosting"]), "the secret never shows in the host's status"
            body = {"model": "default", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            url = st["openai_url"].split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
            out = net.exec(0, [py, "-c", CTL, url, "-", "POST", "/v1/chat/completions", json.dumps(body)],
                           timeout=320).stdout
            status, r = json.loads(out.strip().splitlines()[-1])
            assert status == 200 and "Paris" in r["choices"][0]["message"]["content"], r
            friend = wait(1, lambda s: s["sharing"]["connected"] and s["sharing"]["layers"])
            assert friend["sharing"]["layers"][1] == 30      # the friend holds the last layers
            # and says what that takes: its slice of the weights (the output head's 108 MB
            # among them), and the cache it holds now
            assert friend["sharing"]["weights_bytes"] > 108 << 20 and friend["sharing"]["kv_bytes"] >= 0, friend

            # the observer saw the whole exchange (weights never cross; activations do) and
            # learned nothing of it: no prompt, reply, message, model name or secret
            observer.terminate()
            observer.wait(20)
            seen = capture.read_bytes()
            assert len(seen) > 50_000, len(seen)
            answer = r["choices"][0]["message"]["content"]
            secret = address.rsplit("#", 1)[1]
            # (the handshake itself is in the clear: a challenge, a hello and an accept)
            for plain in (b"capital of France", answer.encode(), b"Paris", b"configure", b"route",
                          b"SmolLM2", b"welcome", secret.encode(), b"PTLK"):
                assert plain not in seen, f"the LAN observer read {plain!r}"
        finally:
            for p in nodes:
                p.stdin.close()
            for p in nodes:
                try:
                    p.wait(60)
                except Exception:  # noqa: BLE001
                    p.kill()
