"""Which transformers model families the stage engine drives, and which it refuses and why.

A family is listed only once a token-exact parity test against transformers'
`generate` passes for it (tests/model/test_parity.py); a family that is refused is
refused on purpose, with the reason a user is shown. Every causal-LM model type of
the transformers Potluck ships is one or the other (tests/model/test_families.py);
a supported family's checkpoint may still be refused for a feature it uses
(REFUSED_FEATURES).
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
    "cwm", "jais2", "iquestcoder", "hyperclovax", "gemma4_text", "gemma4_unified_text", "cohere_compass_text",
    "modernbert-decoder",
    # mixture of experts
    "mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "gpt_oss", "llama4_text",
    "hunyuan_v1_moe", "dots1", "glm4_moe", "granitemoe", "granitemoeshared", "jetmoe", "olmoe",
    "flex_olmo", "minimax_m2", "exaone_moe", "solar_open", "afmoe", "cohere2_moe", "mellum",
    "mimo_v2_flash", "dbrx", "aria_text", "beam", "flint", "granitemoe_swa", "hy_v3", "kolibri1", "laguna",
    # multi-head latent attention
    "deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "youtu", "axk1",
    # GPT-2 lineage
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen", "falcon", "mpt", "xglm", "gpt_neox_japanese",
    "ctrl",
)

_RECURRENT = (
    "its layers keep a recurrent state (Mamba, linear attention or short convolutions), not a "
    "key/value cache, and Potluck's stage KV store holds only keys and values"
)

_SPARSE_INDEXER = (
    "its sparse attention keeps a second cache of indexer keys beside the key/value cache, "
    "which Potluck's stage KV store does not hold"
)
_PER_LAYER_EMBEDDINGS = (
    "every layer also takes per-layer embeddings looked up from the token ids, which later stages "
    "never see"
)
_SHARED_KV = "its last layers reuse earlier layers' key/value cache, which may sit on another stage"
_ENCODER = (
    "it is an encoder (BERT-style, bidirectional attention) whose causal-LM head is for fine-tuning it "
    "as a decoder; Potluck runs decoder-only language models"
)
_ENCODER_DECODER = (
    "it is an encoder-decoder model: its causal-LM class is the decoder half, which attends to an "
    "encoder's output; Potluck runs decoder-only language models"
)


def _multimodal(text_type: str | None = None) -> str:
    why = ("it is a multimodal model (image, audio or video inputs beside text) whose language model sits "
           "inside a wrapper; Potluck runs text-only decoder checkpoints")
    return why + (f" (this family's text-only model type '{text_type}' is supported)" if text_type else "")


# model_type -> why Potluck does not run it (shown to the user as is). With the supported
# ones above this covers every causal-LM model type of the transformers Potluck ships
# (tests/model/test_families.py).
REFUSED_MODEL_TYPES: dict[str, str] = {
    **{t: _RECURRENT for t in (
        "jamba", "bamba", "falcon_h1", "falcon_mamba", "zamba", "zamba2", "qwen3_next", "qwen3_5",
        "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text", "lfm2",
        "lfm2_moe", "lfm3", "granitemoehybrid", "minimax", "mamba", "mamba2", "rwkv", "recurrent_gemma",
        "nemotron_h", "kimi_linear", "olmo_hybrid", "bailing_hybrid", "xlstm", "zaya", "inkling_text",
        "inkling2_text",
    )},
    **{t: _SPARSE_INDEXER for t in (
        "deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text", "minimax_m3_vl_text",
    )},
    "deepseek_v4": (
        "its compressed attention keeps running compressed key/value entries and their compressor's state "
        "per layer, and its sparse indexer a cache of its own; Potluck's stage KV store holds only keys "
        "and values"
    ),
    "longcat_flash": (
        "each decoder layer holds two attention sublayers, so its config counts twice as many layers as "
        "the model has (num_hidden_layers = 2 x num_layers), which Potluck's layer split does not follow yet"
    ),
    "hrm_text": (
        "its layer stacks run in repeated cycles (the same layers several times per token), not once each "
        "in order, so a stage cannot hold a contiguous slice of them"
    ),
    "cpmant": (
        "it builds its attention mask and position bias inside its own forward from the token ids (prompt "
        "tokens prepended, padding read from token id 0), which later stages never see"
    ),
    "openai-gpt": (
        "it has no key/value cache (each step recomputes the whole sequence), and Potluck's stages decode "
        "from one"
    ),
    "xlnet": (
        "its permutation language modelling attends with two streams over a memory of earlier segments, "
        "not with a causal key/value cache"
    ),
    "reformer": (
        "its LSH and chunked local attention hash keys into buckets with a cache of their own, not a "
        "causal key/value cache"
    ),
    "blt": (
        "it is a byte-level model: a local encoder pools bytes into patches for its global transformer "
        "and a local decoder expands them back, not one stack of decoder layers a pipeline can divide"
    ),
    **{t: ("it is a draft model for speculative decoding: it reads the key/value states its target model "
           "shares with it and does not run on its own") for t in ("gemma4_assistant", "gemma4_unified_assistant")},
    **{t: _ENCODER for t in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
        "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
        "xlm-roberta", "xlm-roberta-xl", "xmod", "xlm",
    )},
    **{t: _ENCODER_DECODER for t in (
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
        "plbart", "prophetnet", "whisper", "trocr", "musicgen", "musicgen_melody",
    )},
    **{t: _multimodal() for t in (
        "dots3_note", "emu3", "fuyu", "git", "got_ocr2", "mllama", "moshi", "moss_transcribe_diarize",
        "phi4_multimodal",
    )},
    "gemma3": _multimodal("gemma3_text"),
    "gemma4": _multimodal("gemma4_text"),
    "gemma4_unified": _multimodal("gemma4_unified_text"),
    "llama4": _multimodal("llama4_text"),
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


# Supported families some of whose checkpoints use a feature Potluck cannot run:
# (model types, does this config use it?, why), checked when a config is read.
REFUSED_FEATURES = (
    (("gemma4_text", "gemma4_unified_text"), lambda cfg: bool(getattr(cfg, "hidden_size_per_layer_input", 0)),
     _PER_LAYER_EMBEDDINGS),
    (("gemma4_text", "gemma4_unified_text"), lambda cfg: bool(getattr(cfg, "num_kv_shared_layers", 0)),
     _SHARED_KV),
    (("gemma4_text", "gemma4_unified_text"), lambda cfg: getattr(cfg, "use_bidirectional_attention", None) == "all",
     "its attention is bidirectional (an embedding model), not causal: it does not generate text"),
)


def check_supported(cfg) -> None:
    model_type = getattr(cfg, "model_type", "?")
    if model_type in SUPPORTED_MODEL_TYPES:
        for types, uses, why in REFUSED_FEATURES:
            if model_type in types and uses(cfg):
                raise ModelError(f"This '{model_type}' checkpoint is not supported by Potluck: {why}")
        return
    why = REFUSED_MODEL_TYPES.get(model_type)
    if why:
        raise ModelError(f"Architecture '{model_type}' is not supported by Potluck: {why}")
    raise ModelError(
        f"Architecture '{model_type}' is not supported by Potluck yet. "
        f"Supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )
