"""Startup profiling (engine/profile.py): the probes leave the stage as they found it."""

import math

import pytest
import torch

from engine.profile import context_cost, interp, measure
from engine.stage_model import StageModel


def test_probes_leave_no_kv_and_the_budget_as_it_was(default_source):
    torch.set_num_threads(1)
    stage = StageModel(default_source, 10, 12)
    stage.kv.budget_tokens = 4096
    prof = measure(stage, repeats=1)
    cost = context_cost(stage, rows=4, context=64, repeats=1)
    assert [n for n, _ in prof["decode"]] == [1, 2, 3, 4, 8, 16] and all(t > 0 for _, t in prof["decode"])
    assert math.isfinite(cost) and cost >= 0
    assert not stage.kv.seqs and stage.kv.budget_tokens == 4096


def test_interp_is_piecewise_linear_and_extrapolates():
    pts = [[1, 0.01], [16, 0.04]]
    assert interp(pts, 1) == pytest.approx(0.01) and interp(pts, 16) == pytest.approx(0.04)
    assert interp(pts, 8.5) == pytest.approx(0.025)
    assert interp(pts, 31) == pytest.approx(0.07) and interp([[4, 0.02]], 8) == pytest.approx(0.04)
