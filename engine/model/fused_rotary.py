"""Rotary embeddings in three kernels a layer on a GPU, not ten (issue 42).

transformers' `apply_rotary_pos_emb` (Llama's form, copied into most families) computes
`q * cos + rotate_half(q) * sin` and the same for k: a multiply, a negation, a
concatenation, a multiply and an add for each, ten small kernels a decoder layer. In a
decode step replayed as a CUDA graph those kernels cost a microsecond or two each
whatever their size, and after the fused norms and products they were the largest group
of small kernels left in a layer (about 40% of its launches).

Here the same function runs as `x * cos` and two in-place `addcmul`s, one for each half
(`rotate_half`'s halves and signs folded into which half of x and of sin each reads):
three kernels. Where q and k are neighbouring views of one projection's output (q/k/v
joined: engine/model/fused_products.py), they are rotated as one tensor: three kernels
for both.

Which families switch is decided by what their function computes, not by its name: the
function an attention class's forward calls is run on random inputs beside ours, and only
one that agrees is replaced, and only in that module's forward (a copy of the forward
whose globals name ours; transformers' module is not touched, so other models in the
process keep theirs). Interleaved rotations (GLM, Cohere) disagree and keep their own; a
call ours does not cover (partial rotary, other arguments, mixed dtypes) is handed to the
family's function. Results differ from transformers' in the last bit of bf16 (each half's
product and sum are rounded once, not twice). CPU stages keep transformers' function: the
CPU tests compare them bit for bit with transformers, and the CPU has no launch cost to
save.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_NAME = "apply_rotary_pos_emb"
_MARK = "_potluck_fused_rotary"


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): three kernels."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
    out[..., h:].addcmul_(x[..., :h], sin[..., h:])
    return out


def joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [B, H, T, D] and k [B, K, T, D] as one [B, H + K, T, D] view, where k's heads follow
    q's in memory (slices of one q/k/v product); None otherwise."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or q.device != k.device:
        return None
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] < 2:
        return None
    # a dimension of size 1 may carry any stride (one position, one row, one key head)
    if any(n > 1 and a != b for n, a, b in zip(k.shape, q.stride(), k.stride())):
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    if k.storage_offset() != q.storage_offset() + q.shape[1] * q.stride(1):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], *q.shape[2:]), q.stride(), q.storage_offset())


class FusedRotary:
    """A family's apply_rotary_pos_emb, computed by `rotate` where the call is the form it
    was checked in; anything else goes to the family's own function."""

    def __init__(self, theirs):
        self.theirs = theirs

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        d = kwargs.get("unsqueeze_dim", 1)
        if (args or set(kwargs) - {"unsqueeze_dim"} or not isinstance(d, int)
                or not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin))
                or q.shape[-1] % 2 or cos.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]
                or sin.shape != cos.shape or len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1):
            return self.theirs(q, k, cos, sin, *args, **kwargs)
        cos, sin = cos.unsqueeze(d), sin.unsqueeze(d)
        qk = joined(q, k) if d == 1 else None
        if qk is not None:
            out = rotate(qk, cos, sin)
            return out[:, :q.shape[1]], out[:, q.shape[1]:]
        return rotate(q, cos, sin), rotate(k, cos, sin)


def agrees(theirs) -> bool:
    """Whether a family's function computes what FusedRotary does, on random inputs in
    float32: q and k apart, and as neighbouring slices of one product (batch 2, 4 query
    heads, 2 key heads, 3 positions, head size 8)."""
    g = torch.Generator().manual_seed(0)
    B, H, K, T, D = 2, 4, 2, 3, 8
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    qkv = torch.randn(B, T, (H + 2 * K) * D, generator=g)
    q = qkv[..., :H * D].view(B, T, H, D).transpose(1, 2)
    k = qkv[..., H * D:(H + K) * D].view(B, T, K, D).transpose(1, 2)
    ours = FusedRotary(theirs)
    try:
        with torch.no_grad():
            for qq, kk in ((q, k), (q.contiguous(), k.contiguous())):
                want = theirs(qq, kk, cos, sin)
                got = ours(qq, kk, cos, sin)
                if not (isinstance(want, tuple) and len(want) == 2):
                    return False
                for a, b in zip(got, want):
                    if not isinstance(b, torch.Tensor) or a.shape != b.shape \
                            or not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                        return False
    except Exception:  # noqa: BLE001 -- a function that takes other arguments keeps its own
        return False
    return True


def _forward_with(fn: types.FunctionType, rotary: FusedRotary) -> types.FunctionType:
    """A copy of a forward whose global `apply_rotary_pos_emb` is `rotary`."""
    glob = dict(fn.__globals__)
    glob[_NAME] = rotary
    new = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


def fuse_rotary(model: nn.Module) -> int:
    """Switch every attention module of `model` whose forward calls an
    apply_rotary_pos_emb that agrees with FusedRotary; returns how many. Idempotent
    (layers kept for a new stage are switched already)."""
    made: dict[int, types.FunctionType | None] = {}   # a class's forward -> its copy, or None
    n = 0
    for m in model.modules():
        if getattr(m, _MARK, False):
            n += 1
            continue
        fn = getattr(type(m), "forward", None)
        if not isinstance(fn, types.FunctionType) or _NAME not in fn.__code__.co_names \
                or "forward" in m.__dict__:   # a forward of its own already (rope.py): left as it is
            continue
        if id(fn) not in made:
            theirs = fn.__globals__.get(_NAME)
            made[id(fn)] = _forward_with(fn, FusedRotary(theirs)) if callable(theirs) and agrees(theirs) else None
        new = made[id(fn)]
        if new is not None:
            m.forward = types.MethodType(new, m)
            setattr(m, _MARK, True)
            n += 1
    return n
