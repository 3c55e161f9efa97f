"""A friend leaves, the chat goes on: a stage process dies (or freezes) mid-reply and
every conversation continues, token for token what an uninterrupted run produces.

Real processes on the default model: a head and two stage processes; four requests
decode together; one stage is killed (SIGKILL), frozen (SIGSTOP: only the heartbeats
notice) or two die one after the other. The head drops what is gone, splits the layers
over what is left, prefills each sequence's history there and goes on decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import time
import weakref

import pytest

from conftest import pipeline_config

from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta, Done
from engine.pipeline.launch import launch
from testkit.streams import tiny_head, tokens, until
from testkit.freed import all_freed

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
TOKENS = 48


def params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=TOKENS)
    return SamplingParams(greedy=True, max_tokens=TOKENS)


async def run(head, seeded: bool, on_token=None) -> list[list[int]]:
    """The four requests at once; on_token(count of seq 0's tokens) after each of seq 0's."""
    return await replies(head, [(p, params(seeded, i)) for i, p in enumerate(PROMPTS)], on_token)


async def replies(head, asks: list[tuple[str, SamplingParams]], on_token=None) -> list[list[int]]:
    """Each (question, sampling) as a chat request, all at once: their tokens."""
    handles = [head.submit(head.chat_prompt([{"role": "user", "content": q}]), p) for q, p in asks]

    async def one(i, h):
        toks = []
        async for ev in h:
            if isinstance(ev, Delta):
                toks.extend(ev.token_ids)
                if i == 0 and on_token is not None:
                    on_token(len(toks))
            else:
                assert isinstance(ev, Done) and ev.error is None, ev
        return toks

    return await asyncio.wait_for(asyncio.gather(*(one(i, h) for i, h in enumerate(handles))), 300)


# An uninterrupted run's replies (greedy, seeded), taken once for the module: every
# pipeline of this config gives the same ones (the fixed-buffer test checks that across
# two), and each run on the default model's three processes costs seconds of CI.
REFERENCE: dict[bool, list[list[int]]] = {}


async def interrupted(seeded: bool, hits: list[tuple[int, int, int]], own_reference: bool = False):
    """An uninterrupted run (or the module's, unless own_reference), then the same with
    each (at_token, stage process, signal) of `hits` delivered as sequence 0 reaches that
    many tokens."""
    pipe = await launch(pipeline_config())
    head = pipe.head
    head.eos_ids = set()  # every request runs its full length
    stopped, delivered = [], []
    try:
        reference = None if own_reference else REFERENCE.get(seeded)
        if reference is None:
            reference = await run(head, seeded)
            if not own_reference:
                REFERENCE[seeded] = reference
        head.info()   # as the app's status does, every second: it reads stage 0's memory
        head.old_stage0 = weakref.ref(head.stage0)
        head.old_ranges = list(head.ranges)
        procs = list(pipe.local.procs)
        pending = sorted(hits)

        def on_token(n):
            while pending and n >= pending[0][0]:
                _, which, sig = pending.pop(0)
                os.kill(procs[which].pid, sig)
                delivered.append(time.time())
                if sig == signal.SIGSTOP:
                    stopped.append(procs[which].pid)

        t0 = time.monotonic()
        got = await run(head, seeded, on_token)
        seconds = time.monotonic() - t0
        assert not pending, "the run ended before every failure was delivered"
        head.delivered = delivered
        return head, reference, got, seconds, await all_freed(head)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await pipe.close()


def check(head, reference, got, lost: int):
    assert got == reference  # not a token lost, repeated or changed
    assert all(len(t) == TOKENS for t in got)
    events = head.info()["events"]
    assert [e["event"] for e in events].count("recovered") == lost
    assert head.error is None and head.n_stages == 3 - lost


async def test_the_middle_stage_killed_mid_reply(monkeypatch):
    # without spare layers (no room for them, or no quiet moment yet: test_spare_layers.py
    # has them), the survivors read the lost stage's layers
    monkeypatch.setenv("POTLUCK_SPARES", "0")
    head, reference, got, _, stats = await interrupted(False, [(12, 0, signal.SIGKILL)])
    # the old arrangement's slice is gone from memory: nothing holds it once the head let it
    # go (it goes before the new slice loads: a GPU host has room for one of them, not both)
    gc.collect()
    assert head.old_stage0() is None
    check(head, reference, got, 1)
    assert len(stats) == 2
    # the head and the last stage kept the layers they held and read only the middle's
    (_, a), (b, L) = head.old_ranges[0], head.old_ranges[2]
    x = head.ranges[0][1]
    recovered = [e for e in head.info()["events"] if e["event"] == "recovered"][-1]
    assert recovered["kept_layers"] == min(a, x) + L - max(b, x) > 0


async def test_decode_over_fixed_buffers_gives_the_same_replies_through_a_kill(monkeypatch):
    """The decode step a GPU replays as CUDA graphs (engine/model/static_decode.py; on the
    CPU run eagerly when asked), in real stage processes: the eager path's replies, token
    for token, and again after the middle stage dies and its layers are replayed."""
    eager = REFERENCE.get(False)
    if eager is None:   # run alone: the module's other tests have not taken it
        pipe = await launch(pipeline_config())
        pipe.head.eos_ids = set()
        try:
            eager = REFERENCE[False] = await run(pipe.head, False)
        finally:
            await pipe.close()
    monkeypatch.setenv("POTLUCK_STATIC_DECODE", "1")      # the stage processes inherit it
    head, reference, got, _, stats = await interrupted(False, [(12, 0, signal.SIGKILL)], own_reference=True)
    assert reference == eager
    check(head, reference, got, 1)
    assert all(s["fixed_steps"] > TOKENS for s in stats), stats


async def test_the_last_stage_killed_with_seeded_sampling():
    # the last stage samples: its replacement draws each token from the seed and the
    # position, so the continuation is the one the dead stage would have drawn
    head, reference, got, _, _ = await interrupted(True, [(12, 1, signal.SIGKILL)])
    check(head, reference, got, 1)


async def test_two_stages_die_one_after_the_other():
    head, reference, got, _, stats = await interrupted(False, [(8, 0, signal.SIGKILL), (24, 1, signal.SIGKILL)])
    check(head, reference, got, 2)
    assert len(stats) == 1  # the head alone holds the model


async def test_a_frozen_stage_is_noticed_by_its_heartbeats():
    from engine.pipeline.stage_server import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S

    head, reference, got, _, _ = await interrupted(False, [(12, 0, signal.SIGSTOP)])
    check(head, reference, got, 1)
    left = next(e for e in head.events if e["event"] == "left")
    # noticed within a heartbeat and its timeout (plus slack for a busy 2-core machine),
    # where no connection closed at all
    assert HEARTBEAT_S + HEARTBEAT_TIMEOUT_S <= 10
    assert left["t"] - head.delivered[0] < HEARTBEAT_S + HEARTBEAT_TIMEOUT_S + 3


async def test_a_head_held_past_its_heartbeat_keeps_its_stages():
    """The head's own process stalls (a laptop swapping, a debugger) longer than the
    heartbeat's timeout while a ping is outstanding: the stage answered meanwhile, so
    nobody is lost and the next reply comes from the same three stages."""
    import threading

    from engine.pipeline.stage_protocol import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S

    pipe = await launch(pipeline_config())
    head = pipe.head
    stage = pipe.local.procs[0].pid
    try:
        before = await replies(head, [(PROMPTS[0], params(False, 0))])
        # stage 0 slow to answer for a moment, so that a ping to it is outstanding...
        os.kill(stage, signal.SIGSTOP)
        await asyncio.sleep(HEARTBEAT_S + 0.5)
        threading.Timer(0.5, os.kill, (stage, signal.SIGCONT)).start()
        # ...when the head's loop is held past the timeout (its answer waits in the socket)
        time.sleep(HEARTBEAT_TIMEOUT_S + 1.0)
        await asyncio.sleep(0.5)
        assert [e["event"] for e in head.info()["events"] if e["event"] in ("left", "recovered")] == []
        assert await replies(head, [(PROMPTS[0], params(False, 0))]) == before
        assert head.n_stages == 3 and head.error is None
        assert len(await all_freed(head)) == 3
    finally:
        os.kill(stage, signal.SIGCONT)
        await pipe.close()


async def test_a_stage_stopped_gracefully_hands_over_mid_reply():
    # SIGTERM: the stage says "leaving", the head moves its layers at once and lets it go
    head, reference, got, _, _ = await interrupted(False, [(12, 0, signal.SIGTERM)])
    check(head, reference, got, 1)
    left = next(e for e in head.events if e["event"] == "left")
    assert "leaving" in left["why"] and "stopped by its owner" in left["why"], left
    # told, not timed out: the notice reaches the head at once, and the stage is let go
    # once the others have loaded its layers (at most PART_SHARE of its notice)
    from engine.pipeline.recovery_driver import PART_SHARE
    from engine.pipeline.stage_server import LEAVE_S
    leaving = next(e for e in head.events if e["event"] == "leaving")
    assert leaving["t"] - head.delivered[0] < 2
    assert left["t"] - leaving["t"] < PART_SHARE * LEAVE_S + 2


async def test_a_reply_held_to_a_schema_survives_the_sampling_stage_dying():
    """The last stage holds each constrained sequence's grammar state; its replacement
    rebuilds it from the tokens already sent, so the reply still parses and is the one an
    uninterrupted run gives."""
    schema = json.dumps({"type": "object", "additionalProperties": False, "required": ["city", "country"],
                         "properties": {"city": {"type": "string", "maxLength": 24},
                                        "country": {"type": "string", "maxLength": 24}}})
    asks = [(q, SamplingParams(greedy=True, max_tokens=64, json_schema=schema))
            for q in ("Give the capital of France as JSON.", "Give the largest city of Japan as JSON.")]
    pipe = await launch(pipeline_config())
    head = pipe.head
    try:
        reference = await replies(head, asks)
        last = list(pipe.local.procs)[-1]
        killed = []

        def on_token(n):
            if n >= 4 and not killed:
                os.kill(last.pid, signal.SIGKILL)
                killed.append(n)

        got = await replies(head, asks, on_token)
        assert killed and got == reference
        for toks in got:
            reply = json.loads(head.tokenizer.decode(toks, skip_special_tokens=True))
            assert set(reply) == {"city", "country"}
        assert [e["event"] for e in head.info()["events"]].count("recovered") == 1
    finally:
        await pipe.close()


async def test_survivors_too_small_wait_for_the_same_machine_to_come_back(tmp_path):
    """Three machines, each capped so that two cannot hold the model: the middle one dies
    (kill -9) mid-reply, the head says it waits for a GPU for that machine's layers, the
    same machine comes back on its address, and all four replies finish as if nothing
    happened."""
    import subprocess
    import sys

    from conftest import THREADS, free_port
    from engine.pipeline.launch import PipelineConfig

    cap_mb = 320  # 13 of the default model's 30 layers each (USABLE of the cap)
    ports = [free_port(), free_port()]

    def stage(port):
        return subprocess.Popen([sys.executable, "-m", "engine", "stage", "--port", str(port), "--threads",
                                 str(THREADS), "--memory-cap-mb", str(cap_mb), "--device", "cpu"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    procs = [stage(p) for p in ports]
    pipe = None
    try:
        await until(lambda: all(port_open(p) for p in ports), timeout=120, every=0.2)
        pipe = await launch(PipelineConfig(model="default", stage_addr=[f"ws://127.0.0.1:{p}" for p in ports],
                                           threads=THREADS, memory_cap_mb=cap_mb, device="cpu"))
        head = pipe.head
        head.eos_ids = set()
        assert head.n_stages == 3
        reference = await run(head, False)
        missing = head.ranges[1]
        waiting = []

        def on_token(n):
            if n == 12 and not waiting:
                procs[0].kill()
                waiting.append(True)

        async def come_back():
            await until(lambda: (head.info()["recovering"] or "").startswith("waiting"), timeout=120)
            waiting.append(head.info()["recovering"])
            procs[0] = stage(ports[0])

        back = asyncio.ensure_future(come_back())
        got = await run(head, False, on_token)
        await back
        assert f"waiting for a computer to hold layers {missing[0] + 1}–{missing[1]}" in waiting[1], waiting
        assert got == reference
        kinds = [e["event"] for e in head.info()["events"]]
        assert kinds == ["left", "waiting", "recovered"], kinds
        assert head.n_stages == 3 and head.error is None
        stats = await all_freed(head)
        assert len(stats) == 3
    finally:
        if pipe is not None:
            await pipe.close()
        for p in procs:
            p.kill()
            p.wait()


def test_a_link_cut_between_two_homes_is_noticed_by_the_heartbeats(tmp_path):
    """Three machines on one switch (network namespaces); the middle stage's port on the
    switch goes down mid-reply: its packets are dropped, nothing is closed. The heartbeats
    notice within 10 s, the head goes on with the last stage, and the replies are those
    of an uninterrupted run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from testkit.netns import emulated_network, netns_available, sh

    ok, why = netns_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    driver = Path(__file__).with_name("netcut_head.py")
    SECRET = "netcut-test-secret-0123"   # stages on the LAN need one; the addresses carry it
    with emulated_network(3, "star", subnet=71) as net:
        for node in (1, 2):
            net.popen(node, [sys.executable, "-m", "engine", "stage", "--host", "0.0.0.0", "--port", "7860",
                             "--threads", "1", "--device", "cpu", "--secret", SECRET], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
        # the stages take a moment to listen; the driver's launch retries nothing, so wait
        probe = "import socket, sys\nfor a in sys.argv[1:]: socket.create_connection((a, 7860), 1).close()"
        deadline = time.monotonic() + 120
        while net.exec(0, [sys.executable, "-c", probe, net.addr(1), net.addr(2)], check=False).returncode != 0:
            assert time.monotonic() < deadline, "the stages never listened"
            time.sleep(0.5)
        log = open(tmp_path / "head.log", "w")
        head = net.popen(0, [sys.executable, str(driver), f"ws://{net.addr(1)}:7860#{SECRET}",
                             f"ws://{net.addr(2)}:7860#{SECRET}"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
        lines = []
        for line in head.stdout:
            lines.append(line)
            if line.startswith("CUT"):
                cut_at = time.time()
                sh(["ip", "-n", net.hub, "link", "set", "p1", "down"])  # no FIN, no RST: silence
            if line.startswith("{"):
                break
        head.wait(60)
        log.close()
        assert lines and lines[-1].startswith("{"), (tmp_path / "head.log").read_text()[-3000:]
    out = json.loads(lines[-1])
    assert out["error"] is None and out["got"] == out["reference"]
    assert all(len(t) == 40 for t in out["got"])
    kinds = [e["event"] for e in out["events"]]
    assert kinds[:1] == ["left"] and "recovered" in kinds, out["events"]
    left = out["events"][0]
    assert "stopped answering" in left["why"] or "failed" in left["why"], left
    assert left["t"] - cut_at < 10 + 3  # heartbeat and its timeout, plus a busy machine's slack
    assert out["stages"] == 2


# ---- the defaults users run: `potluck serve --stages 3`, no threads pinned ----

def stage_children(pid: int) -> list[int]:
    """The stage processes `pid` started, oldest (stage 1) first."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = sorted(int(c) for c in f.read().split())
    stages = []
    for c in kids:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            if b"\0stage\0" in f.read():
                stages.append(c)
    return stages


async def kill_stages_mid_chat(url: str, parent: int, stages: int = 3):
    """Over the API at `url`: a streamed chat uninterrupted, then once per stage process
    of `parent` (oldest first) the same chat with that process killed (kill -9) mid-reply.
    Each reply must be the uninterrupted one, and the pipeline one stage shorter. Before
    each kill the pipeline has been quiet long enough to load its spare layers, as a
    chat's pauses give it: the rearrangement then reads no layer."""
    import aiohttp
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
    ask = dict(messages=[{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
               temperature=0, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True})

    async def status():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/potluck/status") as r:
            return await r.json()

    async def chat(model, kill_at: int | None = None, victim: int | None = None):
        stream = await client.chat.completions.create(model=model, **ask)
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if kill_at is not None and len(parts) == kill_at:
                    os.kill(victim, signal.SIGKILL)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(parts), usage

    try:
        victims = stage_children(parent)
        assert len(victims) == stages - 1
        assert len((await status())["stages"]) == stages
        model = (await client.models.list()).data[0].id
        reference, n = await chat(model)
        assert n > 16, (reference, n)  # long enough to be cut mid-reply
        for k, victim in enumerate(victims):
            deadline = time.monotonic() + 120
            while (await status())["spare_layers"] == 0:
                assert time.monotonic() < deadline, await status()
                await asyncio.sleep(0.5)
            got = await chat(model, kill_at=8, victim=victim)
            assert got == (reference, n), (k, got, reference, (await status())["events"])
            info = await status()
            assert info["error"] is None and len(info["stages"]) == stages - 1 - k, info
            assert [e["event"] for e in info["events"]].count("recovered") == k + 1, info["events"]
            recovered = [e for e in info["events"] if e["event"] == "recovered"][-1]
            assert recovered["kept_layers"] == info["stages"][-1]["layers"][1], recovered
    finally:
        await client.close()


def default_env() -> dict:
    """This environment without anything that pins threads: what a user's shell has."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


async def test_serve_defaults_a_stage_killed_mid_chat_then_another(tmp_path):
    """`potluck serve --stages 3` exactly as a user starts it: no --threads, so the head
    and its two stage processes share this CPU's cores (engine/model/cores.py) and the
    split follows each one's share. A streamed chat over the API; a stage process is
    killed (kill -9) mid-reply, then the other one on the next reply: each reply is the
    one an uninterrupted run gives, and the head alone finishes the last. (Before, the
    head planned the survivors with the old count's CPU shares: IndexError, pipeline
    failed; the other tests pin threads=1 and so never took that path.)"""
    async with serving_defaults(tmp_path) as (serve, url):
        await kill_stages_mid_chat(f"{url}/v1", serve.pid)


@contextlib.asynccontextmanager
async def serving_defaults(tmp_path):
    """`potluck serve --stages 3` as a user starts it, answering: (its process, its URL)."""
    import subprocess
    import sys

    from conftest import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--stages", "3", "--port", str(port)],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=default_env())
    try:
        await until(lambda: serve.poll() is not None or port_open(port), timeout=300, every=0.5)
        assert serve.poll() is None, (tmp_path / "serve.log").read_text(errors="replace")[-3000:]
        yield serve, f"http://127.0.0.1:{port}"
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        log.close()


async def test_serve_defaults_a_link_between_stages_cut_while_idle(tmp_path):
    """`potluck serve --stages 3` as a user starts it. Between two chats the data link
    from stage 1 to stage 2 is cut by the kernel (`ss -K`, as a router that forgets an
    idle connection does), every process and the head's own connections still up. The
    next chat answers, the same reply: stage 1 notices its link ended and leaves its
    arrangement, and the head forms the pipeline again over all three (before, the link
    ended quietly and the next request failed on it, or waited for ever)."""
    import subprocess

    import aiohttp
    from openai import AsyncOpenAI

    if os.geteuid() != 0:
        pytest.skip("cutting another process's connection (ss -K) needs root")

    async def status(url):
        async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/potluck/status") as r:
            return await r.json()

    async def chat(client, model):
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three rivers."}], temperature=0, max_tokens=20)
        return r.choices[0].message.content

    def links_to(stage_port: int, pid: int) -> list[str]:
        out = subprocess.run(["ss", "-tnpH", "state", "established", "dport", "=", f":{stage_port}"],
                             capture_output=True, text=True, check=True).stdout
        return [line.split()[2].rsplit(":", 1)[1] for line in out.splitlines() if f"pid={pid}," in line]

    async with serving_defaults(tmp_path) as (serve, url), \
            AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id
        reference = await chat(client, model)
        first, _ = stage_children(serve.pid)
        info = await status(url)
        assert len(info["stages"]) == 3
        next_port = int(re.search(r":(\d+)", info["stages"][2]["address"].split("//", 1)[1]).group(1))
        (local,) = links_to(next_port, first)            # stage 1's data link to stage 2
        cut = subprocess.run(["ss", "-K", "state", "established", "sport", "=", f":{local}",
                              "dport", "=", f":{next_port}"], capture_output=True, text=True)
        if links_to(next_port, first):
            pytest.skip(f"this kernel cannot cut a connection (ss -K: {cut.stderr.strip()})")
        await asyncio.sleep(3)    # the stage's grace before it leaves (NEXT_LINK_GRACE_S), and a moment
        assert await chat(client, model) == reference
        info = await status(url)
        assert info["error"] is None and len(info["stages"]) == 3, info
        kinds = [e["event"] for e in info["events"]]
        assert "left" in kinds and "recovered" in kinds, info["events"]
        left = next(e for e in info["events"] if e["event"] == "left")
        assert "link to the next stage" in left["why"], left


def test_terminal_chat_defaults_a_stage_killed_mid_reply(tmp_path):
    """`potluck chat --stages 3` with its defaults (no --threads): the reply it prints
    with a stage process killed (kill -9) mid-reply is the one it prints uninterrupted."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "engine", "chat", "--stages", "3", "--temperature", "0", "--max-tokens",
            str(TOKENS), "--prompt", "Write a short story about a lighthouse keeper."]

    def chat(kill: bool) -> str:
        log = open(tmp_path / f"chat-{kill}.log", "wb")
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=default_env())
        out, killed = b"", not kill
        try:
            while chunk := os.read(p.stdout.fileno(), 256):
                out += chunk
                if not killed and len(out.partition(b"bot> ")[2]) > 24:
                    os.kill(stage_children(p.pid)[0], signal.SIGKILL)
                    killed = True
            assert p.wait(60) == 0, (tmp_path / f"chat-{kill}.log").read_text(errors="replace")[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        assert killed, out
        text = out.decode().partition("bot> ")[2]
        reply, _, stats = text.partition("\n     [")
        # '[N tokens, first after Xs, R tok/s]'; a failed reply's error would follow the rate
        assert re.match(r"\d+ tokens, first after [\d.]+s, [\d.]+ tok/s\]", stats), text
        return reply + "|" + stats.split(",")[0]

    reference = chat(False)
    assert chat(True) == reference


async def test_node_hosting_defaults_a_stage_killed_mid_chat_then_another(tmp_path):
    """The node's hosting as the app asks for it (POST /host, three stages on this
    machine; `potluck node` without --threads, as the app starts it): the same kills
    mid-chat, through the API URL the node reports."""
    import subprocess
    import sys
    import urllib.request

    token = "failover-test-token-" + "x" * 24
    env = dict(default_env(), POTLUCK_HOME=str(tmp_path / "home"))
    node = subprocess.Popen([sys.executable, "-m", "engine", "node", "--token-stdin", "--share-host", "127.0.0.1",
                             "--share-port", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "node.log", "wb"),
                            env=env)
    node.stdin.write((token + "\n").encode())
    node.stdin.flush()

    def call(method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    try:
        line = node.stdout.readline().decode()
        assert line.startswith("POTLUCK_NODE_PORT="), line
        port = int(line.split("=")[1])
        call("POST", "/host", {"model": "default", "stages": 3})
        status = {}

        def hosting():
            status.update(call("GET", "/status"))
            assert not status["error"], status["error"]
            return status["openai_url"] is not None and status["hosting"] is not None

        await until(hosting, timeout=300, every=0.5)
        await kill_stages_mid_chat(status["openai_url"], node.pid)
    finally:
        node.stdin.close()   # the node exits when its stdin closes
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- waiting for room, and machines that come back (tiny model, stages in this process) ----

def tiny_cap(source, layers: int) -> int:
    """An owner's memory cap under which a stage holds at most `layers` of the model's."""
    from engine.core import precision

    per_layer = precision.per_layer_bytes(source.config(), "bf16", 4)
    return int((layers + 0.5) * per_layer / precision.USABLE)


async def tiny_reply(head, n=30):
    return await tokens(head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=n)))


async def mended(head, stages: int, reference):
    """The head re-formed its pipeline after a link dropped, and answers; the machine that
    left (asked back at once, or by the watch a moment later) serves again."""
    await until(lambda: "recovered" in [e["event"] for e in head.info()["events"]] and head.recovering is None,
                timeout=60)
    assert head.error is None
    toks, done = await asyncio.wait_for(tiny_reply(head), 60)
    assert done.error is None and toks == reference
    await until(lambda: head.n_stages == stages and head.recovering is None, timeout=60)
    toks, done = await asyncio.wait_for(tiny_reply(head), 60)
    assert done.error is None and toks == reference


async def test_a_data_link_dropped_while_idle_is_mended_before_the_next_request(tiny_folder, monkeypatch):
    """The head's data link to stage 1 drops while no reply runs (a keepalive that timed
    out on a busy machine, a router forgetting the connection), its control connection
    still up: the head is told at once and re-forms the pipeline, and the next request is
    answered. (It used to learn only from that request, which failed: 'connection
    closed', found by CI.)"""
    import engine.pipeline.head as head_module
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}"])
    try:
        reference, _ = await tiny_reply(head)
        head._data_ws.ws.transport.abort()     # gone under both ends, nothing said
        await mended(head, 2, reference)
    finally:
        await head.close()
        await a.close()


async def test_a_link_between_two_stages_dropped_while_idle_is_mended_too(tiny_folder, monkeypatch):
    """The same between stage 1 and stage 2, whose head hears of it from neither: stage 1
    leaves its arrangement (after a moment's grace, in case the head is letting go
    anyway), the head goes on over the others at once, the next request is answered, and
    stage 1, asked again, is taken back."""
    import engine.pipeline.head as head_module
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{b.port}"])
    try:
        reference, _ = await tiny_reply(head)
        a._next_ws.ws.transport.abort()
        await mended(head, 3, reference)
        left = next(e for e in head.info()["events"] if e["event"] == "left")
        assert "link to the next stage dropped" in left["why"], left
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_survivors_too_small_wait_then_go_on_when_a_machine_joins(tiny_folder):
    """Neither the head nor the stage can hold the model alone: when the stage leaves, the
    reply waits with a status that says for which layers, and goes on -- unchanged --
    once another machine offers itself."""
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    cap = tiny_cap(source, 4)   # of 6 layers: two machines needed
    a = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    head = await tiny_head(source, [f"ws://127.0.0.1:{a.port}"], memory_cap=cap)
    b = None
    try:
        reference, _ = await tiny_reply(head)
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=30))
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        lost_layers = head.ranges[1]
        await a.close("switched off")
        await until(lambda: (head.info()["recovering"] or "").startswith("waiting"))
        status = head.info()["recovering"]
        assert f"layers {lost_layers[0] + 1}–{lost_layers[1]}" in status, status
        # meanwhile a new request is taken, and waits too
        later = asyncio.ensure_future(tiny_reply(head))
        await asyncio.sleep(0.5)
        assert not later.done() and head.error is None
        b = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
        head.offer(f"ws://127.0.0.1:{b.port}")
        toks = []
        async for ev in handle:
            if isinstance(ev, Delta):
                toks.extend(ev.token_ids)
            else:
                assert ev.error is None, ev
        assert toks == reference
        assert (await asyncio.wait_for(later, 60))[0] == reference
        kinds = [e["event"] for e in head.info()["events"]]
        assert kinds == ["left", "waiting", "recovered"], kinds
        assert head.n_stages == 2 and head.remotes[0].address.endswith(f":{b.port}")
    finally:
        await head.close()
        await a.close()
        if b is not None:
            await b.close()


async def test_a_second_machine_lost_while_waiting_is_noticed_and_waited_for_too(tiny_folder):
    """Issue 44: the pipeline waits for room after one machine left, and a survivor dies
    meanwhile. The head notices at once (not when loading on it fails), the status names
    both machines' layers, one machine offering itself is not enough any more, and the
    reply goes on unchanged once a second one comes."""
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    cap = tiny_cap(source, 2)   # of 6 layers: three machines needed
    a = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    b = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    head = await tiny_head(source, [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{b.port}"], memory_cap=cap)
    extra = []
    try:
        reference, _ = await tiny_reply(head)
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=30))
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        first, second = head.ranges[1], head.ranges[2]
        await a.close("switched off")
        await until(lambda: (head.info()["recovering"] or "").startswith("waiting"))
        await b.close("switched off too")
        both = f"layers {first[0] + 1}–{second[1]}"         # the two machines' layers, adjacent
        await until(lambda: both in (head.info()["recovering"] or ""), timeout=30)
        status = head.info()["recovering"]
        assert "left meanwhile" in status and head.error is None, status
        for _ in range(2):      # one machine is not enough now; the second completes the ring
            extra.append(await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start())
            head.offer(f"ws://127.0.0.1:{extra[-1].port}")
            await asyncio.sleep(1.0)
            assert head.error is None, head.error
        toks = []
        async for ev in handle:
            if isinstance(ev, Delta):
                toks.extend(ev.token_ids)
            else:
                assert ev.error is None, ev
        assert toks == reference
        kinds = [e["event"] for e in head.info()["events"]]
        assert kinds.count("left") == 2 and kinds[-1] == "recovered", kinds
        assert head.n_stages == 3
    finally:
        await head.close()
        for s in [a, b] + extra:
            await s.close()


async def test_two_stages_lost_at_once_the_status_names_every_missing_layer(tiny_folder):
    """Three machines, none able to hold the model alone; both stages go at once. The
    status names all the layers nobody holds (once it named only the first stage's,
    'layers 5–6', while 3–6 had no holder); a machine that joins takes them all and the
    reply goes on unchanged."""
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    cap = tiny_cap(source, 3)   # of 6 layers: three machines hold it, one cannot
    a = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    b = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    head = await tiny_head(source, [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{b.port}"], memory_cap=cap)
    c = None
    try:
        assert head.n_stages == 3
        reference, _ = await tiny_reply(head)
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=30))
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        gone_from = head.ranges[1][0]
        await asyncio.gather(a.close("switched off"), b.close("switched off"))
        await until(lambda: (head.info()["recovering"] or "").startswith("waiting"))
        status = head.info()["recovering"]
        assert status.startswith(f"waiting for a computer to hold layers {gone_from + 1}–6 "), status   # counted from 1
        assert "(the machines left have room for 3 of the model's 6 layers)" in status, status
        c = await StageServer("127.0.0.1", 0, threads=1).start()   # room for all of them
        head.offer(f"ws://127.0.0.1:{c.port}")
        toks, done = await asyncio.wait_for(tokens(handle), 60)
        assert done.error is None and toks == reference
        assert head.n_stages == 2 and head.error is None
    finally:
        await head.close()
        for s in (a, b, c):
            if s is not None:
                await s.close()


async def test_nobody_joins_in_time_fails_with_a_clear_error(tiny_folder):
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    cap = tiny_cap(source, 4)
    a = await StageServer("127.0.0.1", 0, memory_cap=cap, threads=1).start()
    head = await tiny_head(source, [f"ws://127.0.0.1:{a.port}"], memory_cap=cap, wait_timeout=1.0)
    try:
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=200))
        await until(lambda: len(handle.seq.generated) >= 2, every=0.001)
        await a.close("switched off")
        _, done = await asyncio.wait_for(tokens(handle), 30)
        assert done.finish_reason == "error"
        assert "switched off" in done.error and "no machine joined within 1 s" in done.error, done.error
        assert head.error == done.error
    finally:
        await head.close()
        await a.close()


async def test_a_machine_that_comes_back_gets_its_slice_again(tiny_folder, monkeypatch):
    """The stage leaves; the head alone goes on; the same machine comes back (same
    address) and the head hands it a slice again -- a reply in flight meanwhile is
    replayed, unchanged."""
    import engine.pipeline.head as head_module
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer

    monkeypatch.setattr(head_module, "WATCH_S", 0.1)  # back while the reply is still going
    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    port = a.port
    head = await tiny_head(source, [f"ws://127.0.0.1:{port}"])
    back = None
    try:
        reference, _ = await tiny_reply(head, 200)
        await a.close("switched off", wait_s=10)
        await until(lambda: head.info()["events"] and head.info()["events"][-1]["event"] == "recovered")
        assert head.n_stages == 1
        # the head alone decodes a tiny model's token in a millisecond or two: paced, the
        # reply is surely still going when the machine is back, however busy this one is
        alone, step = head.stage0, head.stage0.forward

        def paced(*args, **kw):
            # slower still near the reply's end while the machine is not yet back in: on a
            # crowded CI machine loading its share ahead has outlasted 200 paced tokens
            slow = head.n_stages == 1 and len(handle.seq.generated) >= 150
            time.sleep(0.5 if slow else 0.05)
            return step(*args, **kw)

        monkeypatch.setattr(alone, "forward", paced)
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=200))
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        back = await StageServer("127.0.0.1", port, threads=1).start()
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: head.info()["events"][-1]["event"] == "rejoined", timeout=30)
        assert done.error is None and toks == reference
        events = head.info()["events"]
        assert [e["event"] for e in events] == ["left", "recovered", "back", "rejoined"], events
        assert head.n_stages == 2 and events[-1]["replayed"] == 1
        # the head held every layer alone: it kept its new share, reading none of it again;
        # the machine loaded its share ahead while the reply went on, and kept it too
        assert events[-1]["kept_layers"] == head.ranges[-1][1] and events[1]["kept_layers"] > 0
        assert events[-1]["ahead_s"] is not None
        assert (await tiny_reply(head, 200))[0] == reference
    finally:
        await head.close()
        await a.close()
        if back is not None:
            await back.close()


async def test_a_machine_back_on_a_collapsed_line_waits_until_its_line_carries_the_replay(tiny_folder, monkeypatch):
    """A friend's upload collapses (someone at home sends a video): dropped, it still
    answers the watch's hello, a few bytes. It used to be taken straight back, and the
    replay of every conversation over its line stalled them all until it dropped again.
    Now the head times its line first (engine/core/line_check.py): too slow, the pipeline
    serves on without it and asks again later; once the line carries the replay in time
    it is taken back. The line: testkit's shaping proxy between the head and the stage."""
    import engine.pipeline.head as head_module
    from engine.core import line_check
    from engine.model.sources import resolve
    from engine.pipeline.stage_server import StageServer
    from testkit.linkemu import ShapedLink

    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    # the tiny model's replay is small: a budget to match, and a short hold between tests
    monkeypatch.setattr(line_check, "BUDGET_S", 0.5)
    monkeypatch.setattr(line_check, "HOLD_S", (0.5, 2.0))
    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    port = a.port
    line = ShapedLink("127.0.0.1", 0, "127.0.0.1", port, rate_bps=200e6)
    head = back = None
    try:
        head = await tiny_head(source, [f"ws://127.0.0.1:{await line.start()}"])
        reference, _ = await tiny_reply(head, 40)
        await a.close("switched off", wait_s=10)
        await until(lambda: head.info()["events"][-1]["event"] == "recovered")
        line.set_rate(100e3, "down")        # the stage's upload: 100 kbit/s
        back = await StageServer("127.0.0.1", port, threads=1).start()
        await until(lambda: head.info()["events"][-1]["event"] == "slow", timeout=30)
        slow = head.info()["events"][-1]
        assert "its line carries under" in slow["why"] and head.n_stages == 1, slow
        # served on without it meanwhile, and asked again more than once
        tested = line.connections
        assert (await tiny_reply(head, 40))[0] == reference
        await until(lambda: line.connections >= tested + 2, timeout=30)
        assert head.n_stages == 1 and [e["event"] for e in head.info()["events"]].count("slow") == 1
        line.set_rate(200e6, "down")        # the video is sent
        await until(lambda: head.info()["events"][-1]["event"] == "rejoined", timeout=60)
        assert head.n_stages == 2
        assert [e["event"] for e in head.info()["events"]] == ["left", "recovered", "slow", "back", "rejoined"]
        assert (await tiny_reply(head, 40))[0] == reference
        # lost without notice while its line is collapsed (as the heartbeats would find it):
        # it answers the rearrangement's brief ask, but its line is timed there too, and the
        # pipeline goes on without it rather than keep it and lose it again in the replay
        line.set_rate(20e3, "down")
        events = len(head.info()["events"])
        head._stage_lost(1, "stage 1 (test) stopped answering", head.recovery.epoch)
        await until(lambda: head.info()["events"][-1]["event"] == "recovered", timeout=60)
        assert head.n_stages == 1, head.info()["events"][events:]
        assert [e["event"] for e in head.info()["events"][events:]] == ["left", "slow", "recovered"]
        assert (await tiny_reply(head, 40))[0] == reference
        line.set_rate(200e6, "down")
        await until(lambda: head.info()["events"][-1]["event"] == "rejoined", timeout=60)
        assert head.n_stages == 2
    finally:
        if head is not None:
            await head.close()
        for s in (a, back):
            if s is not None:
                await s.close()
        await line.close()
