"""The draft model (engine/model/draft.py): greedy guesses from its own KV cache, batched
over sequences, kept in step with what the target accepted (rejected guesses rolled
back), and refused when its tokenizer is not the target's. A tiny random model in this
process stands in for both the draft and a plain greedy decoder."""

from __future__ import annotations

import pytest
import torch

from engine.model.draft import DraftModel, check_tokenizers, parse_draft
from engine.model.sources import ModelError, resolve
from engine.model.stage import StageBatch, StageModel


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    folder, _ = tiny_folder("llama", seed=0)
    return resolve(str(folder))


def whole(source) -> StageModel:
    return StageModel(source, 0, source.config().num_hidden_layers, dtype=torch.float32, device="cpu")


def greedy(stage: StageModel, ctx: list[int], n: int, seq: int = 99) -> list[int]:
    """Plain greedy decoding, a token per step, in a fresh cache slot."""
    stage.free(seq)
    out = stage.forward(StageBatch([seq], [0], [len(ctx)]), torch.tensor(ctx))
    toks = [int(out[-1].argmax())]
    for i in range(n - 1):
        out = stage.forward(StageBatch([seq], [len(ctx) + i], [1]), torch.tensor(toks[-1:]))
        toks.append(int(out[-1].argmax()))
    stage.free(seq)
    return toks


def test_drafts_are_greedy_and_stay_in_step_after_a_rejection(tiny):
    ref = whole(tiny)
    d = DraftModel(whole(tiny), "tiny")
    a, b = list(range(5, 25)), list(range(40, 52))
    got = d.draft([(1, a, 4), (2, b, 2)])
    assert got == {1: greedy(ref, a, 4), 2: greedy(ref, b, 2)}
    # sequence 1: two guesses stood and the target said something else next; sequence 2:
    # everything stood and the target added its own token
    wrong = (got[1][2] + 1) % 256
    a2 = a + got[1][:2] + [wrong]
    b2 = b + got[2] + [7]
    again = d.draft([(1, a2, 3), (2, b2, 5)])
    assert again == {1: greedy(ref, a2, 3), 2: greedy(ref, b2, 5)}
    # the rejected guess is gone from the cache: it holds the context and the guesses fed
    assert d.tokens[1] == a2 + again[1][:2] and d.model.kv.length(1) == len(a2) + 2
    # a whole new turn after the reply (the context shrinks and changes): still greedy
    a3 = a2[:10] + [3, 4, 5]
    assert d.draft([(1, a3, 2)]) == {1: greedy(ref, a3, 2)}
    # finished sequences are freed at the next round
    d.retain([1])
    assert set(d.tokens) == {1} and not d.model.kv.has(2)
    assert d.draft([(1, a3, 0)]) == {}


def test_a_prompts_prefill_is_not_charged_to_its_guesses(tiny, monkeypatch):
    """The first round for a sequence prefills its whole prompt into the draft's cache: the
    cost per guess comes from the later positions only (else the policy, fed a cost many
    times the real one, would never draft again); a steady round charges all of it. On a
    clock where a step costs 1 s per token it is fed."""
    import engine.model.draft as draft_mod

    d = DraftModel(whole(tiny), "tiny")
    now, real = [0.0], d._step

    def step(rows):
        out = real(rows)
        now[0] += sum(len(r[2]) for r in rows)
        return out

    monkeypatch.setattr(d, "_step", step)
    monkeypatch.setattr(draft_mod.time, "perf_counter", lambda: now[0])
    ctx = list(range(5, 45))                         # a 40-token prompt, new to the draft
    got = d.draft([(1, ctx, 4)])
    assert len(got[1]) == 4 and d.seconds_per_token == 1.0     # the 3 steps after the prefill
    # steady: two guesses stood and the target said 9: the draft feeds [9], guesses 2
    got = d.draft([(1, ctx + got[1][:2] + [9], 2)])
    assert len(got[1]) == 2 and d.seconds_per_token == 1.0     # 1 token fed + 1 step, 2 guesses
    assert d.draft([(2, list(range(50, 60)), 1)]) and d.seconds_per_token is None   # all prefill


def test_guesses_drafted_ahead_are_served_from_the_chain(tiny):
    """The head's overlap: while a verification of [d1..dk] is in flight it drafts on
    after them; if every guess stood and the target's own token is the draft's next
    guess, the next round's draft is already there (and costs nothing). Anything else
    and the model carries on from where the chain and the context part. A stop()
    turning true cuts the drafting-ahead short."""
    ref = whole(tiny)
    d = DraftModel(whole(tiny), "tiny")
    ctx = list(range(5, 25))
    first = d.draft([(1, ctx, 3)])[1]
    ahead = d.draft([(1, ctx + first, 4)])[1]            # in flight: draft on after d3
    assert ahead == greedy(ref, ctx + first, 4)
    assert d.chain(1) == ctx + first + ahead
    # all stood, and the target's token was the draft's own next guess: free
    ctx2 = ctx + first + ahead[:1]
    before = d.model.kv.length(1)
    assert d.ahead_of(1, ctx2) == 3 and d.ahead_of(1, ctx + [0]) == 0
    # what a draft after a context would read first: nothing new here, all of it for a
    # sequence the draft model has not seen (the head has that read while a trip is out)
    assert d.unread(1, ctx2) == 0 and d.unread(1, ctx + [0]) == 1 and d.unread(5, ctx) == len(ctx)
    assert d.draft([(1, ctx2, 3)]) == {1: ahead[1:4]}
    assert d.seconds_per_token is None and d.from_chain == 3 and d.model.kv.length(1) == before
    # more than the chain holds: its 3 free guesses, then the model from the chain's end
    assert d.draft([(1, ctx2, 5)]) == {1: greedy(ref, ctx2, 5)}
    assert 0.0 < d.seconds_per_token and 0.0 < d.seconds_per_position
    # the target said something else: no free guesses, greedy from the new context
    ctx3 = ctx + first[:1] + [(first[1] + 1) % 256]
    assert d.draft([(1, ctx3, 2)]) == {1: greedy(ref, ctx3, 2)}
    # drafting ahead stops when asked (the verification came back)
    calls = []
    got = d.draft([(1, ctx3 + [7], 6)], stop=lambda: calls.append(1) or len(calls) > 2)
    assert got[1] == greedy(ref, ctx3 + [7], 2)
    assert d.draft([(1, ctx3 + [7, 8], 6)], stop=lambda: True) == {}
    # stopped after its first position (a trip with time for one): still timed, or the
    # head would find drafting ahead untried, and try it, on every trip
    calls.clear()
    got = d.draft([(1, ctx3 + [7, 9], 6)], stop=lambda: calls.append(1) or len(calls) > 1)
    assert len(got[1]) == 1 and d.seconds_per_position is not None and d.seconds_per_position > 0.0


def test_a_full_draft_cache_drafts_nothing_rather_than_failing(tiny):
    d = DraftModel(whole(tiny), "tiny")
    d.model.kv.budget_tokens = 16
    assert d.draft([(1, list(range(5, 25)), 3)]) == {}
    assert not d.model.kv.has(1)


def test_draft_specs_and_tokenizers(tiny, default_source):
    assert parse_draft("default") == ("default", "bf16")
    assert parse_draft("default@int8") == ("default", "int8")
    assert parse_draft("meta-llama/Llama-3.2-1B-Instruct@nf4") == ("meta-llama/Llama-3.2-1B-Instruct", "nf4")
    assert parse_draft("default@int4") == ("default", "int4")
    for bad in ("", "default@int3", "@int8"):
        with pytest.raises(ModelError):
            parse_draft(bad)
    tok = default_source.tokenizer()
    check_tokenizers(tok, tok, "a", "b")

    class Other:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    with pytest.raises(ModelError, match="tokenizer"):
        check_tokenizers(Other(), tok, "other", "SmolLM2")


def test_an_int8_draft_on_a_cpu_uses_torchs_int8_kernel(tiny_folder):
    """--draft MODEL@int8 on a CPU: torch's weight-only int8 layers (bitsandbytes' CPU
    kernels draft slower than float32), a quarter of the decoder's bytes, real guesses."""
    from torch import nn

    from engine.model.cpu_linear import Int8WeightLinear, int8_kernel_works
    if not int8_kernel_works():
        pytest.skip("no CPU weight-only int8 kernel in this torch")
    folder, _ = tiny_folder("llama", seed=0)
    full = DraftModel.load(str(folder), dtype=torch.float32, device="cpu")
    d = DraftModel.load(f"{folder}@int8", dtype=torch.float32, device="cpu")
    assert d.name.endswith("(int8)")
    layers = [m for m in d.model.model.modules() if isinstance(m, (nn.Linear, Int8WeightLinear))]
    assert layers and all(isinstance(m, Int8WeightLinear) for m in layers)
    assert d.param_bytes < full.param_bytes
    ctx = list(range(5, 25))
    guesses = d.draft([(1, ctx, 4)])[1]
    assert len(guesses) == 4 and all(0 <= t < d.vocab_limit for t in guesses)

