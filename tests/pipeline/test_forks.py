"""n > 1 at the head: a request's choices share one prefill and then decode apart
(core/scheduler.py forks, model/kv.py fork, the last stage's Sampler.step).

Tiny random-weight models, greedy: every choice must read token for token what n=1
reads, whether the head is the only stage, the prompt streams in chunks over real
stage processes, a choice is cancelled while it waits, or its prompt's step fails.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import THREADS
from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta, Done
from engine.pipeline.stage_server import StageServer
from testkit.freed import all_freed
from testkit.tiny_models import start_tiny_head as start_head


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=max_tokens, **kw)


async def collect(handle) -> tuple[list[int], list, Done]:
    toks, lps = [], []
    async for ev in handle:
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
            lps.extend(ev.logprobs or ())
        else:
            return toks, lps, ev
    raise AssertionError("no Done event")


async def wait_freed(head, timeout: float = 10.0):
    await all_freed(head, timeout)


PROMPT = list(range(5, 45))


async def test_a_lone_head_forks_its_choices(tiny_folder):
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, [])
    try:
        alone, _, _ = await collect(head.submit(PROMPT, greedy(12)))
        await head.drop_kept()   # the choices compute their prompt (else they take `alone`'s over)
        results = await asyncio.gather(*(collect(h) for h in head.submit_n(
            PROMPT, greedy(12, logprobs=True, top_logprobs=2), 3)))
        for toks, lps, done in results:
            assert toks == alone and done.finish_reason == "length" and done.prompt_tokens == len(PROMPT)
            assert [lp.token for lp in lps] == toks and all(lp.top[0] == (lp.token, lp.logprob) for lp in lps)
        assert [lp.logprob for lp in results[1][1]] == pytest.approx([lp.logprob for lp in results[0][1]], abs=1e-5)
        await wait_freed(head)
        assert head.reserved == 0
    finally:
        await head.close()


async def test_choices_fork_after_a_chunked_prompt_on_every_stage(tiny_folder, spare_stages):
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, spare_stages, prefill_chunk=8)
    try:
        alone, _, _ = await collect(head.submit(PROMPT, greedy(10)))
        await head.drop_kept()   # the choices' prompt goes in chunks again, not one token of it
        # two requests of 3 and 2 choices at once, beside a plain one
        a = head.submit_n(PROMPT, greedy(10), 3)
        b = head.submit_n(PROMPT[:20], greedy(10), 2)
        c = head.submit(PROMPT[:20], greedy(10))
        res = await asyncio.gather(*(collect(h) for h in a + b + [c]))
        assert [r[0] for r in res[:3]] == [alone] * 3
        assert [r[0] for r in res[3:]] == [res[5][0]] * 3
        await wait_freed(head)
    finally:
        await head.close()


async def test_a_cancelled_choice_leaves_the_others_running(tiny_folder, spare_stages):
    """Cancelled while the request waits for KV room: the first choice's cancellation
    hands the shared prompt to the next, a later choice's just drops it."""
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, spare_stages, kv_budget_tokens=200)
    try:
        alone, _, _ = await collect(head.submit(PROMPT, greedy(10)))
        blocker = head.submit(PROMPT, greedy(100))                # 140 of 200 tokens
        handles = head.submit_n(PROMPT, greedy(10), 4)            # 4 x 50: waits for the blocker
        await asyncio.sleep(0)
        handles[0].cancel()
        handles[2].cancel()
        res = await asyncio.gather(*(collect(h) for h in handles), collect(blocker))
        assert [r[2].finish_reason for r in res[:4]] == ["cancelled", "length", "cancelled", "length"]
        assert res[1][0] == res[3][0] == alone
        await wait_freed(head)
        assert head.reserved == 0
    finally:
        await head.close()


@pytest.fixture
async def inproc_stage():
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    try:
        yield server, f"ws://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_when_the_step_that_forks_fails_every_choice_fails(inproc_stage, tiny_folder):
    """(Whole prompts: a failing prompt chunk could come back before or after the step
    that forks is built, and the choices fail with it or take the prompt over.)"""
    server, addr = inproc_stage
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, [addr], prefill_chunk=None)
    try:
        real = server.stage.forward
        doomed = []

        def forward(batch, x):
            if any(s in doomed for s in batch.seq_ids):
                raise RuntimeError("this step fails")
            return real(batch, x)

        server.stage.forward = forward
        handles = head.submit_n(PROMPT, greedy(8), 3)
        doomed.append(handles[0].seq.id)
        res = await asyncio.gather(*(collect(h) for h in handles))
        assert [r[2].finish_reason for r in res] == ["error"] * 3
        server.stage.forward = real
        toks, _, done = await collect(head.submit(PROMPT, greedy(8)))   # the pipeline goes on
        assert done.finish_reason == "length" and len(toks) == 8
        await wait_freed(head)
    finally:
        await head.close()


async def test_n_is_bounded_and_the_kv_must_hold_every_choice(tiny_folder):
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, [], kv_budget_tokens=100)
    try:
        with pytest.raises(ValueError, match="n must be"):
            head.submit_n(PROMPT, greedy(4), 0)
        with pytest.raises(ValueError, match="n must be"):
            head.submit_n(PROMPT, greedy(4), 17)
        with pytest.raises(ValueError, match="lower max_tokens or n"):
            head.submit_n(PROMPT, greedy(20), 3)          # 3 x 60 > 100
        assert not head.seqs and head.reserved == 0
    finally:
        await head.close()
