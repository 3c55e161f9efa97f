"""Rotary embeddings in three kernels on a GPU (engine/model/fused_rotary.py): which
families switch, decided by what their function computes; a stage that gives the same
logits with fewer operators a step, for every family; transformers' module untouched.
Run on the CPU here (the switch itself is a GPU stage's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pytest

from engine.core.product_choice import ProductChoice
from engine.model.fused_products import fuse_products
from engine.model.fused_rotary import FusedRotary, agrees, fuse_rotary, joined
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel
from testkit.tiny_models import ARCHS

PROMPT = [5, 9, 14, 3, 77, 8, 1, 60]
VIEWS = {"view", "_unsafe_view", "slice", "select", "transpose", "t", "unsqueeze", "reshape", "alias",
         "as_strided", "expand", "detach", "lift_fresh"}


class Kernels(TorchDispatchMode):
    """Operators that compute (views, which launch nothing, left out)."""

    def __init__(self):
        super().__init__()
        self.n = self.bmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.n += 1
        self.bmm += func.overloadpacket.__name__ == "bmm"
        return func(*args, **(kwargs or {}))


def stage(source, rotary: bool, joined_products: bool = False) -> StageModel:
    # one matrix product for both (each stage would otherwise time its own choice:
    # engine/model/cpu_linear.py), and transformers' Linears where they are joined
    s = StageModel(source, 0, source.config().num_hidden_layers, device="cpu",
                   products=ProductChoice(fixed="rows"))
    if joined_products:
        for m in s.model.modules():
            if isinstance(m, nn.Linear):
                m.__class__ = nn.Linear
        fuse_products(s.model)
    s.switched = fuse_rotary(s.model) if rotary else 0
    return s


def steps(s: StageModel) -> tuple[list[torch.Tensor], int, int]:
    """A prompt step, a decode step and a 1 + 4 token verification step; the operators of
    the last two counted."""
    n = len(PROMPT)
    out = [s.forward(StageBatch([0], [0], [n]), torch.tensor(PROMPT))]
    with Kernels() as d:
        out.append(s.forward(StageBatch([0], [n], [1]), out[-1].argmax(-1)))
    with Kernels() as v:
        out.append(s.forward(StageBatch([0], [n + 1], [5], keep=[5]), torch.tensor(PROMPT[:5])))
    s.free(0)
    return out, d.n, v.n


def same(got, want):
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_gives_the_same_logits_with_its_rotary_switched_or_kept(tiny_folder, arch):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    want, _, _ = steps(stage(source, rotary=False))
    fused = stage(source, rotary=True)
    got, _, _ = steps(fused)
    same(got, want)
    assert fuse_rotary(fused.model) == fused.switched   # again: nothing more, nothing wrapped twice


@pytest.mark.parametrize("arch, switched, saved", [
    ("llama", True, 4),          # q and k apart: 5 operators each become 3
    ("qwen3", True, 4),          # (q and k normed per head first: apart)
    ("gemma3_text", True, 4),
    ("cohere", False, 0),        # interleaved halves: its own function kept
    ("glm", False, 0),
    ("gpt_neox", True, 0),       # partial rotary: switched, every call handed to its own function
])
def test_a_stage_saves_rotary_operators_where_its_family_agrees(tiny_folder, arch, switched, saved):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    _, d_plain, v_plain = steps(stage(source, rotary=False))
    fused = stage(source, rotary=True)
    _, d_fused, v_fused = steps(fused)
    assert fused.switched == (L if switched else 0)
    assert d_plain - d_fused == saved * L, (d_plain, d_fused)
    assert v_plain - v_fused == saved * L, (v_plain, v_fused)


def test_q_and_k_from_one_product_are_rotated_as_one(tiny_folder):
    """q/k/v joined (a GPU stage's default): 10 operators a layer become 3."""
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    want, d_plain, v_plain = steps(stage(source, rotary=False, joined_products=True))
    got, d_fused, v_fused = steps(stage(source, rotary=True, joined_products=True))
    same(got, want)
    assert d_plain - d_fused == 7 * L and v_plain - v_fused == 7 * L, (d_plain, d_fused, v_plain, v_fused)


def test_the_fixed_buffer_decode_path_rotates_as_one_too(tiny_folder, monkeypatch):
    """The path a GPU replays as graphs (engine/model/static_decode.py), run eagerly here."""
    monkeypatch.setenv("POTLUCK_STATIC_DECODE", "1")
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    plain = stage(source, rotary=False, joined_products=True)
    fused = stage(source, rotary=True, joined_products=True)
    want, d_plain, v_plain = steps(plain)
    got, d_fused, v_fused = steps(fused)
    assert plain.static is not None and fused.static.steps == plain.static.steps == 2
    same(got, want)
    assert d_plain - d_fused == 7 * L and v_plain - v_fused == 7 * L


def test_transformers_module_and_other_models_keep_their_function(tiny_folder):
    import transformers.models.llama.modeling_llama as ml

    theirs = ml.apply_rotary_pos_emb
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    fused = stage(source, rotary=True)
    assert fused.switched > 0
    assert ml.apply_rotary_pos_emb is theirs
    for m in fused.model.modules():
        if "forward" in m.__dict__ and type(m).__name__ == "LlamaAttention":
            assert isinstance(m.forward.__func__.__globals__["apply_rotary_pos_emb"], FusedRotary)
    _, d_plain, _ = steps(stage(source, rotary=False))
    _, d_again, _ = steps(stage(source, rotary=False))
    assert d_plain == d_again                  # a model built after it computes as before


def half_split(q, k, cos, sin, unsqueeze_dim=1):   # Llama's form
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GLM's and Cohere's form
    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def wrong_sign(q, k, cos, sin, unsqueeze_dim=1):
    return half_split(q, k, cos, -sin, unsqueeze_dim)


def needs_positions(q, k, cos, sin, position_ids):
    return half_split(q, k, cos[position_ids], sin[position_ids])


def test_only_a_function_that_computes_the_half_split_rotation_is_replaced():
    assert agrees(half_split)
    for fn in (interleaved, wrong_sign, needs_positions):
        assert not agrees(fn), fn.__name__


class Spy:
    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, *args, **kwargs):
        self.calls += 1
        return q, k


def test_a_call_it_was_not_checked_in_goes_to_the_family_function():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    spy = Spy()
    rot = FusedRotary(spy)
    for a, b in zip(rot(q, k, cos, sin), half_split(q, k, cos, sin)):
        torch.testing.assert_close(a, b)
    assert spy.calls == 0
    # [B, T, H, D] with unsqueeze_dim=2: still ours
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    for a, b in zip(rot(qt, kt, cos, sin, unsqueeze_dim=2), half_split(qt, kt, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(a, b)
    assert spy.calls == 0
    rot(q, k, cos[..., :4], sin[..., :4])                       # partial rotary
    rot(q, k, cos.double(), sin.double())                       # mixed dtypes
    rot(q, k, cos, sin, 1)                                      # positional extras
    assert spy.calls == 3


def test_neighbouring_slices_of_one_product_are_seen_as_one_tensor():
    B, T, H, K, D = 2, 3, 4, 2, 8
    for b, t, kh in ((B, T, K), (1, 1, K), (B, 1, 1)):          # one position, one key head (MQA)
        qkv = torch.randn(b, t, (H + 2 * kh) * D)
        q = qkv[..., :H * D].view(b, t, H, D).transpose(1, 2)
        k = qkv[..., H * D:(H + kh) * D].view(b, t, kh, D).transpose(1, 2)
        v = qkv[..., (H + kh) * D:].view(b, t, kh, D).transpose(1, 2)
        qk = joined(q, k)
        assert qk is not None and qk.shape == (b, H + kh, t, D)
        assert torch.equal(qk[:, :H], q) and torch.equal(qk[:, H:], k)
        assert joined(q, v) is None                              # not neighbours
        assert joined(q.clone(), k.clone()) is None              # separate tensors


@pytest.mark.gpu
def test_a_gpu_stage_fuses_its_rotary_and_keeps_its_logits(tmp_path, monkeypatch):
    from testkit.stage_pairs import off_and_on

    plain, fused = off_and_on(tmp_path, "POTLUCK_FUSED_ROTARY", monkeypatch)
    assert plain.fused_rotary == 0 and fused.fused_rotary == fused.end
    assert fused.fused_products > 0                 # q and k from one product: rotated as one
    want, d_plain, v_plain = steps(plain)
    got, d_fused, v_fused = steps(fused)
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-4)   # (float32 stages)
    assert d_plain - d_fused == 7 * fused.end and v_plain - v_fused == 7 * fused.end


def test_the_default_models_stage_as_a_user_gets_it_with_a_gpus_switches(default_source):
    """The default model's stage with every setting at its default, as `potluck chat` loads
    it, given by hand what a GPU stage takes by itself: the fused rotary and the decode
    attention as two products. The same greedy tokens and logits as without them."""
    from engine.model.product_attention import set_products

    source = default_source
    L = source.config().num_hidden_layers
    plain = StageModel(source, 0, L)
    set_products(plain.model, None)   # SDPA (a CPU stage takes the products by default)
    s = StageModel(source, 0, L, products=plain.products)
    assert fuse_rotary(s.model) == L
    set_products(s.model, {1: 1})
    ids = source.tokenizer()("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    n = len(ids)
    outs = []
    for stage_ in (plain, s):
        out = [stage_.forward(StageBatch([0], [0], [n]), torch.tensor(ids))]
        with Kernels() as c:
            out.append(stage_.forward(StageBatch([0], [n], [1]), out[0][-1:].argmax(-1)))
        out.append(stage_.forward(StageBatch([0], [n + 1], [5], keep=[5]), torch.tensor([11, 12, 13, 14, 15])))
        outs.append((out, c.bmm))
    (want, bmm_plain), (got, bmm_fused) = outs
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        # 30 layers of sums in another order: float32's rounding, a few 1e-5 of logits near 20
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert bmm_plain == 0 and bmm_fused == 2 * L     # the decode step took the two products
