"""A short list of well-known chat models people pool GPUs for, with their sizes.

Pure data: each entry keeps the few config.json fields the memory estimates read
(engine/core/precision.py), so the app can say what a model weighs at bf16, int8 and
nf4 before anything is downloaded. No torch here: the GUI process imports this.
The numbers are those of each model's published config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.core import precision

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Entry:
    id: str              # what to host: "default" or a Hugging Face hub id
    name: str            # what to show
    params: float        # the published parameter count
    config: dict = field(repr=False)  # the config.json fields the estimates need
    gated: bool = False  # the hub asks you to accept a license (and log in) first
    note: str = ""
    # a draft model for speculative decoding (issue 34): a small sibling of the same
    # tokenizer, run beside the host's own stage (--draft auto picks it; engine/model/draft.py)
    draft: str = ""

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def hidden(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def cfg(self) -> SimpleNamespace:
        """Stands in for the transformers config in engine/core's estimates."""
        return SimpleNamespace(**self.config)

    def weights_bytes(self, weights: str, dtype_bytes: int = 2) -> int:
        """The whole model's weights at this precision (bf16: at dtype_bytes a weight)."""
        return precision.slice_bytes(self.cfg(), 0, self.layers, weights, dtype_bytes)

    def sizes(self, dtype_bytes: int = 2) -> dict[str, int]:
        return {w: self.weights_bytes(w, dtype_bytes) for w in (precision.FULL,) + precision.QUANTIZED}

    def label(self, dtype_name: str = "bfloat16") -> str:
        """'Qwen2.5-7B-Instruct — 16.5 GB bf16 · 8.7 GB int8 · 5.0 GB nf4', the unquantized
        size at the dtype the machine computes in ('… 33.0 GB full (float32) · …' on a CPU)."""
        nbytes = DTYPE_BYTES.get(dtype_name, 2)
        sizes = " · ".join(f"{gb(b)} {precision.full_label(dtype_name) if w == precision.FULL else w}"
                           for w, b in self.sizes(nbytes).items())
        return f"{self.name} — {sizes}"


def _cfg(hidden, inter, layers, heads, kv_heads, vocab, tied, **extra) -> dict:
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                tie_word_embeddings=tied, **extra)


# draft models (issue 34): the smallest instruct sibling of each tokenizer family. Llama
# 3.2 1B shares Llama 3.1's 128256-token tokenizer; Qwen2.5 0.5B every Qwen2.5's (their
# LM heads are padded to different widths, the tokens are the same); gemma-2 2b gemma-2's.
LLAMA_DRAFT = "meta-llama/Llama-3.2-1B-Instruct"
QWEN_DRAFT = "Qwen/Qwen2.5-0.5B-Instruct"

MODELS: list[Entry] = [
    Entry("default", "SmolLM2-135M-Instruct", 134.5e6, _cfg(576, 1536, 30, 9, 3, 49152, True),
          note="built in, works offline; small, for trying Potluck out"),
    Entry("Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct", 0.494e9,
          _cfg(896, 4864, 24, 14, 2, 151936, True)),
    Entry("Qwen/Qwen2.5-1.5B-Instruct", "Qwen2.5-1.5B-Instruct", 1.54e9,
          _cfg(1536, 8960, 28, 12, 2, 151936, True), draft=QWEN_DRAFT),
    Entry("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B-Instruct-v0.3", 7.25e9,
          _cfg(4096, 14336, 32, 32, 8, 32768, False)),
    Entry("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct", 7.62e9,
          _cfg(3584, 18944, 28, 28, 4, 152064, False), draft=QWEN_DRAFT),
    Entry("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct", 8.03e9,
          _cfg(4096, 14336, 32, 32, 8, 128256, False), gated=True, draft=LLAMA_DRAFT),
    Entry("google/gemma-2-9b-it", "gemma-2-9b-it", 9.24e9,
          _cfg(3584, 14336, 42, 16, 8, 256000, True, head_dim=256), gated=True, draft="google/gemma-2-2b-it"),
    Entry("Qwen/Qwen2.5-32B-Instruct", "Qwen2.5-32B-Instruct", 32.8e9,
          _cfg(5120, 27648, 64, 40, 8, 152064, False), draft=QWEN_DRAFT),
    # mixture of experts: all 8 experts' weights load, 2 compute per token
    Entry("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B-Instruct-v0.1", 46.7e9,
          _cfg(4096, 14336, 32, 32, 8, 32000, False, num_local_experts=8, num_experts_per_tok=2)),
    Entry("meta-llama/Llama-3.1-70B-Instruct", "Llama-3.1-70B-Instruct", 70.6e9,
          _cfg(8192, 28672, 80, 64, 8, 128256, False), gated=True, draft=LLAMA_DRAFT),
    Entry("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B-Instruct", 72.7e9,
          _cfg(8192, 29568, 80, 64, 8, 152064, False), draft=QWEN_DRAFT),
]

_BY_KEY = {k.lower(): e for e in MODELS for k in (e.id, e.name)}


def find(spec: str) -> Entry | None:
    """The entry a hub id, a display name or a label from the list names, if any."""
    spec = (spec or "").strip()
    hit = _BY_KEY.get(spec.lower())
    if hit is None:
        for e in MODELS:
            if spec == e.label() or spec.startswith(e.name + " — "):
                return e
    return hit


def draft_for(spec: str) -> str:
    """The curated draft model for a model spec ('' when the catalog pairs it with none)."""
    e = find(spec)
    return e.draft if e is not None else ""


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
