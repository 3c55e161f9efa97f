"""Friends in other homes come and go: the pipeline rearranges through the tunnels.

In this process, on loopback: a host (Friends: tunnels, invites) and three friends who
joined with the code (join_stage: a stage server reached only through its encrypted
tunnel), a tiny model split over the head and the three. The middle friend leaves
mid-reply, so the first must now reach the third: a new hop through the host. The
reply goes on unchanged; the friend comes back as a member (same key, same address on
the host) and gets a slice again; a fourth friend who joins later is taken in too.
"""

from __future__ import annotations

import asyncio

from engine.core.sampling import SamplingParams
from testkit.streams import tokens, until


async def reply_of(handle):
    toks, done = await tokens(handle)
    assert done.error is None, done
    return toks


async def test_friends_leave_come_back_and_join_through_the_tunnels(tmp_path, tiny_folder, monkeypatch):
    import engine.pipeline.head as head_module
    from engine.node.homes import Friends, join_stage
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.wire.invite import parse

    monkeypatch.setattr(head_module, "WATCH_S", 0.2)
    folder, _ = tiny_folder("llama", seed=0)
    friends = Friends(str(tmp_path / "host"))
    await friends.open(listen="127.0.0.1:0")
    invite = parse(friends.invite(uses=4))
    joined, pipe = [], None
    try:
        for name in "abc":
            joined.append(await join_stage(invite, name=name, config=str(tmp_path / name), threads=1,
                                           device="cpu", accept_models=[str(folder)]))
        peers = await asyncio.wait_for(friends.wait(3), 30)
        # each friend said what its computer gives as it joined (the host shows it)
        assert all(p.about["device"] and p.about["memory"] > 0 for p in peers), [p.about for p in peers]
        cfg = await friends.route(peers, PipelineConfig(model=str(folder), threads=1, device="cpu"))
        pipe = await launch(cfg)
        friends.follow(pipe.head)
        head = pipe.head
        head.eos_ids = set()
        assert head.n_stages == 4
        # each stage's memory: its weights and its cache's room, of what its machine offered
        mems = [st["memory"] for st in head.info()["stages"]]
        assert all(m["weights"] > 0 and m["cache_room"] > 0 and m["offered"] > 0 for m in mems), mems
        prompt = list(range(5, 15))

        def params():
            return SamplingParams(greedy=True, max_tokens=150)

        reference = await reply_of(head.submit(prompt, params()))
        # the middle friend leaves mid-reply: stage 1 must reach stage 3 now
        handle = head.submit(prompt, params())
        await until(lambda: len(handle.seq.generated) >= 10)
        # mid-reply every stage's cache holds memory (the ring shows it beside the weights)
        assert all(st["kv_bytes"] > 0 for st in await head.stage_stats())
        b = joined[1]
        await b.server.close("switched off")
        assert await asyncio.wait_for(reply_of(handle), 120) == reference
        await until(lambda: head.events and head.events[-1]["event"] == "recovered")
        assert head.n_stages == 3 and head.error is None
        assert [r.address for r in head.remotes] == [peers[0].address, peers[2].address]

        # it comes back as a member: the same address on the host, a slice again, even after
        # the head stopped asking for it (asleep overnight: the host forgot it after 10 minutes)
        from engine.core.recovery import REJOIN_GRACE_S

        head.recovery.grace_s = 0.3
        await until(lambda: peers[1].address not in head.recovery.away)
        await asyncio.sleep(0.5)
        head.recovery.grace_s = REJOIN_GRACE_S
        assert not head.recovery.watching
        handle = head.submit(prompt, params())
        await until(lambda: len(handle.seq.generated) >= 10)
        joined[1] = await join_stage(invite, joiner=b.joiner, threads=1, device="cpu", accept_models=[str(folder)])
        assert await asyncio.wait_for(reply_of(handle), 120) == reference
        await until(lambda: head.events[-1]["event"] == "rejoined")
        assert [e["event"] for e in head.events][-2:] == ["back", "rejoined"]
        assert [r.address for r in head.remotes] == [p.address for p in peers]

        # a fourth friend joins with the code later: taken in as the last stage
        joined.append(await join_stage(invite, name="d", config=str(tmp_path / "d"), threads=1, device="cpu",
                                       accept_models=[str(folder)]))
        await until(lambda: head.events[-1]["event"] == "rejoined" and head.n_stages == 5, timeout=60)
        assert [e["event"] for e in head.events][-2:] == ["joined", "rejoined"]
        assert await reply_of(head.submit(prompt, params())) == reference
    finally:
        if pipe is not None:
            await pipe.close()
        for j in joined:
            await j.close()
        await friends.close()
