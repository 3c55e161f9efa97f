"""The node process and its control API, as the app drives it: a real process, real
sockets. Hosting a model is exercised by the GUI tests (tests/test_app_gui.py); here:
authentication, the token's path into the process, planning, bad input, the share
toggle, joining, pausing by the owner's limits and exiting with the parent.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-" + "x" * 24


# the nodes' config folder (their share secret): not the home of whoever runs the tests
HOME = tempfile.mkdtemp(prefix="potluck-node-test-")


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TQDM_DISABLE="1", POTLUCK_HOME=HOME)
    return env


def start_node(*extra, token_stdin=True, env: dict | None = None):
    """A `potluck node` process and its API port; env: variables for that process only."""
    args = [sys.executable, "-m", "engine", "node", "--share-host", "127.0.0.1", "--share-port", "0",
            "--threads", "1", "--poll", "0.3", *extra]
    if token_stdin:
        args.append("--token-stdin")
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**_env(), **(env or {})}, cwd=ROOT)
    if token_stdin:
        proc.stdin.write((TOKEN + "\n").encode())
        proc.stdin.flush()
    line = proc.stdout.readline().decode()
    assert line.startswith("POTLUCK_NODE_PORT="), line + proc.stderr.read().decode()
    return proc, int(line.split("=")[1])


def call(port, method, path, body=None, token=TOKEN, timeout=60):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_status(port, pred, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = call(port, "GET", "/status")[1]
        if pred(st):
            return st
        time.sleep(0.2)
    raise AssertionError(f"status never matched: {st}")


def can_connect(address: str) -> bool:
    host, port = address.split("#")[0].removeprefix("ws://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def node():
    proc, port = start_node()
    yield port
    proc.stdin.close()
    assert proc.wait(30) == 0


def test_every_request_needs_the_token(node):
    assert call(node, "GET", "/status", token=None)[0] == 401
    assert call(node, "GET", "/status", token="wrong")[0] == 401
    assert call(node, "POST", "/share", {"on": True}, token="x" * 40)[0] == 401
    status, st = call(node, "GET", "/status")
    assert status == 200 and st["state"] == "idle" and st["hosting"] is None


def test_control_api_is_loopback_only(node):
    # bound to 127.0.0.1: another interface of this machine does not answer
    addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
    for a in addrs:
        with pytest.raises(OSError):
            socket.create_connection((a, node), timeout=1).close()


def test_token_never_on_the_command_line(node):
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        assert TOKEN not in " ".join(p.info["cmdline"] or [])


def test_no_gpu_panel_says_so(node):
    st = call(node, "GET", "/status")[1]
    assert "gpu" in st and isinstance(st["gpu"]["message"], str)
    if not st["gpu"]["available"]:
        assert "No NVIDIA GPU" in st["gpu"]["message"]


@pytest.mark.parametrize("body,words", [
    (b"{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
    ({"model": 5}, "'model'"),
    ({"stages": 9}, "'stages'"),   # 0 and none: one process
    ({"stages": True}, "'stages'"),
    ({"stage_addr": ["http://x"]}, "ws://"),
    ({"memory_limit_mb": -1}, "memory_limit_mb"),
    ({"layers": "0:10,12:30"}, "gap"),
    ({"weights": "fp8"}, "'weights' must be one of auto, bf16, int8, nf4"),
    ({"weights": 4}, "'weights'"),
    ({"api_lan_port": 8000}, "needs an API key"),
    ({"api_lan_port": 70000, "api_key": "k" * 20}, "'api_lan_port'"),
    ({"api_lan_port": 8000, "api_key": "short"}, "'api_key'"),
    ({"draft": 5}, "'draft'"),
    ({"draft": "   "}, "'draft'"),
])
def test_bad_plan_requests(node, body, words):
    status, r = call(node, "POST", "/plan", body)
    assert status == 400 and words.lower() in r["error"].lower(), r


def test_the_curated_models_with_their_sizes_come_from_the_node(node):
    status, r = call(node, "GET", "/models")
    assert status == 200 and r["models"][0]["id"] == "default" and len(r["models"]) >= 8
    for m in r["models"]:
        sizes = m["sizes"]
        assert sizes["bf16"] > sizes["int8"] > sizes["nf4"] > 0 and m["name"] in m["label"]
        # the smaller precision fits whenever a bigger one does
        fits = m["fits_here"]
        assert fits["nf4"] >= fits["int8"] >= fits["bf16"]
    assert r["models"][0]["fits_here"]["bf16"]  # the built-in model fits anywhere
    # the unquantized size is at the dtype this machine computes in (the plan's), named so
    default = r["models"][0]
    import torch

    if not torch.cuda.is_available():   # the node computes on the CPU, in float32
        assert "full (float32)" in default["label"] and " bf16" not in default["label"]
        assert default["sizes"]["bf16"] > 3 * default["sizes"]["nf4"]
    assert not next(m for m in r["models"] if "72B" in m["id"])["fits_here"]["bf16"]
    # the catalog's draft pairing, for a host request's draft (speculation, issue 34)
    assert all(isinstance(m["draft"], str) for m in r["models"])
    assert next(m for m in r["models"] if "70B" in m["id"])["draft"] == "meta-llama/Llama-3.2-1B-Instruct"


def test_plan_for_the_default_model(node):
    status, plan = call(node, "POST", "/plan", {"model": "default", "stages": 3})
    assert status == 200 and plan["fits"] and plan["layers"] == 30
    split = [s["layers"] for s in plan["split"]]
    assert len(split) == 3 and split[0][0] == 0 and split[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
    assert split[-1][1] - split[-1][0] < split[0][1] - split[0][0]  # the LM head weighs on the last stage
    assert plan["needed_bytes"] > 100e6 and plan["available_bytes"] > plan["needed_bytes"]
    # at the head's compute dtype, in the memory of the device it computes on
    want = ("cuda:0", ("bfloat16", "float16")) if torch.cuda.is_available() else ("cpu", ("float32",))
    assert plan["device"] == want[0] and plan["dtype"] in want[1]


def test_plan_says_what_each_weight_precision_needs_here(node):
    status, plan = call(node, "POST", "/plan", {"model": "default", "stages": 2})
    assert status == 200 and plan["fits"]
    rows = plan["precisions"]
    assert [r["weights"] for r in rows] == ["bf16", "int8", "nf4", "int4"]
    assert rows[0]["bytes"] > rows[1]["bytes"] > rows[3]["bytes"] > rows[2]["bytes"] > 50e6
    assert all(r["fits_here"] == (r["here_bytes"] <= plan["usable_bytes"]) for r in rows)
    assert rows[0]["available"] and plan["requested_weights"] == "auto"
    # auto: the highest precision that fits this machine; plenty of memory here
    assert plan["weights"] == "bf16" and plan["needed_bytes"] == rows[0]["bytes"]
    assert plan["needed_here_bytes"] == rows[0]["here_bytes"] and "full (float32)" in plan["message"]  # a CPU computes at float32
    # one figure for what the model needs here, as the model list says it: the weights and
    # room for the conversations (the app showed 897 MB, 538 MB and 0.5 GB for one model)
    need = plan["needs_here_words"]
    assert plan["needs_here_bytes"] > plan["needed_here_bytes"] and f"needs about {need} here" in plan["message"]
    assert rows[0]["needs_here_words"] == need
    status, listed = call(node, "GET", "/models")
    default = next(m for m in listed["models"] if m["id"] == "default")
    assert status == 200 and f"needs {need}" in default["group"]["words"], (need, default["group"])

    if not rows[2]["available"]:
        pytest.skip("no bitsandbytes here: bf16 only")
    # room for the smaller precisions only: auto steps down, an explicit bf16 does not fit
    nf4 = rows[2]["bytes"]
    limit_mb = nf4 / 0.6 / 2**20 * 1.05
    status, small = call(node, "POST", "/plan", {"model": "default", "memory_limit_mb": limit_mb})
    assert status == 200 and small["fits"], small
    fitting = [r["weights"] for r in small["precisions"] if r["fits_here"] and r["available"]]
    assert small["weights"] == fitting[0] != "bf16" and small["needed_here_bytes"] <= small["usable_bytes"]
    status, bf16 = call(node, "POST", "/plan", {"model": "default", "memory_limit_mb": limit_mb,
                                                "weights": "bf16"})
    assert status == 200 and not bf16["fits"] and bf16["weights"] == "bf16"
    assert "does not fit" in bf16["message"] and f"Choose {fitting[0]} weights" in bf16["message"]
    status, r = call(node, "POST", "/host", {"model": "default", "memory_limit_mb": limit_mb, "weights": "bf16"})
    assert status == 400 and "does not fit" in r["error"]
    assert call(node, "GET", "/status")[1]["hosting"] is None


def test_plan_with_friends_counts_this_machines_part(node):
    status, plan = call(node, "POST", "/plan", {"model": "default", "friends": 1, "listen": "127.0.0.1:0",
                                               "weights": "bf16"})
    assert status == 200 and plan["weights"] == "bf16" and plan["fits"]
    bf16 = plan["precisions"][0]
    assert bf16["here_bytes"] < bf16["bytes"] == plan["needed_bytes"]
    assert bf16["here_bytes"] == plan["needed_here_bytes"]
    assert "Friends' memory is known once they join" in plan["message"]


def test_nonexistent_model_is_refused_with_a_message(node):
    status, r = call(node, "POST", "/host", {"model": "no-such-user/no-such-model-xyz"})
    assert status == 400 and "is not on this computer" in r["error"]
    assert call(node, "GET", "/status")[1]["state"] == "idle"


def test_model_that_does_not_fit_is_refused(node):
    status, r = call(node, "POST", "/host", {"model": "default", "memory_limit_mb": 64})
    assert status == 400 and "does not fit" in r["error"]
    assert call(node, "GET", "/status")[1]["hosting"] is None


def test_share_toggle(node):
    st = call(node, "POST", "/share", {"on": True})[1]
    st = wait_status(node, lambda s: s["sharing"]["running"])
    addr = st["sharing"]["address"]
    assert st["state"] == "sharing" and can_connect(addr)
    st = call(node, "POST", "/share", {"on": False})[1]
    assert st["state"] == "idle" and not st["sharing"]["on"] and not st["sharing"]["running"]
    assert not can_connect(addr)  # off: nothing of a friend's reaches this machine
    assert call(node, "POST", "/share", {"on": "yes"})[0] == 400


def test_pause_by_limits_and_resume(node):
    call(node, "POST", "/share", {"on": True})
    wait_status(node, lambda s: s["sharing"]["running"])
    # only when idle, and the node cannot tell: sharing pauses and the stage goes away
    status, lim = call(node, "POST", "/limits", {"only_when_idle": True, "idle_after_s": 60})
    assert status == 200 and lim["only_when_idle"]
    st = wait_status(node, lambda s: s["state"] == "paused")
    assert not st["sharing"]["running"] and "away" in st["sharing"]["reason"]
    call(node, "POST", "/activity", {"idle_seconds": 3600})
    st = wait_status(node, lambda s: s["state"] == "sharing" and s["sharing"]["running"])
    assert call(node, "POST", "/limits", {"temp_pause_c": 50, "temp_resume_c": 60})[0] == 400
    assert call(node, "POST", "/activity", {"idle_seconds": -1})[0] == 400
    call(node, "POST", "/limits", {"only_when_idle": False})
    call(node, "POST", "/activity", {"idle_seconds": None})
    call(node, "POST", "/stop", {"what": "share"})
    assert call(node, "GET", "/status")[1]["state"] == "idle"


def _hand_over_mid_reply(node, change, expect_why: str):
    """A head uses this node's shared stage; `change()` happens mid-reply (the owner's
    limits pause sharing, the computer goes to sleep): the stage says it is leaving, the
    head moves its layers (here: to the head alone) and the reply goes on unchanged."""
    import asyncio

    from conftest import pipeline_config

    call(node, "POST", "/activity", {"idle_seconds": None})  # the owner is here (or we cannot tell)
    call(node, "POST", "/share", {"on": True})
    addr = wait_status(node, lambda s: s["sharing"]["running"])["sharing"]["address"]

    async def run():
        from engine.pipeline.launch import launch
        from engine.pipeline.head import Delta
        from engine.core.sampling import SamplingParams

        pipe = await launch(pipeline_config(stage_addr=[addr], pipeline="potluck"))
        head = pipe.head
        loop = asyncio.get_running_loop()
        prompt = head.chat_prompt([{"role": "user", "content": "Tell me a long story."}])
        try:
            async def reply(mid=None):
                toks, changed = [], None
                async for ev in head.submit(prompt, SamplingParams(max_tokens=40, greedy=True)):
                    if isinstance(ev, Delta):
                        toks.extend(ev.token_ids)
                        if mid and len(toks) == 3:
                            changed = loop.run_in_executor(None, mid)
                    else:
                        assert ev.error is None and ev.completion_tokens == 40, ev
                return toks, changed

            head.eos_ids = set()
            reference, _ = await reply()
            t0 = time.monotonic()
            got, changed = await reply(change)
            assert got == reference
            assert (await changed)[0] == 200
            # the node answered once the head let the stage go: well within the deadline
            assert time.monotonic() - t0 < 60
            left = [e for e in head.events if e["event"] == "left"]
            assert left and "leaving" in left[0]["why"] and expect_why in left[0]["why"], head.events
            assert head.events[-1]["event"] == "recovered" and head.error is None and head.n_stages == 1
        finally:
            await pipe.close()

    asyncio.run(run())


def test_paused_by_the_owners_limits_mid_reply_hands_the_stage_over(node):
    _hand_over_mid_reply(node, lambda: call(node, "POST", "/limits", {"only_when_idle": True}), "paused")
    st = wait_status(node, lambda s: s["state"] == "paused")
    assert not st["sharing"]["running"] and "away" in st["sharing"]["reason"]
    call(node, "POST", "/limits", {"only_when_idle": False})
    call(node, "POST", "/stop", {"what": "share"})


def test_going_to_sleep_mid_reply_hands_the_stage_over(node):
    _hand_over_mid_reply(node, lambda: call(node, "POST", "/power", {"state": "sleeping"}), "going to sleep")
    st = wait_status(node, lambda s: s["state"] == "paused")
    assert not st["sharing"]["running"] and "asleep" in st["sharing"]["reason"]
    assert call(node, "POST", "/power", {"state": "dozing"})[0] == 400
    call(node, "POST", "/power", {"state": "awake"})
    wait_status(node, lambda s: s["sharing"]["running"])
    call(node, "POST", "/stop", {"what": "share"})


def test_offering_a_stage_needs_a_hosted_pipeline_and_an_address(node):
    assert call(node, "POST", "/host/offer", {"address": "http://x"})[0] == 400
    status, r = call(node, "POST", "/host/offer", {"address": "ws://127.0.0.1:9"})
    assert status == 409 and "is not hosting" in r["error"]


def test_a_share_that_stops_by_itself_is_reported_and_started_again(node):
    """The stage behind the share closes (here a head tells it to shut down): the node
    notices at its next check, says so in its status, and shares again."""
    import asyncio

    from websockets.asyncio.client import connect

    from engine.pipeline.stage_server import connect_stage
    from engine.wire import frames

    call(node, "POST", "/activity", {"idle_seconds": None})
    call(node, "POST", "/share", {"on": True})
    st = wait_status(node, lambda s: s["sharing"]["running"])
    before = st["sharing"]["restarts"]

    async def shut_down(addr):
        async with await connect_stage(addr, "control", "potluck") as ws:   # the address carries the secret
            assert frames.parse_control(await ws.recv())["type"] == "welcome"
            await ws.send(frames.control("shutdown"))
            await asyncio.wait_for(ws.wait_closed(), 10)

    asyncio.run(shut_down(st["sharing"]["address"]))
    st = wait_status(node, lambda s: s["sharing"]["restarts"] == before + 1 and s["sharing"]["running"])
    assert "stopped by itself" in st["sharing"]["stopped"] and st["state"] == "sharing"
    host, port = st["sharing"]["address"].split("#")[0][len("ws://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), 5):
        pass  # serving again
    call(node, "POST", "/stop", {"what": "share"})


def test_hosting_over_a_friends_plain_share(node, tmp_path):
    """Host a pipeline (POST /host with stage addresses, as the app's Host dialog does)
    over another node's "Share this GPU": the names match without anyone typing one."""
    proc, friend = start_node()
    try:
        call(friend, "POST", "/activity", {"idle_seconds": None})
        call(friend, "POST", "/share", {"on": True})
        addr = wait_status(friend, lambda s: s["sharing"]["running"])["sharing"]["address"]
        # and the API for the other computers of the LAN, behind a key (the Host dialog's option)
        lan_port, key = free_port(), "lan-key-" + "x" * 16
        status, r = call(node, "POST", "/host", {"model": "default", "stages": 1, "stage_addr": [addr],
                                                 "api_lan_port": lan_port, "api_key": key})
        assert status == 200, r
        st = wait_status(node, lambda s: s["state"] in ("serving", "error"), timeout=300)
        assert st["state"] == "serving", st
        assert st["hosting"]["api_lan_url"].endswith(f":{lan_port}/v1")
        assert key not in json.dumps(st), "the status never shows the API key"
        lan = f"http://127.0.0.1:{lan_port}/v1/models"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(lan, timeout=30)
        assert refused.value.code == 401
        with urllib.request.urlopen(urllib.request.Request(lan, headers={"Authorization": f"Bearer {key}"}),
                                    timeout=30) as resp:
            assert json.loads(resp.read())["data"]
        body = json.dumps({"model": "default", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(st["openai_url"] + "/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert "Paris" in json.loads(resp.read())["choices"][0]["message"]["content"]
        assert wait_status(friend, lambda s: s["sharing"]["connected"])["sharing"]["layers"]
        call(node, "POST", "/stop", {"what": "host"})
        call(friend, "POST", "/stop", {"what": "share"})
    finally:
        proc.stdin.close()
        assert proc.wait(60) == 0


def test_hosting_that_fails_says_why_in_words(node):
    """A friend's computer that never answers: the status says what happened and what to
    do, without its address (the engine's account goes to the node's log)."""
    gone = f"ws://127.0.0.1:{free_port()}#secret-of-a-friend"
    status, r = call(node, "POST", "/host", {"model": "default", "stages": 1, "stage_addr": [gone],
                                             "wait_timeout_s": 1})
    assert status == 200, r
    st = wait_status(node, lambda s: s["state"] in ("serving", "error", "idle") and s["error"], timeout=120)
    assert "did not answer" in st["error"] and "host again" in st["error"], st["error"]
    assert "ws://" not in st["error"] and "secret" not in st["error"] and "Errno" not in st["error"]


def test_join(node):
    assert call(node, "POST", "/join", {})[0] == 400
    assert call(node, "POST", "/join", {"pipeline": "friends", "port": 99999})[0] == 400
    status, r = call(node, "POST", "/join", {"code": "   "})
    assert status == 400
    status, st = call(node, "POST", "/join", {"pipeline": "friends-pipeline"})
    assert status == 200 and st["sharing"]["on"] and st["sharing"]["pipeline"] == "friends-pipeline"
    assert can_connect(st["sharing"]["address"])
    call(node, "POST", "/stop", {"what": "all"})


def test_standalone_node_writes_a_private_token_file(tmp_path):
    path = tmp_path / "sub" / "token"
    proc, port = start_node("--token-file", str(path), token_stdin=False)
    try:
        token = path.read_text()
        assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert call(port, "GET", "/status", token=token)[0] == 200
        assert call(port, "GET", "/status")[0] == 401
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_node_exits_when_its_parent_goes():
    proc, port = start_node()
    call(port, "POST", "/share", {"on": True})
    proc.stdin.close()  # what the kernel does for us when the app dies, even by SIGKILL
    assert proc.wait(30) == 0


def test_a_friend_who_joins_counts_toward_what_the_group_can_run_while_others_are_awaited(tmp_path):
    """Hosting for two friends: the first to join says what its computer gives (device,
    free memory), the Host dialog lists it, and GET /models counts its memory in each
    model's `group` answer, with one friend still to join."""
    host, hport = start_node(env={"POTLUCK_HOME": str(tmp_path / "host"), "POTLUCK_KEYSTORE": "file"})
    proc, port = start_node(env={"POTLUCK_HOME": str(tmp_path / "ana"), "POTLUCK_KEYSTORE": "file",
                                 "POTLUCK_NAME": "Ana"})
    try:
        status, r = call(hport, "POST", "/host", {"model": "default", "stages": 1, "friends": 2,
                                                  "listen": "127.0.0.1:0"})
        assert status == 200, r
        code = wait_status(hport, lambda s: bool((s.get("loading") or {}).get("invite")))["loading"]["invite"]
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200, st
        st = wait_status(hport, lambda s: len((s.get("loading") or {}).get("arrived") or []) == 1)
        (ana,) = st["loading"]["arrived"]
        assert ana["name"] == "Ana" and ana["device"] == "CPU" and ana["memory"] > 2**28, ana
        assert ana["gives"].startswith("CPU, ") and ana["gives"].endswith(" GB free") and ana["path"] == "direct"
        group = call(hport, "GET", "/models")[1]["models"][0]["group"]
        assert group["friends"] == [{"name": "Ana", "bytes": ana["memory"]}] and group["waiting"] == 1, group
        assert "1 friend still to join" in group["words"]
    finally:
        for p in (proc, host):
            p.stdin.close()
            assert p.wait(60) == 0


def test_hosting_with_a_relay_offers_a_short_code_a_friend_joins_with(tmp_path):
    """With a relay, the host's status carries a short code to read out (what the Host
    dialog shows); a friend's node joins with it and the relay, and a new one is offered
    for the next friend."""
    relay_port = free_port()
    relay = subprocess.Popen([sys.executable, "-m", "engine", "relay", "--host", "127.0.0.1", "--port",
                              str(relay_port)], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    relay_url = f"ws://127.0.0.1:{relay_port}"
    host, hport = start_node(env={"POTLUCK_HOME": str(tmp_path / "host"), "POTLUCK_KEYSTORE": "file"})
    proc, port = start_node(env={"POTLUCK_HOME": str(tmp_path / "ana"), "POTLUCK_KEYSTORE": "file"})
    try:
        for _ in range(100):
            if can_connect(relay_url):
                break
            time.sleep(0.1)
        status, r = call(hport, "POST", "/host", {"model": "default", "stages": 1, "friends": 2,
                                                  "relay": relay_url})
        assert status == 200, r
        short = wait_status(hport, lambda s: bool((s.get("loading") or {}).get("short_code")))["loading"]["short_code"]
        assert len(short) == 11 and short[4] == "-" and short.replace("-", "").isdigit()
        status, st = call(port, "POST", "/join", {"code": short, "relay": relay_url}, timeout=120)
        assert status == 200, st
        wait_status(hport, lambda s: len((s.get("loading") or {}).get("arrived") or []) == 1)
        # spent: the next friend gets another
        wait_status(hport, lambda s: (s.get("loading") or {}).get("short_code") not in (None, short))
    finally:
        for p in (proc, host):
            p.stdin.close()
            assert p.wait(60) == 0
        relay.terminate()
        relay.wait(30)


def _host_with_invite(tmp_path, *extra) -> tuple[subprocess.Popen, str]:
    """`potluck host` waiting for one friend on loopback, and the invite code it printed."""
    host = subprocess.Popen([sys.executable, "-m", "engine", "host", "--listen", "127.0.0.1:0", "--peers", "1",
                             "--threads", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(_env(), POTLUCK_HOME=str(tmp_path / "host"), POTLUCK_KEYSTORE="file"), cwd=ROOT)
    line = ""
    while not line.startswith("Invite code"):
        line = host.stdout.readline()
        if not line:
            host.kill()
            raise AssertionError(host.stderr.read())
    return host, host.stdout.readline().strip()


def test_join_with_an_invite_code(tmp_path):
    """`potluck host` prints an invite; the node joins with it through the tunnel, and the
    host's pipeline answers with this node holding its second stage."""
    host, code = _host_with_invite(tmp_path, "--max-tokens", "8", "--prompt", "What is the capital of France?")
    proc, port = start_node(env={"POTLUCK_HOME": str(tmp_path / "joiner"), "POTLUCK_KEYSTORE": "file"})
    try:
        assert call(port, "POST", "/join", {"code": code[:-3] + "AAA"})[0] == 400  # a typo is reported
        # whose code it is, read without joining (the join window asks before leaving a friend)
        from engine.wire.invite import parse

        status, checked = call(port, "POST", "/join", {"code": code, "check": True})
        assert status == 200 and checked == {"pipeline": parse(code).pipeline_id, "shared_with": None}, checked
        status, err = call(port, "POST", "/join", {"code": code[:-3] + "AAA", "check": True})
        assert status == 400 and "not a whole invite code" in err["error"] and "typo" in err["details"], err
        assert call(port, "GET", "/status")[1]["state"] == "idle"
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200, st
        assert st["state"] == "sharing" and st["sharing"]["joined"]["via"] == "direct"
        status, checked = call(port, "POST", "/join", {"code": code, "check": True})
        assert checked["shared_with"] == checked["pipeline"], checked
        assert st["sharing"]["address"] is None  # the stage listens on loopback only
        out, err = host.communicate(timeout=300)
        assert host.returncode == 0, err[-2000:]
        assert "Paris" in out
        call(port, "POST", "/share", {"on": False})
        assert call(port, "GET", "/status")[1]["state"] == "idle"
    finally:
        if host.poll() is None:
            host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_potluck_join_stopped_by_sigterm_leaves_with_notice_and_the_host_serves_on(tmp_path):
    """`potluck join` stopped as a service manager or logout stops it (SIGTERM): the host
    is told first and moves the layers to itself (it used to find the friend gone), and
    the host's API answers on over one stage; then `potluck host` stopped the same way
    exits cleanly."""
    import signal

    api = free_port()
    host, code = _host_with_invite(tmp_path, "--port", str(api))
    joiner = None
    try:
        line = ""
        joiner = subprocess.Popen([sys.executable, "-m", "engine", "join", code, "--threads", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=dict(_env(), POTLUCK_HOME=str(tmp_path / "friend"), POTLUCK_KEYSTORE="file"))
        while "OpenAI-compatible API on" not in line:
            line = host.stdout.readline()
            assert line, host.stderr.read()[-2000:]
        url = f"http://127.0.0.1:{api}/v1"

        def status():
            with urllib.request.urlopen(url + "/potluck/status", timeout=30) as r:
                return json.loads(r.read())

        assert len(status()["stages"]) == 2
        joiner.send_signal(signal.SIGTERM)
        out, err = joiner.communicate(timeout=120)
        assert joiner.returncode == 0 and "Stopped sharing" in err, err[-2000:]
        # the friend's own terminal says what its computer does in the pipeline
        assert "in the pipeline: this computer computes layers" in err, err[-2000:]
        deadline = time.monotonic() + 60
        while len(status()["stages"]) != 1:
            assert time.monotonic() < deadline, status()
            time.sleep(0.5)
        assert any("stopped sharing" in json.dumps(e) for e in status()["events"]), status()["events"]
        body = json.dumps({"max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(url + "/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert "Paris" in json.loads(resp.read())["choices"][0]["message"]["content"]
        host.send_signal(signal.SIGTERM)
        assert host.wait(60) == 0, host.stderr.read()[-2000:]
        # the host's lines name the friend, not the loopback port its tunnel arrives on
        said = host.stderr.read()
        leaving = [x for x in said.splitlines() if "leaving" in x]
        assert leaving and not any("ws://127.0.0.1" in x for x in leaving), said[-3000:]
    finally:
        for p in (host, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_friend_who_cannot_reach_the_host_joins_with_a_reply_code(tmp_path):
    """Two nodes, as two homes would run them: one hosts and hands out an invite, the other
    joins with it; the pipeline spans both and answers through the first's API. The
    invite's address does not answer from the friend's side (rewritten here to a closed
    port) and there is no relay: the friend's /join answers at once with a reply code and
    keeps waiting; the host's node takes the code (POST /host/reply, the host dialog's
    "Connect to them") and connects to the friend. (A node joining on the invite's own
    address: test_join_with_an_invite_code.)"""
    from dataclasses import replace

    from engine.wire.invite import encode, parse

    common = {"POTLUCK_KEYSTORE": "file", "POTLUCK_UPNP": "0"}
    host, hport = start_node(env={**common, "POTLUCK_HOME": str(tmp_path / "host")})
    friend, fport = start_node(env={**common, "POTLUCK_HOME": str(tmp_path / "friend"),
                                    "POTLUCK_REPLY_LISTEN": "0.0.0.0:0"})
    try:
        assert call(hport, "POST", "/host", {"model": "default", "friends": 1})[0] == 400  # no way in
        status, r = call(hport, "POST", "/host", {"model": "default", "friends": 1, "listen": "127.0.0.1:0"})
        assert status == 200 and [s["where"] for s in r["plan"]["split"]][1].startswith("friend 1"), r
        st = wait_status(hport, lambda s: (s["loading"] or {}).get("invite"))
        assert st["state"] == "loading" and "Waiting for friends" in st["loading"]["message"]
        invite = parse(st["loading"]["invite"])
        unreachable = encode(replace(invite, direct=["ws://127.0.0.1:9"], kinds=["lan"]))
        status, fst = call(fport, "POST", "/join", {"code": unreachable}, timeout=120)
        assert status == 200, fst
        joining = fst["sharing"]["joining"]
        assert joining["reply_code"] and any("reply code" in e for e in joining["events"]), fst
        assert call(hport, "POST", "/host/reply", {"code": joining["reply_code"]})[0] == 200
        st = wait_status(hport, lambda s: s["state"] == "serving", timeout=300)
        assert st["hosting"]["stages"][1]["via"] == "direct (reply)", st["hosting"]["stages"]
        fst = wait_status(fport, lambda s: (s["sharing"].get("joined") or {}).get("via") == "direct (reply)")
        assert "joining" not in fst["sharing"]
        body = json.dumps({"model": "default", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(st["openai_url"] + "/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert "Paris" in json.loads(resp.read())["choices"][0]["message"]["content"]
        fst = wait_status(fport, lambda s: s["sharing"]["layers"] is not None and s["sharing"]["connected"])
        assert fst["sharing"]["layers"] == st["hosting"]["stages"][1]["layers"]
        assert call(hport, "POST", "/stop", {"what": "host"})[1]["state"] == "idle"
    finally:
        for p in (host, friend):
            p.stdin.close()
        assert host.wait(60) == 0 and friend.wait(60) == 0


def _ask(openai_url: str) -> str:
    body = json.dumps({"model": "default", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    req = urllib.request.Request(openai_url + "/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def test_the_chats_pipeline_answers_while_the_friends_invited_come(tmp_path):
    """The app hosts the default model on this computer for its chat; then its owner hosts
    with a friend. The chat's pipeline serves until the friend has joined (it used to stop
    at once: no answer for as long as the friend took), then the pipeline with the friend
    takes over."""
    common = {"POTLUCK_KEYSTORE": "file", "POTLUCK_UPNP": "0"}
    host, hport = start_node(env={**common, "POTLUCK_HOME": str(tmp_path / "host")})
    friend, fport = start_node(env={**common, "POTLUCK_HOME": str(tmp_path / "friend")})
    try:
        assert call(hport, "POST", "/host", {"model": "default"})[0] == 200
        st = wait_status(hport, lambda s: s["state"] == "serving", timeout=300)
        alone = st["openai_url"]
        # the host as it starts (one process): its card reads the whole model, not "30 of 30 layers"
        assert [r["share"] for r in st["hosting"]["ring"]] == ["the whole model"], st["hosting"]["ring"]
        # the friends' door cannot open (an address not this computer's): the chat's pipeline
        # serves on, as it was asked for, and the failure is said beside it
        status, r = call(hport, "POST", "/host", {"model": "default", "friends": 1, "listen": "203.0.113.7:0"})
        assert status == 200, r
        st = wait_status(hport, lambda s: s["error"] and not s["loading"])
        assert st["state"] == "serving" and st["openai_url"] == alone and not st["host_request"].get("friends"), st
        assert "Paris" in _ask(alone)
        with socket.socket() as s:      # one door for both invites, as the app's 0.0.0.0:7870
            s.bind(("127.0.0.1", 0))
            door = f"127.0.0.1:{s.getsockname()[1]}"
        status, r = call(hport, "POST", "/host", {"model": "default", "friends": 1, "listen": door})
        assert status == 200, r
        st = wait_status(hport, lambda s: (s["loading"] or {}).get("invite"))
        assert st["state"] == "serving" and st["openai_url"] == alone and not st["hosting"]["friends"]
        assert "Paris" in _ask(alone)     # while nobody has joined yet
        withdrawn = st["loading"]["invite"]
        # the invite withdrawn before anyone came: the chat's pipeline serves on as it was
        status, r = call(hport, "POST", "/stop", {"what": "invite"})
        assert status == 200 and not r["loading"] and r["openai_url"] == alone, r
        assert not r["host_request"].get("friends") and r["state"] == "serving", r
        assert call(hport, "POST", "/stop", {"what": "invite"})[0] == 409      # nothing left to withdraw
        assert "Paris" in _ask(alone)
        status, r = call(hport, "POST", "/host", {"model": "default", "friends": 1, "listen": door})
        assert status == 200, r
        st = wait_status(hport, lambda s: (s["loading"] or {}).get("invite"))
        # the withdrawn code no longer works, though the host's door is open again
        status, r = call(fport, "POST", "/join", {"code": withdrawn}, timeout=120)
        assert status == 502 and "withdrew this invite" in r["error"], r
        # pasted on the host's own computer, the invite is refused in words (it joined itself)
        status, r = call(hport, "POST", "/join", {"code": st["loading"]["invite"]}, timeout=120)
        assert status == 400 and "own invite" in r["error"], r
        status, fst = call(fport, "POST", "/join", {"code": st["loading"]["invite"]}, timeout=120)
        assert status == 200, fst
        st = wait_status(hport, lambda s: s["state"] == "serving" and not s["loading"]
                         and (s["hosting"] or {}).get("friends"), timeout=300)
        assert any(st_.get("name") for st_ in st["hosting"]["stages"][1:]), st["hosting"]["stages"]
        assert "Paris" in _ask(st["openai_url"])
        assert call(hport, "POST", "/stop", {"what": "host"})[1]["state"] == "idle"
    finally:
        for p in (host, friend):
            p.stdin.close()
        assert host.wait(60) == 0 and friend.wait(60) == 0


def _joined_with_a_gone_code_to_try(tmp_path, env: dict):
    """A node joined to a `potluck host` (its layers loaded), and a code of a host that
    answers nowhere: (host, node process, its port, the first pipeline, the code)."""
    from engine.wire.invite import HostState

    host, code = _host_with_invite(tmp_path, "--port", "0")
    proc, port = start_node(env={"POTLUCK_HOME": str(tmp_path / "joiner"), "POTLUCK_KEYSTORE": "file",
                                 "POTLUCK_UPNP": "0", **env})
    try:
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200 and st["state"] == "sharing", st
        # the host's pipeline formed, this computer's layers loaded: the ring as a friend has it
        wait_status(port, lambda s: s["sharing"]["layers"] and s["sharing"]["connected"], timeout=120)
    except BaseException:
        host.kill()
        proc.kill()
        raise
    (tmp_path / "gone").mkdir()
    _, gone = HostState(tmp_path / "gone").create_invite(os.urandom(32), "", ["ws://127.0.0.1:9"], kinds=["lan"])
    return host, proc, port, st["sharing"]["joined"]["pipeline"], gone


def test_a_join_that_fails_leaves_this_computer_sharing_with_the_friend_it_had(tmp_path):
    """Joined to one friend, a code from another who withdrew it (here: a host that answers
    nowhere, and no reply code): the join failed, and this computer had already left the
    first friend, its share off, with nothing said."""
    host, proc, port, first, gone = _joined_with_a_gone_code_to_try(tmp_path, {"POTLUCK_REPLY_LISTEN": "off"})
    try:
        status, err = call(port, "POST", "/join", {"code": gone}, timeout=120)
        assert status >= 400 and "shares with the friend it shared with before" in err["error"], err
        st = wait_status(port, lambda s: s["state"] == "sharing", timeout=60)
        assert st["sharing"]["joined"]["pipeline"] == first, st
    finally:
        host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_a_join_that_fails_on_its_reply_code_goes_back_to_the_friend_it_had(tmp_path):
    """As a join that fails at once: one that offered a reply code nobody took (the other
    host withdrew, or closed Potluck) gave up after its wait with this computer's share off,
    the first friend left for nothing."""
    host, proc, port, first, gone = _joined_with_a_gone_code_to_try(
        tmp_path, {"POTLUCK_REPLY_LISTEN": "127.0.0.1:0", "POTLUCK_REPLY_WAIT_S": "3"})
    try:
        status, st = call(port, "POST", "/join", {"code": gone}, timeout=120)
        assert status == 200 and st["sharing"]["joining"]["reply_code"], st      # waiting on the code
        st = wait_status(port, lambda s: "joining" not in s["sharing"] and s["error"]
                         and "before" in s["error"], timeout=90)
        assert "did not connect with this computer's reply code" in st["error"], st
        assert st["state"] == "sharing" and st["sharing"]["joined"]["pipeline"] == first, st
    finally:
        host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_a_friend_who_leaves_while_the_model_loads_is_waited_for_and_the_host_loads_again(tmp_path):
    """The friend switched sharing off while the host was forming the pipeline (a computer
    that went to sleep does the same): `potluck host` ended with "cannot reach stage", its
    invite and every other friend's wait with it. It waits for them now, and loads again."""
    host, code = _host_with_invite(tmp_path, "--port", "0")
    proc, port = start_node(env={"POTLUCK_HOME": str(tmp_path / "joiner"), "POTLUCK_KEYSTORE": "file",
                                 "POTLUCK_UPNP": "0", "POTLUCK_REPLY_LISTEN": "off"})
    try:
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200 and st["sharing"]["layers"] is None, st      # joined, nothing loaded yet
        assert call(port, "POST", "/share", {"on": False})[0] == 200
        import queue
        import threading

        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in host.stderr], daemon=True).start()
        said = ""

        def until(words: str, timeout: float = 120):
            nonlocal said
            deadline = time.time() + timeout
            while words not in said:
                try:
                    said += lines.get(timeout=max(0.1, deadline - time.time()))
                except queue.Empty:
                    raise AssertionError(f"the host never said {words!r}: {said}") from None

        until("left while the model loaded")
        assert host.poll() is None
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)   # the same code: a member
        assert status == 200, st
        st = wait_status(port, lambda s: s["sharing"]["layers"] and s["sharing"]["connected"], timeout=180)
        until("Ready:")
        assert "came back: loading again" in said and "2 stages" in said, said
    finally:
        host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_sharing_on_after_a_restart_joins_the_friend_joined_last(tmp_path):
    """A friend's Potluck restarted (its computer rebooted) came back with sharing off, and
    switching it on shared under a name nobody knew: the invite code had to be pasted
    again. The node keeps who it joined (0600), and sharing on joins them again."""
    host, code = _host_with_invite(tmp_path, "--port", "0")
    env = {"POTLUCK_HOME": str(tmp_path / "joiner"), "POTLUCK_KEYSTORE": "file", "POTLUCK_UPNP": "0",
           "POTLUCK_REPLY_LISTEN": "off"}
    proc, port = start_node(env=env)
    try:
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200, st
        first = st["sharing"]["joined"]["pipeline"]
        kept = tmp_path / "joiner" / "joined.json"
        assert kept.exists() and stat.S_IMODE(kept.stat().st_mode) == 0o600
        proc.stdin.close()
        assert proc.wait(60) == 0                          # Potluck quit (the friend leaves, told)
        proc, port = start_node(env=env)                   # and started again
        assert call(port, "GET", "/status")[1]["state"] == "idle"
        status, st = call(port, "POST", "/share", {"on": True}, timeout=120)
        assert status == 200 and st["sharing"]["joined"]["pipeline"] == first, st
    finally:
        host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_a_host_started_again_gets_its_friend_back_without_a_new_code(tmp_path):
    """What the app does after Restart or when opened again (app/controller.py): the host's
    node, started anew, hosts alone (the chat answers), then the same request with its
    friend; the friend's node, still joined, comes back by itself as a member."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{s.getsockname()[1]}"
    henv = {"POTLUCK_HOME": str(tmp_path / "host"), "POTLUCK_KEYSTORE": "file", "POTLUCK_UPNP": "0"}
    host, hport = start_node(env=henv)
    friend, fport = start_node(env={"POTLUCK_HOME": str(tmp_path / "ana"), "POTLUCK_KEYSTORE": "file",
                                    "POTLUCK_UPNP": "0", "POTLUCK_REPLY_LISTEN": "off"})
    request = {"model": "default", "stages": 1, "friends": 1, "listen": listen}
    try:
        assert call(hport, "POST", "/host", request)[0] == 200
        code = wait_status(hport, lambda s: bool((s.get("loading") or {}).get("invite")))["loading"]["invite"]
        # the name the app's Settings give (what the host shows, not the computer's name)
        assert call(fport, "POST", "/join", {"code": code, "name": "  Ana "}, timeout=120)[0] == 200
        wait_status(hport, lambda s: s["state"] == "serving" and (s.get("hosting") or {}).get("friends"), timeout=180)
        host.stdin.close()
        assert host.wait(60) == 0
        host, hport = start_node(env=henv)
        assert call(hport, "POST", "/host", {"model": "default", "stages": 1})[0] == 200
        wait_status(hport, lambda s: s["state"] == "serving", timeout=180)
        assert call(hport, "POST", "/host", request)[0] == 200
        st = wait_status(hport, lambda s: s["state"] == "serving" and not s.get("loading")
                         and (s.get("hosting") or {}).get("friends"), timeout=240)
        assert [f["name"] for f in st["hosting"]["friends"]] == ["Ana"], st
    finally:
        for p in (friend, host):
            p.stdin.close()
            assert p.wait(60) == 0


def test_a_friend_rejoins_as_a_member_after_its_code_expired_and_not_once_revoked(tmp_path):
    """Potluck started again a day later: the code it joined with had expired, and it was
    asked for a new one although the host still counted it a member. It rejoins as that
    member now; a host that revoked it says no, and the kept code is forgotten."""
    from engine.wire.invite import HostState

    host, code = _host_with_invite(tmp_path, "--port", "0")
    env = {"POTLUCK_HOME": str(tmp_path / "ana"), "POTLUCK_KEYSTORE": "file", "POTLUCK_UPNP": "0",
           "POTLUCK_REPLY_LISTEN": "off"}
    proc, port = start_node(env=env)
    try:
        status, st = call(port, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200 and st["state"] == "sharing", st
        proc.stdin.close()
        assert proc.wait(60) == 0
        (state_file,) = (tmp_path / "host").rglob("host.json")
        state = HostState(state_file.parent)
        with state._locked() as data:            # a day on: the invite has expired
            for rec in data["invites"].values():
                rec["expires"] = time.time() - 60
        proc, port = start_node(env=env)
        status, st = call(port, "POST", "/share", {"on": True}, timeout=120)
        assert status == 200 and st["sharing"]["joined"], st
        st = wait_status(port, lambda s: (s["sharing"].get("joined") or {}).get("via") == "direct")
        assert st["state"] == "sharing" and not st["error"], st

        assert call(port, "POST", "/share", {"on": False})[0] == 200
        with state._locked() as data:            # the host revokes this computer
            for rec in data["members"].values():
                rec["revoked"] = True
        call(port, "POST", "/share", {"on": True}, timeout=120)
        st = wait_status(port, lambda s: s["error"])
        assert "Ask them for a new code" in st["error"] and st["state"] == "error", st
        assert not list((tmp_path / "ana").rglob("joined.json"))          # not tried at the next start
        proc.stdin.close()
        assert proc.wait(60) == 0
        proc, port = start_node(env=env)
        status, err = call(port, "POST", "/share", {"on": True}, timeout=120)
        assert status == 200 and err["state"] == "sharing" and not err["sharing"].get("joined"), err
    finally:
        host.kill()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_a_join_waiting_on_its_reply_code_is_given_up_cleanly(tmp_path):
    """Sharing switched off while the host has not used the reply code yet: the wait ends,
    its listener closes, and the node is idle again."""
    friend, fport = start_node(env={"POTLUCK_HOME": str(tmp_path / "friend"), "POTLUCK_KEYSTORE": "file",
                                    "POTLUCK_UPNP": "0", "POTLUCK_REPLY_LISTEN": "127.0.0.1:0"})
    try:
        from engine.wire.invite import HostState

        (tmp_path / "a-host-that-is-not-running").mkdir()
        state = HostState(tmp_path / "a-host-that-is-not-running")
        _, code = state.create_invite(os.urandom(32), "", ["ws://127.0.0.1:9"], kinds=["lan"])
        status, fst = call(fport, "POST", "/join", {"code": code}, timeout=120)
        assert status == 200 and fst["sharing"]["joining"]["reply_code"], fst
        assert call(fport, "POST", "/share", {"on": False})[0] == 200
        st = wait_status(fport, lambda s: "joining" not in s["sharing"])
        assert st["state"] == "idle" and not st["error"], st
    finally:
        friend.stdin.close()
        assert friend.wait(60) == 0


def test_switching_sharing_off_and_on_leaves_no_threads_behind():
    """Every time a head takes the share, its stage computes on threads of its own; a share
    switched off must take them with it. (Each kept thread holds its own heap arena: a
    friend toggled all evening grew by hundreds of MB.)"""
    import asyncio

    from engine.pipeline.stage_server import connect_stage
    from engine.wire import frames

    async def take(addr):
        async with await connect_stage(addr, "control", "potluck") as ws:
            assert frames.parse_control(await ws.recv())["type"] == "welcome"   # measured on its thread

    proc, port = start_node()

    def threads() -> int:
        return len(os.listdir(f"/proc/{proc.pid}/task"))

    try:
        call(port, "POST", "/activity", {"idle_seconds": None})
        counts = []
        for _ in range(12):
            call(port, "POST", "/share", {"on": True})
            asyncio.run(take(wait_status(port, lambda s: s["sharing"]["running"])["sharing"]["address"]))
            assert call(port, "POST", "/share", {"on": False})[1]["state"] == "idle"
            counts.append(threads())
        # A thread kept per toggle grows the count by one a round (10 from round 2 on). The
        # event loop's default executor may add workers now and then and keep them (when
        # two of the node's calls overlap on a busy machine: seen growing 4 -> 6 over 7
        # rounds in a CI run), but not one a round: the count may grow by half the rounds.
        print("threads", counts)
        assert counts[-1] - counts[1] <= (len(counts) - 2) // 2, counts
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_the_api_keeps_its_port_from_one_start_to_the_next_or_takes_a_free_one(tmp_path):
    """The app asks its node for a stable API port (a tool set up with the address keeps
    working after a restart; it changed at every start); another program holding it
    means a free one, not a failure."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        wanted = held.getsockname()[1]
        node, port = start_node("--api-port", str(wanted), env={"POTLUCK_HOME": str(tmp_path)})
        try:
            assert call(port, "POST", "/host", {"model": "default", "stages": 1})[0] == 200
            st = wait_status(port, lambda s: s["state"] == "serving", timeout=300)
            assert f":{wanted}/" not in st["openai_url"] and "Paris" in _ask(st["openai_url"])
            assert call(port, "POST", "/stop", {"what": "host"})[0] == 200
            held.close()                       # the port free again: the next pipeline takes it
            assert call(port, "POST", "/host", {"model": "default", "stages": 1})[0] == 200
            st = wait_status(port, lambda s: s["state"] == "serving", timeout=300)
            assert st["openai_url"] == f"http://127.0.0.1:{wanted}/v1"
        finally:
            node.stdin.close()
            assert node.wait(60) == 0
