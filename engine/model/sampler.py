"""The sampler that runs on the last stage.

Each request carries its own parameters (engine/core/sampling.py); a batch mixes greedy
and sampled rows. A seeded request owns a torch.Generator so its draw does not depend
on its batch mates.
"""

from __future__ import annotations

import torch

from engine.core.sampling import SamplingParams


class Sampler:
    """Keeps per-sequence state (token history for the repetition penalty, generator)."""

    def __init__(self):
        self._history: dict[int, list[int]] = {}
        self._params: dict[int, SamplingParams] = {}
        self._gen: dict[int, torch.Generator] = {}

    def open(self, seq_id: int, params: SamplingParams, prompt: list[int]) -> None:
        self._params[seq_id] = params
        self._history[seq_id] = list(prompt) if params.repetition_penalty != 1.0 else []
        if params.seed is not None:
            self._gen[seq_id] = torch.Generator().manual_seed(params.seed)

    def knows(self, seq_id: int) -> bool:
        return seq_id in self._params

    def close(self, seq_id: int) -> None:
        self._history.pop(seq_id, None)
        self._params.pop(seq_id, None)
        self._gen.pop(seq_id, None)

    def sample(self, seq_ids: list[int], logits: torch.Tensor) -> list[int]:
        """logits [B, vocab] float32 -> one token id per row."""
        params = [self._params[s] for s in seq_ids]
        if all(p.is_greedy and p.repetition_penalty == 1.0 for p in params):
            out = logits.argmax(-1).tolist()  # the common fast path, one op for the batch
        else:
            out = [self._sample_row(s, p, logits[i]) for i, (s, p) in enumerate(zip(seq_ids, params))]
        for s, t in zip(seq_ids, out):
            if self._params[s].repetition_penalty != 1.0:
                self._history[s].append(t)
        return out

    def _sample_row(self, seq_id: int, p: SamplingParams, row: torch.Tensor) -> int:
        # on the CPU whatever device computed the logits: a seeded request's generator
        # lives there, and so the same seed draws the same tokens on a GPU stage as on a CPU one
        row = row.detach().to("cpu", copy=True)
        hist = self._history.get(seq_id)
        if p.repetition_penalty != 1.0 and hist:
            idx = torch.tensor(sorted(set(hist)), dtype=torch.long)
            vals = row[idx]
            row[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.is_greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            cum = probs.cumsum(-1)
            drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
            row[order[drop]] = float("-inf")
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._gen.get(seq_id)).item())
