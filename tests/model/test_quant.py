"""8-bit and 4-bit weights: each stage quantizes its own slice as it loads it.

Tiny random-weight checkpoints (testkit/tiny_models.py) split into stages, against
the same checkpoint at full precision and against transformers' own bitsandbytes
models. bitsandbytes computes on the CPU too, so none of this needs a GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.model import quant  # noqa: E402
from engine.model.sources import ModelError, resolve  # noqa: E402
from engine.model.stage import StageBatch, StageModel  # noqa: E402
from testkit.tiny_models import VOCAB, build_tiny_model  # noqa: E402

pytest.importorskip("bitsandbytes")

PROMPTS = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_q")
    build_tiny_model("llama", root)
    return root


def run(stages, ids) -> torch.Tensor:
    x = ids
    for s in stages:
        x = s.forward(StageBatch([1], [0], [len(ids)]), x)
        s.free(1)
    return x[0]


def split(source, weights, cuts=(0, 3, 6)):
    # on the CPU even where a GPU is there: these compare with CPU references
    return [StageModel(source, a, b, weights=weights, device="cpu") for a, b in zip(cuts, cuts[1:])]


def linear_kinds(stage) -> set[str]:
    return {type(m).__name__ for m in stage.model.modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("weights,kind,min_cos", [("int8", "Linear8bitLt", 0.995), ("nf4", "Linear4bit", 0.85)])
def test_each_stage_quantizes_its_own_layers(llama, weights, kind, min_cos):
    source = resolve(str(llama))
    full, q = split(source, "bf16"), split(source, weights)
    for s in q:
        assert s.weights == weights
        assert kind in linear_kinds(s)
    # the LM head stays at the compute dtype (bitsandbytes leaves it), the layers shrink
    assert type(q[-1].model.lm_head).__name__ != kind
    layer_bytes = [sum(p.numel() * p.element_size() for p in s._layers.parameters()) for s in (full[0], q[0])]
    assert layer_bytes[1] < layer_bytes[0] / (3 if weights == "int8" else 5)
    for ids in PROMPTS:
        a, b = run(full, ids), run(q, ids)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > min_cos


@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_a_checkpoint_saved_quantized_loads_as_it_is(llama, tmp_path, weights):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = (BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) if weights == "int8" else
          BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    ref = AutoModelForCausalLM.from_pretrained(str(llama), quantization_config=qc, dtype=torch.float32,
                                               device_map="cpu")
    ref.save_pretrained(str(tmp_path))
    source = resolve(str(tmp_path))
    stages = split(source, "auto")
    assert [s.weights for s in stages] == [weights, weights]
    for ids in PROMPTS:
        with torch.inference_mode():
            want = ref(ids[None]).logits[0, -1]
        # the same quantized weights: the split computes what transformers computes
        assert torch.allclose(run(stages, ids), want, atol=1e-4)
    other = "nf4" if weights == "int8" else "int8"
    with pytest.raises(ModelError, match=f"saved as {weights}"):
        StageModel(source, 0, 3, weights=other)


def test_without_bitsandbytes_the_message_says_what_to_do(llama, monkeypatch):
    monkeypatch.setattr(quant.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else __import__("importlib").util.find_spec(name))
    with pytest.raises(ModelError, match="pip install bitsandbytes.*--weights bf16"):
        StageModel(resolve(str(llama)), 0, 3, weights="nf4")


def test_unknown_weights_are_refused(llama):
    with pytest.raises(ModelError, match="unknown weights 'fp3'"):
        StageModel(resolve(str(llama)), 0, 3, weights="fp3")


def test_a_tensor_of_the_wrong_shape_is_an_error_not_a_half_loaded_stage(tmp_path):
    from safetensors.torch import load_file, save_file

    build_tiny_model("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    key = "model.layers.1.mlp.down_proj.weight"
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] // 2)
    save_file(state, str(path), metadata={"format": "pt"})
    for weights in ("bf16", "int8", "nf4"):
        with pytest.raises(ModelError, match="down_proj"):
            StageModel(resolve(str(tmp_path)), 0, 3, weights=weights)


def test_another_quantization_method_is_refused_with_its_name(llama, tmp_path):
    import shutil

    shutil.copytree(llama, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="'awq'"):
        StageModel(resolve(str(tmp_path / "m")), 0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_quantized_stages_compute_on_the_gpu(llama, weights):
    source = resolve(str(llama))
    full = split(source, "bf16")
    q = [StageModel(source, a, b, weights=weights, device="cuda", dtype=torch.bfloat16)
         for a, b in ((0, 3), (3, 6))]
    assert all(s.device.type == "cuda" and s.weights == weights for s in q)
    for ids in PROMPTS:
        # the reference stages are on the GPU too when there is one (device "auto")
        a, b = run(full, ids).float().cpu(), run(q, ids).float().cpu()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.8
