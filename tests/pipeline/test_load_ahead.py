"""A machine taken in loads its share while the pipeline serves.

A friend who joins (or comes back) used to be taken in by a rearrangement that loaded its
layers while every conversation paused. Now it loads them first, while the others go on
(recovery_driver._take_in, the stage's "prepare"), and the rearrangement that follows keeps
them. Real stage servers (in this process) on a tiny random-weight model, a real head.
"""

from __future__ import annotations

import asyncio
import time

from engine.core.sampling import SamplingParams
from engine.pipeline.stage_server import StageServer
from testkit.streams import tiny_head, tokens, until

N_LAYERS = 6   # the tiny model's (conftest tiny_folder)


def last_event(head) -> str | None:
    events = head.info()["events"]
    return events[-1]["event"] if events else None


def ask(head, n=200):
    return head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=n))


def pace(monkeypatch, stage, seconds=0.05):
    """The head's stage steps slowly: a tiny model's reply is surely still going while a
    machine is taken in, however busy this machine is."""
    step = stage.forward

    def paced(*args, **kw):
        time.sleep(seconds)
        return step(*args, **kw)

    monkeypatch.setattr(stage, "forward", paced)


async def found_by_the_watch(head, server: StageServer, ahead: bool):
    """What the head's watch does when `server`, offered, answers (_watch_loop), up to the
    take-in it starts: the test starts it (head._start_take_in) where it wants the race."""
    from engine.pipeline.head import RemoteStage

    r = RemoteStage(head._remember(f"ws://127.0.0.1:{server.port}"))
    head.recovery.offer(r.address, time.monotonic())
    await head._hello(r, attempts=1, timeout=10)
    head.recovery.came(r.address, time.monotonic(), ahead=ahead)
    return r


def held_back(server: StageServer, gate: asyncio.Event, times: int = 1):
    """The server's first `times` loads ahead wait for `gate` (a machine slow to read its layers)."""
    original, calls = server._prepare, []

    async def slow(ws, msg, *rest):
        calls.append(time.monotonic())
        if len(calls) <= times:
            await gate.wait()
        return await original(ws, msg, *rest)

    server._prepare = slow
    return calls


def counting_measures(monkeypatch) -> list:
    """Every profile measured in this process (a stage that measures pauses the pipeline)."""
    import engine.model.measure as measure_module

    calls, original = [], measure_module.measure

    def counted(stage):
        calls.append((stage.start, stage.end))
        return original(stage)

    monkeypatch.setattr(measure_module, "measure", counted)
    return calls


async def test_a_machine_that_joins_mid_reply_loads_its_share_while_the_reply_goes_on(tiny_folder, monkeypatch):
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    head = await tiny_head(resolve(str(folder)), [])
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    gate = asyncio.Event()
    held_back(b, gate)
    try:
        reference, _ = await tokens(ask(head))
        pace(monkeypatch, head.stage0)
        handle = ask(head)
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        measured = counting_measures(monkeypatch)
        head.offer(f"ws://127.0.0.1:{b.port}")
        # "layers 4–6", or "layer 6" where the machines' measured speeds give it one
        await until(lambda: "loading layer" in (head.info()["joining"] or ""), timeout=30)
        assert head.recovering is None
        # the machine is loading: the reply goes on meanwhile
        before = len(handle.seq.generated)
        await until(lambda: len(handle.seq.generated) >= before + 5, timeout=30)
        assert head.info()["joining"] is not None and head.n_stages == 1
        gate.set()
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert done.error is None and toks == reference
        events = head.info()["events"]
        assert [e["event"] for e in events] == ["joined", "rejoined"], events
        rejoined = events[-1]
        # every layer stayed where it was loaded: the head kept its share, the machine the
        # one it loaded ahead; measured once, ahead, not again while everyone waited
        assert head.n_stages == 2 and rejoined["kept_layers"] == N_LAYERS, rejoined
        assert rejoined["ahead_s"] > 0 and measured == [tuple(head.ranges[1])], (rejoined, measured)
        assert head.info()["joining"] is None
        assert (await tokens(ask(head, 30)))[0] == reference[:30]
    finally:
        await head.close()
        await b.close()


async def test_a_stage_whose_share_shifts_loads_its_new_layers_beside_the_ones_it_serves(tiny_folder, monkeypatch):
    """Taking a third machine in shifts the middle stage's share down: it loads the layer it
    lacks while it goes on serving its own, and the rearrangement reads nothing."""
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    # the split is pinned: one measured on a busy machine may already start the middle
    # stage at layer 2 (CI: (2, 6)), and then it would lack nothing once b is in
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}"], layers=[(0, 3), (3, 6)])
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    gate = asyncio.Event()
    calls = held_back(a, gate)
    try:
        reference, _ = await tokens(ask(head))
        assert head.ranges == [(0, 3), (3, 6)], head.ranges
        head.layers_override = [(0, 2), (2, 4), (4, 6)]   # the split once b is in
        pace(monkeypatch, head.stage0)
        handle = ask(head)
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        head.offer(f"ws://127.0.0.1:{b.port}")
        await until(lambda: calls, timeout=30)
        # the middle stage is loading beside the layers it serves: the reply goes on
        before = len(handle.seq.generated)
        await until(lambda: len(handle.seq.generated) >= before + 5, timeout=30)
        assert head.n_stages == 2
        gate.set()
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert done.error is None and toks == reference
        rejoined = head.info()["events"][-1]
        assert head.ranges == [(0, 2), (2, 4), (4, 6)] and rejoined["kept_layers"] == N_LAYERS, rejoined
        assert a.stage.kept_layers == 2 and a._extra is None   # layer 2 loaded ahead, 3 kept
        assert (await tokens(ask(head, 60)))[0] == reference[:60]
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_a_stage_leaving_with_notice_has_its_layers_loaded_by_the_others_while_it_serves(tiny_folder,
                                                                                               monkeypatch):
    """A friend's stage says it is leaving (sharing off, sleep): it goes on serving while
    the stages left load its layers beside theirs, then it is let go, and the rearrangement
    reads nothing."""
    from engine.model.sources import resolve

    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{b.port}"])
    gate = asyncio.Event()
    calls = held_back(a, gate)
    try:
        reference, _ = await tokens(ask(head))
        pace(monkeypatch, head.stage0)
        handle = ask(head)
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        leaving = asyncio.ensure_future(b.leave("switched off by its owner"))
        await until(lambda: calls, timeout=30)
        assert head.info()["leaving"] and head.recovering is None
        before = len(handle.seq.generated)   # the leaving stage serves on meanwhile
        await until(lambda: len(handle.seq.generated) >= before + 5, timeout=30)
        gate.set()
        assert await asyncio.wait_for(leaving, 30)   # let go within its notice
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: last_event(head) == "recovered", timeout=60)
        assert done.error is None and toks == reference
        events = head.info()["events"]
        assert [e["event"] for e in events] == ["leaving", "left", "recovered"], events
        assert head.n_stages == 2 and events[-1]["kept_layers"] == N_LAYERS, events[-1]
        assert head.info()["leaving"] is None
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_a_machine_that_refuses_its_share_is_not_taken_in_and_the_pipeline_goes_on(tiny_folder, monkeypatch):
    """A friend's Potluck that will not load the model (here: a path, which a stage serving
    someone else's head refuses) says so while loading ahead: it is turned away, where
    taking it in would have failed the whole pipeline's rearrangement."""
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    head = await tiny_head(resolve(str(folder)), [])
    b = await StageServer("127.0.0.1", 0, threads=1, trusted_head=False).start()
    try:
        reference, _ = await tokens(ask(head, 30))
        head.offer(f"ws://127.0.0.1:{b.port}")
        await until(lambda: last_event(head) == "refused", timeout=60)
        refused = head.info()["events"][-1]
        assert "model list" in refused["why"] and "ws://" not in refused["why"], refused
        assert head.error is None and head.recovering is None and head.n_stages == 1
        assert not head.recovery.watching and b.stage is None
        assert (await tokens(ask(head, 30)))[0] == reference
    finally:
        await head.close()
        await b.close()


async def test_without_loading_ahead_the_rearrangement_reads_the_share(tiny_folder, monkeypatch):
    """POTLUCK_LOAD_AHEAD=0 (bench/join.py's side-by-side): the machine reads its share
    during the rearrangement, as before, and the reply is the same."""
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    monkeypatch.setenv("POTLUCK_LOAD_AHEAD", "0")
    folder, _ = tiny_folder("llama", seed=0)
    head = await tiny_head(resolve(str(folder)), [])
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    try:
        reference, _ = await tokens(ask(head, 60))
        handle = ask(head, 60)
        head.offer(f"ws://127.0.0.1:{b.port}")
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert done.error is None and toks == reference
        rejoined = head.info()["events"][-1]
        assert rejoined["ahead_s"] is None and rejoined["kept_layers"] == head.ranges[0][1], rejoined
    finally:
        await head.close()
        await b.close()


async def test_a_stage_lost_while_a_machine_loads_ahead_is_dealt_with_first(tiny_folder, monkeypatch, caplog):
    """The head does not wait for the machine loading ahead: it lets it go, rearranges over
    the stages left at once, and takes the machine in later (its layers, loaded once,
    kept)."""
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}"])
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    gate = asyncio.Event()
    calls = held_back(b, gate)
    try:
        reference, _ = await tokens(ask(head, 60))
        handle = ask(head, 60)
        await until(lambda: len(handle.seq.generated) >= 3, every=0.001)
        head.offer(f"ws://127.0.0.1:{b.port}")
        await until(lambda: calls, timeout=30)
        await a.close("switched off", wait_s=10)
        # dealt with while the machine is still loading (its load waits for the gate); the
        # watch may ask it again at once, and its second load waits behind the first
        kinds = lambda: [e["event"] for e in head.info()["events"]]
        await until(lambda: "recovered" in kinds(), timeout=60)
        assert not gate.is_set() and head.n_stages == 1
        assert kinds()[:3] == ["joined", "left", "recovered"] and kinds()[3:] in ([], ["joined"]), kinds()
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        assert done.error is None and toks == reference
        gate.set()   # the machine finishes; the head asks it again and takes it in
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert head.n_stages == 2 and head.remotes[0].address.endswith(f":{b.port}")
        assert len(calls) == 2 and head.info()["events"][-1]["kept_layers"] == N_LAYERS
        assert (await tokens(ask(head, 60)))[0] == reference
        # the load let go told its progress to a closed connection: quietly
        assert "never retrieved" not in caplog.text
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_a_step_scheduled_just_before_a_take_in_begins_is_replayed_not_lost(tiny_folder, caplog):
    """The watch starts a take-in while the pipeline serves, and in the same turn a step is
    scheduled. The take-in's rearrangement lets the old links go before that step's task
    first runs: the step belongs to the arrangement it was scheduled in and stands down
    (it used to read the new one's epoch, find no link, and die with an AttributeError
    nobody retrieved). Here the watch's own calls, in that order, on a real pipeline."""
    from engine.model.sources import resolve

    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}"])
    try:
        reference, _ = await tokens(ask(head, 40))
        r = await found_by_the_watch(head, b, ahead=False)
        handle = ask(head, 40)   # its step is scheduled on the loop's next turn: after this
        head._recovery = head._start_take_in(r, False)
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        assert done.error is None and toks == reference
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert head.n_stages == 3
        assert "never retrieved" not in caplog.text and "AttributeError" not in caplog.text
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_a_take_in_cancelled_before_it_began_lets_its_machine_go(tiny_folder, monkeypatch):
    """The watch finds a machine and starts its take-in; in the same turn a stage is lost,
    and the loss cancels the take-in before it first ran. The machine's control connection
    is closed all the same (left open, it held the machine's one head slot, so the
    watch's next ask waited out the machine's patience with a head gone quiet), and the
    machine is taken in later."""
    from engine.model.sources import resolve

    import engine.pipeline.head as head_module
    monkeypatch.setattr(head_module, "WATCH_S", 0.1)
    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    c = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{c.port}"])
    try:
        reference, _ = await tokens(ask(head, 40))
        r = await found_by_the_watch(head, b, ahead=True)
        head._recovery = head._start_take_in(r, True)
        head._stage_lost(2, "switched off", head.recovery.epoch)   # before the take-in's first step
        await until(lambda: r.ws.close_code is not None, timeout=10)
        await until(lambda: last_event(head) == "rejoined", timeout=60)
        assert head.n_stages == 4 and f":{b.port}" in " ".join(x.address for x in head.remotes)   # c asked back
        assert (await tokens(ask(head, 40)))[0] == reference
    finally:
        await head.close()
        await a.close()
        await b.close()
        await c.close()


def test_a_serving_stage_loads_beside_only_what_fits_and_what_it_lacks(tiny_folder):
    import pytest
    import torch

    from engine.model.sources import ModelError, resolve
    from engine.model.stage import StageModel
    from engine.pipeline.configure_check import check_configure
    from engine.pipeline.load_ahead import build_beside

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    serving = StageModel(source, 0, 3, dtype=torch.float32, device="cpu", kv_budget_tokens=64)
    msg = dict(model=str(folder), start=1, end=5, fingerprint=None, dtype="float32", weights="bf16")
    checked = check_configure(msg, True, (), None)
    extra = build_beside(checked, msg, serving, "cpu", None, None)
    assert sorted(extra.layers) == [3, 4] and not extra.first_parts and not extra.last_parts
    assert build_beside(checked, dict(msg, start=0, end=2), serving, "cpu", None, None) is None   # holds them
    with pytest.raises(ModelError, match="beside the layers it serves"):
        build_beside(checked, msg, serving, "cpu", serving.held_bytes() + 1024, None)
    # spare layers stay: they leave the cache the room its budget promised (here: more
    # than this machine has), where a take-in's, gone at the next configure, may use it
    promising = StageModel(source, 0, 3, dtype=torch.float32, device="cpu", kv_budget_tokens=1 << 40)
    assert sorted(build_beside(checked, msg, promising, "cpu", None, None).layers) == [3, 4]
    with pytest.raises(ModelError, match="beside the layers it serves"):
        build_beside(checked, msg, promising, "cpu", None, None, spare=True)
    assert sorted(build_beside(checked, msg, serving, "cpu", None, None, spare=True).layers) == [3, 4]


async def test_defaults_a_friend_stage_offered_mid_chat_loads_its_share_while_the_chat_goes_on():
    """What users run: `potluck serve --stages 2` as it starts (no --threads: the local
    stages share this CPU's cores) on the default model, and a friend's `potluck stage`
    with its own defaults offered mid-reply. Every layer is kept through the
    rearrangement and the reply is the one asked again."""
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.local import LocalStages

    pipe = await launch(PipelineConfig(model="default", stages=2))
    head = pipe.head
    head.eos_ids = set()
    friend = LocalStages(1)
    try:
        prompt = head.chat_prompt([{"role": "user", "content": "Tell me about the sea."}])
        handle = head.submit(list(prompt), SamplingParams(greedy=True, max_tokens=4000))
        got, joined_at = [], None
        async for ev in handle:
            if not hasattr(ev, "token_ids"):
                assert ev.error is None, ev
                break
            got.extend(ev.token_ids)
            if len(got) >= 10 and not friend.addresses:
                (address,) = await friend.start()
                head.offer(address)
            if joined_at is None and last_event(head) == "rejoined":
                joined_at = len(got)
            if joined_at is not None and len(got) >= joined_at + 20:
                handle.cancel()
        assert joined_at is not None, head.info()["events"]   # taken in during the reply
        rejoined = head.info()["events"][-1]
        assert head.n_stages == 3 and rejoined["kept_layers"] == head.ranges[-1][1], rejoined
        assert rejoined["ahead_s"] > 0
        again, done = await tokens(head.submit(list(prompt), SamplingParams(greedy=True, max_tokens=len(got))))
        assert done.error is None and again == got
    finally:
        await pipe.close()
        await friend.stop()
