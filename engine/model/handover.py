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
    """Decoder layers by their index in the whole model, the parts around them (the token
    embedding of a first stage; the final norm and LM head of a last one) by their name in
    the model, and how they were built."""

    def __init__(self, layers: dict[int, nn.Module], built: tuple, config, n_layers: int,
                 first_parts: dict[str, nn.Module] | None = None, last_parts: dict[str, nn.Module] | None = None):
        self.layers = layers
        self.built = built     # (fingerprint, dtype, weights asked for, device)
        self.config = config   # the old model's: the kept layers' modules point at it
        self.n_layers = n_layers
        self.first_parts = first_parts or {}
        self.last_parts = last_parts or {}

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """What they hold: memory the machine has for the new stage, though not free yet."""
        modules = [*self.layers.values(), *self.first_parts.values(), *self.last_parts.values()]
        return sum(p.numel() * p.element_size() for p in {id(p): p for m in modules for p in m.parameters()}.values())

    def narrow(self, start: int, end: int) -> "HeldLayers":
        """Let every layer outside [start, end) go: before the new stage loads, so that the
        machine never holds the old slice and the new one at once."""
        self.layers = {i: m for i, m in self.layers.items() if start <= i < end}
        if start != 0:
            self.first_parts = {}
        if end != self.n_layers:
            self.last_parts = {}
        return self

    @staticmethod
    def merged(a: "HeldLayers | None", b: "HeldLayers | None") -> "HeldLayers | None":
        return b if a is None else a.merge(b)

    def merge(self, other: "HeldLayers | None") -> "HeldLayers":
        """These and `other`'s (layers loaded ahead beside a serving stage), when built alike;
        `other` is let go otherwise."""
        if other is not None and other.built == self.built:
            self.layers = {**other.layers, **self.layers}
            self.first_parts = {**other.first_parts, **self.first_parts}
            self.last_parts = {**other.last_parts, **self.last_parts}
        return self

    def take(self, built: tuple, start: int, end: int) -> tuple[dict[int, nn.Module], dict[str, nn.Module]]:
        """The layers in [start, end) and the parts for a stage built as `built`, no longer
        held here."""
        self.narrow(start, end)
        layers, parts = self.layers, {**self.first_parts, **self.last_parts}
        self.layers, self.first_parts, self.last_parts = {}, {}, {}
        if not built or built != self.built:   # () when keeping is off
            return {}, {}
        return layers, parts


def missing_pieces(have: tuple[int, int] | None, want: tuple[int, int]) -> list[tuple[int, int]]:
    """The ranges of layers in `want` that `have` lacks: none, one, or two (a slice that
    grows at both ends)."""
    if have is None or have[1] <= want[0] or want[1] <= have[0]:
        return [want]
    pieces = [(want[0], min(want[1], have[0])), (max(want[0], have[1]), want[1])]
    return [(a, b) for a, b in pieces if a < b]


def not_held(pieces: list[tuple[int, int]], held: "HeldLayers | None") -> list[tuple[int, int]]:
    """`pieces` less the layers `held` has already (loaded ahead before): runs of the rest."""
    have = set(held.layers) if held is not None else set()
    out = []
    for a, b in pieces:
        run = None
        for i in range(a, b):
            if i in have:
                run = None
            elif run is None:
                run = [i, i + 1]
                out.append(run)
            else:
                run[1] = i + 1
    return [tuple(r) for r in out]


def parts_of(model: nn.Module, base: nn.Module, layers: nn.Module) -> dict[str, nn.Module]:
    """The modules besides the decoder layers that hold weights, by name: the decoder's
    children with parameters (embeddings, final norm; a stage's stubs have none) and the
    LM head."""
    units = [c for c in base.children() if c is not layers]
    head = model.get_output_embeddings()
    if isinstance(head, nn.Module) and not any(head is m for m in base.modules()):
        units.append(head)
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(u)]: u for u in units if id(u) in names and any(True for _ in u.parameters())}


def same_part(mine: nn.Module, kept: nn.Module) -> bool:
    """Whether a kept part can stand in for the new model's (still empty) one."""
    def kind(m):   # a CPU stage's SmallBatchLinear is an nn.Linear with another product
        return nn.Linear if isinstance(m, nn.Linear) and type(m).__name__ == "SmallBatchLinear" else type(m)

    def shapes(m):
        return [(n, tuple(p.shape)) for n, p in m.named_parameters()]

    return kind(mine) is kind(kept) and shapes(mine) == shapes(kept)


def put(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def adopt(layer: nn.Module, old_config, config) -> nn.Module:
    """A kept layer's modules pointed at the new stage's model config, as a fresh load's
    are: attention and MLP read theirs at each step (the attention kernel, the window)."""
    for m in layer.modules():
        if getattr(m, "config", None) is old_config:
            m.config = config
    return layer
