"""OpenAI's presence and frequency penalties, end to end: through the OpenAI-compatible
API over the session's real 3-stage pipeline on the default model, against a reference
computed here (the whole model loaded by transformers alone, greedy decoding with
OpenAI's formula applied by this file); each of n choices counting its own tokens; and a
penalized reply surviving the sampling stage dying mid-reply, token for token.

OpenAI's definition: logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty,
c[j] the times token j was generated so far in this choice (the prompt does not count).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import pytest

from conftest import pipeline_config

from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta, Done

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference_model(default_source):
    from testkit.reference import full_model

    return full_model(default_source)


def reference(model, prompt: list[int], eos: set[int], presence: float, frequency: float,
              repetition: float = 1.0, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy decoding of the whole model, each step's logits shaped by hand: HF's
    repetition penalty over prompt and reply, then OpenAI's penalties over the reply."""
    import torch

    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + generated])).logits[0, -1].float().clone()
            if repetition != 1.0:
                for j in set(prompt + generated):
                    v = logits[j]
                    logits[j] = v / repetition if v > 0 else v * repetition
            for j, c in Counter(generated).items():
                logits[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
            t = int(logits.argmax())
            if t in eos:
                break
            generated.append(t)
    return generated


async def _direct_tokens(head, prompt: list[int], params: SamplingParams) -> list[int]:
    toks = []
    async for ev in head.submit(prompt, params):
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
        else:
            assert isinstance(ev, Done) and ev.error is None, ev
    return toks


@pytest.mark.parametrize("presence, frequency, repetition", [
    (0.0, 1.0, None), (1.5, 0.0, None), (0.6, 0.8, None), (-0.5, 0.5, None), (0.8, 0.4, 1.2),
])
async def test_greedy_replies_with_penalties_match_the_reference(client, pipeline, reference_model,
                                                                 presence, frequency, repetition):
    prompt = pipeline.chat_prompt(HAIKU)
    extra = {} if repetition is None else {"extra_body": {"repetition_penalty": repetition}}
    resp = await client.chat.completions.create(model="default", messages=HAIKU, temperature=0,
                                                max_tokens=MAX_TOKENS, presence_penalty=presence,
                                                frequency_penalty=frequency, **extra)
    want = await asyncio.to_thread(reference, reference_model, prompt, pipeline.eos_ids, presence, frequency,
                                   repetition or 1.0)
    assert resp.choices[0].message.content == pipeline.tokenizer.decode(want, skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(want)
    # the head's own tokens (ids, not text) are the reference's
    direct = await _direct_tokens(pipeline, prompt, SamplingParams(
        greedy=True, max_tokens=MAX_TOKENS, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition or 1.0))
    assert direct == want


async def test_penalties_change_the_reply(client, pipeline, reference_model):
    """What the issue saw: 2.0 gave the same text as nothing. Not any more, and 0 is no penalty."""
    kwargs = dict(model="default", messages=HAIKU, temperature=0, max_tokens=MAX_TOKENS)
    plain = (await client.chat.completions.create(**kwargs)).choices[0].message.content
    zero = (await client.chat.completions.create(**kwargs, presence_penalty=0,
                                                 frequency_penalty=0)).choices[0].message.content
    strong = (await client.chat.completions.create(**kwargs, presence_penalty=2.0,
                                                   frequency_penalty=2.0)).choices[0].message.content
    assert zero == plain and strong != plain
    want = await asyncio.to_thread(reference, reference_model, pipeline.chat_prompt(HAIKU), pipeline.eos_ids,
                                   2.0, 2.0)
    assert strong == pipeline.tokenizer.decode(want, skip_special_tokens=True)


async def test_each_of_n_choices_counts_its_own_tokens(client, pipeline, reference_model):
    """Greedy with penalties, n=3: every choice is the reference reply. A fork that
    inherited its parent's counts (or shared them) would read differently."""
    resp = await client.chat.completions.create(model="default", messages=HAIKU, temperature=0,
                                                max_tokens=MAX_TOKENS, n=3, presence_penalty=0.6,
                                                frequency_penalty=0.8)
    want = await asyncio.to_thread(reference, reference_model, pipeline.chat_prompt(HAIKU), pipeline.eos_ids,
                                   0.6, 0.8)
    text = pipeline.tokenizer.decode(want, skip_special_tokens=True)
    assert [c.message.content for c in resp.choices] == [text] * 3


async def test_seeded_penalized_sampling_is_reproducible(client):
    kwargs = dict(model="default", messages=HAIKU, temperature=0.9, seed=77, max_tokens=MAX_TOKENS,
                  presence_penalty=0.7, frequency_penalty=0.5)
    one = await client.chat.completions.create(**kwargs)
    again, three = await asyncio.gather(client.chat.completions.create(**kwargs),
                                        client.chat.completions.create(**kwargs, n=3))
    assert one.choices[0].message.content == again.choices[0].message.content
    assert three.choices[0].message.content == one.choices[0].message.content   # choice 0 is n=1's
    plain = await client.chat.completions.create(**{**kwargs, "presence_penalty": 0, "frequency_penalty": 0})
    assert plain.choices[0].message.content != one.choices[0].message.content


async def test_penalized_replies_survive_the_sampling_stage_dying():
    """The new last stage rebuilds each sequence's counts from the tokens the head sends
    it as generated (`replayed`): the replies are those of an uninterrupted run."""
    from engine.pipeline.launch import launch

    asks = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=40, presence_penalty=0.9,
                           frequency_penalty=0.6) for i in range(2)]
    asks.append(SamplingParams(greedy=True, max_tokens=40, frequency_penalty=1.2))
    questions = ["Write a haiku about the sea.", "Name three colors.", "Count from one to ten."]
    pipe = await launch(pipeline_config())
    head = pipe.head
    head.eos_ids = set()   # every reply runs its full length

    async def replies(on_token=None):
        handles = [head.submit(head.chat_prompt([{"role": "user", "content": q}]), p)
                   for q, p in zip(questions, asks)]

        async def one(i, h):
            toks = []
            async for ev in h:
                if isinstance(ev, Delta):
                    toks.extend(ev.token_ids)
                    if i == 0 and on_token is not None:
                        on_token(len(toks))
                else:
                    assert ev.error is None, ev
            return toks

        return await asyncio.wait_for(asyncio.gather(*(one(i, h) for i, h in enumerate(handles))), 300)

    try:
        want = await replies()
        last = list(pipe.local.procs)[-1]
        killed = []

        def on_token(n):
            if n >= 10 and not killed:
                os.kill(last.pid, signal.SIGKILL)
                killed.append(n)

        got = await replies(on_token)
        assert killed and got == want
        assert [e["event"] for e in head.info()["events"]].count("recovered") == 1
    finally:
        await pipe.close()


async def test_the_chats_repetition_penalty_on_the_pipeline_serve_starts(reference_model):
    """`potluck serve` as it starts (3 stages sharing this CPU's cores, no --threads) and
    the chat's repetition penalty: greedy replies are the reference's, one alone and
    three side by side, as each sequence's kept distinct tokens
    (engine/model/token_history.py) grow step by step."""
    from engine.core.sampling import CHAT_DEFAULTS
    from engine.pipeline.launch import launch

    rep = CHAT_DEFAULTS["repetition_penalty"]
    questions = ["Write a haiku about the sea.", "Name three colors.", "Count from one to ten."]
    pipe = await launch(pipeline_config(threads=None))
    head = pipe.head
    try:
        assert head.cores is not None   # what serve starts with: the cores shared, not pinned
        prompts = [head.chat_prompt([{"role": "user", "content": q}]) for q in questions]
        wants = [await asyncio.to_thread(reference, reference_model, p, head.eos_ids, 0.0, 0.0, rep)
                 for p in prompts]
        params = SamplingParams(greedy=True, max_tokens=MAX_TOKENS, repetition_penalty=rep)
        assert await _direct_tokens(head, prompts[0], params) == wants[0]
        await head.drop_kept()   # all three prompts computed side by side
        together = await asyncio.gather(*(_direct_tokens(head, p, params) for p in prompts))
        assert together == wants
    finally:
        await pipe.close()
