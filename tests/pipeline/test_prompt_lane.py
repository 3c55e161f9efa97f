"""A long prompt is computed a piece at a time between the decode steps (engine/core/
prompt_chunk.py lane_chunk_tokens, Head._prompt_lane), on the default model: in one
process, as a GPU host (or `--stages 1`) serves, and as `potluck serve` starts on a CPU
(its stages sharing the machine's cores, the pieces sent on as prompt chunks).

Before, a 4,000-token prompt on a CPU held every other reply for its whole step (a
3-token request sent beside it waited 15 s: bench/prompt_lane.py) and could not be given
up on.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.core.sampling import SamplingParams
from engine.pipeline.launch import PipelineConfig, launch
from testkit.streams import tokens as collect
from testkit.freed import all_freed

LONG = "The history of the world is long, and nobody has read all of it. " * 140   # ~2,100 tokens


@pytest.fixture(scope="module", params=["one stage", "as it starts"])
async def head(request):
    cfg = PipelineConfig(model="default", stages=1, threads=1, device="cpu") if request.param == "one stage" \
        else PipelineConfig(model="default")
    p = await launch(cfg)
    try:
        yield p.head
    finally:
        await p.close()


async def in_lane(head, handle):
    for _ in range(600):
        if head.sched.lane is handle.seq and handle.seq.pos > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the long prompt never went through the prompt lane")


async def test_a_short_request_is_answered_while_a_long_prompt_is_computed(head):
    long_prompt = head.chat_prompt([{"role": "user", "content": LONG + "Summarize this."}])
    short_prompt = head.chat_prompt([{"role": "user", "content": "Count from one to five."}])
    greedy = SamplingParams(greedy=True, max_tokens=6)
    assert len(long_prompt) > 4 * head.sched.lane_chunk if head.sched.lane_chunk else len(long_prompt) > 1024
    long = head.submit(long_prompt, greedy)
    await in_lane(head, long)
    assert head.info()["running"] == 1   # status said nothing ran while a long prompt was computed
    short_toks, short_done = await collect(head.submit(short_prompt, SamplingParams(greedy=True, max_tokens=3)))
    # the short reply went out between the long prompt's pieces: that prompt is not done yet
    assert short_done.finish_reason == "length" and len(short_toks) == 3
    assert not long.seq.opened and long.seq.pos < len(long_prompt)
    laned_toks, laned_done = await collect(long)
    assert laned_done.error is None and laned_done.prompt_tokens == len(long_prompt)
    # the same reply as the prompt computed in one step (its kept reply let go first: the
    # same prompt would take it over and compute one token of it)
    await head.drop_kept()
    hits = head.kept_info()["hits"]
    head.prompt_lane = False
    try:
        whole_toks, _ = await collect(head.submit(long_prompt, greedy))
    finally:
        head.prompt_lane = True
    assert laned_toks == whole_toks and head.kept_info()["hits"] == hits
    await freed(head)


async def test_a_long_prompt_given_up_on_stops_at_its_next_piece(head):
    long_prompt = head.chat_prompt([{"role": "user", "content": LONG + "Summarize it again."}])
    long = head.submit(long_prompt, SamplingParams(greedy=True, max_tokens=6))
    await in_lane(head, long)
    long.cancel()
    _, done = await asyncio.wait_for(collect(long), 60)
    assert done.finish_reason == "cancelled" and long.seq.pos < len(long_prompt)
    assert head.sched.lane is None and head.sched.reserved == 0
    await freed(head)
    # and the head serves on
    toks, done = await collect(head.submit(head.chat_prompt([{"role": "user", "content": "Hi"}]),
                                           SamplingParams(greedy=True, max_tokens=3)))
    assert len(toks) == 3 and done.finish_reason == "length"


async def freed(head):
    """Every stage let the sequences go (a piece that came late would cache one again)."""
    await all_freed(head, 10)
