"""The projections that read the same input as one matrix product on a GPU (issue 42).

A Llama-style decoder layer multiplies one input by three matrices for attention (q_proj,
k_proj, v_proj) and another by two for the MLP (gate_proj, up_proj). At decode's one row
a product is a matrix-vector product that reads its weight once: five separate ones read
the same bytes as two fused ones, but launch five kernels (each with its split-K
reduction), and the small k/v matrices of a grouped-query model are too small to keep the
GPU's memory busy. On the H200 the matrix kernels of an 8B bf16 step read the weights at
0.83 of the copy bandwidth, and each small kernel cost a microsecond or two
(bench/RESULTS.md, 2026-12-04).

transformers' attention and MLP modules call each projection themselves, so the fused
product is shared rather than rewritten into them: the members' weights become row
slices of one matrix (no second copy), and the first member called with an input
computes the whole product for it; the others, called with that same tensor, are handed
their columns of it. The group holds the input while its members are still due, so its
identity cannot pass to another tensor in between; a member called with any other input
(or twice with one) starts a new product, so a module that feeds its projections
different inputs stays correct, only slower. The outputs differ from the separate
products' at most in rounding (another kernel over the same sums).

Only plain `nn.Linear` members of one dtype, device and input width, all with a bias or
none, are grouped: bitsandbytes' 4- and 8-bit layers keep their own kernels. CPU stages
keep transformers' modules (engine/model/cpu_linear.py chooses their products).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

# the sets of sibling projections that read one input, by transformers' names
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_MARK = "_potluck_fused_group"


class SharedProduct:
    """One product shared by sibling projections: `product(x)` gives the members' outputs
    side by side, member i's in columns `bounds[i]`; it holds the last input and its
    product while members are still due to take theirs. `product` is the joined Linear's
    weights here, and a joined int4 layer in engine/model/int4.py."""

    def __init__(self, product, bounds: list[tuple[int, int]]):
        self.product, self.bounds = product, bounds
        self.x = self.y = None
        self.served: set[int] = set()

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        # another input, or a member asking twice for this one: a new call of the module
        # (a step that stopped half-way, a module feeding its members different inputs)
        if self.x is not x or index in self.served:
            self.x, self.y = x, self.product(x)
            self.served = set()
        lo, hi = self.bounds[index]
        y = self.y[..., lo:hi]
        self.served.add(index)
        if len(self.served) == len(self.bounds):
            self.x = self.y = None   # a prompt's activations are not kept past the layer
            self.served = set()
        return y


def _member_forward(self, x: torch.Tensor) -> torch.Tensor:
    group, index = getattr(self, _MARK)
    return group.take(index, x)


def bounds(members) -> list[tuple[int, int]]:
    """Each member's columns of the joined output, in order."""
    out, lo = [], 0
    for m in members:
        out.append((lo, lo + m.out_features))
        lo += m.out_features
    return out


def sibling_groups(parent: nn.Module):
    """Each set of `parent`'s projections (GROUPS) that all exist, as (names, modules)."""
    for names in GROUPS:
        members = [getattr(parent, name, None) for name in names]
        if all(m is not None for m in members):
            yield names, members


def _groupable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members):
        return False
    w0 = members[0].weight
    if any(m.weight.is_meta for m in members):
        return False
    same = all(m.weight.dtype == w0.dtype and m.weight.device == w0.device
               and m.in_features == members[0].in_features for m in members)
    biased = {m.bias is not None for m in members}
    return same and len(biased) == 1


def fuse_products(model: nn.Module) -> int:
    """Join every group of sibling projections of `model` that read one input into one
    product; returns how many groups are fused. Idempotent (layers kept for a new stage
    are joined already)."""
    n = 0
    for parent in model.modules():
        for _, members in sibling_groups(parent):
            if all(getattr(m, _MARK, None) is not None for m in members):
                n += 1
                continue
            if not _groupable(members):
                continue
            try:
                with torch.no_grad():
                    weight = torch.cat([m.weight for m in members])
                    bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
            except torch.OutOfMemoryError:
                # a GPU filled to its share has no room for one group's second copy: the
                # groups left keep their separate products (slower, never a failed load)
                _give_back(members[0].weight)
                return n
            group = SharedProduct(functools.partial(F.linear, weight=weight, bias=bias), bounds(members))
            for i, m in enumerate(members):
                lo, hi = group.bounds[i]
                # the member's parameters become views of the joined ones: one copy in memory
                m.weight = nn.Parameter(weight[lo:hi], requires_grad=False)
                if bias is not None:
                    m.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
                setattr(m, _MARK, (group, i))
                m.forward = types.MethodType(_member_forward, m)
            n += 1
            # the members' old weights go back to the device now, not to the allocator's
            # cache: kept there, a layer's joined matrix would not fit in them (another
            # size), and a whole stage's cache would grow by most of its weights (+5.8 GiB
            # seen on an 8B model) -- memory the KV cache, the load of a spare, or a
            # friend's other programs were promised
            _give_back(weight)
    return n


def _give_back(like: torch.Tensor) -> None:
    if like.is_cuda:
        from engine.model.cuda_graphs import release_cached_memory

        release_cached_memory()
