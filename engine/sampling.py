"""Sampling parameters and the sampler that runs on the last stage.

Each request carries its own parameters; a batch mixes greedy and sampled rows. A
seeded request owns a torch.Generator so its draw does not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 256


class SamplingError(ValueError):
    pass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0              # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    greedy: bool = False        # temperature 0 means greedy too
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Strict: unknown keys and wrong types are errors (this may come off the wire)."""
        if not isinstance(d, dict):
            raise SamplingError("sampling parameters must be an object")
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise SamplingError(f"unknown sampling parameter(s): {', '.join(sorted(extra))}")
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        def num(name, lo, hi, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
                raise SamplingError(f"{name} must be a {'whole ' if integer else ''}number")
            if not (lo <= v <= hi):
                raise SamplingError(f"{name} must be between {lo} and {hi}, got {v}")

        num("temperature", 0.0, 100.0)
        num("top_k", 0, 1 << 20, integer=True)
        num("top_p", 0.0, 1.0)
        if self.top_p == 0.0:
            raise SamplingError("top_p must be greater than 0")
        num("repetition_penalty", 0.01, 100.0)
        num("max_tokens", 1, 1 << 20, integer=True)
        if self.seed is not None:
            num("seed", 0, 2**63 - 1, integer=True)
        if not isinstance(self.greedy, bool):
            raise SamplingError("greedy must be true or false")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingError(f"stop must be a list of at most {MAX_STOP_SEQUENCES} strings")
        for s in self.stop:
            if not isinstance(s, str) or not (0 < len(s) <= MAX_STOP_LENGTH):
                raise SamplingError(f"each stop sequence must be a string of 1..{MAX_STOP_LENGTH} characters")


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
        row = row.clone()
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
