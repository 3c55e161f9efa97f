"""Rotary types whose frequencies follow the sequence length, in a batch (engine/model/rope.py).

LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) and dynamic NTK pick their frequencies
from the longest position transformers sees, the whole batch's; dynamic NTK also keeps
them from one call to the next. A batch mixing a prompt past the original context with
short ones must give every row what its prompt alone gets, and nothing may carry over
from one request to the next.

The reference is transformers' generate on each prompt alone, on a copy of the model as
loaded (dynamic NTK's module state would otherwise carry from one reference to the next).
Prompts are prefilled whole and the short ones stay within the original context while
they decode: a prompt prefilled in chunks across the boundary, or a sequence crossing it
while decoding, gets other frequencies than the whole prompt at once, in transformers too
(for LongRoPE, transformers' generate then recomputes the whole cache; the stages do not).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.model.sources import resolve  # noqa: E402
from engine.model.stage import StageModel  # noqa: E402
from test_parity import LOGIT_ATOL, MAX_NEW, run_stages  # noqa: E402
from testkit.tiny_models import ROPE_ARCHS, ROPE_ORIGINAL, VOCAB, build_tiny_model  # noqa: E402

# two prompts past the original context (a long one and a medium one, which dynamic NTK
# stretches differently) and two short ones that stay within it
LONG, MEDIUM, SHORT = 30, 26, (5, 9)
assert LONG > MEDIUM > ROPE_ORIGINAL and max(SHORT) + MAX_NEW <= ROPE_ORIGINAL


def _prompts():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (LONG, MEDIUM, *SHORT)]


PROMPTS = _prompts()


class Tiny:
    def __init__(self, arch, root):
        self.model = build_tiny_model(arch, root)
        self.source = resolve(str(root))
        self._refs = {}

    def reference(self, prompt):
        if tuple(prompt) not in self._refs:
            model = copy.deepcopy(self.model)  # as loaded: no rotary state from another request
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
            self._refs[tuple(prompt)] = (out.sequences[0, len(prompt):].tolist(),
                                         torch.stack([s[0] for s in out.logits]).float())
        return self._refs[tuple(prompt)]

    def stages(self, cuts=(0, 2, 4, 6)):
        return [StageModel(self.source, a, b) for a, b in zip(cuts, cuts[1:])]

    def check(self, prompts, outs, logits):
        for prompt, got, got_logits in zip(prompts, outs, logits):
            want, want_logits = self.reference(prompt)
            assert got == want, f"prompt of {len(prompt)}: stages {got} != alone {want}"
            torch.testing.assert_close(got_logits, want_logits, atol=LOGIT_ATOL, rtol=1e-4)


@pytest.fixture(scope="module", params=ROPE_ARCHS)
def tiny(request, tmp_path_factory):
    return Tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_the_long_prompt_changes_the_frequencies(tiny):
    """The premise: past the original context the model's frequencies differ, so a short
    prompt given the long one's would not match itself alone."""
    model = copy.deepcopy(tiny.model)
    rope = model.model.rotary_emb
    x = torch.zeros(1)
    short = rope(x, torch.arange(SHORT[0])[None])[0]
    in_long = rope(x, torch.arange(LONG)[None])[0][:, :SHORT[0]]
    assert not torch.allclose(short, in_long)


def test_batch_mixing_a_long_prompt_with_short_ones(tiny):
    outs, logits = run_stages(tiny.stages(), PROMPTS)
    tiny.check(PROMPTS, outs, logits)


def test_long_prompt_joins_short_ones_decoding(tiny):
    """The long prompt's prefill shares steps with short rows decoding, and they share
    decode steps after."""
    outs, logits = run_stages(tiny.stages(), PROMPTS, joins=[3, 5, 0, 1])
    tiny.check(PROMPTS, outs, logits)


def test_nothing_carries_over_to_the_next_request(tiny):
    """On the same stages, each request after a longer one is that request alone."""
    stages = tiny.stages((0, 3, 6))
    for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]):
        outs, logits = run_stages(stages, [prompt])
        tiny.check([prompt], outs, logits)


def test_one_stage_holds_everything(tiny):
    outs, logits = run_stages(tiny.stages((0, 6)), PROMPTS[::-1])
    tiny.check(PROMPTS[::-1], outs, logits)
