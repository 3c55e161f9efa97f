"""A lean decode path for a Llama-family draft model on the host (issue 34).

A draft model's whole job is a few tokens for a few sequences, one position per step,
and the guesses it makes while a verification is in flight are what that trip can
carry next: a position's cost is tokens per trip. Through transformers' modules each
step also pays for what a draft never needs -- the stage's hooks, the cache object,
masks built for the general case, the module calls around them. This loop runs the same
weights (the draft's StageModel's modules, int8 or float32 alike) with none of that: the
products, RoPE, one attention call per row over its own cache, the residuals. On this
project's 2-core test machine the default model drafts 6-9% faster through it (one
thread: 56-62 ms a position at int8 against 60-67; the matrix products are most of
what is left).

It only has to be close: a draft's guesses are checked by the target, so a difference
in the last bits costs at most a rejected guess, never a different reply. It still
matches the StageModel's logits to float32 rounding (tests/model/test_lean_decoder.py).

Families: Llama's layout -- pre-norm, rotary q/k, grouped KV heads, a gated MLP -- as
Llama, Mistral (without a sliding window) and Qwen2 have it. Others keep the StageModel
path (`supports`).

The cache: per sequence one tensor [layers, 2, kv heads, capacity, head dim], grown by
doubling; a sequence's length is how much of it counts, so rolling back rejected
guesses is setting a number. The same interface as engine/model/kv.py's store for what
DraftModel asks of it (has, length, truncate, free, budget_tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.kv import KVCapacityError
from engine.model.stage import StageBatch, StageModel

FAMILIES = ("llama", "mistral", "qwen2")


def supports(stage: StageModel) -> bool:
    """Whether a whole-model StageModel is of a family this loop runs."""
    cfg = stage.source.config()
    if getattr(cfg, "model_type", None) not in FAMILIES or not (stage.first and stage.last):
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
            and cfg.model_type != "llama":
        return False
    base = getattr(stage.model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers) or not hasattr(base, "rotary_emb"):
        return False
    attn, mlp = layers[0].self_attn, layers[0].mlp
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


class LeanCache:
    """Per-sequence KV for the lean loop: what DraftModel needs of a KV store."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 budget_tokens: int):
        self.shape = (layers, 2, kv_heads)
        self.head_dim = head_dim
        self.dtype, self.device = dtype, device
        self.budget_tokens = budget_tokens
        self._kv: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def has(self, seq_id: int) -> bool:
        return seq_id in self._kv

    def length(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def truncate(self, seq_id: int, n: int) -> None:
        if seq_id in self._len:
            self._len[seq_id] = max(0, min(n, self._len[seq_id]))

    def free(self, seq_id: int) -> bool:
        self._len.pop(seq_id, None)
        return self._kv.pop(seq_id, None) is not None

    def reserve(self, rows: list[tuple[int, int, int]]) -> None:
        """Room for each (seq, start, n); KVCapacityError past the budget, nothing changed."""
        after = dict(self._len)
        for seq_id, start, n in rows:
            if start > after.get(seq_id, 0):
                raise ValueError(f"sequence {seq_id}: a step at {start} past its cache's {after.get(seq_id, 0)}")
            after[seq_id] = start + n
        if sum(after.values()) > self.budget_tokens:
            raise KVCapacityError(f"the draft model's cache holds {self.budget_tokens} tokens")
        for seq_id, start, n in rows:
            buf = self._kv.get(seq_id)
            cap = 0 if buf is None else buf.shape[3]
            if start + n > cap:
                grown = torch.zeros(*self.shape, max(16, 2 * cap, start + n), self.head_dim,
                                    dtype=self.dtype, device=self.device)
                if buf is not None:
                    grown[:, :, :, :cap] = buf
                self._kv[seq_id] = grown
            self._len[seq_id] = start + n

    def slot(self, seq_id: int) -> torch.Tensor:
        return self._kv[seq_id]


class LeanDecoder:
    """StageModel's forward for a whole Llama-family model, as a lean loop over its modules."""

    first = last = True

    def __init__(self, stage: StageModel):
        if not supports(stage):
            raise ValueError("the lean decoder runs whole Llama-family models only")
        self.stage = stage
        model = stage.model
        base = model.model
        self.embed, self.layers, self.norm = base.embed_tokens, list(base.layers), base.norm
        self.rotary, self.lm_head = base.rotary_emb, model.lm_head
        cfg = stage.source.config()
        attn = self.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.vocab_size = stage.vocab_size
        self.device = stage.device
        self.dtype = stage.dtype
        self.kv = LeanCache(len(self.layers), self.kv_heads, self.head_dim, stage.dtype, stage.device,
                            stage.kv.budget_tokens)

    @property
    def model(self):
        return self.stage.model

    def param_bytes(self) -> int:
        return self.stage.param_bytes()

    def free(self, seq_id: int) -> bool:
        return self.kv.free(seq_id)

    @torch.inference_mode()
    def forward(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids packed row after row -> the logits of each row's last token [B, vocab]."""
        rows = list(zip(batch.seq_ids, batch.starts, batch.ns))
        if inputs.shape[0] != sum(n for _, _, n in rows) or batch.keep is not None:
            raise ValueError("the lean decoder takes whole rows of token ids, the last position kept")
        self.kv.reserve(rows)
        ids = inputs.to(self.device)
        h = self.embed(ids)                                          # [N, hidden]
        pos = torch.cat([torch.arange(s, s + n) for _, s, n in rows]).to(self.device)
        cos, sin = self.rotary(h[None], pos[None])
        cos, sin = cos[0][:, None, :].to(h.dtype), sin[0][:, None, :].to(h.dtype)   # [N, 1, head dim]
        N, H, KVH, D = h.shape[0], self.heads, self.kv_heads, self.head_dim
        offsets = [0]
        for _, _, n in rows:
            offsets.append(offsets[-1] + n)
        masks = [None if n == 1 else _causal(s, n, self.device) for _, s, n in rows]
        slots = [self.kv.slot(sid) for sid, _, _ in rows]
        for li, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q = _rope(attn.q_proj(x).view(N, H, D), cos, sin)
            k = _rope(attn.k_proj(x).view(N, KVH, D), cos, sin)
            v = attn.v_proj(x).view(N, KVH, D)
            outs = []
            for r, (_, s, n) in enumerate(rows):
                a, b = offsets[r], offsets[r + 1]
                cache = slots[r][li]                                 # [2, kv heads, capacity, head dim]
                cache[0, :, s:s + n] = k[a:b].transpose(0, 1)
                cache[1, :, s:s + n] = v[a:b].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], cache[0, :, :s + n][None], cache[1, :, :s + n][None],
                    attn_mask=masks[r], scale=self.scaling, enable_gqa=KVH != H)
                outs.append(o[0].transpose(0, 1).reshape(b - a, H * D))
            h = h + attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
            x = layer.post_attention_layernorm(h)
            h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        last = torch.tensor([b - 1 for b in offsets[1:]], device=self.device)
        return self.lm_head(self.norm(h[last])).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _causal(start: int, n: int, device) -> torch.Tensor:
    """A row of n new tokens after `start` cached ones: token i sees positions <= start + i."""
    return torch.arange(start + n, device=device)[None, :] <= torch.arange(start, start + n, device=device)[:, None]
