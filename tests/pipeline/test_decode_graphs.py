"""A head whose stage replays its decode steps as graphs (issue 42), on the CPU.

A GPU stage with POTLUCK_CUDA_GRAPHS=1 captures its buckets at load, is measured (1 to 16
rows), then serves whatever the scheduler batches: the path on which every graph worker
of bench/gpu.py died on the first H200 run. Here the stage's graphs replay through
testkit/graph_tape.py (the operators of the capture over its memory, no Python), and the
replies of several users at once, greedy and sampled, are the eager stage's.
"""

from __future__ import annotations

import asyncio

from engine.core.sampling import SamplingParams
from testkit.graph_tape import TapeCuda
from testkit.streams import tiny_head, tokens

PROMPTS = [list(range(5, 15)), [7, 3, 9, 9, 40, 41, 42] * 3, [100, 101]]


async def replies(head) -> list[list[int]]:
    asks = [head.submit(p, SamplingParams(greedy=True, max_tokens=24)) for p in PROMPTS]
    asks.append(head.submit(PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=24)))
    done = await asyncio.gather(*(tokens(a) for a in asks))
    assert all(d.error is None for _, d in done), [d.error for _, d in done]
    return [t for t, _ in done]


async def test_a_head_whose_stage_replays_graphs_answers_as_the_eager_one(tiny_folder, monkeypatch):
    import engine.model.stage as stage_module
    from engine.model.sources import resolve
    from engine.model.static_decode import unsupported, use_graphs

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    eager = await tiny_head(source, [])
    try:
        want = await replies(eager)
    finally:
        await eager.close()

    def graphs(stage):             # what decode_path gives a GPU stage
        if unsupported(stage) is None:
            use_graphs(stage, TapeCuda())

    monkeypatch.setattr(stage_module, "decode_path", graphs)
    head = await tiny_head(source, [])
    try:
        assert head.stage0.static is not None
        book = head.stage0.static.book
        measured = book.replays            # the profile at load ran on the graphs
        assert await replies(head) == want
        assert measured > 0 and book.replays > measured and not book.failed, book.summary()
    finally:
        await head.close()


async def test_a_follow_up_taking_its_kept_reply_over_replays_graphs_as_the_eager_head(tiny_folder, monkeypatch):
    """On a GPU a chat's follow-up takes its kept reply over through a stage replaying
    graphs: the rewind in its first frame, its new tokens, then replayed steps. Beside
    the kept reply in slot 0 the second conversation's steps gather from slot 1, and
    speculation's verification steps of whatever k replay graphs of the load too: no
    capture in the middle of a reply."""
    import engine.model.stage as stage_module
    from engine.model.sources import resolve
    from engine.model.static_decode import unsupported, use_graphs

    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    greedy = SamplingParams(greedy=True, max_tokens=12)

    async def conversation(head) -> list[list[int]]:
        first, _ = await tokens(head.submit(PROMPTS[1], greedy))
        other, _ = await tokens(head.submit(PROMPTS[0] * 3, greedy))     # kept beside it
        follow, _ = await tokens(head.submit(PROMPTS[1] + first[:6] + [50, 51, 52], greedy))
        return [first, other, follow]

    eager = await tiny_head(source, [], keep_replies=0)
    try:
        want = await conversation(eager)
    finally:
        await eager.close()

    def graphs(stage):
        if unsupported(stage) is None:
            use_graphs(stage, TapeCuda())

    monkeypatch.setattr(stage_module, "decode_path", graphs)
    head = await tiny_head(source, [])
    try:
        book = head.stage0.static.book
        captured = book.captures
        assert await conversation(head) == want
        assert head.kept_info()["hits"] == 1 and book.captures == captured and not book.failed, \
            (head.kept_info(), book.summary())
    finally:
        await head.close()
