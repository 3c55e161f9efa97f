"""4-bit weights through torch's own int4 kernels: `--weights int4` (issue 42).

bitsandbytes' NF4 kernels read an H200's memory at about a fifth of its bandwidth, no
faster than bf16 weights, and a 1 + 4 token verification step costs 1.9x a 1-token one
(bench/RESULTS.md, 2026-12-04). torch ships the int4 weight-only kernels torchao uses
("tinygemm"): `_weight_int4pack_mm` on a CUDA GPU (Ampere or newer) and
`_weight_int4pack_mm_for_cpu` on a CPU, both reading packed 4-bit weights with a bf16
scale and zero per group of GROUP input columns. No compiler, nothing more to install.

The format is asymmetric: a group's weights are w = (q - 8) * scale + zero, q in 0..15,
the group's minimum and maximum spanning the 16 levels -- the shape of a GGUF's Q4_1
blocks (32 weights, a scale and a minimum), which is why GROUP is 32: the default model's
layers keep their own 4-bit levels (only the zero is rounded to bf16). Activations enter
the kernel in bf16 and the output returns to the stage's dtype; on a CPU stage (float32)
that rounding is part of what int4 costs. Together: int4 agrees with the default model's
full-precision logits as often as computing in bf16 does (bench/quant.py).

A stage quantizes each decoder layer's Linear weights as soon as that layer is read, on
the device it is read to (the full-precision copy of one layer at a time exists there, never
the slice's), then packs them for its device. Embeddings and the LM head stay at the compute dtype, as with
int8 and nf4. A Linear the kernels cannot take (rows not a multiple of 16, columns not
of the group) keeps its own product.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core.errors import ModelError
from engine.model.fused_products import SharedProduct, bounds, sibling_groups

GROUP = 32
# the CPU kernel packs rows 16 at a time; the CUDA one tiles the columns by 16 x innerKTiles
_ROW_MULTIPLE = 16


def quantize(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q uint8 [N, K] in 0..15, scale_zero [K / group, N, 2] bf16), with
    weight ~= (q - 8) * scale + zero in each group of `group` columns of a row."""
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    # bf16 first: the kernel scales with these, so q is chosen against what it will use
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = ((w - zero) / scale + 8).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    scale_zero = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, scale_zero


def dequantize(q: torch.Tensor, scale_zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """What the kernels compute with: [N, K] float32."""
    N, K = q.shape
    sz = scale_zero.float().transpose(0, 1)                  # [N, K / group, 2]
    w = (q.reshape(N, K // group, group).float() - 8) * sz[..., :1] + sz[..., 1:]
    return w.reshape(N, K)


def fits(linear: nn.Linear, group: int = GROUP) -> bool:
    K = linear.in_features
    return linear.out_features % _ROW_MULTIPLE == 0 and K % group == 0 and K % 32 == 0


def _inner_k_tiles(K: int) -> int:
    for t in (8, 4, 2):
        if K % (t * 16) == 0:
            return t
    raise ModelError(f"int4 weights need a layer's input width to be a multiple of 32, not {K}")


def to_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> [N, K / 2], two weights a byte, the first in the high half."""
    return q[:, ::2] << 4 | q[:, 1::2]


def from_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(nibbles.shape[0], -1)


def pack(nibbles: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Nibbles [N, K / 2] -> the kernel's packed weights on `device`."""
    if device.type == "cuda":
        try:
            return torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), _inner_k_tiles(nibbles.shape[1] * 2))
        except RuntimeError as exc:
            raise ModelError(f"int4 weights cannot run on this GPU ({exc}); choose --weights nf4 or bf16") from None
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(from_nibbles(nibbles.cpu()).to(torch.int32), 1)
    raise ModelError(f"int4 weights run on a CUDA GPU or the CPU, not {device.type}")


class Int4Linear(nn.Module):
    """A Linear whose weight is 4-bit groups (see the module's docstring). Built from a
    full-precision Linear where that was read; `packed` for its device by `to_device`."""

    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        q, scale_zero = quantize(linear.weight, group)
        # half a byte a weight until packed for the stage's device (which may move them there first)
        self.register_buffer("nibbles", to_nibbles(q))
        self.register_buffer("scale_zero", scale_zero)
        self.register_buffer("packed", None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def to_device(self, device: torch.device) -> None:
        self.scale_zero = self.scale_zero.to(device)
        self.packed = pack(self.nibbles, device)
        self.nibbles = None
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(device), requires_grad=False)

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * self.scale_zero.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.packed.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zero)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


class Int4Part(nn.Module):
    """One projection's columns of a joined int4 product: q of q/k/v, gate of gate/up.
    The joined layer is registered under the first part only, so it is moved, packed and
    counted once with the model."""

    def __init__(self, shared: SharedProduct, index: int, in_features: int, out_features: int,
                 whole: Int4Linear | None = None):
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = in_features, out_features
        if whole is not None:
            self.whole = whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.take(self.index, x)

    def extra_repr(self) -> str:
        lo, hi = self.shared.bounds[self.index]
        return f"columns {lo}..{hi} of a joined int4 product"


def join(members: list[nn.Linear], group: int = GROUP) -> list[Int4Part]:
    """Sibling projections that read one input (engine/model/fused_products.py GROUPS) as
    one int4 product. A weight's groups are per row, so each member keeps the very levels
    it would have alone, and the kernel computes each output as it would alone (the CPU's
    bit for bit); what goes is a kernel call per member -- and on a GPU a grouped-query
    model's small k and v products, too narrow to keep its memory busy."""
    K = members[0].in_features
    # quantized one member at a time, then joined: the float copies quantizing makes are
    # one projection's, not the group's (a 70B model's gate and up together would be
    # gigabytes on the device a stage fits only at 4 bits)
    parts = [Int4Linear(m, group) for m in members]
    whole = parts[0]
    whole.out_features = sum(p.out_features for p in parts)
    whole.nibbles = torch.cat([p.nibbles for p in parts])
    whole.scale_zero = torch.cat([p.scale_zero for p in parts], 1)
    if whole.bias is not None:
        whole.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    shared = SharedProduct(whole, bounds(members))
    return [Int4Part(shared, i, K, m.out_features, whole if i == 0 else None) for i, m in enumerate(members)]


def _joinable(members: list) -> bool:
    return all(type(m) is nn.Linear and not m.weight.is_meta and fits(m) for m in members) \
        and len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1


def quantize_layers(layers: nn.Module, progress=None, joined: bool = True) -> int:
    """Swap each Linear of `layers` the kernels can take for an Int4Linear (on the device
    they were read to), sibling projections that read one input for one joined product
    unless `joined` is False; returns how many Linears are now 4-bit. progress(done, total,
    what): a big model's layers take a while on a CPU."""
    groups = [(parent, names, members) for parent in layers.modules() for names, members in sibling_groups(parent)
              if joined and _joinable(members)]
    in_groups = {id(m) for _, _, members in groups for m in members}
    todo = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and not child.weight.is_meta and fits(child) and id(child) not in in_groups]
    total = len(todo) + len(groups)
    for i, (parent, name, child) in enumerate(todo):
        if progress is not None:
            progress(i, total, "making the weights 4-bit")
        setattr(parent, name, Int4Linear(child))
    for i, (parent, names, members) in enumerate(groups):
        if progress is not None:
            progress(len(todo) + i, total, "making the weights 4-bit")
        for name, part in zip(names, join(members)):
            setattr(parent, name, part)
    if progress is not None and total:
        progress(total, total, "making the weights 4-bit")
    return len(todo) + len(in_groups)


def place(model: nn.Module, device: torch.device) -> None:
    """Pack every Int4Linear of `model` for `device` (after the model moved there)."""
    for m in model.modules():
        if isinstance(m, Int4Linear) and m.nibbles is not None:
            m.to_device(device)


def int4_bytes(model: nn.Module) -> int:
    """The packed weights and their scales: memory no parameter's numel() counts."""
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, Int4Linear) and m.packed is not None)
