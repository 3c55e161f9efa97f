"""Two stages of one tiny model, built with a stage option switched off and then on: how
the GPU tests of the fused modules compare a switch's logits with transformers' own."""

from __future__ import annotations

from engine.model.sources import resolve
from engine.model.stage import StageModel
from testkit.tiny_models import build_tiny_model


def off_and_on(folder, switch: str, monkeypatch, device: str = "cuda", arch: str = "llama"
               ) -> tuple[StageModel, StageModel]:
    """(the stage built with the environment `switch` at 0, the one built with it at 1),
    each the whole tiny `arch` model, stepping eagerly (no graphs). The model is built in
    `folder`: a lent GPU machine has no default model (conftest's tiny_folder copies its
    tokenizer)."""
    build_tiny_model(arch, folder)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "0")
    monkeypatch.setenv(switch, "0")
    plain = StageModel(source, 0, L, device=device)
    monkeypatch.setenv(switch, "1")
    return plain, StageModel(source, 0, L, device=device)
