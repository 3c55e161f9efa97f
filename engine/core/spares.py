"""Spare layers: what each machine loads beside its slice while the pipeline serves, so
that a stage lost without notice (a crash, a pulled cable, a laptop lid) costs no loading.

When a stage is lost, the layers are split again over the machines left, and each
survivor's new share holds layers it did not have; read during the rearrangement, they
paused every conversation for as long as the slowest survivor read them. The head knows
ahead of time what each loss would give each survivor: the split over the others
(`plans`, one per stage that may be lost; the head's own stage is never lost). So once a
formation is done, each machine loads, beside the slice it serves and only where its
memory has room, the layers any of those splits would give it: one contiguous range
around its slice (`spare_ranges`). When a stage is then lost, the rearrangement takes
the plan made for that loss (`Spares.for_loss`) and every survivor keeps what it needs.

Plain data in, plain data out: the head (engine/pipeline/spare_layers.py) does the I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

Range = tuple[int, int]


def spares_on() -> bool:
    """POTLUCK_SPARES=0 loads no spare layers (for side-by-side runs: bench/failover.py --spares)."""
    return os.environ.get("POTLUCK_SPARES", "1") != "0"


def spare_ranges(current: list[Range], plans: dict[int, list[Range]]) -> list[Range]:
    """Per stage of `current` (the head's first): the smallest range holding its slice and
    every slice a loss would give it. plans: lost stage index (1..) -> the split over the
    others, in their order."""
    out = []
    for i, (a, b) in enumerate(current):
        for lost, split in plans.items():
            if i == lost:
                continue
            if len(split) != len(current) - 1:
                raise ValueError(f"the plan for losing stage {lost} has {len(split)} slices")
            s, e = split[i if i < lost else i - 1]
            a, b = min(a, s), max(b, e)
        out.append((a, b))
    return out


def spare_count(current: list[Range], spares: list[Range]) -> int:
    """Layers the spare ranges hold beyond the slices served."""
    return sum((b - a) - (e - s) for (s, e), (a, b) in zip(current, spares))


@dataclass
class Spares:
    """The plans made for each loss, by the lost stage's address: (the survivors'
    addresses, the split), as engine/pipeline/ring_formation.py's `_form` takes it."""

    plans: dict[str, tuple]
    weights: str            # what every stage loads; a plan that changes it is not kept
    layers: int = 0         # spare layers loaded so far, over every machine

    def for_loss(self, lost: str, survivors: list[str]) -> tuple | None:
        """The plan for losing `lost`, while the survivors are still those."""
        plan = self.plans.get(lost)
        if plan is None or plan[0] != survivors or plan[1][1] != self.weights:
            return None
        return plan
