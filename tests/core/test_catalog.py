"""The curated model list: sizes estimated from config fields alone, no download."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.core import precision
from engine.model import catalog

ROOT = Path(__file__).resolve().parents[2]


def test_the_list_holds_the_models_people_pool_gpus_for():
    ids = [e.id for e in catalog.MODELS]
    assert 8 <= len(ids) <= 12 and len(set(ids)) == len(ids) and ids[0] == "default"
    for want in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                 "meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3",
                 "Qwen/Qwen2.5-32B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-72B-Instruct",
                 "mistralai/Mixtral-8x7B-Instruct-v0.1", "google/gemma-2-9b-it"):
        assert want in ids
    sizes = [e.params for e in catalog.MODELS]
    assert sizes == sorted(sizes)  # smallest first


@pytest.mark.parametrize("entry", catalog.MODELS, ids=lambda e: e.name)
def test_estimate_is_within_15_percent_of_the_published_parameter_count(entry):
    params = entry.weights_bytes(precision.FULL, 2) / 2
    assert abs(params / entry.params - 1) <= 0.15, (entry.name, params, entry.params)
    assert entry.layers > 0 and entry.hidden > 0 and entry.vocab > 0 and isinstance(entry.tied, bool)


def test_mixture_of_experts_counts_every_expert():
    mixtral = catalog.find("mistralai/Mixtral-8x7B-Instruct-v0.1")
    dense = dict(mixtral.config)
    del dense["num_local_experts"]
    one_expert = catalog.Entry("x", "x", 0, dense).weights_bytes("bf16")
    assert mixtral.weights_bytes("bf16") > 5 * one_expert


def test_quantized_sizes_shrink_and_the_label_says_them():
    e = catalog.find("Qwen/Qwen2.5-7B-Instruct")
    s = e.sizes()
    assert list(s) == ["bf16", "int8", "nf4"] and s["bf16"] > s["int8"] > s["nf4"]
    # embeddings and the LM head stay at the compute dtype: a bit more than half, a quarter
    assert 0.5 < s["int8"] / s["bf16"] < 0.65 and 0.28 < s["nf4"] / s["bf16"] < 0.45
    assert e.label().startswith("Qwen2.5-7B-Instruct — ") and "GB bf16 · " in e.label()
    # a CPU's bf16 is float32: twice the bytes, the quantized layers unchanged
    assert e.weights_bytes("bf16", 4) == pytest.approx(2 * s["bf16"], rel=0.01)


def test_find_by_id_name_or_label():
    e = catalog.find("Qwen/Qwen2.5-72B-Instruct")
    assert catalog.find("qwen2.5-72b-instruct") is e and catalog.find(e.label()) is e
    assert catalog.find("default").name == "SmolLM2-135M-Instruct"
    assert catalog.find("someone/something") is None and catalog.find("") is None


def test_importing_it_pulls_in_no_torch():
    code = "import sys, engine.model.catalog; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_draft_pairings_are_small_siblings_of_the_same_tokenizer_family():
    assert catalog.draft_for("meta-llama/Llama-3.1-70B-Instruct") == "meta-llama/Llama-3.2-1B-Instruct"
    assert catalog.draft_for("Qwen2.5-72B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert catalog.draft_for("default") == "" and catalog.draft_for("someone/something") == ""
    family = {"meta-llama": 128256, "Qwen": (151936, 152064), "google": 256000}
    paired = [e for e in catalog.MODELS if e.draft]
    assert len(paired) >= 5
    for e in paired:
        org = e.id.split("/")[0]
        assert e.draft.split("/")[0] == org and e.draft != e.id, e
        want = family[org]
        assert e.vocab in (want if isinstance(want, tuple) else (want,)), e
        listed = catalog.find(e.draft)
        if listed is not None:   # a draft the catalog lists is far smaller than its target
            assert listed.params * 3 < e.params and not listed.draft
