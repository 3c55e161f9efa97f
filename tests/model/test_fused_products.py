"""Projections that read one input joined into one product on a GPU
(engine/model/fused_products.py): which groups join, one copy of their weights, the same
logits from fewer matrix products, and a module that feeds its projections different
inputs still right. Run on the CPU here (the joining itself is a GPU stage's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pytest

from engine.model.fused_products import fuse_products
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel

PROMPT = [5, 9, 14, 3, 77, 8, 1, 60]
PRODUCTS = {"mm", "addmm", "bmm", "linear"}


class CountProducts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in PRODUCTS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def plain_linears(model: nn.Module) -> None:
    """A CPU stage's Linears choose their own product (engine/model/cpu_linear.py); the
    GPU's are transformers' own, which is what joins."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = nn.Linear


def steps(s: StageModel) -> tuple[list[torch.Tensor], int]:
    """A prompt step, then two decode steps of two rows, their products counted."""
    out = [s.forward(StageBatch([0, 1], [0, 0], [len(PROMPT), 3]), torch.tensor(PROMPT + PROMPT[:3]))]
    with CountProducts() as c:
        for _ in range(2):
            ids = out[-1].argmax(-1)
            n0 = s.kv.seqs[0].length
            n1 = s.kv.seqs[1].length
            out.append(s.forward(StageBatch([0, 1], [n0, n1], [1, 1]), ids))
    s.free(0)
    s.free(1)
    return out, c.n


def storage_bytes(model: nn.Module) -> int:
    seen = {}
    for p in model.parameters():
        st = p.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("arch, groups", [("llama", 2), ("qwen2", 2), ("gemma3_text", 2), ("qwen3", 2),
                                          ("phi3", 0)])
def test_a_stage_with_joined_products_gives_the_same_logits_from_fewer_products(tiny_folder, arch, groups):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    plain = StageModel(source, 0, L, device="cpu")
    plain_linears(plain.model)
    want, n_plain = steps(plain)
    fused = StageModel(source, 0, L, device="cpu")
    plain_linears(fused.model)
    before = storage_bytes(fused.model)
    joined = fuse_products(fused.model)
    got, n_fused = steps(fused)
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # phi3's attention and MLP products are joined in its checkpoint already
    assert joined == groups * L, joined
    if groups:
        # per layer, each step: 5 products become 2
        assert n_plain - n_fused == 2 * 3 * L, (n_plain, n_fused)   # two steps
    else:
        assert n_fused == n_plain
    assert storage_bytes(fused.model) == before      # the members are views: no second copy
    assert fuse_products(fused.model) == joined      # again: nothing more, nothing wrapped twice


class Separate(nn.Module):
    """Projections named like a group but fed their own inputs (cross-attention's form)."""

    def __init__(self, h=16):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, 8), nn.Linear(h, 4), nn.Linear(h, 4)

    def forward(self, x, memory):
        return self.q_proj(x), self.k_proj(memory), self.v_proj(memory)


def test_projections_fed_other_inputs_give_their_own_products():
    torch.manual_seed(0)
    m = Separate()
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    want = m(x, memory)
    assert fuse_products(m) == 1
    for _ in range(3):   # and again: nothing left over from the call before
        for a, b in zip(m(x, memory), want):
            torch.testing.assert_close(a, b)
    # one input to all three: the joined product, the same values
    same = [p(x) for p in (m.q_proj, m.k_proj, m.v_proj)]
    m2 = Separate()
    m2.load_state_dict(m.state_dict())
    for a, p in zip(same, (m2.q_proj, m2.k_proj, m2.v_proj)):
        torch.testing.assert_close(a, p(x))


def test_a_call_stopped_half_way_leaves_the_next_one_joined():
    torch.manual_seed(0)
    m = Separate()
    ref = Separate()
    ref.load_state_dict(m.state_dict())
    fuse_products(m)
    m.q_proj(torch.randn(2, 16))                   # a step that raised after its first product
    x = torch.randn(2, 16)
    with CountProducts() as c:
        got = [p(x) for p in (m.q_proj, m.k_proj, m.v_proj)]
    assert c.n == 1                                # one joined product, not three
    for a, p in zip(got, (ref.q_proj, ref.k_proj, ref.v_proj)):
        torch.testing.assert_close(a, p(x))


def test_quantized_or_mixed_projections_stay_apart():
    m = Separate()
    m.k_proj = nn.Linear(16, 4, bias=False)   # a bias on some members, not all
    assert fuse_products(m) == 0
    m = Separate()
    m.v_proj = nn.Linear(16, 4).to(torch.float64)
    assert fuse_products(m) == 0


@pytest.mark.gpu
def test_a_gpu_stage_joins_its_products_and_keeps_its_logits(tmp_path, monkeypatch):
    from testkit.stage_pairs import off_and_on

    plain, fused = off_and_on(tmp_path, "POTLUCK_FUSED_PRODUCTS", monkeypatch)
    L = fused.end
    assert plain.fused_products == 0 and fused.fused_products == 2 * L
    got, _ = steps(fused)
    want, _ = steps(plain)
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-4)


def test_joined_products_over_the_fixed_buffer_decode_path(tiny_folder, monkeypatch):
    """The path a GPU replays as graphs (engine/model/static_decode.py), run eagerly here."""
    monkeypatch.setenv("POTLUCK_STATIC_DECODE", "1")
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    plain = StageModel(source, 0, L, device="cpu")
    fused = StageModel(source, 0, L, device="cpu")
    assert plain.static is not None
    for s in (plain, fused):
        plain_linears(s.model)
    assert fuse_products(fused.model) == 2 * L
    want, _ = steps(plain)
    got, _ = steps(fused)
    assert fused.static.steps == plain.static.steps == 2
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
