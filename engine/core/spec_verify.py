"""Verifying a draft on the last stage (issue 34): keep the longest prefix the target
model agrees with, and emit one token of the target's own after it.

The head sends a sequence's last token and its k drafted tokens through the pipeline as
one step of k + 1 rows; the last stage has the target's distribution after each prefix
(row i: after the context and draft[:i]) and decides here how many drafted tokens stand
and what comes next. Every round emits n_accepted + 1 tokens, 1 to k + 1, and the
output is the one plain decoding would give: token for token when greedy, in
distribution when sampled (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling").

No torch import: core stays importable without it (tests/test_layers.py). The sampled
path works on whatever tensors the caller has, through their own methods
(multinomial, uniform_, clamp), which is torch's tensor API.

Random draws: the contract, so seeded runs stay reproducible
------------------------------------------------------------
`generator` is one torch.Generator (or None: torch's default one) used for every
position in order, or a sequence of k + 1 of them, generator[i] for the round's i-th
position. The last stage's sampler (engine/model/sampler.py) seeds a fresh generator
per token from (seed, position) (`draw_seed`), and draws each token with
`torch.multinomial(probs, 1, generator=gen)` on the CPU; passing generator[i] = that
position's generator keeps speculation inside that scheme (a generator lives on one
device: CPU generators want CPU probabilities, as the sampler has them). Positions
after the emitted token are never touched. Per position i = 0 .. n_accepted (the last one emits next_token):

  deterministic draft (draft_probs None): exactly one `probs[i].multinomial(1,
      generator=g_i)`, the sampler's own call. The target samples its token as plain
      decoding would and the draft stands while it agrees. Accepting x exactly when the
      target's sample is x accepts with probability p(x), and a rejection leaves the
      sample conditioned on not-x, i.e. p with x removed, renormalised: the rejection
      scheme with q = one-hot(x), drawn by coupling. So with per-position generators the
      emitted tokens are the very tokens plain seeded sampling gives, whatever k and
      whatever the draft: reruns, failover replay and speculation on or off all agree
      (as far as the verify step's probabilities equal a plain step's bit for bit).
      With one shared generator: one multinomial per emitted token.
  model draft (draft_probs given), i < k: exactly one float64 uniform,
      `new_zeros(1).double().uniform_(generator=g_i)` (drawn even when p(x) >= q(x), so
      the count does not depend on the numbers); accept draft[i] when u * q(x) < p(x);
      on rejection one `multinomial(1, generator=g_i)` from norm(max(p - q, 0)).
      i == k (all accepted): one `p[k].multinomial(1, generator=g_k)`, the bonus token.
      The emitted tokens depend on the draft's tokens and on k, so a seeded request
      reproduces only with the same draft (itself seeded) and the same k per round.

Edge cases: k = 0 samples p[0] (one multinomial from generator[0]); a drafted token the
target gives probability 0 is always rejected (and one outside the vocabulary too); a
residual max(p - q, 0) with no mass left (p == q up to rounding, where a rejection is
all but impossible) falls back to p; target rows need not sum to exactly 1
(multinomial normalises). target_probs must be the processed distribution
(penalties, temperature, top-k, top-p, grammar mask applied: the caller's, as the
sampler does for a plain step) and draft_probs the distribution the draft actually
sampled its tokens from.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class Verdict(NamedTuple):
    n_accepted: int     # drafted tokens that stand (0..k)
    next_token: int     # the target's token after them: emitted too


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """target_argmax[i]: the target's greedy choice after the context and draft[:i]
    (k + 1 of them). The draft stands while it equals those choices; the next token is
    the target's choice after the last one that stood. Token for token plain greedy
    decoding: every emitted token is the target's argmax after the emitted prefix."""
    k = len(draft)
    if len(target_argmax) != k + 1:
        raise ValueError(f"{k} drafted tokens need {k + 1} target choices, got {len(target_argmax)}")
    n = 0
    while n < k and int(draft[n]) == int(target_argmax[n]):
        n += 1
    return Verdict(n, int(target_argmax[n]))


def verify_sampled(draft: Sequence[int], draft_probs: Any, target_probs: Any, generator: Any = None) -> Verdict:
    """draft: k drafted ids; draft_probs: None (a deterministic draft) or a [k, V] tensor,
    the draft's distribution at each drafted position; target_probs: a [k + 1, V] tensor,
    the target's processed distribution after the context and draft[:i]; generator: a
    torch.Generator, None, or k + 1 of them (see the module's draw contract)."""
    k = len(draft)
    if len(target_probs) != k + 1:
        raise ValueError(f"{k} drafted tokens need {k + 1} target distributions, got {len(target_probs)}")
    vocab = target_probs.shape[-1]
    per_position = isinstance(generator, (list, tuple))
    if per_position and len(generator) != k + 1:
        raise ValueError(f"{k} drafted tokens need {k + 1} generators, got {len(generator)}")

    def gen(i: int):
        return generator[i] if per_position else generator

    if draft_probs is None:
        for i in range(k + 1):
            tok = _sample(target_probs[i], gen(i))
            if i == k or tok != int(draft[i]):
                return Verdict(i, tok)
    if tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [{k}, {vocab}], got {list(draft_probs.shape)}")
    for i in range(k):
        g, x = gen(i), int(draft[i])
        p, q = target_probs[i], draft_probs[i]
        u = float(p.new_zeros(1).double().uniform_(generator=g))
        inside = 0 <= x < vocab
        px, qx = (float(p[x]), float(q[x])) if inside else (0.0, 0.0)
        # accept with probability min(1, p(x) / q(x)), written without the division: a
        # token the target rules out (p = 0) never stands, even one the draft ruled out too
        if u * qx < px:
            continue
        residual = (p.double() - q.double()).clamp(min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p  # p == q up to rounding: the rejection had (almost) no chance
        return Verdict(i, _sample(residual, g))
    return Verdict(k, _sample(target_probs[k], gen(k)))


def _sample(probs: Any, generator: Any) -> int:
    # the sampler's own call (torch.multinomial(probs, 1, generator=gen)) on the same row
    return int(probs.multinomial(1, generator=generator).item())
