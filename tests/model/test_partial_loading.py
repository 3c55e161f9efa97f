"""A stage reads only its share of a sharded safetensors checkpoint."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.model.sources import resolve  # noqa: E402
from engine.model.stage import StageModel  # noqa: E402
from testkit.tiny_models import build_tiny_model  # noqa: E402

N_LAYERS = 8
N_STAGES = 4
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_sharded")
    # ~150 kB per layer: shards of 200 kB hold about one layer each, some straddling two.
    model = build_tiny_model("llama", root, shard_size="200KB", n_layers=N_LAYERS)
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    return root, model, weight_map


def _stage_of_key(key: str, bounds) -> set[int]:
    """Which stages hold this checkpoint tensor."""
    m = LAYER_KEY.match(key)
    if m:
        i = int(m.group(1))
        return {s for s, (a, b) in enumerate(bounds) if a <= i < b}
    if key.startswith("model.embed_tokens."):
        return {0}
    return {len(bounds) - 1}  # final norm, lm_head


def _layer_bytes(named_params) -> int:
    return sum(p.numel() * p.element_size() for n, p in named_params if ".layers." in f".{n}")


def test_stages_load_only_their_share(sharded_llama):
    root, full, weight_map = sharded_llama
    all_files = set(weight_map.values())
    assert len(all_files) >= 6, "the checkpoint should be split into many shards"

    source = resolve(str(root))
    step = N_LAYERS // N_STAGES
    bounds = [(s * step, (s + 1) * step) for s in range(N_STAGES)]
    stages = [StageModel(source, a, b) for a, b in bounds]

    total_layer_bytes = _layer_bytes(full.named_parameters())
    emb_bytes = full.model.embed_tokens.weight.numel() * 4
    head_bytes = full.lm_head.weight.numel() * 4
    for s, stage in enumerate(stages):
        own = _layer_bytes(stage.model.named_parameters())
        assert own / total_layer_bytes == pytest.approx(1 / N_STAGES, abs=0.02)
        # Everything else is the embedding (first stage), the final norm and head (last).
        other = stage.param_bytes() - own
        expect = (emb_bytes if stage.first else 0) + (head_bytes if stage.last else 0)
        assert expect <= other <= expect + 4 * full.config.hidden_size
        assert len(stage._layers) == step

        opened = set(stage.files_opened)
        needed = {f for k, f in weight_map.items() if s in _stage_of_key(k, bounds)}
        assert opened < all_files, f"stage {s} opened every shard"
        assert opened == needed, f"stage {s}: opened {sorted(opened)}, needs {sorted(needed)}"

        # The weights are the checkpoint's, at the right (re-indexed) layers.
        for i, layer in enumerate(stage._layers):
            ref = full.model.layers[stage.start + i].state_dict()
            got = layer.state_dict()
            assert got.keys() == ref.keys()
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], atol=0, rtol=0)
    # Together the stages open every shard; a shard is opened by two stages only when
    # it straddles their boundary (checked above: opened == needed).
    assert set().union(*(set(s.files_opened) for s in stages)) == all_files
