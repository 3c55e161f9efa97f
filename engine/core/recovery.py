"""The head's decisions when a stage leaves, sans-I/O.

What the status says while the pipeline waits for room: every range of layers that
nobody holds any more, named.
"""

from __future__ import annotations


def missing_ranges(ranges: list[tuple[int, int]], kept: list[bool]) -> list[tuple[int, int]]:
    """The layers the old arrangement's stages held and nobody holds now: the ranges of
    the stages not kept (stage i held ranges[i]), neighbouring ones merged."""
    out: list[tuple[int, int]] = []
    for (a, b), k in zip(ranges, kept):
        if k:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def describe_layers(ranges: list[tuple[int, int]]) -> str:
    """'layer 4', 'layers 12–29', 'layers 3–5 and 20–29', 'layers 1, 3–5 and 20–29'."""
    parts = [f"{a}" if b - a == 1 else f"{a}–{b - 1}" for a, b in ranges]
    word = "layer" if len(ranges) == 1 and ranges[0][1] - ranges[0][0] == 1 else "layers"
    if len(parts) <= 1:
        return f"{word} {''.join(parts)}"
    return f"{word} {', '.join(parts[:-1])} and {parts[-1]}"


def waiting_status(missing: list[tuple[int, int]], need: int, have: int) -> tuple[str, str]:
    """What a pipeline that cannot hold the model says while it waits for a machine:
    (the status, what it waits for). missing: the layers nobody holds (empty when the
    shortfall is not one stage's, e.g. a machine that came back with less room)."""
    what = describe_layers(missing) if missing else f"{max(1, need - have)} more layers"
    room = (f"the machines left have room for {have} of the model's {need} layers" if have < need
            else "a machine left has no room for even one layer")
    return f"waiting for a GPU to hold {what} ({room})", what
