"""How many tokens of a new prompt the head computes per step before sending them on.

A prompt streams through the pipeline in chunks: the head computes chunk k+1 while
the link carries chunk k and the next stage computes chunk k-1. Smaller chunks start
the downstream stages sooner (time to first token), but every chunk is a step of its
own and pays a step's fixed cost (reading the weights) on every stage.

Over a link that is slow for the model (a home uplink: tens of ms per token of
activations against a few ms per token of compute) the link is the pipeline's
bottleneck, and a prompt's chunks reach the last stage no sooner than the link carries
them whatever their size: a small chunk only shortens the wait before the link starts
and after it ends. The price is compute, and compute is shared with the other
sequences' decode steps. So the chunk is the smallest whose compute takes at most
1/HEADROOM of its own link time: the head spends at most half its time on a prompt's
chunks while the link carries them, the other half is left to decode steps. On a fast
link (compute the bottleneck) no size meets that, and the chunk is the cap.

Pure: fed the head's prefill profile and the measured link, no I/O. Head and the
simulator (bench/simulator.py) call this same function.
"""

from __future__ import annotations

from engine.core.compression import q8_ratio, should_compress
from engine.core.profile import interp

HEADROOM = 2.0    # link time per chunk over compute time per chunk, at least
FLOOR = 16        # tokens: below this a chunk is mostly the step's fixed cost
CAP = 64          # tokens: the largest chunk (and the chunk on a fast link)


def prompt_chunk_tokens(prefill: list, bytes_per_token: int, dtype_bytes: int, bandwidth: float,
                        cap: int = CAP, compress: str = "off") -> int:
    """Tokens per prompt chunk (FLOOR..cap) for a link of `bandwidth` bytes/s.

    prefill: the head's profile points [[tokens, seconds], ...]; bytes_per_token: one
    token's activations (values of dtype_bytes each); compress: the head's compression
    policy (a chunk it would compress takes less link time).
    """
    if cap <= FLOOR or bandwidth <= 0 or not prefill:
        return cap
    for c in range(FLOOR, cap):
        compute = interp(prefill, c)
        nbytes = c * bytes_per_token
        if should_compress(compress, "prefill", nbytes, bandwidth, compute):
            nbytes *= q8_ratio(dtype_bytes)
        if compute * HEADROOM <= nbytes / bandwidth:
            return c
    return cap


# ---- one stage: a long prompt in pieces between the decode steps --------------------------

# A pipeline of one stage computed a prompt in one step: 4,000 tokens held every other
# reply for 25 s on a CPU (a 3-token request waited the whole time), and a client that
# gave up could not stop it. So a long prompt is computed a piece at a time ahead of its
# micro-batch (the head's prompt lane), and the decode steps go between the pieces.
LANE_SECONDS = 0.5   # about the longest a decode step waits behind one piece
LANE_MIN = 256       # tokens: on a CPU 128-token pieces took 10% longer than one step; 256-512 no longer
LANE_MAX = 8192


def lane_chunk_tokens(prefill: list | None) -> int | None:
    """Tokens per piece of a long prompt on a one-stage pipeline, by the stage's prefill
    profile ([[tokens, seconds], ...]): the largest power of two from LANE_MIN whose
    compute takes at most LANE_SECONDS (None: no profile yet). A prompt is cut only
    when more than two pieces are left of it."""
    if not prefill:
        return None
    c = LANE_MIN
    while c < LANE_MAX and interp(prefill, 2 * c) <= LANE_SECONDS:
        c *= 2
    return c
