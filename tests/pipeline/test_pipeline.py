"""The pipeline across real processes: exact tokens, cancellation, admission, bad peers.

Most tests share the session `pipeline` (head + 2 stage processes, default model).
Tests that need another model or other limits configure the two `spare_stages`
processes with a head of their own; a stage serves one head at a time and forgets a
head's sequences when it disconnects, so the next test reconfigures them cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from conftest import THREADS, free_port
from engine.wire import frames
from engine.pipeline.head import Delta, Done, Head, PipelineError
from engine.model.sources import ModelError, ModelSource, resolve
from engine.core import precision
from engine.core.partition import parse_layers
from engine.core.sampling import SamplingParams
from engine.pipeline.stage_server import PROTOCOL_VERSION, StageServer, connect_stage
from engine.wire.stage_auth import HelloOpener
from testkit.freed import all_freed

ROOT = Path(__file__).resolve().parents[2]
STAGE_CMD = ("engine", "stage", "--announce")


# ---- helpers --------------------------------------------------------------------------

async def collect(handle) -> tuple[list[int], str, Done]:
    toks, parts = [], []
    async for ev in handle:
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
            parts.append(ev.text)
        else:
            return toks, "".join(parts), ev
    raise AssertionError("no Done event")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=max_tokens)


async def wait_freed(head, timeout: float = 10.0) -> list[dict]:
    """Every stage holds no sequence and no cached token, once the head lets its kept replies go."""
    return await all_freed(head, timeout)


async def start_head(source: ModelSource, addrs: list[str], **kw) -> Head:
    head = Head(source, addrs, **kw)
    try:
        await head.start()
    except BaseException:
        await head.close()
        raise
    return head


async def reference_generate(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """transformers' own greedy decoding of one prompt, cut at the first end-of-sequence.
    It runs in a thread: this loop hosts the head, and a loop held for seconds misses its
    links' heartbeats (2 s pings, 5 s to answer), which then close as if a stage had died."""
    return await asyncio.to_thread(_generate, model, prompt, max_new, eos)


def _generate(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=sorted(eos) or None, pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    for i, t in enumerate(toks):
        if t in eos:
            return toks[:i]
    return toks


def stage_pids(run: str) -> set[int]:
    """The stage processes that cli(..., run=run) started and that still live. Tests run in
    parallel workers, so other tests' stages come and go meanwhile: a stage is ours when it
    inherited our run's mark."""
    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if all(part in cmd for part in STAGE_CMD):
            try:
                if p.environ().get(RUN_MARK) == run:
                    pids.add(p.info["pid"])
            except psutil.Error:   # gone meanwhile, or not ours to read
                pass
    return pids


RUN_MARK = "POTLUCK_TEST_RUN"


def cli(*args, timeout=180, run: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", **{RUN_MARK: run})
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---- token-exact parity across processes --------------------------------------------

@pytest.fixture(scope="module")
def default_reference(default_source):
    from testkit.reference import full_model

    return full_model(default_source)


CHATS = [
    "What is the capital of France?",
    "Hi",
    "Summarize in one sentence: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 8),
    "Translate to French, sentence by sentence: " + " ".join(
        f"Sentence number {i} is about the color {c}." for i, c in enumerate(
            ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"] * 2)),
]


async def test_default_model_matches_transformers(pipeline, default_reference):
    """Different-length prompts (two longer than a prefill chunk) batched concurrently."""
    max_new = 16
    prompts = [pipeline.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]
    assert len({len(p) for p in prompts}) == len(prompts)
    # "auto" (the default) sizes chunks by the measured link: the cap (64) over an idle
    # loopback, less when the machine was busy as it measured (CI once read 16 beside the
    # chaos test); the cap on a fast link is tests/core/test_prompt_chunk.py's to check
    from engine.core.prompt_chunk import CAP, FLOOR

    chunk = pipeline.prompt_chunk_tokens()
    assert pipeline.sched.prefill_chunk == "auto" and FLOOR <= chunk <= CAP
    assert max(len(p) for p in prompts) > 2 * chunk
    handles = [pipeline.submit(p, greedy(max_new)) for p in prompts]
    results = await asyncio.gather(*(collect(h) for h in handles))
    for prompt, (toks, text, done) in zip(prompts, results):
        want = await reference_generate(default_reference, prompt, max_new, pipeline.eos_ids)
        assert done.error is None and done.finish_reason in ("stop", "length")
        assert toks == want, f"prompt of {len(prompt)} tokens: pipeline {toks} != generate {want}"
        assert done.completion_tokens == len(toks)
        assert text == pipeline.tokenizer.decode(toks, skip_special_tokens=True)
    assert "Paris" in results[0][1]
    await wait_freed(pipeline)


async def test_stages_sharing_cores_match_transformers(default_reference):
    """Stage processes leasing this CPU's cores (no --threads): same tokens, alone and batched.

    3 stages on 2 cores: the head and stage 2 take turns on one core and layers are split
    by CPU share; the stages are one compute resource (each borrows every idle core), so
    the head keeps one micro-batch.
    """
    from conftest import pipeline_config
    from engine.pipeline.launch import launch

    pipe = await launch(pipeline_config(threads=None))
    head = pipe.head
    try:
        assert head.cores is not None
        n = os.cpu_count() or 1
        assert head.micro_batches == 1 and not head.dynamic_micro_batches
        # links between processes sharing this CPU carry no acks (see Head.acks)
        assert head.acks is False and head.link.acked is False
        max_new = 8
        prompts = [head.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]
        toks, _, done = await collect(head.submit(prompts[3], greedy(max_new)))  # alone
        assert done.error is None
        assert toks == await reference_generate(default_reference, prompts[3], max_new, head.eos_ids)
        if n >= 2:
            # a lone prompt ran on more than its own core, unless other programs held the rest
            # (under xdist, the other worker's processes are other programs)
            assert head.cores.borrowed_steps > 0 or head.cores.usable < 2, head.cores.usable
        await head.drop_kept()   # the longest prompt computed again in the batch, not taken over
        results = await asyncio.gather(*(collect(head.submit(p, greedy(max_new))) for p in prompts))
        for prompt, (toks, _, done) in zip(prompts, results):
            assert done.error is None
            assert toks == await reference_generate(default_reference, prompt, max_new, head.eos_ids)
        # no ack came back (an unexpected one fails the link), so nothing was measured
        assert head.link.sched.link.samples == 0 and not head.link.failed and head.link.in_flight == 0
        await wait_freed(head)
    finally:
        await pipe.close()


async def test_newcomer_gets_its_own_micro_batch_when_all_are_decoding(pipeline, default_reference):
    """With every micro-batch decoding, a new request opens one more (up to 2M) instead of
    holding a decoding batch's next token behind its prompt; it leaves when done."""
    if not pipeline.dynamic_micro_batches:
        pytest.skip("a fixed micro-batch count keeps newcomers in decoding batches")
    prompts = [pipeline.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]
    m = len(pipeline.groups)
    first = [pipeline.submit(pipeline.chat_prompt(STORY), greedy(60)) for _ in range(m)]
    deadline = time.monotonic() + 60
    while not all(h.seq.generated for h in first):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert all(g.seqs for g in pipeline.groups[:m])
    late = pipeline.submit(prompts[3], greedy(12))
    while not late.seq.opened:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    holder = [g for g in pipeline.groups if late.seq in g.seqs]
    assert holder and holder[0].id >= m and len(holder[0].seqs) == 1  # a micro-batch of its own
    toks, _, done = await collect(late)
    assert done.error is None
    assert toks == await reference_generate(default_reference, prompts[3], 12, pipeline.eos_ids)
    for h in first:
        assert (await collect(h))[2].error is None
    await wait_freed(pipeline)
    pipeline._kick()
    assert len(pipeline.groups) <= max(m, pipeline.micro_batches)  # the extra one left


TINY_PROMPT_LENS = (5, 17, 70, 150)  # the longer ones stream in several prefill chunks


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
async def test_tiny_arch_matches_transformers(arch, tiny_folder, spare_stages):
    folder, model = tiny_folder(arch)
    head = await start_head(resolve(str(folder)), spare_stages)
    try:
        head.eos_ids = set()  # random weights: run every request to its full length
        assert len(head.ranges) == 3
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in TINY_PROMPT_LENS]
        max_new = 12
        results = await asyncio.gather(*(collect(head.submit(p, greedy(max_new))) for p in prompts))
        for prompt, (toks, _, done) in zip(prompts, results):
            assert done.finish_reason == "length" and done.completion_tokens == max_new
            want = await reference_generate(model, prompt, max_new, set())
            assert toks == want, f"{arch}, prompt of {len(prompt)}: pipeline {toks} != generate {want}"
        await wait_freed(head)
    finally:
        await head.close()


# ---- cancellation ---------------------------------------------------------------------

STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


async def test_cancel_frees_kv_everywhere(pipeline):
    prompt = pipeline.chat_prompt(STORY)
    h = pipeline.submit(prompt, greedy(200))
    seen = 0
    async for ev in h:
        assert isinstance(ev, Delta), ev
        seen += 1
        if seen == 3:
            break
    stats = await pipeline.stage_stats()
    assert all(s["seqs"] == 1 for s in stats), stats
    h.cancel()
    toks, _, done = await collect(h)
    assert done.finish_reason == "cancelled"
    assert 3 <= done.completion_tokens < 200
    await wait_freed(pipeline)
    assert pipeline.reserved == 0


async def test_cancel_at_any_moment(pipeline):
    """Cancelled before its first step, while prefilling in chunks, or while waiting."""
    long_prompt = pipeline.chat_prompt(
        [{"role": "user", "content": " ".join(["Tell me about the history of bread."] * 40)}])
    short = pipeline.chat_prompt(STORY)
    h_now = pipeline.submit(short, greedy(50))
    h_now.cancel()  # same tick as submit: before its micro-batch launched
    h_prefill = pipeline.submit(long_prompt, greedy(50))
    h_keep = pipeline.submit(short, greedy(8))
    await asyncio.sleep(0.05)
    h_prefill.cancel()
    for h in (h_now, h_prefill):
        _, _, done = await collect(h)
        assert done.finish_reason == "cancelled"
    toks, _, done = await collect(h_keep)
    assert done.finish_reason == "length" and len(toks) == 8
    await wait_freed(pipeline)
    assert pipeline.reserved == 0 and not pipeline.waiting


async def test_api_stream_closed_early_frees_kv(pipeline, api_url):
    body = {"model": "default", "messages": STORY, "max_tokens": 200, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(api_url + "/chat/completions", json=body)
        assert r.status == 200
        chunks = 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if chunks == 4:
                    break
        r.close()  # drop the connection mid-stream
    await asyncio.sleep(0.2)
    await wait_freed(pipeline)
    assert pipeline.reserved == 0


async def test_api_client_gone_non_streaming_frees_kv(pipeline, api_url):
    body = {"model": "default", "messages": STORY, "max_tokens": 300, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.5)) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(api_url + "/chat/completions", json=body) as r:
                await r.read()
    await wait_freed(pipeline)
    assert pipeline.reserved == 0


# ---- admission control ----------------------------------------------------------------

async def test_admission_waits_for_kv_budget(tiny_folder, spare_stages):
    folder, _ = tiny_folder("llama")
    budget = 200
    head = await start_head(resolve(str(folder)), spare_stages, kv_budget_tokens=budget)
    runner = None
    try:
        head.eos_ids = set()
        assert head.capacity == budget
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, 256, (30,), generator=g).tolist() for _ in range(4)]
        handles = [head.submit(p, greedy(120)) for p in prompts]  # 150 tokens each: one fits at a time
        peak = {"waiting": head.info()["waiting"], "reserved": head.reserved}

        async def watch():
            while True:
                info = head.info()
                peak["waiting"] = max(peak["waiting"], info["waiting"])
                peak["reserved"] = max(peak["reserved"], info["kv_reserved_tokens"])
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(collect(h) for h in handles))
        watcher.cancel()
        for toks, _, done in results:
            assert done.error is None and done.finish_reason == "length" and len(toks) == 120
        assert peak["waiting"] >= 3
        assert peak["reserved"] <= budget
        assert head.reserved == 0
        await wait_freed(head)

        # one request that could never fit is refused up front, not queued forever
        with pytest.raises(ValueError, match="KV cache"):
            head.submit(prompts[0], greedy(180))
        assert not head.waiting

        # a waiting request can be cancelled
        first = head.submit(prompts[0], greedy(120))
        second = head.submit(prompts[1], greedy(120))
        await asyncio.sleep(0.05)  # submissions start on the loop's next turn
        assert head.info()["waiting"] == 1
        second.cancel()
        assert (await collect(second))[2].finish_reason == "cancelled"
        assert (await collect(first))[2].finish_reason == "length"

        # and the API says 400
        from engine.pipeline.api import serve_api

        port = free_port()
        runner = await serve_api(head, "127.0.0.1", port)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": prompts[0], "max_tokens": 180}) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert "KV cache" in err["message"] and err["type"] == "invalid_request_error"
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": prompts[0], "max_tokens": 5, "temperature": 0}) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 5
        await wait_freed(head)
    finally:
        if runner is not None:
            await runner.cleanup()
        await head.close()


# ---- bad peers ------------------------------------------------------------------------

def hello(role="data", version=PROTOCOL_VERSION, pipeline="local", key=None):
    """A hello answering the stage's challenge: a function of its nonce. key: the key its
    handshake proves (the route token for data, the secret for control; "" is a loopback
    stage's own); None sends an empty auth."""
    def answer(nonce: str) -> str:
        return json.dumps({"type": "hello", "role": role, "version": version, "pipeline": pipeline,
                           "auth": HelloOpener(key, role, pipeline, nonce).auth if key is not None else ""})
    return answer


def assert_policy_close(exc: ConnectionClosed) -> str:
    assert exc.rcvd is not None, "closed without a close frame"
    assert exc.rcvd.code == 1008, (exc.rcvd.code, exc.rcvd.reason)
    assert exc.rcvd.reason
    return exc.rcvd.reason


async def expect_policy_close(address: str, *messages, timeout: float = 10.0) -> str:
    """Send messages (a callable gets the challenge's nonce); the stage must close this
    connection with 1008 and a reason."""
    async with connect(address) as ws:
        try:
            challenge = frames.parse_control(await asyncio.wait_for(ws.recv(), timeout))
            assert challenge["type"] == "challenge" and set(challenge) == {"type", "nonce"}
            for m in messages:
                await ws.send(m(challenge["nonce"]) if callable(m) else m)
            while True:
                await asyncio.wait_for(ws.recv(), timeout)
        except ConnectionClosed as exc:
            return assert_policy_close(exc)
    raise AssertionError("unreachable")


async def expect_sealed_close(address: str, key: str, message, timeout: float = 10.0) -> str:
    """A data link that proves `key`, then sends `message` sealed, as a stage would: the
    stage must open it, refuse it and close this connection with 1008 and a reason."""
    ws = await connect_stage(address, "data", "local", key=key, timeout=timeout)
    try:
        await ws.send(message)
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as exc:
        return assert_policy_close(exc)
    finally:
        await ws.close()


async def test_bad_frames_close_only_that_connection(pipeline):
    before = await pipeline.stage_stats()
    hidden = pipeline.config.hidden_size
    good = frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[10**6, 0, 2]]}, torch.zeros(2, hidden))
    bad_frames = {
        "garbage": b"\x00garbage bytes, not a frame",
        "bad magic": b"XXXX" + good[4:],
        "truncated": good[:-5],
        "wrong hidden size": frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[10**6, 0, 2]]},
                                         torch.zeros(2, hidden + 1)),
        "wrong dtype": frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[10**6, 0, 2]]},
                                   torch.zeros(2, hidden, dtype=torch.float16)),
        "rows disagree with tensor": frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[10**6, 0, 3]]},
                                                 torch.zeros(2, hidden)),
        "token frame": frames.encode(frames.FrameType.TOKENS, 0, 1, {"tokens": [[1, 2]]}),
        "text frame": "not binary",
    }
    n_bad = 0
    for r in pipeline.remotes:
        for name, frame in bad_frames.items():
            reason = await expect_sealed_close(r.address, pipeline.route, frame)
            n_bad += 1
            if name == "wrong hidden size":
                assert "hidden size" in reason
        for bad_hello in (hello(pipeline="someone-else", key=pipeline.route), hello(version=99, key=pipeline.route),
                          hello(role="admin"), b"binary hello", "not json", json.dumps({"type": "hello", "role": "data"}),
                          hello(), hello(key="not the route token"), hello(key=""),
                          hello(role="control", key="")):   # (its parent gave it a secret)
            await expect_policy_close(r.address, bad_hello)
        # a second head is turned away while ours holds the stage
        reason = await expect_policy_close(r.address, hello(role="control", key=pipeline._secrets[r.address]))
        assert "already" in reason

    after = await pipeline.stage_stats()
    for b, a in zip(before[1:], after[1:]):
        assert a["rejected"] >= b["rejected"] + len(bad_frames) + 9
    assert pipeline.error is None
    _, text, done = await collect(pipeline.submit(
        pipeline.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]), greedy(24)))
    assert "Paris" in text and done.finish_reason == "stop"
    await wait_freed(pipeline)


@pytest.fixture
async def inproc_stage():
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    try:
        yield server, f"ws://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_silent_connection_times_out(inproc_stage, monkeypatch):
    import engine.pipeline.stage_server as ss

    monkeypatch.setattr(ss, "HELLO_TIMEOUT", 0.5)
    server, addr = inproc_stage
    t0 = time.monotonic()
    reason = await expect_policy_close(addr, timeout=5)
    assert time.monotonic() - t0 < 4
    assert "hello" in reason
    assert server.rejected_frames == 1


async def test_a_step_that_fails_unexpectedly_ends_its_replies_and_the_stage_serves_on(inproc_stage, tiny_folder):
    """An exception nothing checked for (here an IndexError from the last stage's draw)
    ends that step's replies with the reason; the stage's lane goes on serving. Before,
    the lane's task died with it and every later reply through the stage hung."""
    server, addr = inproc_stage
    folder, _ = tiny_folder("llama", seed=0)
    head = await start_head(resolve(str(folder)), [addr])
    head.eos_ids = set()
    try:
        real, doomed = server.sampler.step, []

        def step(seq_ids, *args, **kw):
            if any(s in doomed for s in seq_ids):
                raise IndexError("index 70000 is out of bounds for dimension 1 with size 256")
            return real(seq_ids, *args, **kw)

        server.sampler.step = step
        bad = head.submit(list(range(5, 15)), greedy(6))
        doomed.append(bad.seq.id)
        _, _, done = await asyncio.wait_for(collect(bad), 60)
        assert done.finish_reason == "error" and "out of bounds" in done.error
        toks, _, done = await asyncio.wait_for(collect(head.submit(list(range(5, 15)), greedy(6))), 60)
        assert done.error is None and len(toks) == 6
        await wait_freed(head)
    finally:
        await head.close()


async def test_a_leaving_stage_hands_its_layers_over_before_it_goes(inproc_stage, tiny_folder):
    """The owner takes a stage back ("leaving"): the head moves its layers (here: to the
    head alone) and lets it go within the deadline; the reply in flight goes on, token for
    token what it would have been, and the head says who left and why."""
    server, addr = inproc_stage
    folder, _ = tiny_folder("llama", seed=0)
    head = await start_head(resolve(str(folder)), [addr])
    head.eos_ids = set()
    try:
        a = head.submit(list(range(5, 15)), greedy(30))
        deadline = time.monotonic() + 30
        while not a.seq.generated:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        assert await server.leave("GPU too hot (85 C)", seconds=20)  # the head let go by itself
        released = time.monotonic() - t0
        assert not server.connected
        toks_a, _, done_a = await asyncio.wait_for(collect(a), 60)
        assert done_a.error is None and len(toks_a) == 30
        assert head.error is None and head.n_stages == 1
        left = [e for e in head.info()["events"] if e["event"] == "left"]
        assert left and "GPU too hot" in left[0]["why"] and "leaving" in left[0]["why"]
        assert head.info()["events"][-1]["event"] == "recovered"
        # a leaving stage takes no head meanwhile
        ws = await connect_stage(addr, "control", "local")
        async with ws:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd.code == 1013 and "leaving" in closed.value.rcvd.reason
        again, _, _ = await collect(head.submit(list(range(5, 15)), greedy(30)))
        assert toks_a == again
        assert released < 20
    finally:
        await head.close()


async def test_a_leaving_stage_goes_on_time_even_if_its_head_holds_on(inproc_stage):
    """A head that ignores "leaving" (an old one, or one across homes that cannot move the
    layers) does not keep the owner's machine: leave() gives up at its deadline."""
    server, addr = inproc_stage
    async with await connect_stage(addr, "control", "local") as ws:
        assert frames.parse_control(await ws.recv())["type"] == "welcome"
        t0 = time.monotonic()
        assert not await server.leave("game started", seconds=1.0)
        assert 0.9 <= time.monotonic() - t0 < 5
        msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 5))
        assert msg == {"type": "leaving", "reason": "game started", "seconds": 1.0}


async def test_stage_with_another_model_is_refused(inproc_stage, tiny_folder, spare_stages):
    server, addr = inproc_stage
    folder_a, _ = tiny_folder("llama", seed=0)
    folder_b, model_b = tiny_folder("llama", seed=1)
    fp_a, fp_b = resolve(str(folder_a)).fingerprint(), resolve(str(folder_b)).fingerprint()
    assert fp_a != fp_b

    # raw: a configure whose fingerprint is not the stage's copy -> an error message
    async with await connect_stage(addr, "control", "local") as ws:
        assert frames.parse_control(await ws.recv())["type"] == "welcome"
        configure = dict(model=str(folder_b), start=3, end=6, next=None, dtype="float32",
                         kv_budget_tokens=None, threads=None, link=None, compress=None, compute=None,
                         acks=True, weights="bf16", profile=None, route="r" * 32)
        await ws.send(frames.control("configure", fingerprint=fp_a, **configure))
        msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
        assert msg["type"] == "error" and "fingerprint" in msg["message"], msg
        assert server.stage is None
        # the stage is unharmed: the right fingerprint configures it on the same connection
        await ws.send(frames.control("configure", fingerprint=fp_b, **configure))
        msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
        while msg["type"] == "progress":
            msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
        assert msg["type"] == "configured" and msg["fingerprint"] == fp_b, msg

    # a head whose weights (folder A) differ from what its stage processes load under
    # the same name (folder B): refused at setup with the reason, not a crash
    src = resolve(str(folder_b))
    mixed = ModelSource(spec=src.spec, name=src.name, root=folder_a)
    with pytest.raises(PipelineError, match="fingerprint"):
        await start_head(mixed, spare_stages)

    # ...and those stages then serve a head with the right model
    head = await start_head(src, spare_stages)
    try:
        head.eos_ids = set()
        prompt = list(range(10, 30))
        toks, _, done = await collect(head.submit(prompt, greedy(6)))
        assert toks == await reference_generate(model_b, prompt, 6, set())
    finally:
        await head.close()


async def test_bad_layer_ranges_fail_before_anything_loads(default_source):
    n = default_source.config().num_hidden_layers
    nowhere = ["ws://127.0.0.1:9"]  # never contacted: ranges are checked first
    cases = {
        "gap": [(0, 10), (12, n)],
        "overlap": [(0, 12), (10, n)],
        "layers": [(0, 10), (10, n + 1)],
        "2 stages": [(0, n)],
        "end at": [(0, 10), (10, n - 1)],
    }
    for word, layers in cases.items():
        head = Head(default_source, nowhere, layers=layers)
        with pytest.raises(ModelError, match=word):
            await head.start()
        assert head.stage0 is None
        await head.close()
    with pytest.raises(ModelError, match="gap"):
        parse_layers("0:10,12:30", n)


async def test_cli_bad_layers_exit_code():
    run = uuid.uuid4().hex
    r = await asyncio.to_thread(cli, "chat", "--layers", "0:10,12:30", "--prompt", "hi", run=run)
    assert r.returncode == 2, r.stderr
    assert "gap" in r.stderr
    assert "Traceback" not in r.stderr
    assert stage_pids(run) == set()


@pytest.mark.parametrize("stages", [None, 2])
async def test_cli_chat_smoke(stages):
    # no --stages, as a user starts it: one process (engine/core/local_stages.py); and the
    # head with a stage process, which the CLI must not leave behind
    run = uuid.uuid4().hex
    more = ("--stages", str(stages)) if stages else ()
    r = await asyncio.to_thread(cli, "chat", "--prompt", "What is the capital of France?",
                                "--max-tokens", "20", "--temperature", "0", *more, run=run)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    n = stages or 1
    said = f"{n} stage" + ("s" if n != 1 else "")     # "1 stage", "3 stages": not "stage(s)"
    assert f"on {said}..." in r.stderr and f", {said} — " in r.stderr and "(s)" not in r.stderr, r.stderr
    assert ("head (this process): layers 1–30 of 30" in r.stderr) == (n == 1), r.stderr
    deadline = time.monotonic() + 5
    while stage_pids(run) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert stage_pids(run) == set(), "the CLI left stage processes behind"


async def test_stage_process_dies(tiny_folder):
    """A stage that dies mid-reply: the head takes its layers and the reply goes on,
    token for token what it would have been; new requests are served too."""
    from engine.pipeline.api import serve_api
    from engine.pipeline.local import LocalStages

    folder, _ = tiny_folder("llama")
    local = LocalStages(1, threads=THREADS)
    addrs = await local.start()
    head = runner = None
    try:
        head = await start_head(resolve(str(folder)), addrs)
        head.eos_ids = set()
        reference, _, _ = await collect(head.submit(list(range(5, 25)), greedy(60)))
        h = head.submit(list(range(5, 25)), greedy(60))
        seen = 0
        async for ev in h:
            seen += len(ev.token_ids)
            if seen >= 10:
                break  # it is generating
        local.procs[0].kill()
        rest, _, done = await asyncio.wait_for(collect(h), 60)
        assert done.error is None and reference[:seen] + rest == reference
        assert head.error is None and head.n_stages == 1
        assert [e["event"] for e in head.events] == ["left", "recovered"]
        port = free_port()
        runner = await serve_api(head, "127.0.0.1", port)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": [5, 6, 7], "max_tokens": 3}) as r:
                assert r.status == 200
    finally:
        if runner is not None:
            await runner.cleanup()
        if head is not None:
            await head.close()
        await local.stop()


# ---- decode steps cutting into prompt steps (Head(compute="decode-first")) --------------

async def test_decode_first_compute_cuts_in_and_keeps_every_token(default_source, spare_stages):
    """A request decodes while a 400-token prompt is computed in one step on every stage:
    with compute="decode-first" its decode steps cut into that prompt step (counted on
    the head and the stages), and both requests' tokens equal an in-order run's."""
    g = torch.Generator().manual_seed(11)
    short = torch.randint(200, 40000, (20,), generator=g).tolist()
    long = torch.randint(200, 40000, (400,), generator=g).tolist()

    async def run(compute):
        head = await start_head(default_source, spare_stages, compute=compute, prefill_chunk=None)
        try:
            head.eos_ids = set()
            task = asyncio.ensure_future(collect(head.submit(short, greedy(40))))
            while head.seqs and not any(s.generated for s in head.seqs.values()):
                await asyncio.sleep(0.01)
            results = await asyncio.gather(task, collect(head.submit(long, greedy(4))))
            stats = await head.stage_stats()
            cut_ins = sum(s["cut_ins"] for s in stats)
            await wait_freed(head)
            return [r[0] for r in results], cut_ins
        finally:
            await head.close()

    in_order, none = await run("in-order")
    decode_first, cut_ins = await run("decode-first")
    assert none == 0
    assert cut_ins > 0, "no decode step cut into the 400-token prompt step"
    assert decode_first == in_order
    assert len(in_order[0]) == 40 and len(in_order[1]) == 4


async def test_profiles_follow_the_steps_in_service(inproc_stage, tiny_folder, monkeypatch):
    """A stage times its steps and tells the head when its profile moved; the head's own
    stage refreshes too. Both start from a profile 1000x too slow (as if the machine had
    been busy at startup): after one request the head decides from what the steps took."""
    import engine.pipeline.stage_server as ss
    from engine.core.profile import StepLog

    monkeypatch.setattr(ss, "PROFILE_REPORT_S", 0.0)
    server, addr = inproc_stage
    folder, _ = tiny_folder("llama", seed=0)
    # one timed decode step per token: speculation would carry several tokens in some steps
    # (timed as decode steps of that many rows: test_speculative.py), fewer steps than tokens
    head = await start_head(resolve(str(folder)), [addr], speculate="off")
    head.eos_ids = set()
    try:
        def slow(p):
            return {k: [[n, s * 1000] for n, s in v] for k, v in p.items()}

        remote, local = slow(server.profile), slow(head.profiles[0])
        server.stage.step_log, server.profile, head.profiles[1] = StepLog(remote), remote, remote
        head.stage0.step_log, head.profiles[0] = StepLog(local), local
        toks, _, done = await collect(head.submit(list(range(5, 25)), greedy(40)))
        assert done.error is None and len(toks) == 40
        deadline = time.monotonic() + 10
        while head.profiles[1] == remote and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        head.refresh_own_profile()
        for p, slow_p, log in ((head.profiles[1], remote, server.stage.step_log),
                               (head.profiles[0], local, head.stage0.step_log)):
            assert log.steps >= 39     # every decode step was timed
            one_row = p["decode"][0]
            assert one_row[0] == 1 and one_row[1] < slow_p["decode"][0][1] / 50
            assert one_row[1] == pytest.approx(sorted(log._exact[1])[len(log._exact[1]) // 2], rel=0.5)
        assert head.profiles[1] == server.profile   # what the stage last reported
    finally:
        await head.close()


async def test_status_says_where_each_stage_computes(pipeline):
    """--device auto: on this machine (no GPU) the head and every stage compute on the CPU,
    in float32; the status says so per stage (the stages say it in their welcome)."""
    info = pipeline.info()
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert [s["device"] for s in info["stages"]] == [want] * 3
    assert all(s["device_name"] for s in info["stages"])
    assert info["dtype"] == ("float32" if want == "cpu" else pipeline.dtype_name)
    # unquantized weights are named by that dtype, not "bf16" beside float32
    assert info["weights"] == ("full (float32)" if want == "cpu" else precision.full_label(pipeline.dtype_name))


@pytest.mark.parametrize("where", ["last", "middle"])
async def test_out_of_memory_fails_that_request_and_the_stage_serves_the_others(where, inproc_stage, tiny_folder,
                                                                                spare_stages):
    """A step that runs out of (GPU) memory is computed again one sequence at a time: the
    one that still does not fit gets a clear error and is freed everywhere, the one
    batched with it goes on, and the stage serves what comes next. CUDA cannot run here,
    so the stage's forward raises torch.OutOfMemoryError for one sequence's steps."""
    server, addr = inproc_stage
    folder, _ = tiny_folder("llama", seed=0)
    addrs = [addr] if where == "last" else [addr, spare_stages[0]]
    head = await start_head(resolve(str(folder)), addrs, micro_batches=1)
    head.eos_ids = set()
    try:
        real_forward = server.stage.forward
        doomed = []

        def forward(batch, x):
            if any(s in doomed for s in batch.seq_ids):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real_forward(batch, x)

        server.stage.forward = forward
        reference, _, _ = await collect(head.submit(list(range(5, 25)), greedy(12)))
        await head.drop_kept()   # `good` computes its prompt beside the doomed one
        bad = head.submit(list(range(30, 40)), greedy(12))
        doomed.append(bad.seq.id)
        good = head.submit(list(range(5, 25)), greedy(12))
        (_, _, done_bad), (toks, _, done_good) = await asyncio.gather(collect(bad), collect(good))
        assert done_bad.finish_reason == "error" and "out of memory" in done_bad.error
        assert "fewer or shorter requests" in done_bad.error and "Traceback" not in done_bad.error
        assert done_good.error is None and toks == reference   # batched with it, not hurt by it
        assert head.error is None
        after, _, done = await collect(head.submit(list(range(5, 25)), greedy(12)))
        assert done.error is None and after == reference       # the stage still serves
        await wait_freed(head)
    finally:
        await head.close()


async def test_the_owners_memory_cap_bounds_what_a_stage_offers_and_loads(tiny_folder):
    """A stage under its owner's cap (the VRAM cap) tells the head no more free memory than
    the cap, refuses a slice whose weights exceed it with a message, and keeps its KV
    budget within what the cap leaves beside the weights."""
    from engine.core.partition import slice_bytes_estimate
    from engine.model.device import kv_budget_tokens_for, memory_for_kv

    folder, _ = tiny_folder("llama", seed=0)
    src = resolve(str(folder))
    cfg = src.config()
    one = slice_bytes_estimate(cfg, 0, 1, 4)          # the first layer and the embeddings
    cap = int(1.5 * one)
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS, memory_cap=cap).start()
    configure = dict(model=str(folder), fingerprint=src.fingerprint(), next=None, dtype="float32",
                     kv_budget_tokens=None, threads=None, link=None, compress=None, compute=None, acks=True,
                     weights="bf16", profile=None, route="r" * 32)
    try:
        async with await connect_stage(f"ws://127.0.0.1:{server.port}", "control", "local") as ws:
            welcome = frames.parse_control(await ws.recv())
            assert welcome["free_memory"] <= cap and welcome["device"] == "cpu"
            await ws.send(frames.control("configure", start=0, end=3, **configure))
            msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
            assert msg["type"] == "error" and "allows" in msg["message"] and "VRAM cap" in msg["message"], msg
            assert server.stage is None
            await ws.send(frames.control("configure", start=0, end=1, **configure))
            msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
            while msg["type"] == "progress":
                msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 30))
            assert msg["type"] == "configured", msg
            want = kv_budget_tokens_for(cfg, (0, 1), torch.float32, "cpu", memory_for_kv(one, "cpu", cap))
            assert 0 < msg["kv_budget_tokens"] == want == server.stage.kv.budget_tokens
    finally:
        await server.close()
