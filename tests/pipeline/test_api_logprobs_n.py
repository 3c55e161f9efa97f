"""logprobs / top_logprobs and n > 1 through the OpenAI-compatible API, with the official
`openai` client, over the session's real 3-stage pipeline (head + 2 stage processes).

Everything is checked on the text and the numbers, never on timing: greedy choices are
the likeliest tokens, logprobs are the raw model's log-softmax (checked against the whole
model loaded by transformers), a request's n choices share one prefill (counted on the
head's stage 0) and, greedy, read the same as n=1.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from engine.core.sampling import SamplingParams
from testkit.freed import all_freed

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRUIT = [{"role": "user", "content": "Name a fruit and say why you like it."}]


def check_chat_logprobs(content, text: str, top: int):
    assert content, "no logprobs"
    for e in content:
        assert e.logprob <= 0 and math.isfinite(e.logprob)
        assert len(e.top_logprobs) == top
        assert bytes(e.bytes).decode("utf-8", errors="backslashreplace") == e.token
        if top:
            # greedy: the sampled token is the likeliest, with the same number
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
            lps = [t.logprob for t in e.top_logprobs]
            assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
    # the tokens' bytes are the reply's text
    assert b"".join(bytes(e.bytes) for e in content).decode() == text


async def test_chat_logprobs_are_the_sampled_tokens(client, pipeline):
    kwargs = dict(model="default", messages=FRANCE, temperature=0, max_tokens=24)
    plain = await client.chat.completions.create(**kwargs)
    resp = await client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert plain.choices[0].logprobs is None
    assert choice.message.content == plain.choices[0].message.content   # asking changes nothing drawn
    assert "Paris" in choice.message.content
    check_chat_logprobs(choice.logprobs.content, choice.message.content, 3)
    # end-of-sequence is not a token of the text: every other sampled token is listed
    assert len(choice.logprobs.content) == resp.usage.completion_tokens

    # without top_logprobs: the sampled tokens alone
    bare = await client.chat.completions.create(**kwargs, logprobs=True)
    assert [e.token for e in bare.choices[0].logprobs.content] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in bare.choices[0].logprobs.content] == [e.logprob for e in choice.logprobs.content]
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


async def test_head_reports_the_sampled_token_ids_with_their_logprobs(pipeline):
    prompt = pipeline.chat_prompt(FRUIT)
    handle = pipeline.submit(prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=12, logprobs=True,
                                                    top_logprobs=4))
    n = 0
    async for ev in handle:
        if hasattr(ev, "token_ids"):
            (lp,) = ev.logprobs
            assert lp.token == ev.token_ids[0] and lp.logprob <= 0 and len(lp.top) == 4
            # sampled at temperature 0.9: not always the likeliest, never likelier than it
            assert lp.logprob <= lp.top[0][1]
            n += 1
    assert n > 0


async def test_logprobs_are_the_raw_models_log_softmax(pipeline, default_source):
    """Sampled at temperature 0.8 with a repetition penalty, the logprobs are still the
    raw model's: checked against the whole model loaded by transformers alone."""
    import torch

    from testkit.reference import full_model

    ids = list(pipeline.tokenizer("The capital of France is", add_special_tokens=True)["input_ids"])
    handle = pipeline.submit(ids, SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=11, max_tokens=6,
                                                 logprobs=True, top_logprobs=3))
    got = [lp for ev in [e async for e in handle] for lp in (getattr(ev, "logprobs", None) or ())]
    assert got
    model = await asyncio.to_thread(full_model, default_source)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + [lp.token for lp in got]])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(got):
        row = ref[len(ids) - 1 + i]
        assert abs(lp.logprob - row[lp.token].item()) < 2e-3, (i, lp, row[lp.token].item())
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert all(abs(v - row[t].item()) < 2e-3 for t, v in lp.top)


async def test_completions_logprobs_shape_streaming_and_not(client):
    kwargs = dict(model="default", prompt="One, two, three,", max_tokens=10, temperature=0, logprobs=2)
    full = await client.completions.create(**kwargs)
    c = full.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert "".join(lp.tokens) == c.text
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and top[tok] == v and max(top.values()) == v   # greedy: the likeliest
        assert 1 <= len(top) <= 3                                       # "up to logprobs + 1"

    stream = await client.completions.create(**kwargs, stream=True)
    tokens, values, offs, text = [], [], [], ""
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
                offs += ch.logprobs.text_offset
    assert (text, tokens, values, offs) == (c.text, lp.tokens, lp.token_logprobs, lp.text_offset)
    plain = await client.completions.create(**{**kwargs, "logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == c.text


async def test_chat_logprobs_streamed(client):
    kwargs = dict(model="default", messages=FRANCE, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2)
    full = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(**kwargs, stream=True)
    content, text = [], ""
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            if ch.logprobs is not None:
                content += ch.logprobs.content
    assert text == full.choices[0].message.content
    assert [e.token for e in content] == [e.token for e in full.choices[0].logprobs.content]
    # the second request takes the first's kept reply over: its prompt's last position is
    # computed alone, not inside the whole prompt's step, so the float sums differ a little
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in full.choices[0].logprobs.content],
                                                         abs=1e-4)
    check_chat_logprobs(content, text, 2)


async def test_n2_greedy_gives_two_identical_choices_and_counts_the_prompt_once(client, pipeline):
    kwargs = dict(model="default", messages=FRANCE, temperature=0, max_tokens=20)
    one = await client.chat.completions.create(**kwargs)
    two = await client.chat.completions.create(**kwargs, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert all(c.finish_reason == one.choices[0].finish_reason for c in two.choices)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.total_tokens == two.usage.prompt_tokens + two.usage.completion_tokens


async def test_n_choices_share_one_prefill(pipeline, monkeypatch):
    """A request's n choices compute and send their prompt once: stage 0 sees one prompt
    row, and the others start from a copy of its KV on every stage."""
    await pipeline.drop_kept()   # an earlier test's reply to this prompt would be taken over
    prompt = pipeline.chat_prompt(FRUIT)
    rows = []
    forward = pipeline.stage0.forward

    def counting(batch, x):
        rows.extend(zip(batch.seq_ids, batch.ns))
        return forward(batch, x)

    monkeypatch.setattr(pipeline.stage0, "forward", counting)
    handles = pipeline.submit_n(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=8), 3)
    results = await asyncio.gather(*(h.text() for h in handles))
    ids = {h.seq.id for h in handles}
    prompt_rows = [(s, n) for s, n in rows if s in ids and n > 1]
    assert sum(n for _, n in prompt_rows) == len(prompt), prompt_rows    # chunks of one prompt, once
    assert {s for s, _ in prompt_rows} == {handles[0].seq.id}
    assert all(d.finish_reason in ("stop", "length") and d.prompt_tokens == len(prompt) for _, d in results)
    # seeded: the same request draws the same n texts again, and the choices draw apart
    monkeypatch.setattr(pipeline.stage0, "forward", forward)
    again = await asyncio.gather(*(h.text() for h in pipeline.submit_n(
        prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=8), 3)))
    assert [t for t, _ in again] == [t for t, _ in results]
    assert len({t for t, _ in results}) > 1
    # and nothing is left behind on any stage
    await all_freed(pipeline)


async def test_n2_streamed_chat_sends_each_choices_index(client):
    kwargs = dict(model="default", messages=FRANCE, temperature=0, max_tokens=16)
    full = await client.chat.completions.create(**kwargs, n=2)
    stream = await client.chat.completions.create(**kwargs, n=2, stream=True,
                                                  stream_options={"include_usage": True})
    texts, finishes, roles, usage = {0: "", 1: ""}, {}, set(), None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            assert ch.index in (0, 1)
            if ch.delta.role:
                roles.add(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert roles == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert finishes == {0: full.choices[0].finish_reason, 1: full.choices[1].finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


async def test_n_with_logprobs_and_a_list_of_prompts(client):
    prompts = ["The capital of France is", "One, two, three,"]
    resp = await client.completions.create(model="default", prompt=prompts, n=2, max_tokens=6, temperature=0,
                                           logprobs=1)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]            # prompt * n + choice
    for i, p in enumerate(prompts):
        alone = await client.completions.create(model="default", prompt=p, max_tokens=6, temperature=0, logprobs=1)
        for c in resp.choices[2 * i: 2 * i + 2]:
            assert c.text == alone.choices[0].text
            # (batched with other rows, the float sums differ in their last digits)
            assert c.logprobs.token_logprobs == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-4)
    # streamed too: each choice's text arrives under its index
    stream = await client.completions.create(model="default", prompt=prompts, n=2, max_tokens=6, temperature=0,
                                             stream=True)
    texts = {}
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(4)] == [c.text for c in resp.choices]


async def test_seeded_n_choices_are_reproducible_and_choice_0_is_n1(client):
    kwargs = dict(model="default", messages=FRUIT, temperature=1.0, seed=42, max_tokens=12)
    a = await client.chat.completions.create(**kwargs, n=3)
    b = await client.chat.completions.create(**kwargs, n=3)
    one = await client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content == one.choices[0].message.content


# ---- response_format: constrained decoding on the last stage ----------------------------

CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40},
                       "country": {"type": "string", "enum": ["France", "Spain", "Italy"]},
                       "population_millions": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
ASK_CITY = [{"role": "user", "content": "Give the capital of France as JSON."}]


def check_city(text: str):
    obj = json.loads(text)
    assert set(obj) == {"city", "country", "population_millions"}, obj
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 40
    assert obj["country"] in ("France", "Spain", "Italy")
    assert isinstance(obj["population_millions"], (int, float)) and 0 <= obj["population_millions"] <= 100
    return obj


async def test_json_schema_replies_parse_and_match(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}}
    kwargs = dict(model="default", messages=ASK_CITY, max_tokens=80, response_format=fmt)
    greedy = await client.chat.completions.create(**kwargs, temperature=0)
    assert greedy.choices[0].finish_reason == "stop"
    check_city(greedy.choices[0].message.content)
    # sampled, several choices (each fork holds to the schema), streamed
    # (the population an integer: a float's digits may go on for as long as the small
    # model likes, and whether a sampled choice closes its object in 80 tokens would be
    # the seed's luck)
    whole = {**CITY, "properties": {**CITY["properties"], "population_millions": {
        "type": "integer", "minimum": 0, "maximum": 100}}}
    many = await client.chat.completions.create(
        **{**kwargs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "city", "strict": True, "schema": whole}}}, temperature=1.0, seed=3, n=3)
    for c in many.choices:
        assert c.finish_reason == "stop"
        check_city(c.message.content)
    stream = await client.chat.completions.create(**kwargs, temperature=0, stream=True)
    text = ""
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == greedy.choices[0].message.content


async def test_json_mode_replies_with_an_object(client):
    resp = await client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=120, temperature=0,
                                                response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


async def test_a_constrained_request_leaves_its_batch_mates_alone(client):
    """A plain request running beside constrained ones reads as it does alone."""
    plain = dict(model="default", messages=FRANCE, temperature=0, max_tokens=20)
    alone = await client.chat.completions.create(**plain)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    together = await asyncio.gather(
        client.chat.completions.create(**plain),
        client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=80, temperature=0,
                                       response_format=fmt))
    assert together[0].choices[0].message.content == alone.choices[0].message.content
    check_city(together[1].choices[0].message.content)
