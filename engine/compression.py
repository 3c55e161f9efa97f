"""When a link's activations travel as blockwise int8 (wire.quantize_q8).

Policies, chosen by the host per pipeline:
  off      exact activations everywhere (the default: outputs match single-process)
  auto     prefill volumes go int8 while this link is the bottleneck: when sending
           the volume would take longer than computing it did
  prefill  prefill volumes always int8
  all      decode volumes too (the host opts in to inexact decode)
Decode volumes are tiny and latency-bound, so only `all` touches them.
"""

from __future__ import annotations

POLICIES = ("off", "auto", "prefill", "all")


def should_compress(policy: str, kind: str, nbytes: int, bandwidth: float, compute_seconds: float) -> bool:
    if policy == "all":
        return True
    if kind != "prefill" or policy == "off":
        return False
    if policy == "prefill":
        return True
    return nbytes / max(bandwidth, 1.0) > compute_seconds  # auto: the link is slower than compute
