"""Which stage holds which layers: automatic split, user overrides, and their checks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.model.sources import ModelError  # noqa: E402
from engine.core.partition import SAME_SPEED, parse_layers, partition  # noqa: E402
from engine.core.partition import check_partition, validate_range  # noqa: E402


def counts(ranges):
    return [b - a for a, b in ranges]


def assert_tiles(ranges, n_layers):
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    assert all(b > a for a, b in ranges)


# ---- partition ------------------------------------------------------------------

def test_equal_speeds_split_evenly():
    assert partition(32, [1, 1]) == [(0, 16), (16, 32)]
    assert partition(30, [2.5, 2.5, 2.5]) == [(0, 10), (10, 20), (20, 30)]
    assert partition(7, [1.0]) == [(0, 7)]


def test_uneven_remainder_stays_within_one_layer():
    c = counts(partition(10, [1, 1, 1]))
    assert sum(c) == 10 and max(c) - min(c) == 1


def test_split_is_proportional_to_speed():
    assert counts(partition(32, [3, 1])) == [24, 8]
    assert counts(partition(8, [3, 1])) == [6, 2]
    assert counts(partition(40, [1, 3])) == [10, 30]
    assert counts(partition(60, [1, 2, 3])) == [10, 20, 30]
    c = counts(partition(33, [3, 1]))
    assert sum(c) == 33 and abs(c[0] / c[1] - 3) < 0.35


def test_lm_head_work_counts_against_the_last_stage():
    # SmolLM2-135M: the LM head is ~8 layers' worth of weights read every decode step
    from transformers import LlamaConfig

    from engine.core.partition import lm_head_layers_estimate

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152,
                      num_attention_heads=9, num_key_value_heads=3)
    head = lm_head_layers_estimate(cfg)
    assert 7 < head < 9
    assert counts(partition(30, [1, 1], extra=[0, head])) == [19, 11]
    c = counts(partition(30, [1, 1, 1], extra=[0, 0, head]))
    assert c[2] < c[0] and sum(c) == 30
    # a head small next to the layers (Llama-2-7B: 0.65 layers) barely moves the split
    big = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
    assert counts(partition(32, [1, 1], extra=[0, lm_head_layers_estimate(big)])) == [16, 16]
    # the last stage still gets a layer, and capacities still bind
    assert counts(partition(4, [1, 1], extra=[0, 50])) == [3, 1]
    assert counts(partition(30, [1, 1], [12, 30], extra=[0, head])) == [12, 18]


def test_slow_stage_still_gets_one_layer():
    assert counts(partition(10, [1000, 0.001])) == [9, 1]
    assert counts(partition(10, [1, 0, -5])) == [8, 1, 1]  # non-positive speeds: only the minimum


def test_capacities_are_respected():
    assert counts(partition(32, [3, 1], [10, 32])) == [10, 22]
    assert counts(partition(30, [1, 1, 1], [5, 100, 5])) == [5, 20, 5]
    assert counts(partition(12, [1, 1, 1], [4, 4, 4])) == [4, 4, 4]  # exactly full


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 120).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.floats(0.01, 100), min_size=1, max_size=min(n, 8)),
)).flatmap(lambda t: st.tuples(
    st.just(t[0]), st.just(t[1]),
    st.one_of(st.none(), st.lists(st.integers(1, t[0]), min_size=len(t[1]), max_size=len(t[1]))),
)))
def test_partition_properties(args):
    n_layers, speeds, caps = args
    if caps is not None and sum(caps) < n_layers:
        with pytest.raises(ModelError, match="layers of room"):
            partition(n_layers, speeds, caps)
        return
    ranges = partition(n_layers, speeds, caps)
    assert len(ranges) == len(speeds)
    assert_tiles(ranges, n_layers)
    check_partition(ranges, n_layers)
    if caps is not None:
        assert all(c <= cap for c, cap in zip(counts(ranges), caps))
    else:
        # greedy optimality: no stage's last extra layer would finish sooner on any other stage
        c = counts(ranges)
        eff = speeds if max(speeds) >= SAME_SPEED * min(speeds) else [1.0] * len(speeds)
        for j in range(len(c)):
            if c[j] > 1:
                assert all(c[j] / eff[j] <= (c[i] + 1) / eff[i] + 1e-9 for i in range(len(c)))


def test_close_speeds_split_evenly():
    # a noisy probe's 20% difference is not a reason for an unequal split
    assert counts(partition(30, [1.0, 1.2])) == [15, 15]
    assert counts(partition(30, [1.0, 2.0])) == [10, 20]


def test_partition_errors():
    with pytest.raises(ModelError, match="at least one stage"):
        partition(10, [])
    with pytest.raises(ModelError, match="3 stages for 2 layers"):
        partition(2, [1, 1, 1])
    with pytest.raises(ModelError, match="needs 10 layers of room but the stages together hold 9"):
        partition(10, [1, 1], [4, 5])
    with pytest.raises(ModelError, match="no room for even one layer"):
        partition(10, [1, 1], [0, 20])


def test_errors_are_value_errors_with_guidance():
    with pytest.raises(ValueError) as ei:
        partition(10, [1, 1], [2, 2])
    assert "add a machine or choose a smaller model" in str(ei.value)


# ---- parse_layers ----------------------------------------------------------------

def test_parse_ranges():
    assert parse_layers("0:10,10:30", 30) == [(0, 10), (10, 30)]
    assert parse_layers(" 0:5 , 5:6,6:8 ", 8) == [(0, 5), (5, 6), (6, 8)]
    assert parse_layers("0:8", 8) == [(0, 8)]


def test_parse_counts():
    assert parse_layers("10,20", 30) == [(0, 10), (10, 30)]
    assert parse_layers("1,1,1,1", 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert parse_layers("30,", 30) == [(0, 30)]


@pytest.mark.parametrize("text, n, match", [
    ("0:10,12:30", 30, r"gap: range 2 \(12:30\) should start at 10, where the one before it ends"),
    ("0:10,8:30", 30, r"overlap: range 2 \(8:30\) should start at 10"),
    ("2:30", 30, r"gap: range 1 \(2:30\) should start at 0"),
    ("0:10,10:20", 30, "end at 20 but the model has 30 layers: the last should end at 30"),
    ("0:10,10:40", 30, r"layer range 10:40 does not fit a model with 30 layers \(ranges go from 0:… to …:30\)"),
    ("0:10,10:10,10:30", 30, r"range 10:10 does not fit"),
    ("10,10", 30, "the layer counts '10,10' add up to 20, but the model has 30 layers: .* '15,15'"),
    ("10,30", 30, "add up to 40, but the model has 30"),
    ("10,0,20", 30, r"range 10:10 does not fit"),
    ("-5,35", 30, r"range 0:-5 does not fit"),
    ("", 30, "end at 0"),
    ("abc", 30, "cannot read layer split 'abc': for two stages of this 30-layer model, '0:15,15:30'"),
    ("0:10,10", 30, "cannot read layer split"),
    ("0:x,10:30", 30, "cannot read layer split"),
    ("0:,10:30", 30, "cannot read layer split"),
    ("1.5,28.5", 30, "cannot read layer split"),
    ("0:10:20,20:30", 30, "cannot read layer split"),  # three numbers once escaped as a bare ValueError
    ("0;10", 30, "cannot read layer split"),
])
def test_parse_layers_errors(text, n, match):
    with pytest.raises(ModelError, match=match):
        parse_layers(text, n)


# ---- check_partition / validate_range -----------------------------------------

def test_check_partition_gap_vs_overlap():
    check_partition([(0, 4), (4, 9)], 9)
    with pytest.raises(ModelError, match=r"gap: range 3 \(7:9\) should start at 6"):
        check_partition([(0, 3), (3, 6), (7, 9)], 9)
    with pytest.raises(ModelError, match=r"overlap: range 3 \(5:9\) should start at 6"):
        check_partition([(0, 3), (3, 6), (5, 9)], 9)
    with pytest.raises(ModelError, match="end at 6 but the model has 9"):
        check_partition([(0, 3), (3, 6)], 9)
    with pytest.raises(ModelError, match=r"range 6:3 does not fit"):
        check_partition([(0, 6), (6, 9), (6, 3)], 9)


def test_validate_range():
    validate_range(0, 1, 1)
    validate_range(3, 9, 9)
    for bad in [(-1, 3), (3, 3), (4, 3), (0, 10)]:
        with pytest.raises(ModelError, match="does not fit a model with 9 layers"):
            validate_range(*bad, 9)


def test_a_slice_weighs_its_layers_plus_embeddings_first_and_lm_head_last():
    from types import SimpleNamespace

    from engine.core.partition import layer_bytes_estimate, slice_bytes_estimate

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=1000, num_hidden_layers=6,
                          tie_word_embeddings=False)
    layer, vocab = layer_bytes_estimate(cfg, 2), 1000 * 64 * 2
    assert slice_bytes_estimate(cfg, 2, 4, 2) == 2 * layer                   # a middle stage
    assert slice_bytes_estimate(cfg, 0, 2, 2) == 2 * layer + vocab           # embeddings
    assert slice_bytes_estimate(cfg, 4, 6, 2) == 2 * layer + vocab           # LM head
    assert slice_bytes_estimate(cfg, 0, 6, 2) == 6 * layer + 2 * vocab
    cfg.tie_word_embeddings = True
    assert slice_bytes_estimate(cfg, 0, 6, 2) == 6 * layer + vocab           # one matrix for both


def test_shared_cpu_speeds_follow_the_processes_there_are():
    from engine.core.partition import shared_cpu_speeds

    # 3 processes on 2 cores: the head and stage 2 take turns on core 0
    assert shared_cpu_speeds([[0], [1], [0]]) == [0.5, 1.0, 0.5]
    # stage 2 died: the head has core 0 to itself, the split goes even
    assert shared_cpu_speeds([[0], [1]]) == [1.0, 1.0]
    assert shared_cpu_speeds([[0, 1], [2, 3], [4, 5]]) == [2.0, 2.0, 2.0]
    assert shared_cpu_speeds([[0]]) == [1.0]


def test_per_stage_lists_of_another_length_are_refused_clearly():
    # (the head once passed the old stage count's CPU shares after a stage had left:
    # an IndexError deep in the loop)
    with pytest.raises(ValueError, match="2 capacities for 3 stages"):
        partition(30, [0.5, 1.0, 0.5], [20, 20])
    with pytest.raises(ValueError, match="3 extra for 2 stages"):
        partition(30, [1.0, 1.0], [20, 20], [0, 0, 8])
