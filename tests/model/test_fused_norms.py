"""RMSNorm as one fused call on a GPU (engine/model/fused_norms.py): which norms switch,
decided by what they compute, and a stage that gives the same logits with fewer
operators a step. Run on the CPU here (the switch itself is a GPU stage's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pytest

from engine.core.product_choice import ProductChoice
from engine.model.fused_norms import computes_rms_norm, fuse_rms_norms
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel

PROMPT = [5, 9, 14, 3, 77, 8, 1, 60]


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def steps(s: StageModel) -> tuple[list[torch.Tensor], int]:
    """A prompt step, then a decode step counted operator by operator."""
    out = [s.forward(StageBatch([0], [0], [len(PROMPT)]), torch.tensor(PROMPT))]
    with Count() as c:
        out.append(s.forward(StageBatch([0], [len(PROMPT)], [1]), out[-1].argmax(-1)))
    s.free(0)
    return out, c.n


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "olmo2", "deepseek_v3", "granite"])
def test_a_stage_with_fused_norms_gives_the_same_logits_with_fewer_operators(tiny_folder, arch):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    # one matrix product for both: each stage would time its own choice (engine/model/
    # cpu_linear.py), and the two products run different operators (CI ran 772 against 860)
    plain = StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
    want, n_plain = steps(plain)
    fused = StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
    switched = fuse_rms_norms(fused.model)
    got, n_fused = steps(fused)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    norms = [m for m in fused.model.modules() if "RMSNorm" in type(m).__name__]
    if arch == "gemma3_text":
        # its norms scale by (1 + weight): not F.rms_norm, so none switches
        assert switched == 0 and n_fused == n_plain
    else:
        assert switched >= 2 * L + 1 and n_fused < n_plain, (switched, n_fused, n_plain)
    assert switched <= len(norms)
    assert fuse_rms_norms(fused.model) == switched   # again: nothing more, nothing wrapped twice


class OnePlusWeight(nn.Module):     # Gemma's form
    def __init__(self, h):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(h)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class Gated(nn.Module):             # takes a second input
    def __init__(self, h):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), 1e-6

    def forward(self, x, gate):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * gate


class WeightIgnored(nn.Module):     # ones at load, but never read: random weights tell
    def __init__(self, h):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_only_a_norm_that_computes_rms_norm_switches():
    for cls in (OnePlusWeight, Gated, WeightIgnored):
        assert not computes_rms_norm(cls(16), 1e-6), cls.__name__
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert computes_rms_norm(LlamaRMSNorm(16, eps=1e-5), 1e-5)
    assert not computes_rms_norm(LlamaRMSNorm(16, eps=1e-5), 1e-3)   # the eps is checked too


@pytest.mark.gpu
def test_a_gpu_stage_fuses_its_norms_and_keeps_its_logits(tmp_path, monkeypatch):
    from testkit.stage_pairs import off_and_on

    plain, fused = off_and_on(tmp_path, "POTLUCK_FUSED_NORMS", monkeypatch)
    L = fused.end
    assert plain.fused_norms == 0 and fused.fused_norms == 2 * L + 1
    (a0, a1), _ = steps(fused)
    (b0, b1), _ = steps(plain)
    for a, b in ((a0, b0), (a1, b1)):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-4)
