"""Tiny random-weight checkpoints of every supported architecture, built offline.

Each config keeps the family's real code paths (GQA, MoE routing, sliding windows,
soft-capping, multipliers, MLA...) at a size that builds and runs in well under a
second on a CPU: hidden 64, 6 layers (3 stages of 2), 4 query heads and 2 KV heads
where the family supports grouped KV, a 256-token vocabulary.

Random weights at the usual initializer_range (0.02) give nearly flat logits, so
greedy decoding could flip on rounding noise; a larger init keeps the top token
clearly ahead without changing any code path.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = [
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi3", "gpt2", "falcon", "cohere", "glm", "granite", "olmo2",
    "stablelm", "deepseek_v3",
]

VOCAB = 256
N_LAYERS = 6
SLIDING_WINDOW = 8
INIT_RANGE = 0.1

# Shared by the families that take the usual Llama-style names.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=N_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    # No end-of-sequence token: generate() must always run the full length.
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)


def tiny_config(arch: str, n_layers: int = N_LAYERS):
    """A small config of the given model_type (see ARCHS)."""
    import transformers as T

    c = dict(_COMMON, num_hidden_layers=n_layers)
    if arch == "llama":
        return T.LlamaConfig(**c)
    if arch == "mistral":
        # Mistral's single (non-dict) sliding-window mask.
        return T.MistralConfig(**c, sliding_window=SLIDING_WINDOW)
    if arch == "qwen2":
        return T.Qwen2Config(**c, tie_word_embeddings=True)
    if arch == "qwen3":
        return T.Qwen3Config(**c, head_dim=16)
    if arch == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, decoder_sparse_step=1,
        )
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **c, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, norm_topk_prob=True,
        )
    if arch == "gemma":
        return T.GemmaConfig(**c, head_dim=16)
    if arch == "gemma2":
        return T.Gemma2Config(
            **c, head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"] * (n_layers // 2),
        )
    if arch == "gemma3_text":
        # Gemma 3's own pattern (5 sliding : 1 full), so one stage holds only sliding
        # layers and another holds both kinds, each with its own rotary base.
        return T.Gemma3TextConfig(
            **c, head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)
            ],
        )
    if arch == "phi3":
        return T.Phi3Config(**c)
    if arch == "gpt2":
        return T.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=n_layers, n_head=4, n_positions=256,
            initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=None, pad_token_id=0,
        )
    if arch == "falcon":
        # Falcon-7B layout: multi-query attention, parallel attention/MLP, rotary.
        return T.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=INIT_RANGE,
            bos_token_id=1, eos_token_id=None, pad_token_id=0,
        )
    if arch == "cohere":
        return T.CohereConfig(**c, logit_scale=0.5)
    if arch == "glm":
        return T.GlmConfig(**c, head_dim=16)
    if arch == "granite":
        return T.GraniteConfig(
            **c, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
            logits_scaling=2.0,
        )
    if arch == "olmo2":
        return T.Olmo2Config(**c)
    if arch == "stablelm":
        return T.StableLmConfig(**c)
    if arch == "deepseek_v3":
        # Multi-head latent attention (the cache holds the compressed latents; every
        # query head has its own expanded key, so kv heads == query heads, as upstream);
        # layer 0 dense, the rest MoE with a shared expert.
        return T.DeepseekV3Config(
            **dict(c, num_key_value_heads=4), moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8,
        )
    raise KeyError(f"no tiny config for {arch!r}")


def build_tiny_model(arch: str, dir, shard_size=None, n_layers: int = N_LAYERS, seed: int = 0):
    """Build a float32 random-weight model and save it (safetensors) to `dir`."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, n_layers=n_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(str(dir), **kwargs)
    return model
