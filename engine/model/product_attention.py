"""A decode step's attention as two batched matrix products, where a GPU runs it faster
(issue 42).

For a step's few new tokens a row, SDPA's kernels run one block per row and key/value
head: 8 blocks for one user of an 8B Llama, each walking every key alone, far below the
GPU's bandwidth once the context is long (engine/model/key_clock.py). The same attention
as two batched products -- the scores q k^T, a softmax, then p v -- lets each product's
kernel spread over the keys as any matrix product does, at the cost of a few more
launches and the scores written out (a few hundred KB).

A GPU stage uses it only where it timed it faster than SDPA at load, per row count from
a key count on (engine/core/attention_choice.py), and only once it gave SDPA's output on
this device on random inputs (`agrees`); and only for what it timed and checked: one
new token a row, an additive mask, scores under SCORE_BYTES. The choice rides on the model's configs
(`ATTR`), which the attention function (engine/model/gqa_attention.py) reads. Scores and
softmax are float32, as SDPA's own accumulators are.

A CPU stage takes them for every decode row (`EVERY_ROW`), for its bits more than its
time: SDPA's CPU kernel may split one query's keys over the step's threads, so its last
bits can follow the thread count, which follows what the owner's other programs leave
free (core/cpu_share.py) -- a seeded reply served with SDPA drew another token at a near
tie whenever the machine got busier (bench/seeded_repeat.py; bench/RESULTS.md, session 18,
also for what the products' own sums follow). The products give the same bits on any number of threads, at SDPA's
time within a few microseconds a layer (9 query heads over 3, one to sixteen rows, 64 to
2,000 keys on the 2-core test machine; faster from 1,000 keys on).
"""

from __future__ import annotations

import torch
from torch import nn

# on a model's config objects: {rows: fewest keys from which a step of that many rows
# takes the products}
ATTR = "potluck_products_from"
# a table's row count that stands for any: {EVERY_ROW: 1} takes the products for every
# decode step (a CPU stage's)
EVERY_ROW = 0
# the most a layer's float32 scores may take (one user of an 8B model at 128k keys: 16 MiB)
SCORE_BYTES = 64 * 2**20


def product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """query [B, H, T, D], key and value [B, KVH, L, D], an additive mask [B, 1, T, L] ->
    [B, T, H, D], as transformers' attention functions return it. Query head h = kv *
    n_rep + r reads key/value head kv (grouped-query attention, n_rep = H / KVH)."""
    B, H, T, D = query.shape
    kvh, L = key.shape[1], key.shape[2]
    n_rep = H // kvh
    q = query.reshape(B * kvh, n_rep * T, D)       # row r * T + t: query head kv * n_rep + r, token t
    k = key.reshape(B * kvh, L, key.shape[-1])
    v = value.reshape(B * kvh, L, value.shape[-1])
    if q.is_cuda and q.dtype != torch.float32:
        s = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        s = torch.bmm(q, k.transpose(1, 2)).float()
    m = mask if T == 1 else mask.repeat(1, 1, n_rep, 1)          # [B, 1, 1 or n_rep * T, L]
    s = torch.add(m, s.view(B, kvh, n_rep * T, L), alpha=scaling)
    p = torch.softmax(s, dim=-1).to(value.dtype)
    out = torch.bmm(p.view(B * kvh, n_rep * T, L), v)
    return out.view(B, H, T, v.shape[-1]).transpose(1, 2).contiguous()


def agrees(q, k, v, mask, scaling: float, sdpa_out: torch.Tensor) -> bool:
    """Whether product_attention gives SDPA's output (`sdpa_out`, [B, T, H, D]) on these
    inputs: to the last bits of bf16 on a GPU, of float32 on a CPU, against the output's
    largest value (inputs whose attention is peaked, so a key or head read wrong shows)."""
    got = product_attention(q, k, v, mask, scaling).float()
    want = sdpa_out.float()
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    return got.shape == want.shape and bool(torch.isfinite(got).all()) \
        and float((got - want).abs().max()) <= tol * float(want.abs().max()) + 1e-6


def set_products(model: nn.Module, table: dict[int, int] | None) -> None:
    """Have `model`'s decode steps take the products where `table` says ({rows: fewest
    keys}); None or {}: SDPA everywhere. Set on every config object its modules hold (a
    multimodal model's text layers hold a sub-config)."""
    seen = set()
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            setattr(c, ATTR, dict(table) if table else None)


def products_for(module, rows: int, keys: int, heads: int) -> bool:
    """Whether a decode step of `rows` rows over `keys` keys takes the products: where
    the stage chose them, and as long as the scores they write stay under SCORE_BYTES
    (the choice holds past the longest context timed, where SDPA is slower still, but
    not into scores of hundreds of megabytes)."""
    table = getattr(getattr(module, "config", None), ATTR, None)
    if not table:
        return False
    least = table.get(rows, table.get(EVERY_ROW))
    return least is not None and keys >= least and rows * heads * keys * 4 <= SCORE_BYTES
