"""Weight precision: what each choice costs in memory, and which one a pool can hold.

`--weights bf16` means the decoder's weights unquantized, at the pipeline's compute
dtype (bfloat16 on a GPU, float32 on a CPU); int8 and nf4 quantize the decoder
layers' Linear weights with bitsandbytes, int4 with torch's own 4-bit kernels.
Embeddings and the LM head stay at the compute dtype in every case (bitsandbytes leaves
them), so they are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.errors import ModelError
from engine.core.partition import layer_bytes_estimate, slice_bytes_estimate
from engine.core.sizes import counted, size_words

FULL = "bf16"
QUANTIZED = ("int8", "nf4")        # bitsandbytes' (auto chooses among these and FULL)
# torch's own 4-bit kernels (engine/model/int4.py), asked for by name. Not auto's choice even
# on a CPU, where it halves the default model's step at full precision's agreement: its
# input is rounded to bf16, so a token computed in a prompt and one at a time differs by
# ~0.25 in a logit against float32's 5e-5, and replayed or speculated replies stop being
# token-identical to undisturbed ones (bench/RESULTS.md, 2026-12-05)
INT4 = "int4"
EXPLICIT = (FULL,) + QUANTIZED + (INT4,)
CHOICES = ("auto",) + EXPLICIT

# the share of a stage's free memory the partition fills with weights; the rest is
# KV cache, activations and the allocator's slack
USABLE = 0.6

# NF4 packs two weights a byte and keeps one float32 scale per block of 64
_NF4_BYTES = 0.5 + 4 / 64
# int8 keeps one float32 scale per output row: negligible beside the row itself
_INT8_BYTES = 1.0
# int4 packs two weights a byte with a bf16 scale and zero per group of 32
_INT4_BYTES = 0.5 + 4 / 32


def layer_bytes_per_param(weights: str, dtype_bytes: int) -> float:
    if weights == "int8":
        return _INT8_BYTES
    if weights == "nf4":
        return _NF4_BYTES
    if weights == INT4:
        return _INT4_BYTES
    if weights == FULL:
        return float(dtype_bytes)
    raise ModelError(f"unknown weights '{weights}': choose one of {', '.join(CHOICES)}")


def per_layer_bytes(cfg, weights: str, dtype_bytes: int) -> int:
    return int(layer_bytes_estimate(cfg, 1) * layer_bytes_per_param(weights, dtype_bytes))


def slice_bytes(cfg, start: int, end: int, weights: str, dtype_bytes: int) -> int:
    """A stage's weights at this precision: its layers, plus embeddings/LM head at dtype."""
    full = slice_bytes_estimate(cfg, start, end, dtype_bytes)
    layers_full = layer_bytes_estimate(cfg, dtype_bytes) * (end - start)
    return full - layers_full + per_layer_bytes(cfg, weights, dtype_bytes) * (end - start)


def layer_caps(cfg, weights: str, dtype_bytes: int, free: list[int]) -> list[int]:
    """The most layers each stage can hold at this precision (at least one each: a stage
    too small for one layer is refused when it loads, with its own message)."""
    per_layer = max(1, per_layer_bytes(cfg, weights, dtype_bytes))
    return [max(1, int(m * USABLE // per_layer)) for m in free]


@dataclass
class Option:
    weights: str
    bytes: int      # the whole model's weights at this precision
    fits: bool      # the pool's stages can hold its layers between them
    available: bool  # this pool can compute at this precision at all


def options(cfg, dtype_bytes: int, free: list[int], quantized_ok: bool = True,
            among: tuple[str, ...] = (FULL,) + QUANTIZED) -> list[Option]:
    """What each precision `among` needs and whether the pool holds it (quantized_ok:
    whether bitsandbytes runs on every stage; torch's int4 needs nothing more)."""
    n = cfg.num_hidden_layers
    rows = []
    for w in among:
        total = slice_bytes(cfg, 0, n, w, dtype_bytes)
        per_layer = max(1, per_layer_bytes(cfg, w, dtype_bytes))
        room = sum(int(m * USABLE // per_layer) for m in free)
        rows.append(Option(w, total, room >= n and total <= USABLE * sum(free),
                           quantized_ok or w not in QUANTIZED))
    return rows


def choose(cfg, dtype_bytes: int, free: list[int], quantized_ok: bool = True) -> str:
    """`auto`: the highest precision at which the model fits the pool's memory."""
    rows = options(cfg, dtype_bytes, free, quantized_ok)
    for row in rows:
        if row.fits and row.available:
            return row.weights
    best = rows[-1] if quantized_ok else rows[0]
    raise ModelError(
        f"the model does not fit this pool even as {best.weights}: it needs about {size_words(best.bytes)} for its "
        f"weights and the pool's {counted(len(free), 'machine')} have {size_words(USABLE * sum(free))} to give them. "
        "Add a machine, or choose a smaller model")


def table(cfg, dtype_bytes: int, dtype_name: str, free: list[int], chosen: str | None = None,
          quantized_ok: bool = True, where: str | None = None) -> str:
    """What a user reads before loading: each precision's memory against the pool's.
    where: who gives the memory ("this machine's 2 stage(s) (CPU)"). The unquantized row
    says what it is: bf16 where the pipeline computes in bfloat16, else "full (float32)"."""
    where = where or f"the pool's {counted(len(free), 'machine')}"
    lines = [f"What the weights need, against the {size_words(USABLE * sum(free))} that {where} can give them:"]
    among = (FULL,) + QUANTIZED + ((INT4,) if chosen == INT4 else ())   # int4: shown when asked for
    for row in options(cfg, dtype_bytes, free, quantized_ok, among):
        label = full_label(dtype_name) if row.weights == FULL else row.weights
        verdict = ("fits" if row.fits else "does not fit") if row.available else "needs bitsandbytes"
        mark = "  <- chosen" if row.weights == chosen else ""
        lines.append(f"  {label:<16} {size_words(row.bytes):>9}  {verdict}{mark}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Chosen:
    """The precision a pipeline settled on, for whoever shows it (the app's Host window)
    as fields, not as the table's text."""
    weights: str     # bf16 | int8 | nf4 | int4
    label: str       # as the table names it: "full (float32)" for unquantized weights on a CPU
    bytes: int       # the whole model's weights at it
    where: str       # who gives the memory ("2 stage(s) (CPU, cuda)")

    def as_dict(self) -> dict:
        return {"weights": self.weights, "label": self.label, "bytes": self.bytes,
                "size": size_words(self.bytes), "where": self.where}


def chosen(cfg, dtype_bytes: int, dtype_name: str, weights: str, where: str) -> Chosen:
    return Chosen(weights, full_label(dtype_name) if weights == FULL else weights,
                  slice_bytes(cfg, 0, cfg.num_hidden_layers, weights, dtype_bytes), where)


def full_label(dtype_name: str) -> str:
    """The unquantized weights by name: "bf16" when they are bfloat16, else what they are
    ("full (float32)" on a CPU), not bf16 beside another dtype."""
    return FULL if dtype_name == "bfloat16" else f"full ({dtype_name})"

