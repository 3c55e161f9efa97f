"""What a step frame's header says about its rows, for the stage that computes it:
which sequences it forks, which positions' logits the last stage keeps and draws from,
and whether it is a decode step (which may overtake prompt chunks); and the answer
to a step that failed. Pure."""

from __future__ import annotations

import json

from engine.wire import frames


def forks(frame: frames.Frame) -> dict[int, list[int]]:
    """The sequences a frame's step forks (a request's other choices, n > 1): parent ->
    fork ids. Every stage copies the parent's KV to them once the step has computed it."""
    if frame.meta.get("partial"):
        return {}
    return {int(k): [c for c, _ in v["forks"]] for k, v in frame.meta.get("new", {}).items() if v.get("forks")}


def kept(frame: frames.Frame) -> list[int]:
    """Per row, the positions whose logits the last stage returns: all of a verification
    row's (speculative decoding, issue 34: a sequence already open, in a step that is no
    prompt chunk, with more than one token: its last token and a draft), one otherwise."""
    if frame.meta.get("partial"):
        return [1] * len(frame.meta["rows"])
    new = frame.meta.get("new", {})
    return [r[2] if r[2] > 1 and str(r[0]) not in new else 1 for r in frame.meta["rows"]]


def keep(frame: frames.Frame) -> list[int] | None:
    """kept, or None when the step verifies no draft (the common case)."""
    rows = kept(frame)
    return rows if any(k > 1 for k in rows) else None


def drafts(frame: frames.Frame) -> dict[int, list[int]]:
    """The drafted tokens of the step's verification rows: the last stage penalizes each
    position after the draft's tokens before it (engine/model/sampler.py)."""
    return {int(k): v for k, v in frame.meta.get("drafts", {}).items()}


def positions(frame: frames.Frame) -> list[int]:
    """The position of the (first) token each row draws: a verification row draws one
    after each of its tokens, any other row after its last."""
    return [r[1] + r[2] - k + 1 for r, k in zip(frame.meta["rows"], kept(frame))]


def is_decode(frame: frames.Frame) -> bool:
    # a step that opens a sequence is prefill even when its last prompt piece is one
    # token: sent as decode it could overtake that sequence's own queued prompt chunks.
    # A verification step (rows of a few tokens: speculative decoding) is a decode step.
    return not frame.meta.get("partial") and not frame.meta.get("new")


def fit_reason(why: str, max_bytes: int) -> str:
    """`why`, cut (with "…") so that its JSON, as a frame encodes it, takes at most
    max_bytes (never under 64: a few words stay)."""
    max_bytes = max(max_bytes, 64)
    if len(json.dumps(why)) <= max_bytes:
        return why
    lo, hi = 0, len(why)     # the longest prefix that fits, with the mark
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(json.dumps(why[:mid] + "…")) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return why[:lo] + "…"


def failed(frame: frames.Frame, why: str) -> bytes:
    """The head's answer to a step that failed: `why` for each of its sequences (the head
    ends their replies with it and frees them everywhere). Step 0 tells the head it came
    from a prompt chunk, not its micro-batch's step."""
    rows = frame.meta["rows"]
    # every row carries it: kept short enough that the frame stays within what the head
    # reads (frames.MAX_META), whatever the rows and the reason (4096 rows of a long one
    # made a frame the head refused, and it dropped this stage for it)
    meta = {"tokens": [], "errors": [[r[0], fit_reason(why, frames.MAX_META // 2 // len(rows))] for r in rows]}
    step = 0 if frame.meta.get("partial") else frame.step
    return frames.encode(frames.FrameType.TOKENS, frame.micro_batch, step, meta)
