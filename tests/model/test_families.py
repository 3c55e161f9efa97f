"""Every causal-LM model type of this transformers is either supported (with a parity
case in tests/model/test_parity.py) or refused with the reason a user is shown: no
model type is left without a word (engine/model/families.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402

from engine.model.families import (  # noqa: E402
    REFUSED_FEATURES,
    REFUSED_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    check_supported,
)
from engine.model.sources import ModelError, resolve  # noqa: E402
from testkit.tiny_models import ARCHS, tiny_config  # noqa: E402


def _causal_lm_types() -> dict[str, str]:
    """Every model type transformers has a causal-LM class for (decoder-only ones and the
    rest: encoders with an LM head, encoder-decoders' decoders, multimodal wrappers), to
    the model type its config class carries (a few names share another's config:
    'gpt-sw3' reads as 'gpt2')."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {t: CONFIG_MAPPING[t].model_type for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}


def test_every_causal_lm_type_is_supported_or_refused_with_a_reason():
    parity_cases = {tiny_config(arch).model_type for arch in ARCHS}
    types = _causal_lm_types()
    assert len(types) > 150  # the enumeration found transformers' table
    silent, untested = [], []
    for name, model_type in types.items():
        if model_type in SUPPORTED_MODEL_TYPES:
            if model_type not in parity_cases:
                untested.append(name)
        elif not REFUSED_MODEL_TYPES.get(model_type, "").strip():
            silent.append(name)
    assert not silent, f"neither supported nor refused with a reason: {silent}"
    assert not untested, f"supported without a parity case: {untested}"


def test_no_type_is_both_supported_and_refused():
    assert not set(SUPPORTED_MODEL_TYPES) & set(REFUSED_MODEL_TYPES)
    assert len(set(SUPPORTED_MODEL_TYPES)) == len(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(REFUSED_MODEL_TYPES))
def test_a_refused_type_is_refused_with_its_reason(model_type):
    with pytest.raises(ModelError, match=f"'{model_type}'") as err:
        check_supported(SimpleNamespace(model_type=model_type))
    assert REFUSED_MODEL_TYPES[model_type] in str(err.value)


@pytest.mark.parametrize("arch, why", [
    ("gemma4_text_ple", "per-layer embeddings"),
    ("gemma4_text_kvshare", "reuse earlier layers' key/value cache"),
    ("gemma4_text_bidirectional", "bidirectional"),
])
def test_gemma4_checkpoints_with_a_feature_stages_cannot_run_are_refused(tmp_path, arch, why):
    """Gemma 4 E2B/E4B-style checkpoints (per-layer embeddings, shared KV layers) and its
    bidirectional embedding models are refused when their config is read; the others of
    the family run (test_parity.py)."""
    check_supported(tiny_config("gemma4_text"))
    cfg = tiny_config(arch)
    assert cfg.model_type in SUPPORTED_MODEL_TYPES
    assert any(cfg.model_type in types and uses(cfg) for types, uses, _ in REFUSED_FEATURES)
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(ModelError, match=why):
        resolve(str(tmp_path)).config()


def test_an_unknown_type_names_the_supported_ones():
    with pytest.raises(ModelError, match="not supported by Potluck yet. Supported: llama"):
        check_supported(SimpleNamespace(model_type="no_such_family"))
