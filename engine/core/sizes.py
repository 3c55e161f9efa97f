"""Sizes in the words people read on a GPU's box and a disk's label: decimal GB and MB,
one way everywhere the product speaks (the host window once said GiB beside the plan's
GB, for the same memory); and counts as they are said ("1 stage", "3 stages", not
"1 stage(s)")."""

from __future__ import annotations

import math


def size_words(n: float, up: bool = False) -> str:
    """'24 GB', '8.5 GB', '300 MB'. up: rounded up, for what something needs (a need is
    never said smaller than it is); otherwise to the nearest."""
    if n >= 9.5e9:
        return f"{math.ceil(n / 1e9) if up else round(n / 1e9)} GB"
    if n >= 0.95e9:
        return f"{math.ceil(n / 1e8) / 10 if up else n / 1e9:.1f} GB"
    return f"{math.ceil(n / 1e6) if up else round(n / 1e6)} MB"


def counted(n: int, word: str, plural: str | None = None) -> str:
    """'1 stage', '3 stages'; plural where adding an s is wrong ('1 copy', '2 copies')."""
    return f"{n} {word if n == 1 else plural or word + 's'}"
