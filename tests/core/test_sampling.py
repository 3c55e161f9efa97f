"""Sampling parameters off the wire, and the per-row sampler on the last stage."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.core.sampling import (  # noqa: E402
    MAX_SCHEMA_CHARS,
    MAX_TOP_LOGPROBS,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    SamplingError,
    SamplingParams,
)
from engine.model.sampler import Sampler  # noqa: E402

VOCAB = 50


def logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def run(sampler: Sampler, seq_ids, steps: int, seed: int = 0) -> list[list[int]]:
    """Sample `steps` times; each step's logits come from one fixed seed per step."""
    out = []
    for step in range(steps):
        out.append(sampler.sample(seq_ids, logits(len(seq_ids), seed * 1000 + step)))
    return out


# ---- SamplingParams.from_dict ----------------------------------------------------

def test_from_dict_defaults_and_round_trip():
    p = SamplingParams.from_dict({})
    assert p == SamplingParams()
    full = {"temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.5, "frequency_penalty": -1.25, "seed": 7,
            "greedy": False, "max_tokens": 16, "stop": ["\n\n", "END"], "logprobs": True, "top_logprobs": 5,
            "json_schema": '{"type": "object"}'}
    p = SamplingParams.from_dict(full)
    assert p.to_dict() == full
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(greedy=True, temperature=0.8).is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy


@pytest.mark.parametrize("d, match", [
    ("temperature=1", "must be an object"),
    ([("temperature", 1.0)], "must be an object"),
    ({"temperature": 1.0, "bogus": 1, "also": 2}, "unknown sampling parameter\\(s\\): also, bogus"),
    ({"logit_bias": {}}, "logit_bias"),
    ({"logprobs": 1}, "logprobs must be true or false"),
    ({"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs must be between"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be between"),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs must be a whole number"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs must be a whole number"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
    ({"json_schema": {"type": "object"}}, "json_schema must be JSON text"),
    ({"json_schema": " " * (MAX_SCHEMA_CHARS + 1)}, "json_schema must be JSON text"),
    ({"json_schema": "{"}, "json_schema is not valid JSON"),
    ({"json_schema": "[" * 100000 + "]" * 100000}, "json_schema must be JSON text"),
    ({"json_schema": "[" * 5000 + "]" * 5000}, "json_schema is not valid JSON"),
    ({"json_schema": "[]"}, "json_schema must be a JSON object"),
    ({"temperature": "1"}, "temperature must be a number"),
    ({"temperature": None}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"temperature": -0.1}, "temperature must be between"),
    ({"temperature": 100.5}, "temperature must be between"),
    ({"temperature": float("nan")}, "temperature must be between"),
    ({"temperature": float("inf")}, "temperature must be between"),
    ({"top_k": 1.0}, "top_k must be a whole number"),
    ({"top_k": True}, "top_k must be a whole number"),
    ({"top_k": -1}, "top_k must be between"),
    ({"top_k": (1 << 20) + 1}, "top_k must be between"),
    ({"top_p": 1.01}, "top_p must be between"),
    ({"top_p": -0.5}, "top_p must be between"),
    ({"min_p": 1.5}, "min_p must be between"),
    ({"min_p": "0.1"}, "min_p must be a number"),
    ({"top_p": "0.9"}, "top_p must be a number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be between"),
    ({"repetition_penalty": 101}, "repetition_penalty must be between"),
    ({"presence_penalty": 2.01}, "presence_penalty must be between -2.0 and 2.0"),
    ({"presence_penalty": -3}, "presence_penalty must be between"),
    ({"presence_penalty": "0.5"}, "presence_penalty must be a number"),
    ({"presence_penalty": None}, "presence_penalty must be a number"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be between"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty must be between"),
    ({"frequency_penalty": [1]}, "frequency_penalty must be a number"),
    ({"max_tokens": 0}, "max_tokens must be between"),
    ({"max_tokens": 10.0}, "max_tokens must be a whole number"),
    ({"max_tokens": (1 << 20) + 1}, "max_tokens must be between"),
    ({"seed": -1}, "seed must be between"),
    ({"seed": 2**63}, "seed must be between"),
    ({"seed": 1.0}, "seed must be a whole number"),
    ({"seed": False}, "seed must be a whole number"),
    ({"greedy": 1}, "greedy must be true or false"),
    ({"greedy": "true"}, "greedy must be true or false"),
    ({"stop": "END"}, "stop must be a list"),
    ({"stop": None}, "stop must be a list"),
    ({"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)}, f"at most {MAX_STOP_SEQUENCES}"),
    ({"stop": [""]}, "each stop sequence"),
    ({"stop": ["x" * (MAX_STOP_LENGTH + 1)]}, "each stop sequence"),
    ({"stop": [1]}, "each stop sequence"),
    ({"stop": [["a"]]}, "each stop sequence"),
])
def test_from_dict_rejects(d, match):
    with pytest.raises(SamplingError, match=match) as info:
        SamplingParams.from_dict(d)
    if isinstance(d, dict) and len(d) == 1 and not ("top_logprobs" in d or "json_schema" in d):
        assert info.value.param == next(iter(d))   # the API's 400 names the field


@pytest.mark.parametrize("d", [
    {"temperature": 0}, {"temperature": 100}, {"top_k": 0}, {"top_k": 1 << 20}, {"top_p": 1e-9}, {"top_p": 1}, {"top_p": 0},
    {"repetition_penalty": 0.01}, {"repetition_penalty": 100}, {"max_tokens": 1}, {"max_tokens": 1 << 20},
    {"presence_penalty": -2}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"frequency_penalty": 2},
    {"seed": 0}, {"seed": 2**63 - 1}, {"seed": None}, {"stop": ["x"] * MAX_STOP_SEQUENCES},
    {"stop": ["x" * MAX_STOP_LENGTH]}, {"stop": []}, {"logprobs": True}, {"top_logprobs": 0},
])
def test_from_dict_accepts_boundaries(d):
    p = SamplingParams.from_dict(d)
    k, v = next(iter(d.items()))
    assert getattr(p, k) == v


# ---- Sampler --------------------------------------------------------------------

def opened(params_by_seq: dict[int, SamplingParams], prompt=(1, 2, 3)) -> Sampler:
    s = Sampler()
    for seq_id, p in params_by_seq.items():
        s.open(seq_id, p, list(prompt))
    return s


def test_greedy_is_argmax_over_a_batch():
    s = opened({i: SamplingParams(greedy=True) for i in range(6)})
    x = logits(6)
    assert s.sample(list(range(6)), x) == x.argmax(-1).tolist()
    # mixed with temperature-0 rows it is still argmax
    s2 = opened({0: SamplingParams(temperature=0.0), 1: SamplingParams(greedy=True, temperature=2.0)})
    assert s2.sample([0, 1], x[:2]) == x[:2].argmax(-1).tolist()


def test_greedy_row_in_a_sampled_batch_is_argmax():
    s = opened({0: SamplingParams(temperature=5.0, seed=1), 1: SamplingParams(greedy=True)})
    for step in range(10):
        x = logits(2, step)
        assert s.sample([0, 1], x)[1] == int(x[1].argmax())


def test_seeded_sampling_is_reproducible():
    p = SamplingParams(temperature=1.5, seed=1234)
    a = run(opened({0: p}), [0], 30)
    b = run(opened({0: p}), [0], 30)
    assert a == b
    c = run(opened({0: SamplingParams(temperature=1.5, seed=4321)}), [0], 30)
    assert a != c  # the seed matters (30 draws at high temperature over 50 tokens)
    assert len({t[0] for t in a}) > 3  # and it really samples


def test_seeded_sampling_independent_of_batch_mates():
    """The same seeded request draws the same tokens wherever it sits and whoever is beside it."""
    steps = 25
    target = SamplingParams(temperature=1.2, top_k=20, top_p=0.95, seed=99)
    row_logits = [logits(1, 500 + t)[0] for t in range(steps)]

    def tokens_for(position: int, mates: list[SamplingParams]) -> list[int]:
        params = mates[:position] + [target] + mates[position:]
        s = opened(dict(enumerate(params)))
        seq_ids = list(range(len(params)))
        got = []
        for t in range(steps):
            x = logits(len(params), 900 + t)  # batch mates see unrelated logits
            x[position] = row_logits[t]
            got.append(s.sample(seq_ids, x)[position])
        return got

    alone = tokens_for(0, [])
    torch.manual_seed(0)
    assert tokens_for(2, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=5),
                          SamplingParams(greedy=True)]) == alone
    torch.manual_seed(12345)  # unseeded mates draw from the global RNG; that must not matter
    assert tokens_for(1, [SamplingParams(temperature=2.0), SamplingParams(temperature=1.0, seed=99)]) == alone
    assert len(set(alone)) > 2


def test_top_k_1_equals_greedy():
    s = opened({i: SamplingParams(temperature=3.0, top_k=1, seed=i) for i in range(4)})
    for step in range(10):
        x = logits(4, step)
        assert s.sample(list(range(4)), x) == x.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 0.0])   # 0: OpenAI's clients send it for "greedy"
def test_tiny_top_p_equals_greedy(top_p):
    s = opened({i: SamplingParams(temperature=3.0, top_p=top_p, seed=i) for i in range(4)})
    for step in range(10):
        x = logits(4, step)
        assert s.sample(list(range(4)), x) == x.argmax(-1).tolist()


def test_top_k_restricts_to_the_k_best():
    s = opened({0: SamplingParams(temperature=100.0, top_k=3, seed=3)})
    x = logits(1, 42)
    allowed = set(torch.topk(x[0], 3).indices.tolist())
    seen = {s.sample([0], x)[0] for _ in range(200)}
    assert seen == allowed  # flat at temperature 100: all three appear, nothing else


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.75 keeps exactly the first two
    x = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    s = opened({0: SamplingParams(temperature=1.0, top_p=0.75, seed=0)})
    seen = {s.sample([0], x)[0] for _ in range(300)}
    assert seen == {1, 3}
    s = opened({0: SamplingParams(temperature=1.0, top_p=0.85, seed=0)})
    assert {s.sample([0], x)[0] for _ in range(300)} == {0, 1, 3}


def test_repetition_penalty_changes_choice_when_top_token_was_seen():
    x = torch.full((1, 10), -5.0)
    x[0, 4] = 2.0   # best, but in the prompt
    x[0, 7] = 1.8   # runner-up, unseen
    x[0, 2] = -1.0  # negative logit, also in the prompt: made more negative
    plain = opened({0: SamplingParams(greedy=True)}, prompt=[4, 2])
    assert plain.sample([0], x) == [4]
    pen = opened({0: SamplingParams(greedy=True, repetition_penalty=1.2)}, prompt=[4, 2])
    assert pen.sample([0], x) == [7]  # 2.0 / 1.2 = 1.67 < 1.8
    weak = opened({0: SamplingParams(greedy=True, repetition_penalty=1.05)}, prompt=[4, 2])
    assert weak.sample([0], x) == [4]  # 2.0 / 1.05 = 1.905 > 1.8
    # a penalty below 1 boosts seen tokens instead
    y = torch.tensor([[0.0, 0.5, 0.3]])
    boost = opened({0: SamplingParams(greedy=True, repetition_penalty=0.5)}, prompt=[2])
    assert boost.sample([0], y) == [2]  # 0.3 / 0.5 = 0.6 beats 0.5


def test_repetition_penalty_counts_generated_tokens():
    x = torch.tensor([[0.0, 2.0, 1.8, -1.0]])
    s = opened({0: SamplingParams(greedy=True, repetition_penalty=1.2)}, prompt=[])
    assert s.sample([0], x) == [1]   # nothing seen yet
    assert s.sample([0], x) == [2]   # token 1 now penalised (1.67 < 1.8)
    assert s.sample([0], x) == [1]   # both penalised: 1.67 > 1.5
    s.close(0)
    assert not s.knows(0)
    s.open(0, SamplingParams(greedy=True, repetition_penalty=1.2), [])
    assert s.sample([0], x) == [1]   # closing forgot the history


def test_penalised_logits_are_not_modified_in_place():
    x = torch.tensor([[0.0, 2.0, 1.8]])
    before = x.clone()
    s = opened({0: SamplingParams(greedy=True, repetition_penalty=2.0)}, prompt=[1])
    s.sample([0], x)
    assert torch.equal(x, before)


def test_distribution_matches_probabilities():
    x = torch.log(torch.tensor([[0.7, 0.3]]))
    s = opened({0: SamplingParams(temperature=1.0, seed=2024)})
    draws = [s.sample([0], x)[0] for _ in range(2000)]
    freq = draws.count(0) / len(draws)
    # binomial sd = sqrt(.7*.3/2000) ~ 0.0102: 4 sd
    assert abs(freq - 0.7) < 0.041, freq
    assert set(draws) == {0, 1}


def test_temperature_sharpens_and_flattens():
    x = torch.log(torch.tensor([[0.7, 0.3]]))
    cold = opened({0: SamplingParams(temperature=0.25, seed=1)})
    hot = opened({0: SamplingParams(temperature=4.0, seed=1)})
    n = 2000
    f_cold = sum(cold.sample([0], x)[0] == 0 for _ in range(n)) / n
    f_hot = sum(hot.sample([0], x)[0] == 0 for _ in range(n)) / n
    p_cold = 0.7**4 / (0.7**4 + 0.3**4)   # ~0.967
    p_hot = 0.7**0.25 / (0.7**0.25 + 0.3**0.25)  # ~0.553
    tol = lambda p: 4 * math.sqrt(p * (1 - p) / n)  # noqa: E731
    assert abs(f_cold - p_cold) < tol(p_cold), f_cold
    assert abs(f_hot - p_hot) < tol(p_hot), f_hot


def test_unknown_sequence_is_a_key_error():
    s = opened({0: SamplingParams()})
    with pytest.raises(KeyError):
        s.sample([1], logits(1))


# ---- Sampler.step: forks and logprobs -----------------------------------------------

def test_step_without_logprobs_gives_plain_entries():
    s = opened({0: SamplingParams(greedy=True), 1: SamplingParams(temperature=1.0, seed=3)})
    x = logits(2)
    entries = s.step([0, 1], x)
    assert [len(e) for e in entries] == [2, 2] and entries[0] == [0, int(x[0].argmax())]


def test_step_logprobs_are_the_raw_log_softmax_whatever_the_sampling():
    """The sampled token's logprob and the top tokens' come from the model's raw logits
    (what OpenAI reports), not from the temperature/penalty-shaped distribution drawn from."""
    s = opened({0: SamplingParams(greedy=True, logprobs=True, top_logprobs=5),
                1: SamplingParams(temperature=3.0, repetition_penalty=1.5, seed=9, logprobs=True, top_logprobs=2),
                2: SamplingParams(greedy=True)})
    x = logits(3, 7)
    entries = s.step([0, 1, 2], x)
    ref = torch.log_softmax(x, -1)
    seq, tok, lp, top = entries[0]
    assert tok == top[0][0] and lp == top[0][1]        # greedy: the sampled token is the likeliest
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert all(math.isclose(v, ref[0, t].item(), rel_tol=1e-6) for t, v in top)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    _, tok1, lp1, top1 = entries[1]
    assert math.isclose(lp1, ref[1, tok1].item(), rel_tol=1e-6) and lp1 <= 0 and len(top1) == 2
    assert len(entries[2]) == 2                          # this row did not ask


def test_step_logprobs_without_top_and_the_floor():
    s = opened({0: SamplingParams(greedy=True, logprobs=True)})
    x = torch.full((1, VOCAB), float("-inf"))
    x[0, 4] = 0.0
    [[_, tok, lp, top]] = s.step([0], x)
    assert (tok, lp, top) == (4, 0.0, [])
    s2 = opened({0: SamplingParams(greedy=True, logprobs=True, top_logprobs=3)})
    [[_, _, _, top]] = s2.step([0], x)
    assert top[0] == [4, 0.0] and all(v == -9999.0 for _, v in top[1:])   # -inf: OpenAI's floor, JSON-safe


def test_step_samples_forks_from_their_parents_row():
    prompt = [1, 2, 3]
    s = opened({10: SamplingParams(greedy=True), 20: SamplingParams(greedy=True, logprobs=True, top_logprobs=1)},
               prompt)
    for c, p in ((11, SamplingParams(greedy=True)), (12, SamplingParams(greedy=True, logprobs=True)),
                 (21, SamplingParams(greedy=True))):
        s.open(c, p, prompt)
    x = logits(2, 5)
    entries = s.step([10, 20], x, {10: [11, 12], 20: [21]})
    assert [e[0] for e in entries] == [10, 20, 11, 12, 21]
    a, b = int(x[0].argmax()), int(x[1].argmax())
    assert [e[1] for e in entries] == [a, b, a, a, b]
    assert len(entries[3]) == 4 and entries[3][3] == [] and len(entries[2]) == 2


def test_choice_seeds_differ_and_keep_the_first():
    from engine.core.sampling import choice_seed

    seeds = [choice_seed(1234, i) for i in range(16)]
    assert seeds[0] == 1234 and len(set(seeds)) == 16
    assert all(0 <= x < 2**63 for x in seeds)
    assert seeds == [choice_seed(1234, i) for i in range(16)]


# ---- presence and frequency penalties (OpenAI's) --------------------------------------

def expected_penalized(x: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition, written out: logits[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    out = x.clone()
    for j in range(x.numel()):
        c = generated.count(j)
        out[j] -= c * frequency + (c > 0) * presence
    return out


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (1.0, 0.0), (0.7, 0.4), (-2.0, 2.0), (-1.0, -0.5)])
def test_penalties_follow_openais_definition(presence, frequency):
    """Greedy decoding with penalties is argmax of the penalized logits, step after step,
    counting only what this sequence generated (the prompt's tokens do not count)."""
    prompt = [3, 4, 5]
    s = opened({0: SamplingParams(greedy=True, presence_penalty=presence, frequency_penalty=frequency)}, prompt)
    generated: list[int] = []
    for step in range(40):
        x = torch.randn(1, 8, generator=torch.Generator().manual_seed(step)) * 0.5
        x[0, 3] += 0.5   # a prompt token the model likes: penalised only once generated
        want = int(expected_penalized(x[0], generated, presence, frequency).argmax())
        got = s.sample([0], x)[0]
        assert got == want, (step, generated)
        generated.append(got)
    if presence + frequency > 0:
        assert len(set(generated)) > 3     # the penalties really push the reply around


def test_penalties_change_what_is_drawn_but_not_the_logits_or_a_batch_mate():
    x = torch.tensor([[0.0, 2.0, 1.8, -1.0]])
    before = x.clone()
    s = opened({0: SamplingParams(greedy=True, presence_penalty=0.3),
                1: SamplingParams(greedy=True)}, prompt=[1])
    assert s.sample([0, 1], x.repeat(2, 1)) == [1, 1]   # the prompt's token 1 is not penalised
    assert s.sample([0, 1], x.repeat(2, 1)) == [2, 1]   # generated once: 2.0 - 0.3 < 1.8
    assert s.sample([0, 1], x.repeat(2, 1)) == [1, 1]   # 1.7 > 1.8 - 0.3: presence counts once
    assert torch.equal(x, before)
    f = opened({0: SamplingParams(greedy=True, frequency_penalty=0.15)}, prompt=[])
    # token 1 at 2.0, 1.85, 1.7 after 0, 1, 2 draws; token 2 at 1.8, then 1.65 once drawn
    assert [f.sample([0], x)[0] for _ in range(4)] == [1, 1, 2, 1]


def test_penalties_keep_masked_tokens_out():
    from collections import Counter

    from engine.model.draw import penalize

    s = opened({0: SamplingParams(greedy=True, presence_penalty=-2.0, frequency_penalty=-2.0,
                                  repetition_penalty=0.5)}, prompt=[0])
    s._counts[0] = Counter({0: 3, 1: 1})
    row = torch.tensor([[float("-inf"), 1.0, 0.5]])
    penalize(row, s._penalties([0]))
    assert row[0, 0] == float("-inf") and row[0, 1] == 1.0 + 2.0 + 2.0 and row[0, 2] == 0.5


def test_seeded_penalized_sampling_is_reproducible_and_differs_from_unpenalized():
    def draws(p):
        s = opened({0: p})
        return [s.sample([0], logits(1, 77 + t))[0] for t in range(40)]

    p = SamplingParams(temperature=0.8, seed=5, presence_penalty=1.0, frequency_penalty=1.0)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(temperature=0.8, seed=5))


def run_steps(s: Sampler, seq: int, start: int, steps: int) -> list[int]:
    """Greedy steps on logits fixed by position: what a replayed sequence sees again."""
    out = []
    for pos in range(start, start + steps):
        x = torch.randn(1, 12, generator=torch.Generator().manual_seed(pos)) * 0.3
        out.append(s.sample([seq], x)[0])
    return out


@pytest.mark.parametrize("params", [SamplingParams(greedy=True, presence_penalty=0.8, frequency_penalty=0.6),
                                    SamplingParams(temperature=0.9, seed=42, frequency_penalty=1.2,
                                                   repetition_penalty=1.1)])
def test_a_replayed_sequence_counts_what_it_generated_before(params):
    """After a rearrangement the new last stage opens the sequence with prompt + generated
    and `replayed` = how many of those it generated: it goes on exactly as an
    uninterrupted run (the generated tokens count, the prompt's still do not)."""
    prompt = [1, 1, 2, 3, 5]
    whole = opened({0: params}, prompt)
    reference = run_steps(whole, 0, 0, 30)
    first = opened({0: params}, prompt)
    before = run_steps(first, 0, 0, 12)
    assert before == reference[:12]
    again = Sampler()
    again.open(0, params, prompt + before, replayed=len(before))
    assert run_steps(again, 0, 12, 18) == reference[12:]
    # counting the whole history (or none of it) would not be the same reply
    wrong = Sampler()
    wrong.open(0, params, prompt + before, replayed=0)
    assert run_steps(wrong, 0, 12, 18) != reference[12:]


def test_each_choice_counts_its_own_tokens():
    """n > 1: a fork starts from its parent's prompt with no counts of its own, and what
    one choice generates never penalises another."""
    prompt = [7, 8]
    p = SamplingParams(temperature=1.0, seed=3, presence_penalty=1.5, frequency_penalty=0.5)
    s = Sampler()
    s.open(10, p, prompt)
    x = logits(1, 900)
    s.step([10], x, None)
    # the fork, opened after its parent has drawn a token, must not inherit that count
    s.open_fork(11, 10, 99, prompt)
    alone = Sampler()
    alone.open(11, SamplingParams(temperature=1.0, seed=99, presence_penalty=1.5, frequency_penalty=0.5), prompt)
    for t in range(20):
        y = logits(1, 901 + t)
        both = s.step([10, 11], y.repeat(2, 1))
        assert both[1][1] == alone.step([11], y)[0][1]


def test_penalties_leave_logprobs_raw():
    s = opened({0: SamplingParams(greedy=True, presence_penalty=2.0, frequency_penalty=2.0, logprobs=True,
                                  top_logprobs=2)}, prompt=[])
    x = torch.tensor([[3.0, 2.9, -1.0, -2.0]])
    first = s.step([0], x)[0]
    second = s.step([0], x)[0]
    assert first[1] == 0 and second[1] == 1               # token 0 penalised after it was drawn
    ref = torch.log_softmax(x[0], -1)
    assert math.isclose(second[2], ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in second[3]] == [0, 1]            # the raw model's ranking, not the penalised one


# ---- verification rows (speculative decoding, issue 34) --------------------------------

def test_a_verification_row_draws_what_plain_decoding_draws_at_each_position():
    """A row of k + 1 logits answers k + 1 tokens, each the one plain decoding draws at
    that position: greedy the argmax, seeded sampling from draw_seed(seed, position),
    so the head's comparison with the draft keeps seeded replies reproducible."""
    import torch

    from engine.model.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.9, seed=11, top_p=0.9)):
        plain = Sampler()
        plain.open(1, params, list(range(10)))
        # plain decoding: one token per step, positions 10, 11, ... (start + n of each step)
        want = [plain.step([1], logits[i:i + 1], positions=[10 + i])[0][1] for i in range(5)]
        spec = Sampler()
        spec.open(1, params, list(range(10)))
        # a verification row starting at 9 (the last token) with 4 drafted: positions 10..14
        got = spec.step([1], logits, keep=[5], positions=[10])
        assert [e[1] for e in got] == want and all(e[0] == 1 for e in got)
        # a plain row after it, told where the sequence really is, draws as plain decoding would
        again = spec.step([1], logits[2:3], positions=[12])
        assert again[0][1] == plain.step([1], logits[2:3], positions=[12])[0][1]


def test_a_verification_row_is_refused_where_each_token_needs_its_own_step():
    import pytest
    import torch

    from engine.model.sampler import Sampler, speculable

    for params in (SamplingParams(greedy=True, logprobs=True), SamplingParams(greedy=True, json_schema={})):
        assert not speculable(params)
    s = Sampler()
    s.open(1, SamplingParams(greedy=True, logprobs=True), [1, 2])
    with pytest.raises(ValueError, match="speculative"):
        s.step([1], torch.zeros(3, 8), keep=[3], positions=[2])
    assert speculable(SamplingParams(greedy=True)) and speculable(SamplingParams(temperature=0.5, seed=1))
    # penalties verify too (their per-position tests below)
    assert speculable(SamplingParams(presence_penalty=0.5)) and speculable(SamplingParams(repetition_penalty=1.2))


# ---- verification rows with penalties (issue 34) ---------------------------------------

PENALIZED = [SamplingParams(greedy=True, repetition_penalty=1.3),
             SamplingParams(greedy=True, presence_penalty=1.5, frequency_penalty=0.7),
             SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=5),
             SamplingParams(temperature=0.9, seed=11, presence_penalty=0.8, frequency_penalty=1.2,
                            repetition_penalty=1.2)]


def _peaky(n: int, seed: int) -> torch.Tensor:
    """Logits whose top few tokens are close, so the penalties change the picks."""
    x = torch.randn(n, 12, generator=torch.Generator().manual_seed(seed))
    x[:, :3] += 4.0
    return x


def _state(s: Sampler, sid: int):
    return list(s._history.get(sid, [])), dict(s._counts.get(sid) or {}), s._pos[sid]


def _draft(want: list[int], accepted: int, n: int) -> list[int]:
    """A draft of n tokens whose first `accepted` are plain decoding's, the rest wrong."""
    return [want[i] if i < accepted else (want[i] + 1) % 12 for i in range(n)]


@pytest.mark.parametrize("params", PENALIZED, ids=["rep", "presence+frequency", "chat", "all"])
def test_a_penalized_verification_row_draws_what_plain_decoding_would_and_rolls_back(params):
    """A verification row's picks are plain decoding's after each prefix of its draft
    (wherever the draft held so far, which is where a pick is used); the next step's
    position rolls the rejected ones out of the history and the counts, leaving exactly
    plain decoding's state after the accepted tokens + the bonus."""
    prompt = [0, 1, 2, 0, 5]
    rows = _peaky(40, 3)
    plain = Sampler()
    plain.open(1, params, prompt)
    # plain decoding: one row per step at positions 5, 6, ...
    want = [plain.step([1], rows[i:i + 1], positions=[5 + i])[0][1] for i in range(12)]
    assert len(set(want)) > 1
    for accepted in (0, 2, 4):   # of a draft of 4: 0, 2 or all 4 accepted (picks kept: + 1)
        spec = Sampler()
        spec.open(1, params, prompt)
        got = [e[1] for e in spec.step([1], rows[0:5], keep=[5], positions=[5],
                                       drafts={1: _draft(want, accepted, 4)})]
        kept = accepted + 1
        assert got[:kept] == want[:kept]     # the picks the head uses: plain decoding's
        # the next step (a plain row at the position after the kept picks) rolls back the rest
        nxt = spec.step([1], rows[kept:kept + 1], positions=[5 + kept])[0][1]
        assert nxt == want[kept]
        ref = Sampler()
        ref.open(1, params, prompt)
        for i in range(kept + 1):
            ref.step([1], rows[i:i + 1], positions=[5 + i])
        assert _state(spec, 1) == _state(ref, 1)
        # and another verification row from there agrees too
        start = kept + 1
        got = [e[1] for e in spec.step([1], rows[start:start + 4], keep=[4], positions=[5 + start],
                                       drafts={1: want[start:start + 3]})]
        assert got == want[start:start + 4]


def test_a_penalized_verification_rolls_back_after_another_verification_and_a_replay():
    params = SamplingParams(temperature=0.8, seed=2, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.2)
    prompt = [3, 4, 3]
    rows = _peaky(30, 8)
    plain = Sampler()
    plain.open(7, params, prompt)
    want = [plain.step([7], rows[i:i + 1], positions=[3 + i])[0][1] for i in range(10)]
    spec = Sampler()
    spec.open(7, params, prompt)
    # two verification steps in a row: 1 of 3 drafted accepted (2 kept), then all of 3
    got = [e[1] for e in spec.step([7], rows[0:4], keep=[4], positions=[3], drafts={7: _draft(want, 1, 3)})]
    assert got[:2] == want[:2]
    assert [e[1] for e in spec.step([7], rows[2:6], keep=[4], positions=[5], drafts={7: want[2:5]})] == want[2:6]
    assert [e[1] for e in spec.step([7], rows[6:7], positions=[9])] == [want[6]]
    ref = Sampler()
    ref.open(7, params, prompt)
    for i in range(7):
        ref.step([7], rows[i:i + 1], positions=[3 + i])
    assert _state(spec, 7) == _state(ref, 7)
    # a replay (failover) rebuilds the counts from the frame: the accepted tokens only
    replayed = Sampler()
    replayed.open(7, params, prompt + want[:7], replayed=7)
    assert _state(replayed, 7) == _state(ref, 7)
    assert [e[1] for e in replayed.step([7], rows[7:10], keep=[3], positions=[10], drafts={7: want[7:9]})] \
        == want[7:10]


def test_a_steps_verification_rows_are_drawn_together_and_as_each_alone(monkeypatch):
    """Two penalized verification rows and a plain row: one draw for both verification
    rows (one read of the picks, not one per position), and each row's picks are what it
    draws alone."""
    import engine.model.sampler as sampler_mod

    prompts = {1: [0, 1, 2, 0, 5], 2: [3, 4, 3], 3: [7, 7]}
    params = {1: PENALIZED[2], 2: PENALIZED[3], 3: SamplingParams(temperature=0.9, seed=4)}
    rows = _peaky(12, 5)
    drafts = {1: [0, 2, 1, 0], 2: [1, 1]}

    def opened():
        s = Sampler()
        for sid in prompts:
            s.open(sid, params[sid], prompts[sid])
        return s

    alone = opened()
    want = [e[1] for e in alone.step([1], rows[0:5], keep=[5], drafts={1: drafts[1]})]
    want += [e[1] for e in alone.step([2], rows[5:8], keep=[3], drafts={2: drafts[2]})]
    want += [e[1] for e in alone.step([3], rows[8:9])]
    calls = []
    real = sampler_mod.draw
    monkeypatch.setattr(sampler_mod, "draw", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    together = opened()
    got = together.step([1, 2, 3], rows[0:9], keep=[5, 3, 1], drafts=drafts)
    assert sorted(calls) == [1, 8]       # the plain row's own draw, and one for 5 + 3 positions
    assert [e[1] for e in got if e[0] == 1] == want[0:5]
    assert [e[1] for e in got if e[0] == 2] == want[5:8]
    assert [e[1] for e in got if e[0] == 3] == want[8:9]
    assert {sid: _state(together, sid) for sid in prompts} == {sid: _state(alone, sid) for sid in prompts}


def test_a_penalized_verification_row_without_its_draft_is_refused():
    s = Sampler()
    s.open(1, PENALIZED[0], [1, 2])
    with pytest.raises(ValueError, match="drafted tokens"):
        s.step([1], torch.zeros(3, 12), keep=[3], positions=[2])
    with pytest.raises(ValueError, match="drafted tokens"):
        s.step([1], torch.zeros(3, 12), keep=[3], positions=[2], drafts={1: [4]})
    # the frame checks a draft's ids against 2**31; the vocabulary is the sampler's to check
    # (an index on the device, where an out-of-range one is no clean error)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.step([1], torch.zeros(3, 12), keep=[3], positions=[2], drafts={1: [4, 12]})
