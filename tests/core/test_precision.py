"""Weight precision: memory per choice, and `auto` picking the highest that fits."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402

from engine.core import precision  # noqa: E402
from engine.core.errors import ModelError  # noqa: E402

GB = 10**9
# Llama-3.1-8B's shape
L8B = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=128256,
                      tie_word_embeddings=False, num_attention_heads=32, num_key_value_heads=8)


def total(weights: str, dtype_bytes: int = 2) -> int:
    return precision.slice_bytes(L8B, 0, L8B.num_hidden_layers, weights, dtype_bytes)


def test_quantized_layers_shrink_and_embeddings_stay_at_the_compute_dtype():
    bf16, int8, nf4 = total("bf16"), total("int8"), total("nf4")
    assert 14 * GB < bf16 < 17.5 * GB  # ~8B parameters at 2 bytes
    embeddings = 2 * L8B.vocab_size * L8B.hidden_size * 2
    assert int8 - embeddings == pytest.approx((bf16 - embeddings) / 2, rel=1e-6)
    assert nf4 - embeddings == pytest.approx((bf16 - embeddings) * 0.5625 / 2, rel=1e-6)
    # a middle stage holds no embeddings: its weights scale with the precision alone
    mid = [precision.slice_bytes(L8B, 10, 20, w, 2) for w in ("bf16", "int8", "nf4")]
    assert mid[1] / mid[0] == pytest.approx(0.5, rel=0.01) and mid[2] / mid[0] < 0.3


@pytest.mark.parametrize("free_gb,want", [([24, 24], "bf16"), ([12, 12], "int8"), ([6, 6], "nf4"),
                                          ([24, 12, 12], "bf16")])
def test_auto_picks_the_highest_precision_the_pool_holds(free_gb, want):
    assert precision.choose(L8B, 2, [g * GB for g in free_gb]) == want


def test_without_bitsandbytes_auto_never_quantizes_and_says_what_does_not_fit():
    assert precision.choose(L8B, 2, [24 * GB, 24 * GB], quantized_ok=False) == "bf16"
    with pytest.raises(ModelError, match="does not fit this pool even as bf16"):
        precision.choose(L8B, 2, [8 * GB, 8 * GB], quantized_ok=False)


def test_a_model_that_fits_nowhere_is_refused_with_sizes():
    with pytest.raises(ModelError, match=r"even as nf4: it needs about \d+\.\d GB"):
        precision.choose(L8B, 2, [2 * GB])


def test_the_table_a_user_reads_before_loading():
    text = precision.table(L8B, 2, "bfloat16", [12 * GB, 12 * GB], chosen="int8", where="2 GPUs")
    lines = text.splitlines()
    assert "2 GPUs" in lines[0]
    assert lines[1].split()[0] == "bf16" and "does not fit" in lines[1]
    assert lines[2].split()[0] == "int8" and lines[2].rstrip().endswith("fits  <- chosen")
    assert lines[3].split()[0] == "nf4" and "fits" in lines[3]
    assert lines[0] == "What the weights need, against the 14 GB that 2 GPUs can give them:"
    cpu = precision.table(L8B, 4, "float32", [64 * GB], quantized_ok=False, chosen="bf16",
                          where="this machine's 2 stages (CPU)")
    assert cpu.splitlines()[0] == "What the weights need, against the 38 GB that this machine's 2 stages (CPU) " \
                                  "can give them:"
    # a CPU computes at float32: the row says so, not bf16
    assert cpu.splitlines()[1].startswith("  full (float32) ") and cpu.splitlines()[1].endswith("<- chosen")
    assert "bf16" not in cpu and cpu.count("needs bitsandbytes") == 2
    assert "the pool's 1 machine" in precision.table(L8B, 4, "float32", [64 * GB])


def test_the_choice_as_fields_names_what_the_table_names():
    """core/precision.Chosen: the app's Host window reads these fields, not the table."""
    c = precision.chosen(L8B, 4, "float32", "bf16", "2 stages (CPU)")
    row = next(line for line in precision.table(L8B, 4, "float32", [64 * GB], chosen="bf16").splitlines()
               if line.endswith("<- chosen"))
    assert c.label == "full (float32)" and row.split("  ")[1].strip() == c.label
    assert c.as_dict()["size"] in row and c.bytes > 10 * GB
    assert precision.chosen(L8B, 2, "bfloat16", "nf4", "").label == "nf4"
    assert precision.chosen(L8B, 2, "bfloat16", "nf4", "").bytes < c.bytes / 4


def test_layer_caps_follow_the_precision():
    caps = [precision.layer_caps(L8B, w, 2, [8 * GB])[0] for w in ("bf16", "int8", "nf4")]
    assert caps[0] < caps[1] < caps[2]
    with pytest.raises(ModelError, match="unknown weights 'fp8'"):
        precision.layer_caps(L8B, "fp8", 2, [8 * GB])
