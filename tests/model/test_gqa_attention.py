"""Grouped-query attention over several new tokens without copies of the keys
(engine/model/gqa_attention.py): the same outputs as transformers' SDPA path, keys read
as stored, and families that ask for SDPA by name left on it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.product_choice import ProductChoice
from engine.model.gqa_attention import FOLD_MAX_TOKENS, NAME, packed_gqa_attention
from engine.model.product_attention import set_products
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel


class AttentionCalls(TorchDispatchMode):
    """The (query heads, key heads, query length) of every attention kernel a step runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            q, k = args[0], args[1]
            self.calls.append((q.shape[1], k.shape[1], q.shape[2]))
        return func(*args, **(kwargs or {}))


class _Module:
    def __init__(self, n_rep):
        self.num_key_value_groups = n_rep
        self.is_causal = True


@pytest.mark.parametrize("n_rep, T", [(2, 2), (4, 5), (3, 9)])
def test_folded_query_heads_attend_as_copied_keys_do(n_rep, T):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(n_rep * 10 + T)
    B, KVH, L, D = 3, 2, 24, 8
    q = torch.randn(B, KVH * n_rep, T, D)
    k, v = torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    # rows at different positions, each with its own causal edge and masked padding keys
    pos = torch.tensor([[3], [10], [L - T]]) + torch.arange(T)
    allowed = torch.arange(L).view(1, 1, L) <= pos[:, :, None]
    mask = torch.zeros(B, 1, T, L).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    m = _Module(n_rep)
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=D ** -0.5)
    got, _ = packed_gqa_attention(m, q, k, v, mask, scaling=D ** -0.5)
    assert got.shape == want.shape == (B, T, KVH * n_rep, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _stage(folder, products, monkeypatch, packed: bool) -> StageModel:
    if not packed:
        monkeypatch.setenv("POTLUCK_PACKED_GQA", "0")
    source = resolve(str(folder))
    s = StageModel(source, 0, source.config().num_hidden_layers, device="cpu", products=products)
    monkeypatch.delenv("POTLUCK_PACKED_GQA", raising=False)
    # SDPA for decode steps too, whose calls this file counts (a CPU stage takes the two
    # products for them by default: tests/model/test_product_attention.py)
    set_products(s.model, None)
    return s


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_prompts_and_verification_steps_read_grouped_keys_as_stored(tiny_folder, monkeypatch, arch):
    folder, _ = tiny_folder(arch)
    rows = ProductChoice(fixed="rows")
    plain, packed = _stage(folder, rows, monkeypatch, False), _stage(folder, rows, monkeypatch, True)
    assert packed.packed_gqa and packed.model.config._attn_implementation == NAME
    assert not plain.packed_gqa and plain.model.config._attn_implementation == "sdpa"
    heads = packed.model.config.num_attention_heads
    kv_heads = packed.model.config.num_key_value_heads
    assert heads > kv_heads
    prompts = [[5, 9, 14, 3, 77, 8, 1, 60, 33, 2, 90, 41, 17], [4, 4, 150, 7, 19]]
    steps = [
        (StageBatch([0, 1], [0, 0], [len(p) for p in prompts]), [t for p in prompts for t in p]),
        # a verification step of 1 + 4 tokens a row, every position's logits kept
        (StageBatch([0, 1], [13, 5], [5, 5], keep=[5, 5]), [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]),
        (StageBatch([0, 1], [18, 10], [1, 1]), [20, 21]),
    ]
    for batch, ids in steps:
        want = plain.forward(batch, torch.tensor(ids))
        with AttentionCalls() as seen:
            got = packed.forward(batch, torch.tensor(ids))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # every kernel read the stored key heads; several tokens a row folded the query
        # heads into the length (transformers' own path did so for one token only)
        assert seen.calls and all(k == kv_heads for _, k, _ in seen.calls)
        T = max(batch.ns)
        assert all(q == kv_heads and n == heads // kv_heads * T for q, _, n in seen.calls)
    # a long prompt piece keeps transformers' path (compute, not reads, is its cost)
    long = list(range(3, 3 + FOLD_MAX_TOKENS + 8))
    batch = StageBatch([2], [0], [len(long)])
    want = plain.forward(batch, torch.tensor(long))
    with AttentionCalls() as seen:
        got = packed.forward(batch, torch.tensor(long))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seen.calls and all(k == heads for _, k, _ in seen.calls)


def test_a_family_that_asks_for_sdpa_by_name_keeps_it(tiny_folder):
    """Falcon takes its ALiBi path only when its attention is called "sdpa"."""
    folder, _ = tiny_folder("falcon_alibi")
    source = resolve(str(folder))
    s = StageModel(source, 0, source.config().num_hidden_layers, device="cpu")
    assert not s.packed_gqa and s.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("test, asks", [
    ('self.config._attn_implementation == "sdpa"', True),
    ('self.config._attn_implementation in ("eager", "sdpa")', True),
    ('self.config._attn_implementation in {"eager", "sdpa"}', True),
    ('self.config._attn_implementation == "eager"', False),
])
def test_a_modeling_module_that_names_sdpa_is_found_in_its_bytecode(monkeypatch, test, asks):
    """As the installed app's transformers has it: compiled, no source to read."""
    import sys
    import types

    from engine.model.gqa_attention import _asks_for_sdpa_by_name

    name = f"potluck_test_modeling_{abs(hash(test))}"
    module = types.ModuleType(name)
    code = f"class Attention:\n    def forward(self):\n        return {test}\n"
    exec(compile(code, "<modeling>", "exec"), module.__dict__)
    module.Attention.__module__ = name
    monkeypatch.setitem(sys.modules, name, module)
    assert _asks_for_sdpa_by_name(name) is asks


@pytest.mark.gpu
@pytest.mark.parametrize("n_rep, T, L", [(4, 5, 2048), (4, 9, 256), (8, 3, 1024)])
def test_a_gpu_folds_query_heads_on_its_memory_efficient_kernel(n_rep, T, L):
    """The kernel a GPU stage's masked step takes (engine/model/device.py attention_kernels
    allows flash, efficient and math): the folded call runs on the efficient one alone --
    no silent fall back to the math kernel -- and agrees with transformers' copied keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(n_rep + T)
    B, KVH, D = 2, 8, 128
    dev, dt = "cuda", torch.bfloat16
    # as a stage's step has them: q from a transposed projection, keys a slice of the store
    q = torch.randn(B, T, KVH * n_rep, D, device=dev, dtype=dt).transpose(1, 2)
    store = torch.randn(B + 2, KVH, L + 64, D, device=dev, dtype=dt)
    k, v = store[1:B + 1, :, :L], store[:B, :, :L]
    pos = torch.tensor([[L // 3], [L - T]], device=dev) + torch.arange(T, device=dev)
    allowed = torch.arange(L, device=dev).view(1, 1, L) <= pos[:, :, None]
    mask = torch.zeros(B, 1, T, L, device=dev, dtype=dt).masked_fill_(~allowed[:, None], torch.finfo(dt).min)
    m = _Module(n_rep)
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=D ** -0.5)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got, _ = packed_gqa_attention(m, q, k, v, mask, scaling=D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_default_models_stage_as_a_user_gets_it_folds_its_verification_steps(default_source, monkeypatch):
    """The default model (9 query heads over 3 key/value heads) with every setting left to
    its default, as `potluck chat` loads it: its speculation's verification steps read the
    stored key heads, with the logits of transformers' own path."""
    source = default_source
    L = source.config().num_hidden_layers
    stage = StageModel(source, 0, L)
    assert stage.packed_gqa and stage.model.config._attn_implementation == NAME
    monkeypatch.setenv("POTLUCK_PACKED_GQA", "0")
    plain = StageModel(source, 0, L, products=stage.products)
    ids = source.tokenizer()("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    n = len(ids)
    check = (StageBatch([0], [n], [5], keep=[5]), [11, 12, 13, 14, 15])
    for s in (stage, plain):
        s.forward(StageBatch([0], [0], [n]), torch.tensor(ids))
    want = plain.forward(check[0], torch.tensor(check[1]))
    with AttentionCalls() as seen:
        got = stage.forward(check[0], torch.tensor(check[1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kv = source.config().num_key_value_heads
    assert seen.calls and all(q == kv and k == kv for q, k, _ in seen.calls)
