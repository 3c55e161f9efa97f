"""Grouped-query attention over several new tokens without copying the keys (issue 42).

A grouped-query model (an 8B Llama: 32 query heads over 8 key/value heads) has each
key/value head serve several query heads. For one new token a row, transformers' SDPA
path folds those query heads into the query's length (`pack_gqa`) and reads each key
once. For more than one with a mask -- a verification step of 1 + k tokens, a prompt --
it copies every key and value once per query head first (`repeat_kv`): for a 1 + 4 token
step over 2,048 keys of an 8B model, 32 MiB of keys and values copied a layer and read
again, two gigabytes of traffic a step beside the 16 GB of weights. CUDA's fused kernels take no mask
with `enable_gqa`, so this folds the query heads into the length for a few tokens
(FOLD_MAX_TOKENS), as pack_gqa does for one: query [B, H, T, D] -> [B, KVH, n_rep * T, D] (row
r * T + t is query head kv * n_rep + r at token t), the mask [B, 1, T, L] tiled n_rep
times to match. The same sums as the copied keys give, in another kernel's order.

Registered under its own name in transformers' attention registry and picked per model
(`use_packed_gqa`); whatever it does not handle -- one token, no mask, a position bias,
a paged cache, a soft cap -- goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F

from engine.model.product_attention import product_attention, products_for

NAME = "potluck_packed_gqa"
# up to this many new tokens a row are folded: a verification step (2-9 tokens) or a
# short prompt piece, where reading the keys is the step's cost. A long prompt piece is
# compute, not reads, and its mask, tiled per query head, would outgrow the copies it saves
FOLD_MAX_TOKENS = 16


def packed_gqa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_rep = getattr(module, "num_key_value_groups", 1) or 1
    B, H, T, _ = query.shape
    few = (T <= FOLD_MAX_TOKENS and dropout == 0.0 and attention_mask is not None and attention_mask.dim() == 4
           and attention_mask.shape[1] == 1 and attention_mask.shape[2] == T and key.shape[1] * n_rep == H
           and all(kwargs.get(k) is None for k in ("position_bias", "cache", "softcap", "s_aux", "sinks")))
    if few and T == 1 and attention_mask.is_floating_point() and products_for(module, B, key.shape[2], H):
        # a GPU stage that timed two products faster for a decode step at this many keys
        # (product_attention.py; what it timed and checked: one token a row, additive masks)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return product_attention(query, key, value, attention_mask, scale), None
    if not (few and n_rep > 1 and T > 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(B, H // n_rep, n_rep * T, query.shape[-1])
    mask = attention_mask.repeat(1, 1, n_rep, 1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, T, out.shape[-1]).transpose(1, 2).contiguous(), None


def use_packed_gqa(model) -> bool:
    """Have `model`'s attention run through packed_gqa_attention where it runs through
    transformers' SDPA now; True if it does. A family whose code asks whether its
    attention is "sdpa" by name (Falcon's ALiBi path, Gemma 4's query trimming) keeps
    SDPA: under another name it would take another path."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or _asks_for_sdpa_by_name(type(model).__module__):
        return False
    AttentionInterface.register(NAME, packed_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)      # masks made as for SDPA
    config._attn_implementation = NAME     # transformers' setter passes it to sub-configs
    return True


@functools.lru_cache(maxsize=None)
def _asks_for_sdpa_by_name(module_name: str) -> bool:
    """Whether the code of a modeling module holds the string "sdpa". Read from its
    functions' compiled constants, not its source: the installed app's transformers is
    bytecode only."""
    module = sys.modules.get(module_name)
    if module is None:
        return True
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != module_name:
            continue
        for member in (vars(obj).values() if isinstance(obj, type) else (obj,)):
            for fn in (member, getattr(member, "__func__", None), getattr(member, "fget", None),
                       getattr(member, "__wrapped__", None)):
                code = getattr(fn, "__code__", None)
                if code is not None and _holds(code, "sdpa"):
                    return True
    return False


def _holds(code, text: str) -> bool:
    """Whether a code object's constants hold `text`, in nested code and in the tuples and
    frozensets a test like `x in ("eager", "sdpa")` compiles to."""
    consts = code.co_consts if isinstance(code, types.CodeType) else code
    return any(c == text or (isinstance(c, (types.CodeType, tuple, frozenset)) and _holds(c, text))
               for c in consts)
