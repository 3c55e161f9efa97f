"""SpecPolicy: k per sequence from measured acceptance, trip, draft and verification
cost; off on fast links, when busy, and for content the draft cannot guess (re-probed)."""

from __future__ import annotations

import random

import pytest

from engine.core.speculation import SpecConfig, SpecPolicy, best_k, expected_tokens, fit_line, round_time


def policy(trip=None, draft=None, verify=None, **cfg) -> SpecPolicy:
    p = SpecPolicy(SpecConfig(**cfg))
    if trip is not None:
        p.observe_trip(trip)
    if draft is not None:
        p.observe_draft(draft)
    if verify is not None:
        p.observe_verify_extra(verify)
    return p


def feed(p: SpecPolicy, seq: int, a: float, rounds: int, k: int = 4, seed: int = 0) -> None:
    """Rounds drafting k tokens, each standing with probability a until the first miss."""
    rng = random.Random(seed)
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        p.observe_round(seq, k, n)


# ---- the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_expected_tokens_is_the_sum_of_the_prefix_probabilities(a, k):
    assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))


def test_expected_tokens_values():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 7) == 1.0
    # by simulation: the accepted prefix of k Bernoulli(a) guesses, plus the target's token
    rng, a, k = random.Random(5), 0.7, 3
    total = 0
    for _ in range(40_000):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        total += n + 1
    assert total / 40_000 == pytest.approx(expected_tokens(a, k), abs=0.02)


def test_round_time_and_best_k():
    assert round_time(3, 0.1, 0.01, 0.002, sharers=2) == pytest.approx(0.1 + 2 * 3 * 0.012)
    assert best_k(0.8, 0.03, 0.0005, 0.002, k_max=8) == 6      # see test below for the arithmetic
    assert best_k(0.8, 0.03, 0.0005, 0.002, k_max=3) == 3      # capped
    assert best_k(0.0, 0.03, 0.0, 0.0, k_max=8) == 0           # nothing is ever accepted
    # free verification and a perfect draft: as many as allowed
    assert best_k(1.0, 0.03, 0.0, 0.0, k_max=5) == 5


def test_guesses_drafted_ahead_cost_only_their_verification():
    """A round that finds guesses drafted ahead (during the last trip) pays the draft model
    only for the ones beyond them: it takes what is there, and more only where that pays."""
    assert round_time(4, 0.18, 0.06, 0.02, free=3) == pytest.approx(0.18 + 4 * 0.02 + 0.06)
    assert round_time(2, 0.18, 0.06, 0.02, free=3) == pytest.approx(0.18 + 2 * 0.02)
    # this machine's numbers (bench/speculative.py): a 180 ms trip, a 60 ms draft token
    assert best_k(0.94, 0.18, 0.06, 0.02, k_max=8) == 5
    assert best_k(0.94, 0.18, 0.06, 0.02, k_max=8, free=3) == 3      # no paid token beats three free ones
    assert best_k(0.94, 0.18, 0.06, 0.02, k_max=8, free=8) == 8
    # a poor draft is not worth paying for, but free guesses still are
    assert best_k(0.5, 0.18, 0.06, 0.02, k_max=8) == 0
    assert best_k(0.5, 0.18, 0.06, 0.02, k_max=8, free=4) == 2
    p = SpecPolicy()
    p.observe_trip(0.18), p.observe_draft(0.06), p.observe_verify_extra(0.02)
    assert (p.k_for(1), p.k_for(1, free=8)) == (0, 2)   # at the prior's acceptance, 0.5
    p.set_load(5)
    assert p.busy and p.k_for(1, free=8) == 0
    p.set_load(2, full=True)                 # two sequences, but every stage has a micro-batch to do
    assert p.busy and p.k_for(1, free=8) == 0
    p.set_load(2)
    assert not p.busy and p.k_for(1, free=8) > 0


def test_drafting_ahead_only_where_a_trip_has_time_for_guesses_that_pay():
    p = SpecPolicy()
    assert not p.ahead_pays(1)                       # no trip timed yet
    p.observe_trip(0.09), p.observe_verify_extra(0.01, k=1), p.observe_draft(0.11)
    assert p.ahead_pays(1)                           # untried: try it
    assert not p.ahead_pays(1, untried=False)        # ... but not with a prompt's prefill
    p.observe_ahead(0.06)
    assert not p.ahead_pays(1)                       # a fast link: one position a trip, the target's token
    p.observe_trip(0.4)
    assert p.ahead_pays(1) and p.ahead_pays(1, untried=False)   # the link got slower
    p = SpecPolicy()
    p.observe_trip(0.19), p.observe_draft(0.11), p.observe_verify_extra(0.04, k=1), p.observe_ahead(0.06)
    assert p.ahead_pays(1)                           # 30 ms links: two guesses and the target's token
    for _ in range(30):
        p.observe_round(1, 4, 0)                     # a sequence the draft never guesses
    assert not p.ahead_pays(1) and p.ahead_pays(2)
    p.set_load(5)
    assert not p.ahead_pays(2)                       # busy: nobody drafts
    p = SpecPolicy()                                 # a position's time is kept per load
    p.observe_trip(0.19), p.observe_draft(0.11), p.observe_verify_extra(0.001, k=1), p.observe_ahead(0.06)
    p.set_load(2)
    assert p.ahead_pays(1)                           # untried at two users: try it
    p.observe_ahead(0.3)                             # two rows a position, beside busier stages
    assert not p.ahead_pays(1)
    p.set_load(1)
    assert p.ahead_pays(1)                           # the burst's timing is not the lone user's


def test_a_verification_costs_what_steps_of_its_size_measured():
    """On one CPU thread the first extra token of a step costs most (a matrix-vector
    product becomes a matrix product) and the next ones little: with two sizes timed the
    policy draws a line through them instead of charging every token the first's price."""
    p = SpecPolicy()
    p.observe_trip(0.18), p.observe_draft(0.06)
    p.observe_verify_extra(0.04, k=1)
    assert p.verify_cost(4) == pytest.approx(4 * 0.04)       # one size seen: k times it
    p.observe_verify_extra(0.05 / 4, k=4)
    assert p.verify_cost(1) == pytest.approx(0.04) and p.verify_cost(4) == pytest.approx(0.05)
    assert p.verify_cost(8) == pytest.approx(0.04 - 0.01 / 3 + 8 * 0.01 / 3)
    assert p.verify_cost(0) == 0.0
    # the line lets it draft more than a per-token price would
    assert best_k(0.94, 0.18, 0.06, lambda k: k * 0.04, k_max=8) == 4
    assert best_k(0.94, 0.18, 0.06, p.verify_cost, k_max=8) == 7
    # a fit that would start below zero goes through the origin; a negative slope is flat
    assert fit_line({1: 0.01, 3: 0.05}) == (0.0, pytest.approx(0.016))
    assert fit_line({2: 0.05, 6: 0.03}) == (pytest.approx(0.04), 0.0)


def test_margin_keeps_a_marginal_gain_off():
    # k = 1 gains 4%: 1.3 tokens in 1.25 trips
    assert best_k(0.3, 1.0, 0.25, 0.0, k_max=1, margin=0.05) == 0
    assert best_k(0.3, 1.0, 0.25, 0.0, k_max=1, margin=0.03) == 1


# ---- decisions ------------------------------------------------------------------------------


def test_nothing_measured_no_speculation():
    p = policy()
    assert p.k_for(1) == 0
    p.observe_trip(0.1)
    assert p.k_for(1) > 0          # the prior (0.5) with a slow trip: worth a try


def test_fast_link_stays_off():
    # a LAN pipeline of CPU stages: a 10 ms step that is mostly compute, and an extra
    # token costs 8 ms of it; even a good draft (a = 0.8: 1.8 tokens in 18.1 ms, 99 tok/s
    # against 100) does not pay
    p = policy(trip=0.010, draft=0.0001, verify=0.008)
    feed(p, 1, 0.8, 50)
    assert p.acceptance(1) > 0.65
    assert [p.k_for(1) for _ in range(40)] == [0] * 40        # and no re-probes: content is not why
    # the same draft across homes: on
    p.observe_trip(1.0)
    assert p.k_for(1) > 0


def test_slow_link_cheap_draft_high_acceptance_drafts_several():
    # 30 ms trip (the arithmetic: a = 0.8, per token 2.5 ms; E(6) / T(6) = 3.95 / 0.045
    # = 88 tok/s against 33 plain)
    p = policy(trip=0.030, draft=0.0005, verify=0.002)
    feed(p, 7, 0.85, 60)
    assert p.acceptance(7) > 0.75
    k = p.k_for(7)
    assert k >= 3
    s = p.stats()
    assert s["sequences"][7]["k"] == k
    assert s["tokens_per_trip"] > 2.5 and 0.5 < s["acceptance"] <= 1.0


def test_low_acceptance_turns_off_then_reprobes_and_recovers():
    # a model draft across homes: 100 ms trip, 10 ms per drafted token
    cfg = dict(reprobe_every=8)
    p = policy(trip=0.1, draft=0.010, verify=0.002, **cfg)
    assert p.k_for(3) > 0                   # the prior tries
    feed(p, 3, 0.05, 30)                    # chat the draft cannot guess
    assert p.acceptance(3) < 0.15
    ks = [p.k_for(3) for _ in range(24)]
    # off, with a k = 1 probe every 8th round
    assert ks == ([0] * 7 + [1]) * 3
    # the reply starts quoting: the probes succeed and it comes back on
    rounds = 0
    while p.k_for(3) < 2:
        k = p.stats()["sequences"][3]["k"]
        p.observe_round(3, k, k)           # every probe stands
        rounds += 1
        assert rounds < 40
    assert p.acceptance(3) > 0.3


def test_busy_pipeline_turns_it_off_and_load_shrinks_k():
    p = policy(trip=0.05, draft=0.001, verify=0.003)
    feed(p, 1, 0.8, 60)
    alone = p.k_for(1)
    assert alone >= 3
    p.set_load(3)                # everyone's extra tokens lengthen everyone's round
    shared = p.k_for(1)
    assert 0 < shared < alone
    p.set_load(5)                # above busy_above (4): off, and no probes either
    assert [p.k_for(1) for _ in range(40)] == [0] * 40
    p.set_load(1)
    assert p.k_for(1) == alone
    assert policy(trip=0.05, busy_above=8).config.busy_above == 8


def test_acceptance_estimate_counts_truncated_rounds_right():
    # without forgetting, long runs estimate a itself; kept / drafted would not
    # (a = 0.7, k = 4: kept / drafted is E[n] / 4 = 0.44)
    p = policy(memory=1.0)
    feed(p, 1, 0.7, 3000, k=4, seed=11)
    assert p.acceptance(1) == pytest.approx(0.7, abs=0.02)
    assert p.stats()["sequences"][1]["acceptance"] == pytest.approx(0.44, abs=0.02)


def test_plain_rounds_count_as_trips_but_not_as_evidence():
    p = policy(trip=0.1)
    before = p.acceptance(2)
    p.observe_round(2, 0, 0)
    p.observe_round(2, 3, 3)
    assert p.acceptance(2) > before
    after = p.acceptance(2)
    p.observe_round(2, 0, 0)
    assert p.acceptance(2) == after
    s = p.stats()
    assert s["rounds"] == 3 and s["tokens_per_trip"] == pytest.approx(6 / 3)
    assert s["sequences"][2]["tokens_per_trip"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        p.observe_round(2, 1, 2)


def test_measurements_are_smoothed_and_noise_is_tolerated():
    p = policy(trip=0.1)
    p.observe_trip(0.2)
    assert p.trip == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
    p.observe_trip(-1.0)
    p.observe_trip(float("nan"))
    assert p.trip == pytest.approx(0.12)
    p.observe_verify_extra(-0.001)          # a noisy difference: free, not a gain
    assert p.verify_extra == 0.0
    p.observe_verify_extra(0.004)
    assert p.verify_extra == pytest.approx(0.2 * 0.004)


def test_deterministic_and_forgets_dropped_sequences():
    def run():
        p = policy(trip=0.08, draft=0.002, verify=0.001, reprobe_every=4)
        out = []
        for r in range(60):
            for seq in (1, 2):
                k = p.k_for(seq)
                out.append(k)
                rng = random.Random(r * 10 + seq)
                n = 0
                while n < k and rng.random() < (0.9 if seq == 1 else 0.1):
                    n += 1
                p.observe_round(seq, k, n)
        return out, p

    a, p = run()
    b, _ = run()
    assert a == b
    assert set(p.stats()["sequences"]) == {1, 2}
    p.drop(1)
    assert set(p.stats()["sequences"]) == {2} and p.stats()["rounds"] == 120
    assert p.acceptance(1) == pytest.approx(0.5)       # back to the prior


def test_config_is_checked():
    with pytest.raises(ValueError):
        SpecConfig(prior_accept=1.0)
    with pytest.raises(ValueError):
        SpecConfig(busy_above=0)
    assert policy(trip=0.1, k_max=0).k_for(1) == 0


# ---- starting gently ------------------------------------------------------------------------


def test_k_is_one_until_the_verification_and_the_draft_are_timed():
    # a slow trip and a good draft: unmeasured costs would read as free and k as k_max
    p = policy(trip=0.1)
    feed(p, 1, 0.9, 30)
    assert not p.measured
    assert p.k_for(1) == 1
    p.observe_draft(0.0005)
    assert p.k_for(1) == 1                  # the verification is still untimed
    p.observe_verify_extra(0.002)
    assert p.measured and p.stats()["measured"]
    assert p.k_for(1) > 2                   # now the model speaks
    # the verification timed first, the draft not yet: still gentle
    q = policy(trip=0.1, verify=0.002)
    feed(q, 1, 0.9, 30)
    assert q.k_for(1) == 1
    # off stays off: gentle never turns a 0 into a 1
    assert policy(trip=0.010, k_max=8).k_for(2) in (0, 1)
    r = policy(trip=0.010, draft=0.0001, verify=0.008)
    assert r.k_for(1) == 0


def test_busy_counts_every_active_sequence_not_the_step_rows():
    # four micro-batches of two: a step carries two decode rows, the pipeline holds eight
    p = policy(trip=0.05, draft=0.001, verify=0.003)
    feed(p, 1, 0.8, 60)
    p.set_load(8)
    assert p.k_for(1) == 0
    assert p.stats()["active"] == 8
