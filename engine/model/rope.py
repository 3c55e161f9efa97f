"""Rotary embeddings whose frequencies follow the sequence length, computed per row.

Two of transformers' RoPE types pick their frequencies from the sequence length, and
take that length as the largest position in the whole batch (`dynamic_rope_update` in
transformers' modeling_rope_utils):

* `longrope` (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): long factors once the length
  passes `original_max_position_embeddings`, short factors below;
* `dynamic` (dynamic NTK): a base stretched to the length beyond
  `max_position_embeddings`, kept in the module (`max_seq_len_cached`) from one call
  to the next, and so from one request to the next.

With continuous batching one long sequence would switch every shorter one in its batch
to its frequencies, and a long request would leave its frequencies to the next. So on
these modules each row gets the frequencies its own length calls for, from the state a
freshly loaded model has: what the sequence gets when it runs alone.
"""

from __future__ import annotations

import torch
from torch import nn

_PER_LENGTH = ("longrope", "dynamic")


def _types(module) -> set[str]:
    t = getattr(module, "rope_type", None)
    return set(t.values()) if isinstance(t, dict) else {t}


def _follows_length(rope_type) -> bool:
    return isinstance(rope_type, str) and (rope_type == "longrope" or "dynamic" in rope_type)


def per_row_rotary(model: nn.Module) -> int:
    """Make every length-dependent rotary module of `model` per row. Returns how many."""
    n = 0
    for module in model.modules():
        if not any(_follows_length(t) for t in _types(module)) or not hasattr(module, "config"):
            continue
        module.forward = _PerRow(module, module.forward)
        n += 1
    return n


def plain_rotary(module: nn.Module) -> None:
    """Undo per_row_rotary on `module` (if it was patched), its state back to a fresh
    module's: a layer handed to another stage (engine/model/handover.py) is patched anew."""
    per_row = module.__dict__.get("forward")
    if not isinstance(per_row, _PerRow):
        return
    types = module.rope_type if isinstance(module.rope_type, dict) else {None: module.rope_type}
    for layer_type, rope_type in types.items():
        if _follows_length(rope_type):
            per_row._reset(rope_type, layer_type)
    del module.__dict__["forward"]


class _PerRow:
    """A rotary module's forward, called once per group of rows that need the same
    frequencies (rows at or below the original context share one call)."""

    def __init__(self, module, forward):
        self.module = module
        self.forward = forward
        self.fresh_scaling = getattr(module, "attention_scaling", None)

    def _rope_type(self, layer_type):
        t = self.module.rope_type
        return t[layer_type] if layer_type is not None else t

    def _key(self, end: int, rope_type: str, layer_type) -> int:
        """What the frequencies of a row whose positions end at `end` - 1 depend on."""
        m = self.module
        if rope_type == "longrope":
            params = m.config.rope_parameters
            params = params[layer_type] if layer_type is not None else params
            return int(end > params["original_max_position_embeddings"])
        if "dynamic" in rope_type:
            return max(end, m.original_max_seq_len)
        return 0

    def _reset(self, rope_type: str, layer_type) -> None:
        """Dynamic NTK's state as a freshly built module has it (transformers' own reset)."""
        if "dynamic" not in rope_type:
            return  # longrope recomputes its frequencies from the length on every call
        m = self.module
        prefix = "" if layer_type is None else f"{layer_type}_"
        m.register_buffer(f"{prefix}inv_freq", getattr(m, f"{prefix}original_inv_freq"), persistent=False)
        setattr(m, f"{prefix}max_seq_len_cached", m.original_max_seq_len)
        if self.fresh_scaling is not None:
            m.attention_scaling = self.fresh_scaling

    def __call__(self, x, position_ids, *args, **kwargs):
        layer_type = kwargs.get("layer_type", args[0] if args else None)
        rope_type = self._rope_type(layer_type)
        if not _follows_length(rope_type):
            return self.forward(x, position_ids, *args, **kwargs)
        ends = (position_ids.reshape(-1, position_ids.shape[-1]).amax(-1) + 1).tolist()
        if position_ids.dim() != 2 or position_ids.shape[0] != len(ends):
            ends = [max(ends)]  # not one row per sequence: as transformers does
        groups: dict[int, list[int]] = {}
        for r, end in enumerate(ends):
            groups.setdefault(self._key(end, rope_type, layer_type), []).append(r)
        if len(groups) == 1:
            self._reset(rope_type, layer_type)
            return self.forward(x, position_ids, *args, **kwargs)
        outs, order = [], []
        for rows in groups.values():
            self._reset(rope_type, layer_type)
            idx = torch.tensor(rows, device=position_ids.device)
            outs.append(self.forward(x, position_ids.index_select(0, idx), *args, **kwargs))
            order.extend(rows)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        back = back.to(position_ids.device)
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs).index_select(0, back)
        return type(outs[0])(torch.cat(parts).index_select(0, back) for parts in zip(*outs))
