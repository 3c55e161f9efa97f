"""RMSNorm as one kernel on a GPU: the norms whose forward is exactly F.rms_norm (issue 42).

transformers' Llama-style RMSNorm (about 140 of its families share the form) runs as six
or seven small kernels -- a cast, a square, a mean, an add, a reciprocal square root, two
multiplies -- twice per decoder layer. On the H200 a bf16 decode step of an 8B model
spent about a third of its kernel time outside the matrix products, in some 1,300 such
kernels of a microsecond or two each (bench/RESULTS.md, 2026-12-04). torch's
`F.rms_norm` computes the same function in one fused kernel on CUDA.

Which modules may switch is decided by what they compute, not by their names: for each
norm class met, one instance's forward, on a copy given random weights, is compared with
F.rms_norm on random inputs in float32; only a class that agrees switches. Gemma's
(1 + weight) scaling, norms without a weight, norms that take a gate: all disagree or
refuse, and keep their own forward. The results differ from the unfused ones in the last
bit of bf16 (the product with the weight is rounded once, not twice), as any two kernels'
do. CPU stages keep transformers' forward: the CPU tests compare them bit for bit with
transformers, and the CPU has no launch cost to save.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F
from torch import nn

_MARK = "_potluck_fused_eps"


def _eps_of(m: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, float):
            return v
    return None


def _fused_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs or hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, getattr(self, _MARK))


def computes_rms_norm(m: nn.Module, eps: float) -> bool:
    """Whether the module's own forward is F.rms_norm with its weight and eps, checked
    on a copy of it with random weights, in float32, on random inputs."""
    weight = getattr(m, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.is_meta:
        return False
    h = weight.shape[0]
    probe = copy.deepcopy(m).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(h, generator=g) * 0.5 + 1.0)
        # rows of several sizes: the small ones tell one eps from another
        scale = torch.tensor([3.0, 1e-2, 1e-3]).view(3, 1, 1)
        x = (torch.randn(3, 2, h, generator=g) * scale).to(weight.device)
        try:
            got = type(m).forward(probe, x)
        except Exception:  # noqa: BLE001 -- a norm that needs more than an input keeps its forward
            return False
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return False
        want = F.rms_norm(x, (h,), probe.weight, eps)
    return bool(torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5))


def fuse_rms_norms(model: nn.Module) -> int:
    """Switch every RMSNorm of `model` that computes F.rms_norm to it; returns how many.
    Idempotent (layers kept for a new stage are switched already)."""
    verdict: dict[tuple, bool] = {}   # (class, eps) -> whether it computes F.rms_norm
    n = 0
    for m in model.modules():
        if getattr(m, _MARK, None) is not None:
            n += 1
            continue
        if "RMSNorm" not in type(m).__name__:
            continue
        eps = _eps_of(m)
        if eps is None:
            continue
        key = (type(m), eps)
        if key not in verdict:
            verdict[key] = computes_rms_norm(m, eps)
        if verdict[key]:
            setattr(m, _MARK, eps)
            m.forward = types.MethodType(_fused_forward, m)
            n += 1
    return n
