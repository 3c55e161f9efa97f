"""What `auto` loads on a CPU computes a token the same two ways (testkit/two_ways.py).

A reply replayed after a lost stage recomputes its history as a prompt; a reply checked by
speculation computes drafted tokens several to a step. Both give the undisturbed reply
token for token only where a token computed inside a prompt and one step at a time come
out nearly the same: float32 weights do (~5e-5 in a logit); int4, whose kernel rounds its
input to bf16, does not (0.25: bench/quant.py), which is why `auto` never takes it
(engine/core/precision.py). This holds the weights a host settles on to that.
"""

from __future__ import annotations

import asyncio

from engine.core import precision
from engine.model.sources import resolve
from engine.model.stage import StageModel
from engine.pipeline.launch import PipelineConfig, launch
from testkit.two_ways import two_ways

PROMPT = ("The lighthouse keeper found a bottle on the shore one morning, and inside it was a letter "
          "that began with the words")


async def test_the_weights_auto_settles_on_here_compute_a_token_the_same_two_ways():
    # the weights as `potluck chat` settles them with its defaults (here: the head and one
    # stage process on this CPU) ...
    p = await launch(PipelineConfig(model="default"))
    try:
        weights, prompt = p.head.weights, p.head.tokenizer(PROMPT)["input_ids"]
        assert weights in precision.EXPLICIT   # settled, not "auto"
    finally:
        await p.close()
    # ... then one stage of those weights holding every layer, so its output is logits
    source = resolve("default")
    stage = await asyncio.to_thread(StageModel, source, 0, source.config().num_hidden_layers,
                                    device="cpu", weights=weights)
    diff = await asyncio.to_thread(two_ways, stage, prompt)
    assert diff < 1e-3, f"{weights} weights: a logit {diff:.3g} apart two ways"
