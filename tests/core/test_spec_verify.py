"""Verifying drafts: greedy is token for token plain greedy decoding; sampling emits what
the target alone would, in distribution (a chi-square test over thousands of seeded
draws, first token and the first two jointly) and, for a deterministic draft with
per-position generators, token for token."""

from __future__ import annotations

import math
import random
from collections import Counter
from statistics import NormalDist

import pytest
import torch

from engine.core.spec_verify import Verdict, verify_greedy, verify_sampled
from engine.model.sampler import draw_seed

# ---- greedy -------------------------------------------------------------------------------


def test_greedy_accepts_the_longest_agreeing_prefix():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == Verdict(3, 7)   # all stand, bonus 7
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == Verdict(1, 9)   # 5 rejected: 9 instead
    assert verify_greedy([4, 5, 6], [1, 5, 6, 7]) == Verdict(0, 1)   # agreement after a miss counts for nothing
    assert verify_greedy([], [3]) == Verdict(0, 3)                   # k = 0: a plain step
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def _greedy_lm(vocab: int = 7, seed: int = 3):
    """A toy target: its greedy choice is a fixed function of the last two tokens."""
    table = torch.randint(vocab, (vocab, vocab), generator=torch.Generator().manual_seed(seed)).tolist()
    return lambda ctx: table[ctx[-2]][ctx[-1]]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_with_any_draft_is_plain_greedy(k):
    lm, vocab = _greedy_lm(), 7
    plain = [1, 2]
    while len(plain) < 42:
        plain.append(lm(plain))
    rng = torch.Generator().manual_seed(k)
    spec, rounds = [1, 2], 0
    while len(spec) < 42:
        # a draft that is right half the time: sometimes the target's own choices, sometimes noise
        draft, ctx = [], list(spec)
        for _ in range(k):
            t = lm(ctx) if torch.rand(1, generator=rng).item() < 0.7 else int(torch.randint(vocab, (1,), generator=rng))
            draft.append(t)
            ctx.append(t)
        argmax = [lm(spec + draft[:i]) for i in range(k + 1)]
        n, nxt = verify_greedy(draft, argmax)
        spec += draft[:n] + [nxt]
        rounds += 1
    assert spec[:42] == plain
    assert rounds < 40     # some rounds emitted more than one token


# ---- sampled: exact cases -------------------------------------------------------------------


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_sampled_edge_cases():
    g = torch.Generator().manual_seed(0)
    # k = 0: a draw from p[0]; a token with probability 0 is never drawn
    assert {verify_sampled([], None, _probs([0.0, 1.0, 0.0]), g) for _ in range(50)} == {Verdict(0, 1)}
    # a drafted token the target rules out never stands, deterministic draft or model draft
    p = _probs([0.0, 0.5, 0.5], [1.0, 0.0, 0.0])
    for _ in range(50):
        assert verify_sampled([0], None, p, g).n_accepted == 0
        assert verify_sampled([0], _probs([1.0, 0.0, 0.0]), p, g).n_accepted == 0
        assert verify_sampled([7], None, p, g).n_accepted == 0        # outside the vocabulary
        assert verify_sampled([7], _probs([1.0, 0.0, 0.0]), p, g).n_accepted == 0
    # a certain token always stands, and the bonus comes from the last row
    p = _probs([0.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    assert verify_sampled([1], None, p, g) == Verdict(1, 2)
    # p == q: every draft stands (the residual would be empty, never reached)
    q = _probs([0.2, 0.3, 0.5])
    for _ in range(50):
        assert verify_sampled([int(torch.multinomial(q[0], 1, generator=g))], q,
                              torch.cat([q, _probs([1.0, 0.0, 0.0])]), g).n_accepted == 1
    # a rejection that leaves max(p - q, 0) empty (both rule the drafted token out, and
    # agree elsewhere): the next token comes from p
    pq = _probs([0.0, 0.5, 0.5])
    seen = {verify_sampled([0], pq, torch.cat([pq, _probs([1.0, 0.0, 0.0])]), g) for _ in range(50)}
    assert seen == {Verdict(0, 1), Verdict(0, 2)}
    with pytest.raises(ValueError):
        verify_sampled([1, 2], None, _probs([1.0, 0.0, 0.0]), g)
    with pytest.raises(ValueError):
        verify_sampled([1], _probs([1.0, 0.0]), _probs([1.0, 0.0, 0.0], [1.0, 0.0, 0.0]), g)
    with pytest.raises(ValueError):
        verify_sampled([1], None, _probs([1.0, 0.0, 0.0], [1.0, 0.0, 0.0]), [g])


def test_draw_contract_per_position():
    """What the module promises, checked against a generator's state: positions after the
    emitted token are not touched; a model draft draws one uniform per examined position
    (plus one multinomial where it rejects or at the bonus)."""
    def fresh():
        return [torch.Generator().manual_seed(100 + i) for i in range(4)]

    def used(gens):
        return [not torch.equal(g.get_state(), torch.Generator().manual_seed(100 + i).get_state())
                for i, g in enumerate(gens)]

    # the target rejects draft[1] for sure: positions 0 and 1 draw, 2 and 3 do not
    p = _probs([0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
    gens = fresh()
    assert verify_sampled([1, 2, 2], None, p, gens) == Verdict(1, 0)
    assert used(gens) == [True, True, False, False]
    gens = fresh()
    q = _probs([0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0])
    assert verify_sampled([1, 2, 2], q, p, gens) == Verdict(1, 0)
    assert used(gens) == [True, True, False, False]
    # position 0 of a model draft: exactly one float64 uniform when it accepts
    gens = fresh()
    verify_sampled([1, 2, 2], q, p, gens)
    expect = torch.Generator().manual_seed(100)
    torch.zeros(1, dtype=torch.float64).uniform_(generator=expect)
    assert torch.equal(gens[0].get_state(), expect.get_state())


def _plain(probs_of, seed, start, n):
    """Plain seeded sampling as engine/model/sampler.py does it: a fresh generator per
    position from draw_seed, torch.multinomial(probs, 1)."""
    out = list(start)
    while len(out) < len(start) + n:
        g = torch.Generator().manual_seed(draw_seed(seed, len(out)))
        out.append(int(torch.multinomial(probs_of(out), 1, generator=g)))
    return out[len(start):]


def test_deterministic_draft_with_per_position_generators_is_plain_seeded_sampling():
    """Whatever k and whatever the draft: the same tokens as without speculation."""
    vocab = 5
    table = torch.rand(vocab, vocab, generator=torch.Generator().manual_seed(9)) ** 3
    table /= table.sum(-1, keepdim=True)

    def probs_of(ctx):
        return table[ctx[-1]]

    for seed in range(5):
        plain = _plain(probs_of, seed, [0], 30)
        for k in (1, 3, 6):
            out, rounds = [0], 0
            while len(out) < 31:
                # a cheap draft: the most likely next token, chained
                draft, last = [], out[-1]
                for _ in range(k):
                    last = int(table[last].argmax())
                    draft.append(last)
                ctx = out + draft
                target = torch.stack([probs_of(ctx[:len(out) + i]) for i in range(k + 1)])
                gens = [torch.Generator().manual_seed(draw_seed(seed, len(out) + i)) for i in range(k + 1)]
                n, nxt = verify_sampled(draft, None, target, gens)
                out += draft[:n] + [nxt]
                rounds += 1
            assert out[1:31] == plain, (seed, k)
            assert rounds < 30


# ---- sampled: in distribution ------------------------------------------------------------------
#
# A Markov target over V = 6 tokens (token 5 impossible everywhere), a start token, and
# two steps of generation: the first two emitted tokens must be distributed as P[start][a] *
# P[a][b], whether the draft is deterministic (a fixed guess per previous token) or a
# random draft model Q, and whether one round emitted both tokens or two rounds did.
#
# The test: Pearson's chi-square over the cells with a positive expectation, against the
# critical value at ALPHA = 1e-4 (Wilson-Hilferty's approximation to the chi-square
# quantile; at these degrees of freedom it errs high by a few percent, e.g. df = 4:
# 24.2 for the table's 23.51, so the false-alarm rate is at most ~1e-4 per check).
# Seeds are fixed, so the test is deterministic; a seed drawn at random would fail a
# correct verifier about once in 10,000 checks. Impossible cells must stay empty.
# Each case also shows the check has power: the counts reject the distribution a
# classic bug gives (on rejection, sampling from p instead of the residual).

V, START, N_DRAWS, ALPHA = 6, 0, 8_000, 1e-4


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    z = NormalDist().inv_cdf(1.0 - alpha)
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the cells expected > 0."""
    cells = [c for c, e in expected.items() if e > 0]
    stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    return stat, len(cells) - 1


def test_chi2_critical_values_against_the_table():
    # published quantiles (NIST/SEMATECH e-Handbook, 1.3.6.7.4, upper tail 0.001 and 0.0001)
    assert chi2_critical(10, 1e-3) == pytest.approx(29.588, rel=0.02)
    assert chi2_critical(30, 1e-3) == pytest.approx(59.703, rel=0.01)
    assert chi2_critical(4, 1e-4) == pytest.approx(23.513, rel=0.03)


def _chain(seed: int, zero_token: int | None):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(V, V, generator=g) + 0.05
    if zero_token is not None:
        t[:, zero_token] = 0.0
    return t / t.sum(-1, keepdim=True)


P = _chain(1, zero_token=5)                 # the target
Q = _chain(2, zero_token=None)              # a draft model: puts mass on the impossible token too
Q[:, 2] = 0.0                               # ... and none on token 2, which the target likes
Q /= Q.sum(-1, keepdim=True)
GUESS = [3, 5, 0, 1, 2, 3]                  # a deterministic draft: next guess after each token
K = 2


Q_ROWS = Q.tolist()
_stacks: dict = {}


def _stack(table: torch.Tensor, rows: tuple) -> torch.Tensor:
    # the [len(rows), V] distributions after each token in rows, built once (the test's
    # time goes to the verifier, not to the harness)
    key = (id(table), rows)
    if key not in _stacks:
        _stacks[key] = torch.stack([table[t] for t in rows])
    return _stacks[key]


def _two_tokens(model: bool, g: torch.Generator, rng: random.Random) -> tuple[int, int]:
    out = []
    while len(out) < 2:
        last = out[-1] if out else START
        draft, t = [], last
        for _ in range(K):
            # the draft model samples with its own randomness (Python's, for speed)
            t = rng.choices(range(V), Q_ROWS[t])[0] if model else GUESS[t]
            draft.append(t)
        q = _stack(Q, (last, *draft[:-1])) if model else None
        n, nxt = verify_sampled(draft, q, _stack(P, (last, *draft)), g)
        out += draft[:n] + [nxt]
    return out[0], out[1]


def _naive_first(model: bool) -> dict:
    """The first token's distribution under the classic bug: resample from p, not the residual."""
    p = P[START].double()
    if model:
        q = Q[START].double()
        accept = torch.minimum(p, q)               # q(x) * min(1, p(x) / q(x))
        wrong = accept + (1 - accept.sum()) * p
    else:
        x = GUESS[START]
        wrong = (1 - p[x]) * p
        wrong[x] += p[x]
    return {a: float(wrong[a]) for a in range(V)}


@pytest.mark.parametrize("model", [False, True], ids=["deterministic-draft", "model-draft"])
def test_sampled_output_is_distributed_as_the_target(model):
    g, rng = torch.Generator().manual_seed(2024 + model), random.Random(7)
    pairs = [_two_tokens(model, g, rng) for _ in range(N_DRAWS)]
    # every cell the test counts expects enough draws for the chi-square approximation
    assert min(N_DRAWS * float(P[START, a] * P[a, b]) for a in range(5) for b in range(5)) > 5
    first = Counter(a for a, _ in pairs)
    joint = Counter(pairs)
    exp_first = {a: float(P[START, a]) for a in range(V)}
    exp_joint = {(a, b): float(P[START, a] * P[a, b]) for a in range(V) for b in range(V)}

    assert first[5] == 0 and all(joint[(a, 5)] == 0 for a in range(V))    # impossible, never drawn
    stat, df = chi2(first, exp_first, N_DRAWS)
    assert df == 4 and stat < chi2_critical(df), stat
    stat, df = chi2(joint, exp_joint, N_DRAWS)
    assert df == 24 and stat < chi2_critical(df), stat
    # power: the same counts reject the biased scheme's distribution, by far
    wrong, _ = chi2(first, _naive_first(model), N_DRAWS)
    assert wrong > 5 * chi2_critical(4), wrong
