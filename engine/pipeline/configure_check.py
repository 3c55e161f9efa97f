"""What a stage agrees to load when a head configures it: checked before anything loads.

A friend's head chooses among the models the owner's Potluck knows (the default model
or the curated catalog, by name), never a path on this disk nor an arbitrary hub id;
both must hold the same model (by fingerprint); the precision must be one we know; and
the slice's weights must fit the owner's VRAM cap. Each refusal says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.precision import EXPLICIT, slice_bytes
from engine.core.sizes import size_words
from engine.model import catalog
from engine.model.device import DTYPES
from engine.model.sources import DEFAULT_MODEL, DEFAULT_MODEL_NAME, ModelError, ModelSource, resolve


def remote_model_ok(spec: str) -> bool:
    """What a stage serving someone else's head agrees to load: the default model or a
    model of the curated catalog, by name; never a path on this disk, nor an arbitrary hub
    id (a friend's head chooses among what the owner's Potluck knows, not anything)."""
    s = spec.strip()
    return s in (DEFAULT_MODEL, DEFAULT_MODEL_NAME) or catalog.find(s) is not None


@dataclass
class Checked:
    source: ModelSource
    dtype: torch.dtype
    fingerprint: str
    cfg: object
    weight_bytes: int   # the slice's weights, as the precision asked for stores them


def check_configure(msg: dict, trusted_head: bool, accept_models, memory_cap: int | None) -> Checked:
    if not (trusted_head or remote_model_ok(msg["model"]) or msg["model"] in accept_models):
        raise ModelError("this stage loads only the default model or one from Potluck's model list, by name; "
                         f"its owner can let it load this one with `--accept-model {msg['model'][:200]}` on "
                         "its `potluck stage`, `join` or `node`")
    source = resolve(msg["model"])
    dtype = DTYPES.get(msg["dtype"])
    if dtype is None:
        raise ModelError(f"unsupported dtype {msg['dtype']}")
    fp = source.fingerprint()
    if msg["fingerprint"] and msg["fingerprint"] != fp:
        raise ModelError(f"this stage's copy of {msg['model']} differs from the head's "
                         f"(fingerprint {fp} vs {msg['fingerprint']}): both must hold the same model")
    cfg = source.config()
    if msg["weights"] not in EXPLICIT:
        raise ModelError(f"unknown weights {msg['weights']!r}")
    weights = slice_bytes(cfg, msg["start"], msg["end"], msg["weights"], dtype.itemsize)
    if memory_cap is not None and weights > memory_cap:
        raise ModelError(
            f"layers {msg['start'] + 1}-{msg['end']} need about {size_words(weights, up=True)} for their "
            f"weights; this computer's owner allows {size_words(memory_cap)} (their VRAM "
            "cap): give this stage fewer layers, or ask them to raise the cap")
    return Checked(source, dtype, fp, cfg, weights)
