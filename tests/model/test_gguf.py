"""GGUF by slice: a stage reads its own layers' tensors of a memory-mapped GGUF.

The default model is a GGUF (SmolLM2-135M, Q4_1/Q8_0 blocks), so this is the path
every `make run` takes; its answers are checked token by token against
transformers' own GGUF loader in tests/pipeline/test_pipeline.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from engine.model.sources import ModelError, resolve  # noqa: E402
from engine.model.stage import StageModel  # noqa: E402

SPLIT = [(0, 10), (10, 20), (20, 30)]

# One stage in a fresh process: how much its resident memory grew while it loaded
# (peak, from the kernel's own high-water mark) and what it holds.
_PROBE = r"""
import json, resource, sys
sys.path.insert(0, {root!r})
from engine.model.sources import resolve
from engine.model.stage import StageModel
src = resolve("default"); src.config(); src.fingerprint()
import transformers.modeling_utils, accelerate  # imports are not the slice
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
s = StageModel(src, {a}, {b})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
layers = sum(p.numel() * p.element_size() for p in s._layers.parameters())
print(json.dumps({{"growth": peak - before, "params": s.param_bytes(), "layers": layers}}))
"""


def _probe(a: int, b: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(ROOT), a=a, b=b)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_three_stages_each_hold_a_third_and_peak_near_their_slice(default_source):
    whole = StageModel(default_source, 0, 30)
    whole_layers = sum(p.numel() * p.element_size() for p in whole._layers.parameters())
    whole_bytes = whole.param_bytes()
    assert whole.files_opened == [default_source.gguf_path.name]
    del whole
    probes = [_probe(a, b) for a, b in SPLIT]
    for (a, b), p in zip(SPLIT, probes):
        # ten of thirty layers: a third of the layer weights
        assert abs(p["layers"] / whole_layers - 1 / 3) < 0.02, (a, b, p)
        # loading it raised the process's peak by about its slice, nowhere near the
        # whole model dequantized (what a transformers GGUF load costs every stage)
        assert p["growth"] < p["params"] * 1.5 + (48 << 20), (a, b, p)
        assert p["growth"] < whole_bytes * 0.75, (a, b, p)


def test_a_truncated_gguf_is_refused_with_a_message(default_source, tmp_path):
    """A download stopped part way: the header and the tensor table are whole, the
    tensors stop short. It is named as cut short before transformers' reader trips over
    it (that said "cannot reshape array of size ...": a parser's words, no remedy)."""
    data = default_source.gguf_path.read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"half\.gguf is truncated: .*download it again"):
        resolve(str(cut))
    from engine.model.checkpoint import GgufCheckpoint  # the stage's own reader says the same
    with pytest.raises(ModelError, match="is truncated"):
        GgufCheckpoint(cut, None, None)


@pytest.mark.parametrize("content", [b"GGUF" + os.urandom(4096), b"not a gguf at all", b""])
def test_a_file_that_is_not_a_gguf_is_refused_with_a_message(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelError, match="not a GGUF file Potluck can read"):
        resolve(str(bad))


def test_the_config_and_tokenizer_are_read_once(default_source):
    root = default_source.root
    assert (root / "config.json").exists() and (root / "potluck-gguf.json").exists()
    assert not list(root.glob("*.safetensors")), "the weights stay in the GGUF"
    assert json.loads((root / "potluck-gguf.json").read_text())["gguf"] == default_source.gguf_path.name


def test_two_machines_caching_the_default_model_in_different_homes_agree_on_its_fingerprint(tmp_path):
    """Friends' caches sit under different home folders (/home/alice, /home/bob): the
    fingerprint stages compare at connect must not see where the copy lives."""
    prints = []
    for who in ("alice", "bob"):
        env = dict(os.environ, HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path / who / ".cache"))
        out = subprocess.run([sys.executable, "-c", "from engine.model.sources import resolve;"
                              "s = resolve('default'); print(s.root); print(s.fingerprint())"],
                             capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
        assert out.returncode == 0, out.stderr[-2000:]
        root, fp = out.stdout.strip().splitlines()[-2:]
        assert root.startswith(str(tmp_path / who))
        prints.append(fp)
    assert prints[0] == prints[1]
