"""Decode steps as CUDA graphs on a real GPU (engine/model/cuda_graphs.py): captured at
load and on first use, replayed with the eager step's output, recaptured when the KV
store grows, and a capture that fails leaves the step eager with its reason. Skipped
without a GPU (`pytest -m gpu` on a lent machine runs them)."""

from __future__ import annotations

import pytest
import torch

from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel

pytestmark = pytest.mark.gpu

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


def stage(folder, graphs: bool, monkeypatch, dtype=torch.float32) -> StageModel:
    monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "1" if graphs else "0")
    source = resolve(str(folder))
    return StageModel(source, 0, source.config().num_hidden_layers, dtype=dtype, device="cuda")


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


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "gemma3_text", "deepseek_v3"])
def test_replayed_graphs_give_the_eager_steps_logits(tiny_folder, monkeypatch, arch):
    folder, _ = tiny_folder(arch)
    eager = decode(stage(folder, False, monkeypatch), 12)
    s = stage(folder, True, monkeypatch)
    assert s.static is not None and s.static.runner is not None
    warm = s.static.book.captures
    assert warm == 5                                   # rows 1, 2, 4, 8, 16 at load
    got = decode(s, 12)
    for a, b in zip(got, eager):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    book = s.static.book
    assert book.replays >= 11 and book.disabled is None and not book.failed, book.summary()
    assert s.static.steps == 12


def test_a_verification_step_replays_and_rolls_back(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    outs = {}
    for graphs in (False, True):
        s = stage(folder, graphs, monkeypatch)
        got = [s.forward(StageBatch([0, 1], [0, 0], [5, 11]), torch.tensor(PROMPTS[0] + PROMPTS[1]))]
        for start in ((5, 11), (7, 13), (9, 15)):          # each keeps two of five
            got.append(s.forward(StageBatch([0, 1], list(start), [5, 5], keep=[5, 5]), torch.arange(10) + 20))
        outs[graphs] = [g.cpu() for g in got]
        if graphs:
            assert s.static.book.replays >= 2
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_the_store_growing_recaptures_and_stays_right(tiny_folder, monkeypatch):
    from engine.core.graph_plan import GraphPlan

    folder, _ = tiny_folder("llama")
    s = stage(folder, True, monkeypatch)
    s.static.plan, s.static.reserve = GraphPlan(min_kv=64), (0, 0)   # small buckets, a store that grows
    s.static.runner.drop_all()
    ref = stage(folder, False, monkeypatch)
    long = [list(range(2, 122))]                       # 120 tokens: decoding crosses 128 keys
    got, want = decode(s, 12, long), decode(ref, 12, long)
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert [shape.kv_len for shape in s.static.book.live] == [256]
    assert s.static.book.captures >= 5 + 2            # the load's, then 128 keys, then 256 after growing


def test_a_capture_that_fails_leaves_the_step_eager_and_says_why(tiny_folder, monkeypatch, caplog):
    folder, _ = tiny_folder("llama")
    ref = decode(stage(folder, False, monkeypatch), 3)
    monkeypatch.setenv("POTLUCK_CUDA_GRAPHS", "1")
    s = stage(folder, True, monkeypatch)
    s.static.runner.drop_all()
    run = s.static._run

    def syncing(*a):                                   # a host read inside the step: not capturable
        out = run(*a)
        out.sum().item()
        return out

    s.static._run = syncing
    got = decode(s, 3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    book = s.static.book
    assert book.failed and "runs without a CUDA graph" in caplog.text


def test_capture_at_load_is_cheap(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    s = stage(folder, True, monkeypatch, dtype=torch.bfloat16)
    summary = s.static.book.summary()
    assert summary["captures"] == 5 and summary["capture_s"] < 30, summary


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


def test_a_stage_built_on_kept_layers_captures_its_graphs_again_and_frees_the_old_ones(tiny_folder, monkeypatch):
    """A rearrangement on a GPU (engine/model/handover.py): the new stage replays graphs
    of its own over the kept layers, with the eager step's logits, and the old stage's
    graphs and cache go with it."""
    import gc
    import weakref

    folder, _ = tiny_folder("llama")
    eager = decode(stage(folder, False, monkeypatch), 8)
    old = stage(folder, True, monkeypatch)
    decode(old, 8)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    new = StageModel(source, 0, L, device="cuda", reuse=old.hand_over())
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None and new.kept_layers == L
    assert new.static is not None and new.static.book.captures > 0
    for a, b in zip(decode(new, 8), eager):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


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
