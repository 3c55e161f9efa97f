"""Tokens drawn from a batch of logits where the logits are: penalties, temperature,
top-k and top-p for all rows at once, on the logits' device; only token ids leave it.

Why batched and on the device: the chat's defaults sample (temperature 0.7, top-p 0.9,
repetition penalty 1.1), and drawing each row on the CPU copied its whole row off the
GPU and sorted it there, 16 ms a row at a 128k vocabulary, several times the GPU's
whole decode step. Here a step's rows are shaped together, and a row's draw needs one
number from the CPU: its uniform (engine/model/sampler.py makes it from the request's
seed and the token's position, so a seeded reply does not depend on the device or on
its batch mates).

What a row draws (inverse-CDF sampling with the row's uniform u in [0, 1)):
- a row with none of top-k, top-p and min-p: the whole vocabulary in token-id order, the
  first token whose cumulative probability exceeds u;
- a row with any of them: its nucleus in rank order (logit descending, ties by token
  id), the same rule over the nucleus' probabilities. The nucleus is the first top_k
  ranks (all when 0), then of those the smallest prefix whose mass reaches top_p, then
  of those the ones at least min_p times as likely as the first (transformers' order).
- a greedy row: the argmax (the first on ties) of its penalized logits.

Ranking a row takes a sort of the vocabulary: 4-10 ms a row on a CPU core. So a CPU
row is ranked from its likeliest `CPU_CANDIDATES` tokens when its nucleus ends among them
(the usual case for a trained model: 0.9 of the mass in a few hundred tokens), and sorted
whole only when it does not. Both give the same nucleus: a row counts as covered only
when the nucleus' last logit is above the candidates' last, so no token outside them
could rank inside. A GPU sorts every row whole: its sort of 16 rows of a 128k vocabulary
took 0.65 ms on an H200, and ranking from 1024 candidates 1.0 ms, as finding the rows
not covered reads the device back mid-draw (bench/sampling.py --device cuda).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.device import to_device

# how many likeliest tokens a CPU row is ranked from before it falls back to a full sort
CPU_CANDIDATES = 256
# a CPU draws this many rows at a time: each pass over a block's logits then stays in the
# cache (16 rows of a 49k vocabulary are 3 MB); one pass over 80 rows (16 users checking
# 1 + 4 tokens) went to memory five times and cost 9x what 16 rows did, not 5x
CPU_BLOCK_ROWS = 16


class HostRead:
    """A step's token ids on their way to the host: the copy is queued now, waited for
    at tolist(). Queued before a step launched ahead (engine/core/ahead.py), it is
    ordered before that step's kernels, so reading the tokens waits for the draw only,
    not for the step queued behind it (a plain .tolist() there would wait for both)."""

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(t.device))
        else:
            self._host, self._done = t, None

    def tolist(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


@dataclass
class Shape:
    """One row's settings: what engine/core/sampling.py SamplingParams asks of it, with
    its uniform already drawn."""
    greedy: bool
    temperature: float = 1.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1.0: off
    uniform: float = 0.0    # in [0, 1)
    min_p: float = 0.0      # 0.0: off

    @property
    def ranked(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass
class Penalties:
    """The penalties of a batch's rows, flat: (row, token) pairs and what each does.
    Lists or numpy arrays (the sampler's repetition pairs: engine/model/token_history.py)."""
    rep_rows: Sequence[int]
    rep_tokens: Sequence[int]
    rep_factor: Sequence[float]    # HF's repetition penalty: x / f where x > 0, x * f elsewhere
    sub_rows: Sequence[int]
    sub_tokens: Sequence[int]
    sub_amount: Sequence[float]    # presence and frequency: x -= count * frequency + presence

    @classmethod
    def none(cls) -> Penalties:
        return cls([], [], [], [], [], [])

    def __bool__(self) -> bool:
        return len(self.rep_rows) > 0 or len(self.sub_rows) > 0


def penalize(x: torch.Tensor, pen: Penalties) -> None:
    """x [B, V] float32, in place: the repetition penalty, then presence and frequency
    (vLLM's order). A row's (row, token) pairs are unique within each kind."""
    dev = x.device
    if len(pen.rep_rows):
        r = to_device(pen.rep_rows, torch.long, dev)
        t = to_device(pen.rep_tokens, torch.long, dev)
        f = to_device(pen.rep_factor, x.dtype, dev)
        v = x[r, t]
        x[r, t] = torch.where(v > 0, v / f, v * f)
    if len(pen.sub_rows):
        r = to_device(pen.sub_rows, torch.long, dev)
        t = to_device(pen.sub_tokens, torch.long, dev)
        a = to_device(pen.sub_amount, x.dtype, dev)
        x.index_put_((r, t), -a, accumulate=True)


def draw(logits: torch.Tensor, shapes: list[Shape], pen: Penalties | None = None,
         candidates: int | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype, any device) -> token ids [B] (long, on that
    device). The logits are not modified. candidates: how many likeliest tokens a ranked
    row is first ranked from (None: CPU_CANDIDATES on the CPU, every row sorted whole
    elsewhere; the vocabulary's size sorts every row whole)."""
    x = logits.float() if logits.dtype != torch.float32 else logits.clone()
    if pen:
        penalize(x, pen)
    B, V = x.shape
    if candidates is None:
        candidates = CPU_CANDIDATES if x.device.type == "cpu" else V
    if x.device.type == "cpu" and B > CPU_BLOCK_ROWS:
        return torch.cat([_draw_rows(x[i:i + CPU_BLOCK_ROWS], shapes[i:i + CPU_BLOCK_ROWS], candidates)
                          for i in range(0, B, CPU_BLOCK_ROWS)])
    return _draw_rows(x, shapes, candidates)


def _draw_rows(x: torch.Tensor, shapes: list[Shape], candidates: int) -> torch.Tensor:
    B = x.shape[0]
    dev = x.device
    if all(s.ranked for s in shapes):   # the chat's defaults: every row (no copy of them to make)
        return _draw_ranked(x, shapes, candidates)
    if any(s.greedy for s in shapes):
        out = x.argmax(-1)  # the greedy rows' answer; the others are overwritten below
    else:
        out = torch.empty(B, dtype=torch.long, device=dev)
    plain = [i for i, s in enumerate(shapes) if not s.greedy and not s.ranked]
    ranked = [i for i, s in enumerate(shapes) if s.ranked]
    if plain:
        idx = to_device(plain, torch.long, dev)
        out.index_copy_(0, idx, _draw_plain(x.index_select(0, idx), [shapes[i] for i in plain]))
    if ranked:
        idx = to_device(ranked, torch.long, dev)
        out.index_copy_(0, idx, _draw_ranked(x.index_select(0, idx), [shapes[i] for i in ranked], candidates))
    return out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[n, 1] on like's device, in its dtype."""
    return to_device(values, like.dtype, like.device).unsqueeze(1)


def _pick(probs: torch.Tensor, shapes: list[Shape]) -> torch.Tensor:
    """probs [n, m] (unnormalised, zero outside what a row may draw) -> the index of the
    first column whose cumulative probability exceeds the row's uniform share of the total."""
    cum = probs.cumsum(-1)
    target = _column([s.uniform for s in shapes], cum) * cum[:, -1:]
    pick = torch.searchsorted(cum, target, right=True).squeeze(1)
    # u * total rounds up to the total now and then: then the last column that may be
    # drawn (never one past it, which a grammar's mask or top-k ruled out)
    cols = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(probs > 0, cols, 0).amax(-1)
    return torch.minimum(pick, last)


def _draw_plain(x: torch.Tensor, shapes: list[Shape]) -> torch.Tensor:
    """Temperature only: the whole vocabulary, in token-id order."""
    x = x / _column([s.temperature for s in shapes], x)
    probs = torch.softmax(x, -1)
    return _pick(probs, shapes)


def _draw_ranked(x: torch.Tensor, shapes: list[Shape], candidates: int) -> torch.Tensor:
    n, V = x.shape
    x = x / _column([s.temperature for s in shapes], x)
    K = min(V, max(candidates, 2 * max(s.top_k for s in shapes)))
    vals, toks = _rank(x, K)
    keep, kept = _nucleus(x, vals, shapes, whole=K == V)
    out = toks.gather(1, _pick_nucleus(vals, keep, shapes).unsqueeze(1)).squeeze(1)
    if K < V:
        # covered: the nucleus ends inside the candidates, above their last logit (so no
        # token left out, however it ties, could rank inside it); the rest are sorted whole
        last = vals.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        short = ((kept >= K) | (last <= vals[:, -1])).nonzero().flatten()
        if short.numel():
            sub = [shapes[i] for i in short.tolist()]
            sx = x.index_select(0, short)
            fv, ft = _rank(sx, V)
            fkeep, _ = _nucleus(sx, fv, sub, whole=True)
            out.index_copy_(0, short, ft.gather(1, _pick_nucleus(fv, fkeep, sub).unsqueeze(1)).squeeze(1))
    return out


def _rank(x: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K likeliest of each row, in rank order: logit descending, ties by token id
    (topk's order among ties is unspecified, so its picks are put in id order first and
    sorted stably)."""
    if K >= x.shape[1]:
        vals, toks = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals, toks
    _, toks = x.topk(K, dim=-1)
    toks, _ = toks.sort(dim=-1)
    vals = x.gather(1, toks)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, toks.gather(1, order)


def _nucleus(x: torch.Tensor, vals: torch.Tensor, shapes: list[Shape], whole: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [n, K] (a prefix of each row's ranks) and its length [n]."""
    n, K = vals.shape
    ranks = torch.arange(K, device=x.device)
    top_k = to_device([s.top_k or x.shape[1] for s in shapes], torch.long, x.device)
    keep = ranks.unsqueeze(0) < top_k.unsqueeze(1)
    # top-p's mass is over what top-k left: those ranks' logits, or the whole row's
    masked = vals.masked_fill(~keep, float("-inf"))
    by_k = masked.logsumexp(-1)
    norm = by_k if whole else torch.where(top_k < x.shape[1], by_k, x.logsumexp(-1))
    probs = torch.exp(masked - norm.unsqueeze(1))
    before = probs.cumsum(-1) - probs
    # rows without top-p keep all ranks (a cumulative mass that rounds past 1.0 drops none)
    top_p = _column([s.top_p if s.top_p < 1.0 else float("inf") for s in shapes], probs)
    keep &= before <= top_p
    if any(s.min_p > 0.0 for s in shapes):
        # p >= min_p * p_first, in logits (the row's scale cancels); log(0) keeps every rank
        floor = _column([s.min_p for s in shapes], vals).log()
        keep &= vals - vals[:, :1] >= floor
    return keep, keep.sum(-1)


def _pick_nucleus(vals: torch.Tensor, keep: torch.Tensor, shapes: list[Shape]) -> torch.Tensor:
    probs = torch.exp(vals - vals[:, :1]).masked_fill(~keep, 0.0)
    return _pick(probs, shapes)
