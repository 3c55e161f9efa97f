"""Spare layers: a stage lost without notice costs no loading.

Once the pipeline has formed and is idle, every machine loads beside its slice the layers
any single loss would give it (engine/core/spares.py, engine/pipeline/spare_layers.py);
the stage lost, the rearrangement takes the split made for that loss and reads nothing.
Real stage servers (in this process) on a tiny random-weight model, a real head; the
same through `potluck serve`'s processes killed with SIGKILL is test_failover.py's.
"""

from __future__ import annotations

import asyncio

from engine.core.sampling import SamplingParams
from engine.core.spares import spare_ranges
from engine.pipeline.stage_server import StageServer
from testkit.streams import tiny_head, tokens, until

N_LAYERS = 6   # the tiny model's (conftest tiny_folder)


def ask(head, n=120):
    return head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=n))


def events(head) -> list[str]:
    return [e["event"] for e in head.info()["events"]]


async def three(tiny_folder, **kw):
    from engine.model.sources import resolve

    folder, _ = tiny_folder("llama", seed=0)
    a = await StageServer("127.0.0.1", 0, threads=1).start()
    b = await StageServer("127.0.0.1", 0, threads=1).start()
    head = await tiny_head(resolve(str(folder)), [f"ws://127.0.0.1:{a.port}", f"ws://127.0.0.1:{b.port}"],
                           layers=[(0, 2), (2, 4), (4, 6)], **kw)
    return head, a, b


async def test_a_stage_lost_without_notice_costs_no_loading(tiny_folder):
    head, a, b = await three(tiny_folder)
    try:
        reference, _ = await tokens(ask(head))
        await until(lambda: head.spare_layers > 0, timeout=60)
        # each machine holds, beside its slice, every layer either loss would give it
        plans = head._spares.plans
        lose_a = plans[f"ws://127.0.0.1:{a.port}"][1][2]
        lose_b = plans[f"ws://127.0.0.1:{b.port}"][1][2]
        hulls = spare_ranges(head.ranges, {1: lose_a, 2: lose_b})
        held = [head._extra0, a._extra, b._extra]
        for (s, e), (lo, hi), extra in zip(head.ranges, hulls, held):
            assert sorted(extra.layers if extra else []) == [i for i in range(lo, hi) if not s <= i < e]
        assert head.spare_layers == sum(len(x) for x in held if x) > 0
        assert head.info()["spare_layers"] == head.spare_layers
        handle = ask(head)
        await until(lambda: len(handle.seq.generated) >= 10, every=0.001)
        await a.close("pulled the plug", wait_s=10)     # no "leaving": a loss like a crash
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: events(head)[-1:] == ["recovered"], timeout=60)
        assert done.error is None and toks == reference
        recovered = head.info()["events"][-1]
        # the split made for this loss, every layer already where it is needed: none read
        assert head.ranges == lose_a and recovered["kept_layers"] == N_LAYERS, recovered
        assert b.stage.kept_layers == lose_a[1][1] - lose_a[1][0] and b._extra is None and head._extra0 is None
        # and for the next loss, spares again: the head alone would hold all six
        await until(lambda: head.spare_layers > 0, timeout=60)
        assert sorted(head._extra0.layers) == list(range(head.ranges[0][1], N_LAYERS))
        await b.close("pulled the plug", wait_s=10)
        await until(lambda: events(head)[-1:] == ["recovered"] and head.n_stages == 1, timeout=60)
        assert head.info()["events"][-1]["kept_layers"] == N_LAYERS
        assert (await tokens(ask(head)))[0] == reference
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_without_spares_a_loss_reads_its_layers(tiny_folder, monkeypatch):
    """POTLUCK_SPARES=0 (bench/failover.py's side by side): the survivors read the lost
    stage's layers during the rearrangement, as before, and the reply is the same."""
    monkeypatch.setenv("POTLUCK_SPARES", "0")
    head, a, b = await three(tiny_folder)
    try:
        reference, _ = await tokens(ask(head))
        await asyncio.sleep(1.0)
        assert head.spare_layers == 0 and a._extra is None and b._extra is None
        handle = ask(head)
        await until(lambda: len(handle.seq.generated) >= 10, every=0.001)
        await a.close("pulled the plug", wait_s=10)
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        await until(lambda: events(head)[-1:] == ["recovered"], timeout=60)
        assert done.error is None and toks == reference
        assert head.info()["events"][-1]["kept_layers"] < N_LAYERS
    finally:
        await head.close()
        await a.close()
        await b.close()


async def test_spares_wait_for_a_quiet_pipeline_and_give_way_to_a_loss(tiny_folder, monkeypatch):
    """A pipeline busy from its start loads no spares while it replies (they would take
    its cores); a loss while they load stops the head planning them, and the stage still
    loading finishes before its next slice is built (what it loads is that slice's)."""
    import engine.pipeline.spare_layers as spare_module

    monkeypatch.setattr(spare_module, "SPARE_WAIT_S", 600.0)
    head, a, b = await three(tiny_folder)
    try:
        reference, _ = await tokens(ask(head, 60))   # (its spares may load once this ends)
        gate = asyncio.Event()
        original = b._prepare

        async def slow(*args):
            await gate.wait()
            return await original(*args)

        head._disarm_spares()
        b._prepare = slow
        handle = ask(head, 60)
        head._arm_spares()
        await until(lambda: len(handle.seq.generated) >= 5, every=0.001)
        assert head._spares is None   # still replying: nothing planned or loaded yet
        toks, done = await asyncio.wait_for(tokens(handle), 120)
        assert done.error is None and toks == reference
        await until(lambda: head._spares is not None, timeout=30)   # quiet now: planned, loading
        await a.close("pulled the plug", wait_s=10)
        await until(lambda: head.recovering is not None, timeout=30)
        assert head._spares is None and head._spares_task is None
        await asyncio.sleep(0.5)
        gate.set()
        await until(lambda: events(head)[-1:] == ["recovered"], timeout=60)
        assert (await tokens(ask(head, 60)))[0] == reference
        await until(lambda: head.spare_layers > 0, timeout=60)   # and planned again for this arrangement
    finally:
        await head.close()
        await a.close()
        await b.close()
