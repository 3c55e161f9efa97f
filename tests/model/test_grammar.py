"""Constrained decoding (engine/model/grammar.py) in the last stage's sampler: whatever
the logits say, a constrained reply is JSON that matches its schema; the rows beside it
and every unconstrained batch are untouched, and its logprobs stay the raw model's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.core.sampling import SamplingParams  # noqa: E402
from engine.model.grammar import JSON_OBJECT, GrammarError, Grammars, compile_schema, schema_of  # noqa: E402
from engine.model.sampler import Sampler  # noqa: E402

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "role": {"enum": ["cook", "guest"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "role", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(default_source):
    return default_source.tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(lambda: tokenizer, 49152)


def check_person(obj):
    assert set(obj) == {"name", "role", "age", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert obj["role"] in ("cook", "guest")
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(type(t) is bool for t in obj["tags"])


def decode_until_eos(sampler, seq_ids, tokenizer, seed, steps=200, forks=None):
    """Random logits each step; returns each sequence's tokens up to end-of-sequence."""
    g = torch.Generator().manual_seed(seed)
    out = {s: [] for s in seq_ids}
    live = list(seq_ids)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), 49152, generator=g) * 4
        for e in sampler.step(live, logits, forks):
            out.setdefault(e[0], []).append(e[1])
        forks = None
        live = [s for s in out if not out[s] or out[s][-1] != tokenizer.eos_token_id]
    return {s: t[:-1] if t and t[-1] == tokenizer.eos_token_id else t for s, t in out.items()}


def test_schema_of_reads_openais_response_formats():
    assert schema_of(None) is None and schema_of({"type": "text"}) is None
    assert schema_of({"type": "json_object"}) == JSON_OBJECT
    s = schema_of({"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
    assert json.loads(s) == PERSON
    assert json.loads(schema_of({"type": "json_schema", "json_schema": {"name": "any"}})) == {}
    for bad in ("json", [], {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": []},
                {"type": "json_schema", "json_schema": {"schema": []}},
                {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
                {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}):
        with pytest.raises(ValueError):
            schema_of(bad)


def test_compile_schema_refuses_what_it_cannot_hold():
    assert compile_schema(json.dumps(PERSON))
    for bad in ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, {"type": "integer", "minimum": "x"},
                {"type": "no-such-type"}):
        with pytest.raises(GrammarError):
            compile_schema(json.dumps(bad))
    # compiles, but no value satisfies it: its reply was "" with finish_reason "stop"
    for empty in ({"$ref": "#"}, {"anyOf": [{"$ref": "#"}]}):
        with pytest.raises(GrammarError, match="admits no value"):
            compile_schema(json.dumps(empty))
    # recursion with a way out is a schema like any other
    assert compile_schema(json.dumps({"type": "object", "properties": {"next": {"$ref": "#"}}}))


def test_constrained_rows_are_json_that_matches_whatever_the_logits(grammars, tokenizer):
    s = Sampler(grammars)
    schema = json.dumps(PERSON)
    for seq in (1, 2, 3):
        s.open(seq, SamplingParams(temperature=1.0, seed=seq, json_schema=schema, logprobs=True), [1, 2])
    out = decode_until_eos(s, [1, 2, 3], tokenizer, seed=0)
    for seq in (1, 2, 3):
        check_person(json.loads(tokenizer.decode(out[seq])))


def test_json_mode_starts_an_object_and_ends_only_when_it_is_closed(grammars, tokenizer):
    """(Random logits would write one endless string: JSON mode bounds nothing.)"""
    s = Sampler(grammars)
    s.open(1, SamplingParams(greedy=True, json_schema=JSON_OBJECT), [1])
    eos = tokenizer.eos_token_id

    def wants(t):
        y = torch.zeros(1, 49152)
        y[0, t] = 20.0
        return y

    first = s.step([1], wants(eos))[0][1]           # the model wants to stop at once: it may not
    assert first != eos and tokenizer.decode([first]).startswith("{")
    s.close(1)
    s.open(1, SamplingParams(greedy=True, json_schema=JSON_OBJECT), [1])
    ids = tokenizer('{"a": 1}', add_special_tokens=False)["input_ids"]
    for t in ids:                                    # the model writes {"a": 1} ...
        assert s.step([1], wants(t))[0][1] == t
    assert s.step([1], wants(ids[0]))[0][1] == eos  # ... and then it must stop
    assert json.loads(tokenizer.decode(ids)) == {"a": 1}


def test_rows_beside_a_constrained_one_and_its_logprobs_are_untouched(grammars, tokenizer):
    s = Sampler(grammars)
    s.open(1, SamplingParams(greedy=True, json_schema=JSON_OBJECT, logprobs=True, top_logprobs=1), [1])
    s.open(2, SamplingParams(greedy=True, logprobs=True), [1])
    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(3))
    before = x.clone()
    (_, t1, lp1, top1), (_, t2, lp2, _) = s.step([1, 2], x)
    assert torch.equal(x, before)                                  # masked on a copy
    assert t2 == int(x[1].argmax())                                # the free row: plain greedy
    assert tokenizer.decode([t1]).startswith("{")                  # the constrained row: JSON
    raw = torch.log_softmax(x, -1)
    assert lp1 == pytest.approx(raw[0, t1].item(), rel=1e-5)      # the raw model's, not the mask's
    assert top1[0][0] == int(x[0].argmax()) and lp2 == pytest.approx(raw[1, t2].item(), rel=1e-5)


def test_an_unconstrained_batch_never_copies_or_masks(monkeypatch):
    s = Sampler()      # no grammars at all: nothing here may need them
    s.open(1, SamplingParams(greedy=True), [1])
    s.open(2, SamplingParams(temperature=0.7, seed=1, logprobs=True), [1])
    monkeypatch.setattr(Sampler, "_masked", lambda *a: pytest.fail("an unconstrained batch was masked"))
    s.step([1, 2], torch.randn(2, 50))
    with pytest.raises(GrammarError):
        s.open(3, SamplingParams(json_schema=JSON_OBJECT), [1])    # asks for what this sampler cannot do
    assert not s.knows(3)


def test_a_replayed_reply_goes_on_where_its_grammar_was(grammars, tokenizer):
    """After a rearrangement the stages get prompt + generated; the grammar skips the
    generated part (`replayed`) and the reply is still one valid document."""
    schema = json.dumps(PERSON)
    a = Sampler(grammars)
    a.open(1, SamplingParams(temperature=1.0, seed=9, json_schema=schema), [1, 2])
    first = decode_until_eos(a, [1], tokenizer, seed=4, steps=6)[1]
    assert 0 < len(first) == 6
    b = Sampler(grammars)
    b.open_new({"1": {"sampling": SamplingParams(temperature=1.0, seed=9, json_schema=schema).to_dict(),
                      "prompt": [1, 2] + first, "replayed": len(first)}}, 49152)
    rest = decode_until_eos(b, [1], tokenizer, seed=5)[1]
    check_person(json.loads(tokenizer.decode(first + rest)))


def test_forks_of_a_constrained_request_each_hold_to_the_schema(grammars, tokenizer):
    s = Sampler(grammars)
    params = SamplingParams(temperature=1.2, seed=1, json_schema=json.dumps(PERSON))
    s.open_new({"1": {"sampling": params.to_dict(), "prompt": [1, 2], "forks": [[2, 77], [3, None]]}}, 49152)
    out = decode_until_eos(s, [1], tokenizer, seed=6, forks={1: [2, 3]})
    assert set(out) == {1, 2, 3}
    docs = [json.loads(tokenizer.decode(out[k])) for k in (1, 2, 3)]
    for d in docs:
        check_person(d)


def test_a_prompt_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler().open_new({"1": {"sampling": {}, "prompt": [50]}}, 50)
