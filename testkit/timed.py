"""One request through a head, timed as a client sees its tokens arrive (the benches')."""

from __future__ import annotations

import time


async def timed_request(head, prompt: list[int], n: int, system: str, sampling: dict | None = None) -> dict:
    """Submit a request of exactly n tokens (the head's eos_ids cleared by the caller),
    greedy unless `sampling` names SamplingParams fields; returns its submit time, each
    token's arrival time and the tokens."""
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Done

    params = SamplingParams(**sampling, max_tokens=n) if sampling else SamplingParams(greedy=True, max_tokens=n)
    handle = head.submit(prompt, params)
    done, times = None, []
    async for ev in handle:  # as a client sees them
        if isinstance(ev, Done):
            done = ev
        else:
            times += [time.perf_counter()] * len(ev.token_ids)
    seq = handle.seq
    if done.finish_reason != "length" or len(seq.generated) != n:
        raise RuntimeError(f"{system}: request ended with {done.finish_reason} after "
                           f"{len(seq.generated)} tokens: {done.error}")
    if len(times) < n:  # the last token's Delta is skipped when it adds no text
        times.append(seq.t_submit + done.seconds)
    return {"tokens": list(seq.generated), "t_submit": seq.t_submit, "times": times}
