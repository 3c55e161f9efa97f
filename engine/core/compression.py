"""When a link's activations travel as blockwise int8 (engine/wire/frames.py quantize_q8).

Policies, chosen by the host per pipeline:
  off      exact activations everywhere (the default: outputs match single-process)
  auto     prefill volumes go int8 while this link is clearly the bottleneck: when
           sending the volume would take more than AUTO_MARGIN times as long as
           computing it did
  prefill  prefill volumes always int8
  all      decode volumes too (the host opts in to inexact decode)
Decode volumes are tiny and latency-bound, so only `all` touches them.
"""

from __future__ import annotations

POLICIES = ("off", "auto", "prefill", "all")

# 16 values per scale: residual streams carry outlier channels, and a smaller block
# keeps one outlier from flattening its neighbours (bench/compression.py compares
# block sizes: error against bytes)
Q8_BLOCK = 16
Q8_ROW = Q8_BLOCK + 4  # bytes per block on the wire: the int8 values and their scale


def q8_ratio(dtype_bytes: int) -> float:
    """Wire bytes of int8 blocks per byte of activations of dtype_bytes per value."""
    return Q8_ROW / Q8_BLOCK / dtype_bytes


# Prompt chunks are computed and sent in a pipeline: the next chunk computes while this
# one travels, so a prompt's pace is max(send, compute) per chunk. Where sending takes
# about as long as computing, int8 (about a third of float32's bytes: q8_ratio) barely
# moves that maximum but still costs exactness: at the weak-link bench's fastest link
# (~200 Mbit/s equivalent, where by the bench's link mapping a 64-token chunk takes
# about as long to send as to compute) +compress was no faster to first token than
# exact activations and its TPOT several percent worse than FIFO's (bench/weaklink.py;
# see bench/RESULTS.md). Twice as long: the link is the bottleneck by a margin that a
# noisy bandwidth estimate does not flip.
AUTO_MARGIN = 2.0


def should_compress(policy: str, kind: str, nbytes: int, bandwidth: float, compute_seconds: float) -> bool:
    if policy == "all":
        return True
    if kind != "prefill" or policy == "off":
        return False
    if policy == "prefill":
        return True
    return nbytes / max(bandwidth, 1.0) > AUTO_MARGIN * compute_seconds  # auto: link-bound
