"""A head for test_failover's link cut, run inside a network namespace.

    python tests/pipeline/netcut_head.py ws://stage-a:7860 ws://stage-b:7860

Four greedy replies over the two stages, uninterrupted; then the same four again,
printing "CUT" on its own line when reply 0 has 12 tokens (the test then drops the
middle stage's packets). Prints the outcome as one JSON line at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta
from engine.pipeline.launch import PipelineConfig, launch

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
TOKENS, CUT_AT = 40, 12


async def replies(head, cut: bool) -> list[list[int]]:
    handles = [head.submit(head.chat_prompt([{"role": "user", "content": p}]),
                           SamplingParams(greedy=True, max_tokens=TOKENS)) for p in PROMPTS]

    async def one(i, h):
        toks = []
        async for ev in h:
            if isinstance(ev, Delta):
                toks.extend(ev.token_ids)
                if cut and i == 0 and len(toks) == CUT_AT:
                    print("CUT", time.time(), flush=True)
            elif ev.error is not None:
                raise RuntimeError(ev.error)
        return toks

    return await asyncio.wait_for(asyncio.gather(*(one(i, h) for i, h in enumerate(handles))), 300)


async def main(addrs: list[str]) -> None:
    pipe = await launch(PipelineConfig(model="default", stage_addr=addrs, threads=1, device="cpu"))
    head = pipe.head
    head.eos_ids = set()  # every reply runs its full length
    try:
        reference = await replies(head, False)
        got = await replies(head, True)
        print(json.dumps({"reference": reference, "got": got, "events": head.events, "stages": head.n_stages,
                          "error": head.error}), flush=True)
    finally:
        await pipe.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
