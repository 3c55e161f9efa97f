"""Which transformers model families the stage engine drives, and which it refuses and why.

A family is listed only once a token-exact parity test against transformers'
`generate` passes for it (tests/model/test_parity.py); a popular family that is
refused is refused on purpose, with the reason a user is shown.
"""

from __future__ import annotations

from engine.core.errors import ModelError

# Decoder-only families whose transformers implementation the stage engine drives.
SUPPORTED_MODEL_TYPES = (
    # Llama-style dense
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
    "vaultgemma", "phi", "phi3", "cohere", "cohere2", "glm", "glm4", "granite", "granite_swa", "olmo",
    "olmo2", "olmo3", "stablelm", "smollm3", "exaone4", "ernie4_5", "seed_oss", "starcoder2", "helium",
    "apertus", "arcee", "nemotron", "persimmon", "internlm3", "hunyuan_v1_dense", "bitnet", "diffllama",
    "cwm", "jais2", "iquestcoder", "hyperclovax",
    # mixture of experts
    "mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "gpt_oss", "llama4_text",
    "hunyuan_v1_moe", "dots1", "glm4_moe", "granitemoe", "granitemoeshared", "jetmoe", "olmoe",
    "flex_olmo", "minimax_m2", "exaone_moe", "solar_open", "afmoe", "cohere2_moe", "mellum",
    "mimo_v2_flash", "dbrx",
    # multi-head latent attention
    "deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "youtu",
    # GPT-2 lineage
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen", "falcon", "mpt", "xglm",
)

_RECURRENT = (
    "its layers keep a recurrent state (Mamba, linear attention or short convolutions), not a "
    "key/value cache, and Potluck's stage KV store holds only keys and values"
)

# model_type -> why Potluck does not run it (shown to the user as is).
REFUSED_MODEL_TYPES: dict[str, str] = {
    **{t: _RECURRENT for t in (
        "jamba", "bamba", "falcon_h1", "falcon_mamba", "zamba", "zamba2", "qwen3_next", "qwen3_5",
        "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text", "lfm2",
        "lfm2_moe", "lfm3", "granitemoehybrid", "minimax", "mamba", "mamba2", "rwkv", "recurrent_gemma",
        "nemotron_h", "kimi_linear", "olmo_hybrid", "bailing_hybrid", "xlstm",
    )},
    "deepseek_v32": (
        "its sparse attention keeps a second cache of indexer keys beside the key/value cache, "
        "which Potluck's stage KV store does not hold"
    ),
    "gemma3n": (
        "every layer also takes per-layer embeddings looked up from the token ids, which later stages "
        "never see, and its last layers reuse earlier layers' key/value cache"
    ),
    "gemma3n_text": (
        "every layer also takes per-layer embeddings looked up from the token ids, which later stages "
        "never see, and its last layers reuse earlier layers' key/value cache"
    ),
    "doge": (
        "its dynamic-mask attention gives a sequence different results when it shares a batch with "
        "sequences of other lengths, so Potluck cannot batch it exactly"
    ),
    "gpt_neo": (
        "its local-attention layers apply a built-in window that assumes every sequence in a batch "
        "sits at the same position, so Potluck cannot batch sequences of different lengths exactly"
    ),
    "nanochat": (
        "one norm module runs both before its first layer and after its last, which Potluck's "
        "stage split cannot divide between stages yet"
    ),
    "bloom": (
        "its ALiBi attention bias is built from a 2-D padding mask, and Potluck hands layers a "
        "prepared per-row 4-D mask instead"
    ),
    "opt": (
        "its learned position embeddings are computed from the attention mask, which Potluck's "
        "stand-in embeddings on later stages do not accept yet"
    ),
    "biogpt": (
        "its learned position embeddings are computed from the attention mask, which Potluck's "
        "stand-in embeddings on later stages do not accept yet"
    ),
}


def check_supported(cfg) -> None:
    model_type = getattr(cfg, "model_type", "?")
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    why = REFUSED_MODEL_TYPES.get(model_type)
    if why:
        raise ModelError(f"Architecture '{model_type}' is not supported by Potluck: {why}")
    raise ModelError(
        f"Architecture '{model_type}' is not supported by Potluck yet. "
        f"Supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )
