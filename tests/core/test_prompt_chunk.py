"""Prompt chunks sized to the link (engine/core/prompt_chunk.py): small on a slow link, the
cap on a fast one, larger where compression shortens the link time; and what that buys
a pipeline on a slow link (the simulator, which runs the same function)."""

import sys
from pathlib import Path

import pytest

from engine.core import prompt_chunk
from engine.core.compression import q8_ratio
from engine.core.scheduler import Scheduler
from engine.core.profile import interp
from engine.core.prompt_chunk import CAP, FLOOR, HEADROOM, prompt_chunk_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import simulator as sim  # noqa: E402

# the default model's head stage on this CPU: ~42 ms a step plus ~1.8 ms a token
PREFILL = [[32, 0.099], [256, 0.500]]
BPT = 576 * 4          # bytes of one token's float32 activations
MBIT = 1e6 / 8


def test_a_fast_link_gets_the_cap():
    assert prompt_chunk_tokens(PREFILL, BPT, 4, 1000 * MBIT) == CAP
    assert prompt_chunk_tokens(PREFILL, BPT, 4, 1000 * MBIT, cap=48) == 48


def test_a_slow_link_gets_the_smallest_chunk_whose_compute_fits_in_half_its_link_time():
    bw = 3.35 * MBIT
    c = prompt_chunk_tokens(PREFILL, BPT, 4, bw)
    assert FLOOR < c < CAP
    assert interp(PREFILL, c) * HEADROOM <= c * BPT / bw
    assert interp(PREFILL, c - 1) * HEADROOM > (c - 1) * BPT / bw


def test_the_chunk_shrinks_as_the_link_slows_down_to_the_floor():
    sizes = [prompt_chunk_tokens(PREFILL, BPT, 4, m * MBIT) for m in (100, 5, 3.35, 2.5, 1.68, 1.0, 0.5)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == CAP and sizes[-1] == FLOOR
    assert len(set(sizes)) >= 4


def test_compression_makes_the_link_faster_so_the_chunk_larger():
    bw = 0.9 * MBIT
    plain = prompt_chunk_tokens(PREFILL, BPT, 4, bw)
    packed = prompt_chunk_tokens(PREFILL, BPT, 4, bw, compress="auto")
    assert plain < packed < CAP
    # the chunk the rule picked is one compression would send as int8
    nbytes = packed * BPT * q8_ratio(4)
    assert interp(PREFILL, packed) * HEADROOM <= nbytes / bw


@pytest.mark.parametrize("prefill, bw, cap", [([], 1e5, 64), (PREFILL, 0.0, 64), (PREFILL, 1e5, 8)])
def test_without_a_profile_or_a_link_figure_the_cap_stands(prefill, bw, cap):
    assert prompt_chunk_tokens(prefill, BPT, 4, bw, cap=cap) == cap


@pytest.mark.parametrize("bad", [0, -64, "fast", 2.5, True])
def test_the_scheduler_refuses_a_chunk_that_is_not_tokens_auto_or_none(bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(2, prompt_chunk=bad)       # the head passes its prefill_chunk here


def test_on_a_slow_link_chunks_sized_to_it_bring_first_tokens_sooner():
    """The simulator with the same rule: 2 and 3 stages over ~1.7 Mbit/s (the benchmark's
    ~100 Mbit/s point on this CPU), the benchmark's workload: the first token comes
    sooner with link-sized chunks than with 64-token ones, and decoding is not slower."""
    profile = {"decode": [[1, 0.040], [2, 0.060], [4, 0.065], [16, 0.090]], "prefill": PREFILL}
    reqs = sim.workload(0.25, 16, seed=1, scale=1 / 8)
    for stages in (2, 3):
        pipe = sim.Pipeline([profile] * stages, 1.68 * MBIT, 0.053, BPT, dtype_bytes=4)
        fixed = sim.simulate(pipe, sim.Policy("jit", prompt_chunk=64, dynamic=True), reqs)
        auto = sim.simulate(pipe, sim.Policy("jit", prompt_chunk="auto", dynamic=True), reqs)
        assert prompt_chunk.prompt_chunk_tokens(PREFILL, BPT, 4, pipe.bandwidth) < 64
        assert auto["ttft_mean"] < 0.97 * fixed["ttft_mean"], (stages, auto, fixed)
        assert auto["tpot_mean"] < 1.05 * fixed["tpot_mean"], (stages, auto, fixed)

