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

from engine.model.families import SUPPORTED_MODEL_TYPES

# A second tiny config of a supported family, for a code path its first one misses.
_VARIANTS = {
    "mistral": ("mistral_nowindow",),  # sliding_window=None: a plain causal mask
    "falcon": ("falcon_alibi",),       # Falcon-RW: ALiBi instead of rotary
    "gemma4_text": ("gemma4_text_moe",),  # the MoE block, keys as values, other global KV heads
}

# every supported family (engine/model/families.py), and the variants above
ARCHS = [a for t in SUPPORTED_MODEL_TYPES for a in (t, *_VARIANTS.get(t, ()))]

# Families refused in engine/model/families.py whose tiny configs are kept to re-check
# them (parity fails for the reason given there), and the Gemma 4 checkpoints that
# families.py refuses for a feature (per-layer embeddings, shared KV layers, bidirectional).
REFUSED_ARCHS = ["doge", "nanochat", "deepseek_v32", "gpt_neo", "bloom", "opt", "biogpt", "glm_moe_dsa", "axk2",
                 "hy_v4", "dots3_note_text", "minimax_m3_vl_text", "zaya", "openai-gpt", "longcat_flash",
                 "hrm_text", "cpmant", "gemma4_text_ple", "gemma4_text_kvshare", "gemma4_text_bidirectional"]

# Variants whose rotary frequencies follow the sequence length (engine/model/rope.py),
# with an original context of ROPE_ORIGINAL tokens that a long prompt passes. Not in
# ARCHS: a prompt prefilled in chunks across that boundary, or a decode step crossing it,
# gets other frequencies than the whole prompt at once, in transformers too
# (tests/model/test_rope.py).
ROPE_ARCHS = ["phi3_longrope", "phimoe_longrope", "llama_dynamic"]
ROPE_ORIGINAL = 24

# families whose decode step stays eager (engine/model/static_decode.py unsupported: no
# fixed buffers, no graphs), and a word of why
STATIC_EAGER_ONLY = {"llama4_text": "temperature", "falcon_alibi": "ALiBi", "falcon": "lists", "jetmoe": "row counts",
                     "dbrx": "nonzero"}

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


def _no_extra(n_layers):
    return {}


def _alternating(n_layers, window=SLIDING_WINDOW):
    return dict(sliding_window=window, layer_types=["sliding_attention", "full_attention"] * (n_layers // 2))


def _full_first(n_layers, window=SLIDING_WINDOW):
    return dict(sliding_window=window, layer_types=["full_attention", "sliding_attention"] * (n_layers // 2))


# multi-head latent attention at tiny size (kv heads == query heads, as upstream)
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2)
_INDEXER = dict(index_topk=4, index_head_dim=16, index_n_heads=2)


def _dense_then_sparse(n_layers):
    return ["dense"] + ["sparse"] * (n_layers - 1)


# Gemma 4 text: sliding and full layers, the full ones with their own head size
_GEMMA4 = dict(head_dim=16, global_head_dim=32, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=0)


# model_type -> (config class, extra kwargs given n_layers) for the families that take
# the Llama-style names in _COMMON.
_SIMPLE = {
    "mixtral": ("MixtralConfig", lambda n: dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "starcoder2": ("Starcoder2Config", lambda n: dict(sliding_window=SLIDING_WINDOW)),
    "phi": ("PhiConfig", lambda n: dict(num_key_value_heads=4, qk_layernorm=True)),
    "smollm3": ("SmolLM3Config", lambda n: dict(no_rope_layer_interval=3)),
    "glm4": ("Glm4Config", lambda n: dict(head_dim=16)),
    "exaone4": ("Exaone4Config", lambda n: dict(sliding_window=SLIDING_WINDOW, sliding_window_pattern=3)),
    "ernie4_5": ("Ernie4_5Config", lambda n: dict(head_dim=16, tie_word_embeddings=True)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_end_index=n - 1, moe_layer_interval=1)),
    "seed_oss": ("SeedOssConfig", lambda n: dict(head_dim=16, attention_dropout=0.0, residual_dropout=0.0)),
    "gpt_oss": ("GptOssConfig", lambda n: dict(
        head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        **_alternating(n))),
    "deepseek_v2": ("DeepseekV2Config", lambda n: dict(
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)),
    "gpt_neox": ("GPTNeoXConfig", lambda n: dict(num_key_value_heads=4)),
    "olmo": ("OlmoConfig", lambda n: dict(num_key_value_heads=4, clip_qkv=8.0)),
    "llama4_text": ("Llama4TextConfig", lambda n: dict(
        head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=SLIDING_WINDOW, floor_scale=4,
        moe_layers=None, no_rope_layers=None, layer_types=None)),
    "olmo3": ("Olmo3Config", lambda n: _alternating(n)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", lambda n: dict(head_dim=16)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", lambda n: dict(head_dim=16, num_experts=4, moe_topk=2)),
    "apertus": ("ApertusConfig", _no_extra),
    "arcee": ("ArceeConfig", _no_extra),
    "helium": ("HeliumConfig", lambda n: dict(head_dim=16)),
    "dots1": ("Dots1Config", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, **_alternating(n))),
    "glm4_moe": ("Glm4MoeConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, use_qk_norm=True)),
    "nemotron": ("NemotronConfig", lambda n: dict(head_dim=16)),
    "persimmon": ("PersimmonConfig", lambda n: dict(num_key_value_heads=4)),
    "granitemoe": ("GraniteMoeConfig", lambda n: dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", lambda n: dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0)),
    "jetmoe": ("JetMoeConfig", lambda n: dict(kv_channels=16, num_local_experts=4, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", lambda n: dict(
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None)),
    "cohere2": ("Cohere2Config", lambda n: dict(logit_scale=0.5, head_dim=16, **_alternating(n))),
    "doge": ("DogeConfig", lambda n: dict(head_dim=16, keep_window_size=SLIDING_WINDOW)),
    "ministral": ("MinistralConfig", lambda n: dict(head_dim=16, **_alternating(n))),
    "bitnet": ("BitNetConfig", _no_extra),
    "olmoe": ("OlmoeConfig", lambda n: dict(num_experts=4, num_experts_per_tok=2)),
    "internlm3": ("InternLM3Config", lambda n: dict(head_dim=16)),
    "vaultgemma": ("VaultGemmaConfig", lambda n: dict(head_dim=16, query_pre_attn_scalar=16, **_alternating(n))),
    "flex_olmo": ("FlexOlmoConfig", lambda n: dict(num_experts=4, num_experts_per_tok=2)),
    "nanochat": ("NanoChatConfig", lambda n: dict(head_dim=16)),
    "diffllama": ("DiffLlamaConfig", _no_extra),
    "minimax_m2": ("MiniMaxM2Config", lambda n: dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "exaone_moe": ("ExaoneMoeConfig", lambda n: dict(
        sliding_window=SLIDING_WINDOW, sliding_window_pattern=3, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, mlp_layer_types=None)),
    "solar_open": ("SolarOpenConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2)),
    "cwm": ("CwmConfig", lambda n: dict(head_dim=16, sliding_window=SLIDING_WINDOW)),
    "jais2": ("Jais2Config", _no_extra),
    "iquestcoder": ("IQuestCoderConfig", _no_extra),
    "hyperclovax": ("HyperCLOVAXConfig", lambda n: dict(attention_multiplier=0.25)),
    "minicpm3": ("MiniCPM3Config", lambda n: dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, head_dim=8, scale_emb=2, dim_model_base=32)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", lambda n: dict(
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, head_dim=8, mlp_layer_types=["dense"] + ["sparse"] * (n - 1))),
    "youtu": ("YoutuConfig", lambda n: dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, head_dim=8)),
    "afmoe": ("AfmoeConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, global_attn_every_n_layers=2, sliding_window=SLIDING_WINDOW, layer_types=None)),
    "granite_swa": ("GraniteSWAConfig", lambda n: dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0,
        layer_rope_theta=None, **_alternating(n))),
    "cohere2_moe": ("Cohere2MoeConfig", lambda n: dict(
        logit_scale=0.5, head_dim=16, num_experts=4, num_experts_per_tok=2, mlp_layer_types=None,
        sliding_window=SLIDING_WINDOW, sliding_window_pattern=2, layer_types=None)),
    "mellum": ("MellumConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        mlp_layer_types=None)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1), sliding_window=SLIDING_WINDOW, layer_types=None)),
    "ministral3": ("Ministral3Config", lambda n: dict(head_dim=16)),
    "aria_text": ("AriaTextConfig", lambda n: dict(
        head_dim=16, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)),
    "axk1": ("AXK1Config", lambda n: dict(
        **_MLA, **_MOE, n_group=2, topk_group=1, mlp_layer_types=_dense_then_sparse(n))),
    "beam": ("BeamConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        mlp_layer_types=_dense_then_sparse(n), final_logit_softcapping=30.0, **_alternating(n))),
    "cohere_compass_text": ("CohereCompassTextConfig", lambda n: dict(
        head_dim=16, logit_scale=0.5, **_alternating(n),  # full layers without rotary (NoPE)
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": None})),
    "flint": ("FlintConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
        num_experts=4, mlp_only_layers=[0], **_full_first(n))),
    "gemma4_text": ("Gemma4TextConfig", lambda n: dict(**_GEMMA4, **_alternating(n))),
    "gemma4_text_moe": ("Gemma4TextConfig", lambda n: dict(
        **_GEMMA4, **_alternating(n), enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1)),
    "gemma4_text_ple": ("Gemma4TextConfig", lambda n: dict(
        **dict(_GEMMA4, hidden_size_per_layer_input=16), **_alternating(n))),
    "gemma4_text_kvshare": ("Gemma4TextConfig", lambda n: dict(**_GEMMA4, **_alternating(n), num_kv_shared_layers=2)),
    "gemma4_text_bidirectional": ("Gemma4TextConfig", lambda n: dict(
        **_GEMMA4, **_alternating(n), use_bidirectional_attention="all")),
    "gemma4_unified_text": ("Gemma4UnifiedTextConfig", lambda n: dict(
        head_dim=16, global_head_dim=32, **_alternating(n))),
    "granitemoe_swa": ("GraniteMoeSWAConfig", lambda n: dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0, layer_rope_theta=None, **_alternating(n))),
    "hy_v3": ("HYV3Config", lambda n: dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
        mlp_layer_types=_dense_then_sparse(n))),
    "kolibri1": ("Kolibri1Config", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2, num_local_experts=4,
        shared_expert_intermediate_size=32, **_alternating(n))),
    "laguna": ("LagunaConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
        num_experts=4, mlp_layer_types=_dense_then_sparse(n), **_full_first(n),
        num_attention_heads_per_layer=[4, 8] * (n // 2))),  # a head count per layer
    "glm_moe_dsa": ("GlmMoeDsaConfig", lambda n: dict(
        **_MLA, **_MOE, **_INDEXER, mlp_layer_types=_dense_then_sparse(n), first_k_dense_replace=1,
        layer_types=None, indexer_types=None)),
    "axk2": ("AXK2Config", lambda n: dict(
        **_MLA, **_MOE, **_INDEXER, mlp_layer_types=_dense_then_sparse(n), layer_types=None)),
    "hy_v4": ("HYV4Config", lambda n: dict(
        **_MLA, **_MOE, **_INDEXER, mlp_layer_types=_dense_then_sparse(n), layer_types=None, indexer_types=None)),
    "dots3_note_text": ("Dots3NoteTextConfig", lambda n: dict(
        **dict(_MLA, head_dim=16), **_MOE, **_INDEXER, mlp_layer_types=_dense_then_sparse(n), layer_types=None,
        sliding_window=SLIDING_WINDOW, shared_experts_intermediate_size=32, per_layer_config={})),
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", lambda n: dict(
        head_dim=16, num_experts_per_tok=2, num_local_experts=4, dense_intermediate_size=128,
        shared_intermediate_size=32, rotary_dim=8, mlp_layer_types=None,
        layer_types=["full_attention", "minimax_m3_sparse"] * (n // 2), index_n_heads=2, index_head_dim=16,
        index_block_size=4, index_topk_blocks=2, index_local_blocks=1)),
    "zaya": ("ZayaConfig", lambda n: dict(
        head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16)),
    "hrm_text": ("HrmTextConfig", lambda n: dict(head_dim=16, num_layers_per_stack=2)),
    "deepseek_v32": ("DeepseekV32Config", lambda n: dict(
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, mlp_layer_types=None,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        index_topk=4, index_head_dim=16, index_n_heads=2)),
}

# Families whose configs use other names: model_type -> n_layers -> config.
_OTHER_NAMES = dict(vocab_size=VOCAB, initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=None, pad_token_id=0)
_OTHER = {
    "gptj": lambda T, n: T.GPTJConfig(**_OTHER_NAMES, n_embd=64, n_layer=n, n_head=4, n_positions=256, rotary_dim=8),
    "codegen": lambda T, n: T.CodeGenConfig(
        **_OTHER_NAMES, n_embd=64, n_layer=n, n_head=4, n_positions=256, n_ctx=256, rotary_dim=8),
    "gpt_bigcode": lambda T, n: T.GPTBigCodeConfig(
        **_OTHER_NAMES, n_embd=64, n_layer=n, n_head=4, n_positions=256, multi_query=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bloom": lambda T, n: T.BloomConfig(**_OTHER_NAMES, hidden_size=64, n_layer=n, n_head=4),
    "mpt": lambda T, n: T.MptConfig(**_OTHER_NAMES, d_model=64, n_heads=4, n_layers=n, max_seq_len=256),
    "opt": lambda T, n: T.OPTConfig(
        **_OTHER_NAMES, hidden_size=64, ffn_dim=128, num_hidden_layers=n, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, dropout=0.0, init_std=INIT_RANGE),
    "dbrx": lambda T, n: T.DbrxConfig(
        **_OTHER_NAMES, d_model=64, n_heads=4, n_layers=n, max_seq_len=256,
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0), ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "gpt_neo": lambda T, n: T.GPTNeoConfig(
        **_OTHER_NAMES, hidden_size=64, num_layers=n, num_heads=4, max_position_embeddings=256,
        attention_types=[[["global", "local"], n // 2]], window_size=SLIDING_WINDOW),
    "xglm": lambda T, n: T.XGLMConfig(
        **_OTHER_NAMES, d_model=64, ffn_dim=128, num_layers=n, attention_heads=4, max_position_embeddings=256,
        dropout=0.0, init_std=INIT_RANGE),
    "ctrl": lambda T, n: T.CTRLConfig(
        **_OTHER_NAMES, n_positions=256, n_embd=64, dff=128, n_layer=n, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox_japanese": lambda T, n: T.GPTNeoXJapaneseConfig(
        **_OTHER_NAMES, hidden_size=64, num_hidden_layers=n, num_attention_heads=4, max_position_embeddings=256,
        attention_dropout=0.0, hidden_dropout=0.0),
    # an embedding block (token embedding + norm), alternating global and sliding layers
    "modernbert-decoder": lambda T, n: T.ModernBertDecoderConfig(
        **_OTHER_NAMES, hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4,
        max_position_embeddings=256, cls_token_id=2, sep_token_id=3, sliding_window=SLIDING_WINDOW,
        local_attention=SLIDING_WINDOW, layer_types=["full_attention", "sliding_attention"] * (n // 2)),
    "openai-gpt": lambda T, n: T.OpenAIGPTConfig(
        **_OTHER_NAMES, n_positions=256, n_embd=64, n_layer=n, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0),
    "cpmant": lambda T, n: T.CpmAntConfig(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128, num_hidden_layers=n,
        position_bias_num_buckets=32, position_bias_max_distance=64, init_std=INIT_RANGE, prompt_types=2,
        prompt_length=2, segment_types=2),
    "longcat_flash": lambda T, n: T.LongcatFlashConfig(
        **_OTHER_NAMES, hidden_size=64, num_layers=n // 2, num_attention_heads=4, max_position_embeddings=256,
        ffn_hidden_size=128, **_MLA, qk_head_dim=16, moe_topk=2, n_routed_experts=4, zero_expert_num=2,
        expert_ffn_hidden_size=32),
    "biogpt": lambda T, n: T.BioGptConfig(
        **_OTHER_NAMES, hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4,
        max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def tiny_config(arch: str, n_layers: int = N_LAYERS):
    """A small config of the given model_type (see ARCHS)."""
    import transformers as T

    c = dict(_COMMON, num_hidden_layers=n_layers)
    if arch == "llama":
        return T.LlamaConfig(**c)
    if arch == "mistral":
        # Mistral's single (non-dict) sliding-window mask.
        return T.MistralConfig(**c, sliding_window=SLIDING_WINDOW)
    if arch == "mistral_nowindow":
        # Mistral with sliding_window=None: a plain causal mask (model_type mistral).
        return T.MistralConfig(**c, sliding_window=None)
    if arch in _OTHER:
        return _OTHER[arch](T, n_layers)
    if arch in _SIMPLE:
        cls, extra = _SIMPLE[arch]
        return getattr(T, cls)(**dict(c, **extra(n_layers)))
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
    if arch == "phi3_longrope":
        # Phi-3-mini-128k / Phi-3.5 / Phi-4-mini: LongRoPE, long factors past the original context
        return T.Phi3Config(**c, original_max_position_embeddings=ROPE_ORIGINAL, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=ROPE_ORIGINAL,
            short_factor=[1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]))
    if arch == "phimoe_longrope":
        # Phi-3.5-MoE: LongRoPE, and its own choice of a short or long scale for cos/sin
        return T.PhimoeConfig(**c, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                              sliding_window=None, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=ROPE_ORIGINAL,
            short_factor=[1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], short_mscale=1.1, long_mscale=1.3))
    if arch == "llama_dynamic":
        # dynamic NTK: the base stretches with the length past max_position_embeddings
        return T.LlamaConfig(**dict(c, max_position_embeddings=ROPE_ORIGINAL), rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, factor=4.0))
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
    if arch == "falcon_alibi":
        # Falcon-RW layout: ALiBi position bias (no rotary), separate attention and MLP,
        # full multi-head attention with biases.
        return T.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=INIT_RANGE, alibi=True, bias=True,
            multi_query=False, parallel_attn=False, new_decoder_architecture=False,
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


def build_tiny_model(arch: str, dir, shard_size=None, n_layers: int = N_LAYERS, seed: int = 0,
                     vocab: int | None = None):
    """Build a float32 random-weight model and save it (safetensors) to `dir`. vocab: a
    real tokenizer's size, for a model that takes chat text (default: VOCAB ids only)."""
    from transformers import AutoModelForCausalLM

    from engine.model.build_lock import BUILD_LOCK

    cfg = tiny_config(arch, n_layers=n_layers)
    if vocab is not None:
        cfg.vocab_size = vocab
    # not while a stage of this process (an earlier test's pipeline loading its spares)
    # is built on another thread: its meta-device patch is process-wide
    with BUILD_LOCK:
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


async def start_tiny_head(folder, addrs, **kw):
    """testkit/streams.py tiny_head on a tiny checkpoint's folder."""
    from engine.model.sources import resolve
    from testkit.streams import tiny_head

    return await tiny_head(resolve(str(folder)), addrs, **kw)
