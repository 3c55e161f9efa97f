"""The same token computed two ways by one stage: at the end of a prompt in one step, and
reached one step at a time. What a reply replayed after a lost stage, or checked by
speculation, relies on: where the two come out this close, a greedy reply takes the same
token either way. bench/quant.py prints it per precision; tests/model/test_two_ways.py
holds `auto`'s CPU choice to it."""

from __future__ import annotations

import torch

from engine.model.stage import StageBatch

POSITIONS = 8


def two_ways(stage, prompt: list[int], positions: int = POSITIONS, seqs: tuple[int, int] = (1, 2)) -> float:
    """The largest |logit| difference between the two ways over the last `positions`
    tokens of `prompt`, computed as sequences `seqs` of `stage` (freed after; a stage
    in service needs ids no request has)."""
    start = len(prompt) - positions
    assert start > 0, "the prompt must be longer than the positions compared"
    stepped, whole = seqs
    stage.forward(StageBatch([stepped], [0], [start]), torch.tensor(prompt[:start]))
    worst = 0.0
    try:
        for k in range(start, len(prompt)):
            one = stage.forward(StageBatch([stepped], [k], [1]), torch.tensor(prompt[k:k + 1]))
            at_once = stage.forward(StageBatch([whole], [0], [k + 1]), torch.tensor(prompt[:k + 1]))
            stage.free(whole)
            a = one.reshape(-1, one.shape[-1])[-1].float()
            b = at_once.reshape(-1, at_once.shape[-1])[-1].float()
            worst = max(worst, float((a - b).abs().max()))
    finally:
        stage.free(stepped)
    return worst
