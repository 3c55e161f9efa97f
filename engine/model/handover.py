"""A stage's layers handed to the next stage its machine builds.

When the pipeline rearranges (a friend left, came back or joined), every stage loads
its new share of the layers. Most of that share is usually what the machine already
held: a stage that grows keeps its old layers and gains a few, one that shrinks keeps
a subset. Reading those again from disk (and dequantizing them, or copying them to the
GPU) is most of a rearrangement's wait for a big model, during which every
conversation pauses. So the old stage hands its decoder layers over
(`StageModel.hand_over`) and the new one takes those in its range (`take`), reading
only the rest.

Layers move only between stages built alike -- the same model (by fingerprint), dtype,
weights and device -- and lose what the old stage hung on them (its hooks, its per-row
rotary patches) before the new stage adds its own, so a kept layer is the same module
a fresh load would build, with the same weights: outputs are identical
(tests/model/test_handover.py). POTLUCK_KEEP_LAYERS=0 reads every layer again (for
side-by-side measurements, bench/failover.py --keep).
"""

from __future__ import annotations

import os

from torch import nn


def keeping_layers() -> bool:
    return os.environ.get("POTLUCK_KEEP_LAYERS", "1") != "0"


class HeldLayers:
    """Decoder layers by their index in the whole model, and how they were built."""

    def __init__(self, layers: dict[int, nn.Module], built: tuple, config):
        self.layers = layers
        self.built = built     # (fingerprint, dtype, weights asked for, device)
        self.config = config   # the old model's: the kept layers' modules point at it

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """What they hold: memory the machine has for the new stage, though not free yet."""
        return sum(p.numel() * p.element_size() for m in self.layers.values() for p in m.parameters())

    def narrow(self, start: int, end: int) -> "HeldLayers":
        """Let every layer outside [start, end) go: before the new stage loads, so that the
        machine never holds the old slice and the new one at once."""
        self.layers = {i: m for i, m in self.layers.items() if start <= i < end}
        return self

    def take(self, built: tuple, start: int, end: int) -> dict[int, nn.Module]:
        """The layers in [start, end) for a stage built as `built`, no longer held here."""
        layers, self.layers = self.layers, {}
        if not built or built != self.built:   # () when keeping is off
            return {}
        return {i: m for i, m in layers.items() if start <= i < end}


def adopt(layer: nn.Module, old_config, config) -> nn.Module:
    """A kept layer's modules pointed at the new stage's model config, as a fresh load's
    are: attention and MLP read theirs at each step (the attention kernel, the window)."""
    for m in layer.modules():
        if getattr(m, "config", None) is old_config:
            m.config = config
    return layer
