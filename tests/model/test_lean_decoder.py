"""The draft model's lean decode loop (engine/model/lean_decoder.py): the StageModel's
logits from the same weights, batched rows of different lengths, rolled back by a
length, and the draft model's guesses unchanged by it."""

from __future__ import annotations

import pytest
import torch

from engine.model.draft import DraftModel
from engine.model.kv import KVCapacityError
from engine.model.lean_decoder import LeanDecoder, supports
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel


def whole(folder) -> StageModel:
    source = resolve(str(folder))
    return StageModel(source, 0, source.config().num_hidden_layers, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def pair(tiny_folder):
    folder, _ = tiny_folder("llama", seed=0)
    ref = whole(folder)
    return ref, LeanDecoder(whole(folder))


def step(model, seqs, starts, feeds):
    batch = StageBatch(list(seqs), list(starts), [len(f) for f in feeds])
    return model.forward(batch, torch.tensor([t for f in feeds for t in f]))


def test_the_lean_loop_gives_the_stage_models_logits(pair):
    ref, lean = pair
    a, b = list(range(5, 25)), list(range(40, 47))
    # two prompts of different lengths in one step, then decode steps, then a catch-up of 3
    for model in (ref, lean):
        model.free(1), model.free(2)
    torch.testing.assert_close(step(lean, [1, 2], [0, 0], [a, b]), step(ref, [1, 2], [0, 0], [a, b]),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step(lean, [1, 2], [20, 7], [[9], [11]]), step(ref, [1, 2], [20, 7], [[9], [11]]),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step(lean, [2, 1], [8, 21], [[3, 4, 5], [6]]),
                               step(ref, [2, 1], [8, 21], [[3, 4, 5], [6]]), rtol=1e-4, atol=1e-4)
    assert lean.kv.length(1) == 22 and lean.kv.length(2) == 11


def test_a_rollback_is_a_length(pair):
    ref, lean = pair
    ctx = list(range(60, 90))
    lean.free(3)
    step(lean, [3], [0], [ctx])
    step(lean, [3], [30], [[1, 2, 3]])          # guesses the target then rejects
    lean.kv.truncate(3, 30)
    again = step(lean, [3], [30], [[4]])
    ref.free(3)
    torch.testing.assert_close(again, step(ref, [3], [0], [ctx + [4]]), rtol=1e-4, atol=1e-4)


def test_the_budget_holds_and_bad_rows_are_refused(pair):
    _, lean = pair
    lean.free(4)
    budget, lean.kv.budget_tokens = lean.kv.budget_tokens, 10
    try:
        with pytest.raises(KVCapacityError):
            step(lean, [4], [0], [list(range(11))])
        assert not lean.kv.has(4)
    finally:
        lean.kv.budget_tokens = budget
    with pytest.raises(ValueError):
        step(lean, [4], [5], [[1]])              # past what its cache holds


def test_the_draft_model_drafts_the_same_with_it(tiny_folder):
    folder, _ = tiny_folder("llama", seed=0)
    lean = DraftModel.load(str(folder), dtype=torch.float32, device="cpu")
    plain = DraftModel.load(str(folder), dtype=torch.float32, device="cpu", lean=False)
    assert isinstance(lean.model, LeanDecoder) and not isinstance(plain.model, LeanDecoder)
    ctx = list(range(5, 25))
    for d in (lean, plain):
        d.draft([(1, ctx, 4)])
    assert lean.draft([(1, ctx + [7], 5)]) == plain.draft([(1, ctx + [7], 5)])
    assert lean.draft([(1, ctx + [7, 8], 3), (2, ctx[:9], 3)]) == plain.draft([(1, ctx + [7, 8], 3), (2, ctx[:9], 3)])


def test_other_families_keep_the_stage_model(tiny_folder):
    folder, _ = tiny_folder("gpt2", seed=0)
    assert not supports(whole(folder))
    assert not isinstance(DraftModel.load(str(folder), dtype=torch.float32, device="cpu").model, LeanDecoder)


@pytest.mark.parametrize("arch", ["qwen2", "mistral_nowindow"])
def test_the_other_families_it_runs(tiny_folder, arch):
    folder, _ = tiny_folder(arch, seed=0)
    ref = whole(folder)
    assert supports(ref)
    lean = LeanDecoder(whole(folder))
    a, b = list(range(5, 25)), list(range(40, 47))
    torch.testing.assert_close(step(lean, [1, 2], [0, 0], [a, b]), step(ref, [1, 2], [0, 0], [a, b]),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step(lean, [1, 2], [20, 7], [[9], [11, 12]]),
                               step(ref, [1, 2], [20, 7], [[9], [11, 12]]), rtol=1e-4, atol=1e-4)

