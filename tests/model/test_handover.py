"""A stage's layers handed to the stage that replaces it on the same machine
(engine/model/handover.py): what a rearrangement keeps instead of reading again.

* every family: after the split moves, the stages built from the old ones' layers (and
  embedding, final norm, LM head) give token for token and logit for logit what freshly
  loaded stages give, and read only what they did not hold;
* the default model (GGUF, dequantized on loading) the same, on the path a friend's
  stage and the head take;
* layers move only between stages built alike; the old stage steps no more; what the
  new stage does not hold is let go before it loads.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.core.product_choice import ProductChoice
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel
from testkit.tiny_models import ARCHS

from test_static_decode import greedy


def one_product() -> ProductChoice:
    """Logits are compared bit for bit between stages built apart: one matrix product for
    all, where a CPU stage would pick whichever it times faster (engine/model/cpu_linear.py)."""
    return ProductChoice(fixed="rows")


def build(source, ranges, reuse=None, dtype=torch.float32) -> tuple[list[StageModel], list[int]]:
    """Stages over `ranges` (from the held layers `reuse`, one per range): the stages, and
    how many tensors each read from the checkpoint."""
    stages, reads = [], []
    for i, (a, b) in enumerate(ranges):
        totals = []
        stages.append(StageModel(source, a, b, dtype=dtype, device="cpu", products=one_product(),
                                 reuse=reuse[i] if reuse else None,
                                 progress=lambda done, total, what: totals.append(total)))
        reads.append(totals[0] if totals else 0)
    return stages, reads


def same(x, y) -> bool:
    return x[0] == y[0] and all(torch.equal(a, b) for a, b in zip(x[1], y[1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_steps_on_kept_layers_as_on_freshly_loaded_ones(tiny_folder, arch):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    old, _ = build(source, [(0, L // 2), (L // 2, L)])
    before = greedy(old)
    # a friend joined at the front of the second stage: the first shrinks, the second grows
    new_ranges = [(0, L // 4), (L // 4, L)]
    kept, kept_reads = build(source, new_ranges, [s.hand_over() for s in old])
    fresh, fresh_reads = build(source, new_ranges)
    assert [s.kept_layers for s in kept] == [L // 4, L - L // 2]
    # and the token embedding (first stage), the final norm or LM head (last)
    assert kept[0].kept_parts and kept[1].kept_parts
    after = greedy(kept)
    assert same(after, greedy(fresh))
    assert after[0] == before[0]
    # the kept layers were not read again
    assert kept_reads[0] < fresh_reads[0] and kept_reads[1] < fresh_reads[1]


PROMPTS = [[1, 504, 3458, 314], [1, 20, 30]]


def test_the_default_model_keeps_its_layers_through_a_rearrangement_and_back(default_source):
    L = default_source.config().num_hidden_layers
    three = [(0, 10), (10, 20), (20, L)]
    old, _ = build(default_source, three)
    before = greedy(old, prompts=PROMPTS, new=6)
    # the middle stage's machine left: the other two take its layers
    two = [StageModel(default_source, 0, 15, device="cpu", reuse=old[0].hand_over(), products=one_product()),
           StageModel(default_source, 15, L, device="cpu", reuse=old[2].hand_over(), products=one_product())]
    assert [s.kept_layers for s in two] == [10, L - 20]
    assert same(greedy(two, prompts=PROMPTS, new=6), before)
    # it came back: both shrink, and no tensor of their layers is read again
    back, reads = build(default_source, three, [two[0].hand_over(), None, two[1].hand_over()])
    assert [s.kept_layers for s in back] == [10, 0, L - 20]
    assert reads[0] == 0 and reads[2] == 0 < reads[1]   # nothing but the middle stage's layers
    assert back[0].kept_parts == ["model.embed_tokens"] and back[2].kept_parts == ["lm_head", "model.norm"]
    assert same(greedy(back, prompts=PROMPTS, new=6), before)


def test_layers_move_only_between_stages_built_alike(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    (old,), _ = build(source, [(0, L)])
    # another precision: its layers are other tensors, read again
    (bf16,), _ = build(source, [(0, L)], [old.hand_over()], dtype=torch.bfloat16)
    assert bf16.kept_layers == 0 and bf16.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # another model of the same shape (other weights): nothing kept
    other, _ = tiny_folder("llama", seed=1)
    (a,), _ = build(source, [(0, L)])
    (b,), _ = build(resolve(str(other)), [(0, L)], [a.hand_over()])
    (ref,), _ = build(resolve(str(other)), [(0, L)])
    assert b.kept_layers == 0 and same(greedy([b]), greedy([ref]))
    # switched off (for side-by-side measurements): read again
    monkeypatch.setenv("POTLUCK_KEEP_LAYERS", "0")
    (c,), _ = build(source, [(0, L)])
    (d,), _ = build(source, [(0, L)], [c.hand_over()])
    assert d.kept_layers == 0


def test_a_stage_that_handed_its_layers_over_steps_no_more(tiny_folder):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    (old,), _ = build(source, [(0, 3)])
    held = old.hand_over()
    with pytest.raises(RuntimeError, match="went to the stage that replaced it"):
        old.forward(StageBatch([0], [0], [2]), torch.tensor([5, 9]))
    # the new stage's hooks are its own: the old one's came off with the hand-over
    (new,), _ = build(source, [(0, 3)], [held])
    assert all(len(layer._forward_pre_hooks) == len(fresh._forward_pre_hooks)
               for layer, fresh in zip(new._layers, build(source, [(0, 3)])[0][0]._layers))


def test_what_the_new_stage_does_not_hold_is_let_go_before_it_loads(tiny_folder):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    (old,), _ = build(source, [(0, L)])
    held = old.hand_over()
    gone = weakref.ref(held.layers[L - 1])
    held.narrow(0, 2)
    gc.collect()
    assert gone() is None and sorted(held.layers) == [0, 1]
    (two,), _ = build(source, [(0, 2)])
    assert held.nbytes() == two.param_bytes()   # its layers and the token embedding
    held.narrow(1, 2)
    assert sorted(held.layers) == [1] and not held.first_parts


def test_a_head_tied_to_a_kept_embedding_is_tied_again_not_copied(default_source):
    L = default_source.config().num_hidden_layers
    old = StageModel(default_source, 0, L, device="cpu", products=one_product())
    before = greedy([old], prompts=PROMPTS, new=4)
    new = StageModel(default_source, 0, L, device="cpu", reuse=old.hand_over(), products=one_product())
    assert new.kept_layers == L and new.kept_parts == ["model.embed_tokens", "model.norm"]
    assert new.model.lm_head.weight is new.model.model.embed_tokens.weight
    assert same(greedy([new], prompts=PROMPTS, new=4), before)


@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_quantized_layers_are_kept_as_they_are(tiny_folder, weights, caplog):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    old = StageModel(source, 0, L, dtype=torch.bfloat16, device="cpu", weights=weights)
    before = greedy([old])
    kept = StageModel(source, 0, L, dtype=torch.bfloat16, device="cpu", weights=weights, reuse=old.hand_over())
    fresh = StageModel(source, 0, L, dtype=torch.bfloat16, device="cpu", weights=weights)
    assert kept.kept_layers == L and kept.weights == fresh.weights
    after = greedy([kept])
    assert same(after, greedy([fresh])) and after[0] == before[0]
    assert "no linear modules" not in caplog.text   # nothing left to quantize is no news


def test_the_pieces_a_next_slice_lacks():
    from engine.model.handover import missing_pieces

    assert missing_pieces((10, 20), (12, 18)) == []            # shrinks: lacks nothing
    assert missing_pieces((15, 30), (10, 20)) == [(10, 15)]     # shifts down
    assert missing_pieces((10, 20), (5, 25)) == [(5, 10), (20, 25)]   # grows at both ends
    assert missing_pieces((0, 10), (10, 20)) == [(10, 20)]      # none of it
    assert missing_pieces(None, (3, 6)) == [(3, 6)]


def test_pieces_already_loaded_ahead_are_not_loaded_again():
    from torch import nn

    from engine.model.handover import HeldLayers, not_held

    held = HeldLayers({i: nn.Identity() for i in (5, 6, 9)}, ("fp",), None, 30)
    assert not_held([(3, 8), (9, 12)], held) == [(3, 5), (7, 8), (10, 12)]
    assert not_held([(5, 7)], held) == []
    assert not_held([(5, 7)], None) == [(5, 7)]


def test_layers_loaded_ahead_join_the_old_stages_only_when_built_alike():
    from torch import nn

    from engine.model.handover import HeldLayers

    built = ("fp", "float32", "bf16", "cpu")
    old = HeldLayers({3: nn.Linear(2, 2), 4: nn.Linear(2, 2)}, built, None, 6)
    ahead = HeldLayers({2: nn.Linear(2, 2)}, built, None, 6, last_parts={"lm_head": nn.Linear(2, 3)})
    assert HeldLayers.merged(None, ahead) is ahead
    merged = HeldLayers.merged(old, ahead)
    assert sorted(merged.layers) == [2, 3, 4] and list(merged.last_parts) == ["lm_head"]
    other = HeldLayers({5: nn.Linear(2, 2)}, ("fp", "float32", "nf4", "cpu"), None, 6)
    assert sorted(merged.merge(other).layers) == [2, 3, 4]   # another precision: let go
