"""8-bit and 4-bit weights with bitsandbytes, quantized by each stage as it loads its slice.

We hand transformers' own bitsandbytes quantizer to its loader, so a layer's Linear
weights are quantized one tensor at a time on the stage's device (LLM.int8 for int8,
NF4 blocks with the compute dtype for nf4) and the full-precision copy never exists
on the GPU. Embeddings and the LM head stay at the compute dtype, as bitsandbytes
leaves them. A checkpoint saved already quantized by bitsandbytes loads as it is.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from engine.core.errors import ModelError
from engine.core.precision import CHOICES, FULL, INT4, QUANTIZED


INT8_THRESHOLD = 2.0


def bnb_missing() -> str | None:
    """Why 8/4-bit weights cannot be used here, or None when they can."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return ("8-bit and 4-bit weights need the bitsandbytes package, which is not installed: "
                "run `pip install bitsandbytes` in Potluck's environment, or choose --weights bf16")
    return None


def prequantized(cfg) -> str | None:
    """'int8' or 'nf4' when the checkpoint itself was saved quantized by bitsandbytes."""
    qc = getattr(cfg, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "bitsandbytes":
        raise ModelError(f"this checkpoint is quantized with '{method}', which Potluck does not load; "
                         "use its full-precision or bitsandbytes release")
    if qc.get("load_in_8bit"):
        return "int8"
    if qc.get("bnb_4bit_quant_type", "fp4") != "nf4":
        raise ModelError("this checkpoint holds bitsandbytes FP4 weights; Potluck loads NF4 and int8 ones")
    return "nf4"


def make_quantizer(weights: str, cfg, dtype: torch.dtype):
    """transformers' HfQuantizer for these weights, or None for full precision."""
    saved = prequantized(cfg)
    if saved is not None and weights not in (saved, "auto"):
        raise ModelError(f"this checkpoint is saved as {saved}; it cannot be loaded as {weights}")
    if saved is None and weights in (FULL, "auto", INT4):
        return None   # int4: the stage quantizes its layers itself (engine/model/int4.py)
    if saved is None and weights not in QUANTIZED:
        raise ModelError(f"unknown weights '{weights}': choose one of {', '.join(CHOICES)}")
    why = bnb_missing()
    if why:
        raise ModelError(why)
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    kind = saved or weights
    # bitsandbytes logs a warning on every int8 matmul whose input is not fp16 (every
    # step of a float32 or bf16 stage): said once per process it is noise, said per
    # layer per step it buries the log
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    # and on a CPU, at import, that an optional kernels package would speed 4-bit up:
    # nothing a person sharing a computer acts on
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if saved is not None:
        qc = cfg.quantization_config
        config = BitsAndBytesConfig.from_dict(qc if isinstance(qc, dict) else qc.to_dict())
    elif kind == "int8":
        # LLM.int8(): activation columns holding a value above the threshold are
        # multiplied in 16 bits, the rest in int8. 6.0, the paper's value, suits the
        # large outliers of models over ~7B parameters; on the default 135M model it
        # lets top-1 agreement with full precision fall to 0.91, while 2.0 keeps it
        # at 0.95 (bench/quant.py and its threshold sweep in bench/RESULTS.md)
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=False)
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=saved is not None)
    try:
        quantizer.validate_environment(device_map=None, weights_only=True)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ModelError(f"{kind} weights cannot run here: {exc}") from None
    return quantizer


def misshapen(model) -> list[str]:
    """Quantized Linear modules whose weight does not have the module's shape.

    transformers checks a checkpoint tensor's shape against the model's only when it
    loads it as it is; quantized on the way, a tensor of the wrong shape becomes
    int8 or NF4 blocks of the wrong shape without a word."""
    bad = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind not in ("Linear8bitLt", "Linear4bit") or m.weight.is_meta:
            continue
        state = getattr(m.weight, "quant_state", None)
        shape = tuple(state.shape) if state is not None else tuple(m.weight.shape)
        if shape != (m.out_features, m.in_features):
            bad.append(f"{name}.weight: {list(shape)} where the model has {[m.out_features, m.in_features]}")
    return bad


def weights_of(model) -> str:
    """What a loaded model's decoder weights are: 'int8', 'nf4', 'int4' or the full dtype."""
    kinds = {type(m).__name__ for m in model.modules()}
    if "Linear8bitLt" in kinds:
        return "int8"
    if "Linear4bit" in kinds:
        return "nf4"
    if "Int4Linear" in kinds:
        return INT4
    return FULL
