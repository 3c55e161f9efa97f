"""bench/northstar.py: the 70B-over-three-homes profiles are what its docstring says, and
the simulated policy speculates where verification is cheap and not where it is dear."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import northstar as ns  # noqa: E402
import simulator as sim  # noqa: E402


def test_the_split_fits_three_24_gb_gpus_with_room_for_kv():
    assert ns.LAYER_PARAMS == 855_638_016
    assert sum(ns.SPLIT) == ns.LAYERS
    assert all(gb < 0.8 * ns.GPU_MEM / 1e9 for gb in ns.memory_gb())


def test_profiles():
    roof = ns.stage_profile(27, False, "roofline")
    bnb = ns.stage_profile(27, False, "bnb")
    measured = ns.stage_profile(27, False, "measured")
    one = sim.interp(roof["decode"], 1)
    # one token: 13.0 GB of packed weights at 0.6 x 1008 GB/s, plus its KV
    assert one == pytest.approx(27 * ns.LAYER_PARAMS * ns.NF4_BYTES / (0.6 * ns.MEM_BW), rel=0.02)
    assert sim.interp(roof["decode"], 5) < 1.1 * one                 # fused kernels: extra tokens nearly free
    assert sim.interp(bnb["decode"], 1) == pytest.approx(one)
    assert sim.interp(bnb["decode"], 2) > 7 * one                    # dequantize to bf16 first
    # the H200's graph-replayed steps: a fixed 0.097 ms a layer, the 4-bit weights at 0.33
    # of the bandwidth, 2.59x their time for 1 + 4 tokens
    assert ns.FIXED_PER_LAYER_S == pytest.approx((7.59 - 4.50) / 32 / 1e3)
    assert ns.NF4_FRACTION == pytest.approx(0.325, abs=0.005)
    packed = 27 * ns.LAYER_PARAMS * ns.NF4_BYTES
    assert sim.interp(measured["decode"], 1) == pytest.approx(
        27 * ns.FIXED_PER_LAYER_S + packed / (ns.MEM_BW * ns.NF4_FRACTION), rel=0.02)
    four = sim.interp(measured["decode"], 4) - 27 * ns.FIXED_PER_LAYER_S     # a point of the profile
    assert four == pytest.approx(ns.measured_scale(4) * packed / (ns.MEM_BW * ns.NF4_FRACTION), rel=0.03)
    assert 2.5 < ns.measured_scale(5) < 2.7 and ns.measured_scale(1) == 1.0


def test_one_user_gains_with_fused_kernels_and_loses_nothing_with_bitsandbytes():
    spec = sim.Spec(accept=ns.ACCEPT, draft=ns.draft_seconds("roofline"), seed=0)
    fast = ns.pipeline("roofline", 100, 0.03)
    off, on = ns.one_user(fast, None, n_out=96), ns.one_user(fast, spec, n_out=96)
    assert on["decode_tps"] > 1.5 * off["decode_tps"] and on["tokens_per_trip"] > 2
    dear = ns.pipeline("bnb", 100, 0.03)
    off, on = ns.one_user(dear, None, n_out=96), ns.one_user(dear, spec, n_out=96)
    assert on["decode_tps"] > 0.95 * off["decode_tps"]
