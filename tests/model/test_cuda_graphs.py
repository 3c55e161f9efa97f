"""Decode steps captured as graphs and replayed (engine/model/cuda_graphs.py, issue 42):
captured at load and on first use, replayed with the eager step's output, captured again
when the KV store grows, and a capture that fails leaves the step eager with its reason.

Every test runs twice over: here on the CPU through testkit/graph_tape.py, which replays
a captured step as a graph does (the same operators with the sizes and scalars of the
capture, over the memory of the capture, no Python), and on a real GPU (`pytest -m gpu`
on a lent machine). The first GPU run of this path found every replay out of bounds,
which no CPU test had seen, since nothing here replayed; the tape finds it (the padding
rows' scratch slot, made after the capture, past the store it was captured over).
"""

from __future__ import annotations

import pytest
import torch

from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel
from engine.model.static_decode import use_graphs
from testkit.graph_tape import TapeCuda
from testkit.tiny_models import ARCHS, STATIC_EAGER_ONLY

PROMPTS = [[5, 9, 14, 3, 77], [8, 1, 60, 33, 2, 90, 41, 17, 12, 6, 200], [4, 4, 150]]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """Tiny checkpoints without the default model's tokenizer (conftest's tiny_folder
    copies it): a lent GPU machine gets this file without the 98 MB model."""
    from testkit.tiny_models import build_tiny_model

    built = {}

    def get(arch: str):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            built[arch] = (root, build_tiny_model(arch, root))
        return built[arch]

    return get


class Where:
    """Stages on the CPU replaying through the tape, or on a GPU replaying CUDA graphs."""

    def __init__(self, kind: str, monkeypatch):
        self.kind, self.monkeypatch = kind, monkeypatch
        self.device = "cuda" if kind == "cuda" else "cpu"
        self.tol = 1e-3 if kind == "cuda" else 1e-4

    def stage(self, folder, graphs: bool, start: int = 0, end: int | None = None, dtype=torch.float32,
              **kw) -> StageModel:
        source = resolve(str(folder))
        end = end or source.config().num_hidden_layers
        # what a GPU stage does at load (POTLUCK_CUDA_GRAPHS=1), or does not
        self.monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "1" if graphs else "0")
        s = StageModel(source, start, end, dtype=dtype, device=self.device, **kw)
        if graphs and self.kind == "tape":
            use_graphs(s, TapeCuda())
        return s

    def same(self, got, want):
        for a, b in zip(got, want, strict=True):
            assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
            torch.testing.assert_close(a.cpu(), b.cpu(), atol=self.tol, rtol=self.tol)


@pytest.fixture(params=["tape", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request, monkeypatch):
    return Where(request.param, monkeypatch)


def decode(s: StageModel, steps: int, prompts=PROMPTS) -> list[torch.Tensor]:
    rows = list(range(len(prompts)))
    out = s.forward(StageBatch(rows, [0] * len(rows), [len(p) for p in prompts]),
                    torch.tensor([t for p in prompts for t in p]))
    got, pos = [out.cpu()], [len(p) for p in prompts]
    for _ in range(steps):
        out = s.forward(StageBatch(rows, list(pos), [1] * len(rows)), out.argmax(-1).cpu())
        got.append(out.cpu())
        pos = [p + 1 for p in pos]
    return got


MOE = ("qwen2_moe", "deepseek_v3")


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "gemma3_text", "deepseek_v3"])
def test_replayed_graphs_give_the_eager_steps_logits(where, tiny_folder, arch):
    """Three rows: a bucket of four, whose padding row writes the scratch slot (on the
    first H200 run a slot past the store that the graphs were captured over)."""
    folder, _ = tiny_folder(arch)
    eager = decode(where.stage(folder, False), 12)
    s = where.stage(folder, True)
    book = s.static.book
    if where.kind == "cuda" and arch in MOE and book.failed:
        # float32 experts on a GPU take transformers' grouped-product fallback, which copies
        # between the host and the device inside the step (the H200, transformers 5.23):
        # the capture fails, the stage captures nothing more, and its steps run eagerly
        # with the same logits
        assert book.captures == 0 and book.disabled, book.summary()
        where.same(decode(s, 12), eager)
        return
    assert book.captures == 14           # rows 1, 2, 4, 8, 16 at load, 1 row in any slot, its verifications in both
    where.same(decode(s, 12), eager)
    assert book.replays == 12 and book.captures == 14 and not book.failed, book.summary()


@pytest.mark.gpu
def test_bfloat16_graphs_replay_as_the_eager_bfloat16_steps(tiny_folder, monkeypatch):
    """What a GPU stage computes in: bfloat16 (the tests above compare float32 steps), where
    the attention's products and the memory-efficient kernel take paths of their own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    where = Where("cuda", monkeypatch)
    folder, _ = tiny_folder("llama")
    eager = decode(where.stage(folder, False, dtype=torch.bfloat16), 8)
    s = where.stage(folder, True, dtype=torch.bfloat16)
    got = decode(s, 8)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    assert s.static.book.replays == 8, s.static.book.summary()


def test_one_user_in_another_slot_replays_a_graph_captured_at_load(where, tiny_folder):
    """The next reply lands in slot 1 (the one before still being freed): a graph per
    first slot would be captured in the middle of that reply (an H200 window's one-user
    figure lost a tenth to such a capture); the one-row graph that gathers from any slot
    was captured at load."""
    folder, _ = tiny_folder("llama")
    s, eager = where.stage(folder, True), where.stage(folder, False)
    prompt = PROMPTS[0]

    def reply(stage) -> list[torch.Tensor]:
        stage.kv.open(0)                  # the reply before, not yet freed
        out = stage.forward(StageBatch([1], [0], [len(prompt)]), torch.tensor(prompt))
        got, pos = [out.cpu()], len(prompt)
        assert stage.kv.seqs[1].slot == 1
        for _ in range(6):
            out = stage.forward(StageBatch([1], [pos], [1]), out.argmax(-1).cpu())
            got.append(out.cpu())
            pos += 1
        return got

    where.same(reply(s), reply(eager))
    book = s.static.book
    assert book.captures == 14 and book.replays == 6 and not book.failed, book.summary()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in STATIC_EAGER_ONLY])
def test_every_family_replays_its_captured_steps_as_the_eager_ones(tiny_folder, monkeypatch, arch):
    """On the tape only (a GPU window has minutes): three rows, a bucket of four."""
    where = Where("tape", monkeypatch)
    folder, _ = tiny_folder(arch)
    eager = decode(where.stage(folder, False), 4)
    s = where.stage(folder, True)
    where.same(decode(s, 4), eager)
    assert s.static.book.replays == 4 and not s.static.book.failed, s.static.book.summary()


def test_a_profile_measured_on_graphs_then_a_chat_gives_the_eager_logits(where, tiny_folder):
    """A head measures its stage at load (engine/model/measure.py: 1, 2, 3, 4, 8 and 16 rows)
    before the first reply: what every graph worker of bench/gpu.py died in."""
    from engine.model.measure import measure

    folder, _ = tiny_folder("llama")
    eager = decode(where.stage(folder, False), 6)
    s = where.stage(folder, True)
    measure(s)
    assert s.static.book.replays > 0 and not s.kv.seqs
    where.same(decode(s, 6), eager)


def test_a_sequence_in_a_slot_past_the_store_is_captured_again_over_the_grown_one(where, tiny_folder):
    """A slot the store did not hold at capture (more sequences than the reserve): the
    store grows, the bucket is captured anew over it, and the logits stay the eager
    step's."""
    folder, _ = tiny_folder("llama")
    s, ref = where.stage(folder, True), where.stage(folder, False)
    slots = s.kv._k[0].shape[0]
    prompts = [[3 + i, 4, 5] for i in range(slots + 1)]   # one sequence more than slots
    rows = list(range(len(prompts)))
    for m in (s, ref):
        m.forward(StageBatch(rows, [0] * len(rows), [3] * len(rows)), torch.tensor([t for p in prompts for t in p]))
        for r in rows[:-1]:
            m.free(r)                                     # the last sequence keeps the slot past the store
    captures = s.static.book.captures
    for pos in (3, 4, 5):
        batch = StageBatch([rows[-1]], [pos], [1])
        where.same([s.forward(batch, torch.tensor([9]))], [ref.forward(batch, torch.tensor([9]))])
    assert s.kv.seqs[rows[-1]].slot >= slots and s.kv._k[0].shape[0] > slots
    assert s.static.book.captures == captures + 1 and s.static.book.replays == 2


def test_sixteen_users_and_the_replies_kept_beside_them_fit_the_store_of_the_load(where, tiny_folder):
    """Each reply kept for its follow-up (engine/core/kept_prefixes.py MOST) holds a slot
    on every stage: with a full bucket of users beside them, the store captured at load
    holds them all, and a step in the last of those slots replays a graph of the load
    (a store grown past its reserve would capture every graph in use again, mid-reply)."""
    from engine.core.kept_prefixes import MOST

    folder, _ = tiny_folder("llama")
    s, ref = where.stage(folder, True), where.stage(folder, False)
    n = 16 + MOST
    prompts = [[3 + i, 4, 5] for i in range(n)]
    rows = list(range(n))
    for m in (s, ref):
        m.forward(StageBatch(rows, [0] * n, [3] * n), torch.tensor([t for p in prompts for t in p]))
    slots, captures = s.kv._k[0].shape[0], s.static.book.captures
    assert max(s.kv.seqs[r].slot for r in rows) < slots
    for pos in (3, 4):
        batch = StageBatch([rows[-1]], [pos], [1])
        where.same([s.forward(batch, torch.tensor([9]))], [ref.forward(batch, torch.tensor([9]))])
    assert s.kv._k[0].shape[0] == slots and s.static.book.captures == captures, s.static.book.summary()


def test_a_kept_reply_taken_over_by_its_follow_up_replays_the_graphs_of_the_load(where, tiny_folder):
    """A chat's follow-up takes its kept reply over (engine/pipeline/kept_replies.py): the
    KV is cut back to where the two prompts part, the new tokens are a prompt step, and the
    reply replays the one-row graph captured at load, from slot 1 while another
    conversation's kept reply holds slot 0; no capture mid-reply, and the logits of the
    follow-up computed from scratch."""
    folder, _ = tiny_folder("llama")
    s = where.stage(folder, True)

    def greedy(stage, seq: int, start: int, ids: list[int], steps: int) -> list[torch.Tensor]:
        out = stage.forward(StageBatch([seq], [start], [len(ids)]), torch.tensor(ids))
        got, pos = [out.cpu()], start + len(ids)
        for _ in range(steps):
            out = stage.forward(StageBatch([seq], [pos], [1]), out.argmax(-1).cpu())
            got.append(out.cpu())
            pos += 1
        return got

    greedy(s, 0, 0, PROMPTS[1], 5)                          # a conversation, kept in slot 0
    first = greedy(s, 1, 0, PROMPTS[0], 6)                  # another, kept in slot 1
    reply = [int(o.argmax(-1)[-1]) for o in first]
    assert s.kv.length(1) == len(PROMPTS[0]) + 6 and s.kv.seqs[1].slot == 1
    # its follow-up: the prompt, the reply's first four tokens as the chat sent them back,
    # and a new message; the kept tokens past the fourth go
    follow = PROMPTS[0] + reply[:4] + [7, 8, 9]
    parts = len(PROMPTS[0]) + 4
    s.kv.truncate(1, parts)
    captured, replayed = s.static.book.captures, s.static.book.replays
    got = greedy(s, 1, parts, follow[parts:], 6)
    want = greedy(where.stage(folder, False), 5, 0, follow, 6)
    where.same(got[1:], want[1:])
    where.same(got[:1], [want[0][-1:]])                     # the new tokens' last position
    book = s.static.book
    assert book.captures == captured and book.replays == replayed + 6 and not book.failed, book.summary()


def test_one_users_verification_steps_of_every_k_replay_the_graphs_of_the_load(where, tiny_folder):
    """The speculation policy moves k with the acceptance: every k from 1 to 8 replays one
    of the four verification graphs captured at load (padded up to its bucket), with the
    eager step's logits, and none is captured in the middle of a reply."""
    folder, _ = tiny_folder("llama")
    outs = {}
    for graphs in (False, True):
        s = where.stage(folder, graphs)
        got = [s.forward(StageBatch([0], [0], [11]), torch.tensor(PROMPTS[1]))]
        pos = 11
        for k in (1, 3, 8, 2, 6, 4, 7, 5):
            got.append(s.forward(StageBatch([0], [pos], [1 + k], keep=[1 + k]), torch.arange(1 + k) + 3 * k))
            pos += 1 + k // 2                                 # half the draft stood
        outs[graphs] = got
        if graphs:
            book = s.static.book
            assert book.captures == 14 and book.replays == 8 and not book.failed, book.summary()
    where.same(outs[True], outs[False])


def test_one_user_whose_graphs_attend_over_more_keys_crosses_no_bucket_mid_reply(where, tiny_folder):
    """Few rows' floors (engine/core/graph_plan.py row_floors): a reply growing from 11 to
    111 tokens of context replays one graph, where buckets from 32 keys capture three,
    each in the middle of the reply; the logits are the eager step's either way."""
    from dataclasses import replace

    from engine.core.graph_plan import GraphPlan

    folder, _ = tiny_folder("llama")
    want = decode(where.stage(folder, False), 100, [PROMPTS[1]])
    for floors, captures in (((), 3), (((1, 128),), 1)):
        s = where.stage(folder, True)
        s.static.plan = replace(GraphPlan(min_kv=32, max_kv=256), floors=floors)
        s.static.runner.drop_all()
        before = s.static.book.captures
        where.same(decode(s, 100, [PROMPTS[1]]), want)
        book = s.static.book
        assert book.captures - before == captures and not book.failed, book.summary()


def test_a_verification_step_replays_and_rolls_back(where, tiny_folder):
    folder, _ = tiny_folder("llama")
    outs = {}
    for graphs in (False, True):
        s = where.stage(folder, graphs)
        got = [s.forward(StageBatch([0, 1], [0, 0], [5, 11]), torch.tensor(PROMPTS[0] + PROMPTS[1]))]
        for start in ((5, 11), (7, 13), (9, 15)):          # each keeps two of five
            got.append(s.forward(StageBatch([0, 1], list(start), [5, 5], keep=[5, 5]), torch.arange(10) + 20))
        outs[graphs] = got
        if graphs:
            assert s.static.book.replays == 2              # captured at the first, replayed after
    where.same(outs[True], outs[False])


def test_the_store_growing_recaptures_and_stays_right(where, tiny_folder):
    from engine.core.graph_plan import GraphPlan

    folder, _ = tiny_folder("llama")
    s = where.stage(folder, True)
    s.static.plan, s.static.reserve = GraphPlan(min_kv=64), (0, 0)   # small buckets, a store that grows
    s.kv.keep_storage = False                          # and none yet: the load's given back
    s.kv.open(-1), s.free(-1)
    s.kv.keep_storage = True
    long = [list(range(2, 122))]                       # 120 tokens: decoding crosses 128 keys
    where.same(decode(s, 12, long), decode(where.stage(folder, False), 12, long))
    # 128 keys, then 256: the store grew past the first, whose graph went with the old store
    assert [shape.kv_len for shape in s.static.book.live] == [256] and s.static.book.captures == 14 + 2


def test_graphs_captured_again_after_all_were_dropped_while_their_memory_lives(where, tiny_folder):
    """Every graph dropped (the store grew) while a tensor of their pool lives on: the next
    captures go to a pool of their own (into the old one, torch's allocator asserted)."""
    folder, _ = tiny_folder("llama")
    s = where.stage(folder, True)
    runner = s.static.runner
    kept = [out for _, out, _ in runner.graphs.values()]      # blocks of the old pool, alive
    old_pool = runner.pool
    runner.drop_all()
    where.same(decode(s, 6), decode(where.stage(folder, False), 6))
    book = s.static.book
    assert kept and runner.pool is not old_pool and book.captures > 14 and not book.failed, book.summary()


def test_a_stage_that_is_not_first_replays_its_hidden_states(where, tiny_folder):
    """A middle stage: its inputs are hidden states, its graphs read them from the buffers."""
    folder, _ = tiny_folder("qwen2")
    rows = list(range(len(PROMPTS)))
    outs = {}
    for graphs in (False, True):
        s = where.stage(folder, graphs, 2, 4)
        torch.manual_seed(0)
        got = [s.forward(StageBatch(rows, [0] * 3, [len(p) for p in PROMPTS]), torch.randn(19, 64))]
        for i in range(6):
            got.append(s.forward(StageBatch(rows, [len(p) + i for p in PROMPTS], [1] * 3), torch.randn(3, 64)))
        outs[graphs] = got
        if graphs:
            assert s.static.book.replays == 6
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=where.tol, rtol=where.tol)


def test_a_padding_slot_made_after_the_capture_grows_the_store_before_the_replay(where, tiny_folder):
    """The store a graph replays over must hold every slot the step's rows write, or the
    replay writes out of bounds (a GPU asserts, and its context is lost). Here the padding
    rows' slot is made anew after the load's captures, past the store."""
    folder, _ = tiny_folder("llama")
    s, ref = where.stage(folder, True), where.stage(folder, False)
    slots = s.kv._k[0].shape[0]
    # every slot of the store given out (the load reserves more than its captures open),
    # so the next padding slot is one past it
    s.kv._scratch, s.kv._n_slots = None, slots
    where.same(decode(s, 4), decode(ref, 4))
    assert s.kv.scratch_slot() == slots and s.kv._k[0].shape[0] > slots


def test_a_random_evening_of_steps_replays_as_the_eager_steps(where, tiny_folder):
    """Sequences come and go, rows of 1 to 9 in a step, verification steps and their
    rollback, the store growing as they come: every step's logits are the eager stage's,
    and steps replayed (the rest captured their bucket, or ran eagerly: prompts)."""
    import random

    folder, _ = tiny_folder("llama")
    rng = random.Random(7)
    s, ref = where.stage(folder, True), where.stage(folder, False)
    live: dict[int, int] = {}           # seq -> cached length
    next_id, steps = 0, 0
    for _ in range(60):
        if len(live) < 2 or (rng.random() < 0.25 and len(live) < 9):
            n = rng.choice([3, 17, 40, 120])
            batch = StageBatch([next_id], [0], [n])
            x = torch.tensor([rng.randrange(2, 250) for _ in range(n)])
            live[next_id] = n
            next_id += 1
        elif rng.random() < 0.15:
            gone = rng.choice(sorted(live))
            s.free(gone), ref.free(gone)
            del live[gone]
            continue
        else:
            rows = sorted(rng.sample(sorted(live), rng.randint(1, len(live))))
            k = rng.choice([1, 1, 1, 3])                    # now and then a draft of 2 verified
            batch = StageBatch(rows, [live[r] for r in rows], [k] * len(rows), keep=None if k == 1 else [k] * len(rows))
            x = torch.tensor([rng.randrange(2, 250) for _ in range(k * len(rows))])
            for r in rows:
                live[r] += 1 if k == 1 else rng.randint(1, k)   # how much of a draft was kept
            steps += 1
        torch.testing.assert_close(s.forward(batch, x).cpu(), ref.forward(batch, x).cpu(), atol=where.tol,
                                   rtol=where.tol)
    book = s.static.book
    assert book.replays >= steps // 4 and not book.failed, book.summary()


def test_graphs_captured_at_load_run_the_kernels_a_served_step_runs(tiny_folder, monkeypatch):
    """Captured at load outside the steps' inference mode, an nf4 stage's graphs recorded
    bitsandbytes' autograd path (dequantize the whole weight, then multiply) that no served
    step takes, so the bench's 4-bit rows timed the wrong kernel; and the KV store came out
    of the capture with autograd history."""
    import bitsandbytes.autograd._functions as bnb_functions

    calls = []
    real = bnb_functions.MatMul4Bit.apply
    monkeypatch.setattr(bnb_functions.MatMul4Bit, "apply", lambda *a: calls.append(1) or real(*a))
    folder, _ = tiny_folder("llama")
    s = Where("tape", monkeypatch).stage(folder, True, weights="nf4")
    assert s.static.book.captures == 14 and not s.static.book.failed, s.static.book.summary()
    assert calls == []
    for t in [*s.kv._k.values(), *s.kv._v.values()]:
        assert not t.requires_grad and t.grad_fn is None


def test_int8_stages_keep_their_eager_step_and_say_why(tiny_folder, monkeypatch):
    """LLM.int8 finds each step's outlier columns on the host and sizes its products by
    their count: a graph captured over one step's count replays another's out of bounds
    (the tape caught it as a size mismatch; on a GPU a capture failing half-way can leave
    the context unusable for what follows)."""
    from engine.model.static_decode import StaticDecoder, unsupported

    folder, _ = tiny_folder("llama")
    s = Where("tape", monkeypatch).stage(folder, False, weights="int8")
    assert "int8" in (unsupported(s) or "")
    with pytest.raises(ValueError, match="int8"):
        StaticDecoder(s)
    assert unsupported(Where("tape", monkeypatch).stage(folder, False, weights="nf4")) is None


@pytest.mark.gpu
def test_capture_at_load_is_cheap(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    s = Where("cuda", monkeypatch).stage(folder, True, dtype=torch.bfloat16)
    summary = s.static.book.summary()
    # what the tape runs capture at load too: rows 1, 2, 4, 8, 16, 1 row in any slot, its
    # verifications in both
    assert summary["captures"] == len(s.static.plan.warm_shapes(16)) == 14 and summary["capture_s"] < 30, summary


@pytest.mark.gpu
def test_activations_leave_through_pinned_memory_with_the_same_bytes():
    from engine.model.device import HostStaging
    from engine.wire import frames

    staging = HostStaging()
    for shape in ((1, 4096), (16, 4096), (300, 4096)):     # the buffer grows for a prompt's
        t = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        meta = {"rows": [[0, 0, shape[0]]]}
        pinned = frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, meta, t, to_host=staging)
        assert pinned == frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, meta, t)
    assert staging._local.buf.is_pinned()


def test_a_stage_built_on_kept_layers_captures_its_graphs_again_and_frees_the_old_ones(where, tiny_folder):
    """A rearrangement (engine/model/handover.py): the new stage replays graphs of its own
    over the kept layers, with the eager step's logits, and the old stage's graphs and
    cache go with it."""
    import gc
    import weakref

    folder, _ = tiny_folder("llama")
    eager = decode(where.stage(folder, False), 8)
    old = where.stage(folder, True)
    decode(old, 8)
    new = where.stage(folder, True, reuse=old.hand_over())
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None and new.kept_layers == new.end
    assert new.static is not None and new.static.book.captures > 0
    where.same(decode(new, 8), eager)


@pytest.mark.gpu
def test_layers_loaded_beside_a_stage_replaying_graphs_leave_its_steps_unchanged(tiny_folder, monkeypatch):
    """A stage serving on a GPU while the layers its next share lacks load on another thread
    (engine/pipeline/load_ahead.py): its replayed steps give the eager outputs throughout,
    and a stage built on its layers and those gives the eager logits too."""
    import threading

    from engine.pipeline.configure_check import check_configure
    from engine.pipeline.load_ahead import build_beside

    def fixed_steps(s: StageModel, steps: int = 8) -> list[torch.Tensor]:
        """A first stage that is not the last: its hidden states for fixed tokens."""
        rows = list(range(len(PROMPTS)))
        got = [s.forward(StageBatch(rows, [0] * len(rows), [len(p) for p in PROMPTS]),
                         torch.tensor([t for p in PROMPTS for t in p])).cpu()]
        pos = [len(p) for p in PROMPTS]
        for i in range(steps):
            got.append(s.forward(StageBatch(rows, list(pos), [1] * len(rows)),
                                 torch.tensor([7 + i] * len(rows))).cpu())
            pos = [p + 1 for p in pos]
        for r in rows:
            s.free(r)
        return got

    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "0")
    eager_half = fixed_steps(StageModel(source, 0, L - 2, device="cuda"))
    eager = decode(StageModel(source, 0, L, device="cuda"), 8)
    monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "1")
    serving = StageModel(source, 0, L - 2, device="cuda", weights="bf16")   # as a head asks
    msg = dict(model=str(folder), start=0, end=L, fingerprint=None, dtype="float32", weights="bf16")
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(extra=build_beside(
        check_configure(msg, True, (), None), msg, serving, "cuda", None, None)))
    loader.start()
    during = [fixed_steps(serving) for _ in range(3)]
    loader.join()
    for run in during:
        for a, b in zip(run, eager_half):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert sorted(loaded["extra"].layers) == [L - 2, L - 1] and loaded["extra"].last_parts
    new = StageModel(source, 0, L, device="cuda", weights="bf16", reuse=serving.hand_over().merge(loaded["extra"]))
    assert new.kept_layers == L
    for a, b in zip(decode(new, 8), eager):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


# last: on a GPU, a capture that failed is the one thing here that may leave the CUDA
# context unusable, and every test after it in the process would fail with it
def test_a_host_read_in_the_step_fails_its_capture_and_the_step_runs_eagerly(where, tiny_folder, caplog):
    folder, _ = tiny_folder("llama")
    ref = decode(where.stage(folder, False), 3)
    s = where.stage(folder, True)
    s.static.runner.drop_all()
    run = s.static._run

    def syncing(*a):                                   # a host read inside the step
        out = run(*a)
        out.sum().item()
        return out

    s.static._run = syncing
    where.same(decode(s, 3), ref)
    book = s.static.book
    assert book.failed and "runs without a CUDA graph" in caplog.text
    # refused in the warm-up, before any capture began: the stage may go on capturing
    assert all("reads a device value on the host" in r for r in book.failed.values()), book.summary()
    assert book.disabled is None or "captures failed" in book.disabled


def test_a_step_being_warmed_up_or_captured_never_parks_at_the_step_gate(where, tiny_folder):
    """Parked at the gate while it held the one capture lock, a step waited for the decode
    step that cut in, which waited for the lock to capture its own shape (decode-first)."""
    from engine.model.cuda_graphs import capturing

    folder, _ = tiny_folder("llama")
    s = where.stage(folder, True)
    s.static.runner.drop_all()
    run, seen, asked = s.static._run, [], []

    def watched(*a):
        seen.append(capturing())
        return run(*a)

    s.static._run = watched
    checkpoint = s.gate.checkpoint
    s.gate.checkpoint = lambda: asked.append(capturing()) or checkpoint()
    decode(s, 2)
    assert seen and all(seen)                      # captured again (a replay runs no Python)
    assert asked and not any(asked)                # the gate was asked, never mid-capture


def test_indexing_by_a_boolean_mask_is_a_host_read():
    from engine.model.cuda_graphs import HostRead, HostReadWatch

    x = torch.arange(8.0)
    with HostReadWatch():
        x[torch.tensor([1, 3])] = 0.0               # by positions: sized by the index's shape
        with pytest.raises(HostRead, match="boolean mask"):
            x[x > 2]
        with pytest.raises(HostRead, match="boolean mask"):
            x[x > 2] = 1.0
        with pytest.raises(HostRead, match="on the host"):
            torch.bincount(torch.tensor([0, 1, 1]))
        with pytest.raises(HostRead, match="no range"):
            torch.histc(x, bins=4)
        torch.histc(x, bins=4, min=0, max=7)         # a range: no read (experts count tokens so)


def test_a_host_index_handed_to_a_device_tensor_is_a_host_read():
    """An index kept on the host, used on a GPU tensor, is copied across inside the
    operator: a capture fails half-way through it. The watch refuses it before any
    capture begins. ("meta" stands in for a device here; a host scalar is all right.)"""
    from engine.model.cuda_graphs import HostRead, HostReadWatch

    x = torch.zeros(8, device="meta")
    with HostReadWatch():
        x * torch.tensor(2.0)                        # a host scalar: passed by value
        x[torch.tensor([1, 3], device="meta")]       # an index on the device
        with pytest.raises(HostRead, match="host tensor"):
            x[torch.tensor([1, 3])]
        with pytest.raises(HostRead, match="host tensor"):
            x.index_select(0, torch.tensor([1, 3]))
