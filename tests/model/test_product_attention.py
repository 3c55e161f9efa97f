"""A decode step's attention as two batched products (engine/model/product_attention.py)
and the choice of it by timings (engine/core/attention_choice.py): the same output as
SDPA on grouped and plain heads, masks and strided caches; a stage that takes it gives the
same logits; the choice taken only where the products were faster from there on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pytest

from engine.core.attention_choice import chosen_seconds, products_from
from engine.core.product_choice import ProductChoice
from engine.model.product_attention import ATTR, agrees, product_attention, set_products
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel

PROMPT = [5, 9, 14, 3, 77, 8, 1, 60, 12, 40, 41, 7, 90, 91, 92, 93, 94, 95, 96, 97]


def reference(q, k, v, mask, scale):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("rows, tokens", [(1, 1), (3, 1), (2, 5)])
def test_the_products_give_sdpas_attention(heads, kv_heads, rows, tokens):
    g = torch.Generator().manual_seed(rows * 10 + tokens)
    D, L, cap = 16, 40, 64
    q = torch.randn(rows, heads, tokens, D, generator=g)
    # keys as a graph reads them: the first L of each slot of a larger store
    store_k = torch.randn(rows + 1, kv_heads, cap, D, generator=g)
    store_v = torch.randn(rows + 1, kv_heads, cap, D, generator=g)
    k, v = store_k[:rows, :, :L], store_v[:rows, :, :L]
    lengths = torch.randint(tokens, L + 1, (rows,), generator=g)
    pos = lengths.view(rows, 1) - tokens + torch.arange(tokens)            # each new token's position
    allowed = torch.arange(L).view(1, 1, L) <= pos.view(rows, tokens, 1)   # causal, each row its length
    mask = torch.zeros(rows, 1, tokens, L).masked_fill_(~allowed.unsqueeze(1), torch.finfo(torch.float32).min)
    want = reference(q, k, v, mask, 0.25)
    got = product_attention(q, k, v, mask, 0.25)
    assert got.shape == (rows, tokens, heads, D) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert agrees(q, k, v, mask, 0.25, want)
    assert not agrees(q, k, v, mask, 0.25, want + 0.01)
    # a head mapping read wrong (query head h on key/value head h % KVH, not h // n_rep)
    if heads != kv_heads:
        wrong = reference(q, k.repeat(1, heads // kv_heads, 1, 1), v.repeat(1, heads // kv_heads, 1, 1), mask, 0.25)
        assert not agrees(q, k, v, mask, 0.25, wrong)


def test_products_are_taken_from_where_they_stay_faster():
    timed = {(1, 256): (10e-6, 12e-6), (1, 512): (16e-6, 13e-6), (1, 1024): (30e-6, 14e-6),
             (2, 256): (10e-6, 9.5e-6), (2, 512): (12e-6, 11.5e-6),          # within the margin: SDPA
             (4, 256): (9e-6, 5e-6), (4, 512): (10e-6, 11e-6)}               # faster, then not: SDPA
    table = products_from(timed)
    assert table == {1: 512}
    assert chosen_seconds(timed, table, 1, 1024) == 14e-6 and chosen_seconds(timed, table, 1, 256) == 10e-6
    assert chosen_seconds(timed, table, 4, 256) == 9e-6
    assert products_from({}) == {}


class Bmm(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ == "bmm"
        return func(*args, **(kwargs or {}))


def steps(s: StageModel) -> tuple[list[torch.Tensor], int]:
    """A prompt (SDPA: more tokens than a decode step's), a decode step of two rows and a
    1 + 4 verification step; the batched products the last two ran, counted."""
    n = len(PROMPT)
    out = [s.forward(StageBatch([0, 1], [0, 0], [n, 9]), torch.tensor(PROMPT + PROMPT[:9]))]
    with Bmm() as c:
        out.append(s.forward(StageBatch([0, 1], [n, 9], [1, 1]), out[-1].argmax(-1)))
        out.append(s.forward(StageBatch([0], [n + 1], [5], keep=[5]), torch.tensor(PROMPT[:5])))
    s.free(0)
    s.free(1)
    return out, c.n


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "mistral", "phi3"])
def test_a_stage_that_takes_the_products_gives_the_same_logits(tiny_folder, arch, monkeypatch):
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    build = lambda: StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
    sdpa = build()
    set_products(sdpa.model, None)   # a CPU stage takes the products by default (below)
    want, n_plain = steps(sdpa)
    s = build()
    set_products(s.model, {1: 1, 2: 1})
    assert getattr(s.model.config, ATTR) == {1: 1, 2: 1}
    got, n_products = steps(s)
    for a, b in zip(got, want):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # two products a layer in the decode step; the verification step keeps the folded
    # SDPA (the products were timed and checked on one token a row)
    assert n_products - n_plain == 2 * L
    set_products(s.model, None)
    assert steps(s)[1] == n_plain


def test_the_fixed_buffer_decode_path_takes_them_too(tiny_folder, monkeypatch):
    """The path a GPU replays as graphs (engine/model/static_decode.py), run eagerly here."""
    monkeypatch.setenv("POTLUCK_STATIC_DECODE", "1")
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    plain = StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
    set_products(plain.model, None)
    s = StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
    set_products(s.model, {1: 1, 2: 1})
    want, _ = steps(plain)
    got, n = steps(s)
    assert s.static.steps == plain.static.steps >= 2 and n == 2 * L
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_what_was_timed_takes_them():
    """One new token a row, an additive mask, scores under SCORE_BYTES: a boolean mask
    (transformers' own masks) or more tokens keep SDPA."""
    import types

    from engine.model.gqa_attention import packed_gqa_attention
    from engine.model.product_attention import SCORE_BYTES, products_for

    config = types.SimpleNamespace(**{ATTR: {1: 64}})
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, config=config)
    assert products_for(module, 1, 64, 32) and not products_for(module, 1, 32, 32) and not products_for(module, 2, 64, 32)
    assert not products_for(module, 1, SCORE_BYTES // (32 * 4) + 1, 32)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 80, 8), torch.randn(1, 2, 80, 8)
    allowed = torch.arange(80) < 70
    additive = torch.zeros(1, 1, 1, 80).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with Bmm() as c:
        a, _ = packed_gqa_attention(module, q, k, v, additive, scaling=0.3)
    assert c.n == 2
    with Bmm() as c:
        b, _ = packed_gqa_attention(module, q, k, v, allowed.view(1, 1, 1, 80), scaling=0.3)
    assert c.n == 0
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    q5, mask5 = torch.randn(1, 4, 5, 8), torch.zeros(1, 1, 5, 80)
    with Bmm() as c:
        packed_gqa_attention(module, q5, k, v, mask5, scaling=0.3)
    assert c.n == 0


@pytest.mark.gpu
def test_on_a_gpu_the_products_give_sdpas_attention_in_bf16():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = 4 * torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.zeros(2, 1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    mask[1, ..., 1000:] = torch.finfo(torch.bfloat16).min
    want = reference(q, k, v, mask, 128 ** -0.5)
    assert agrees(q, k, v, mask, 128 ** -0.5, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_cpu_stages_decode_step_has_the_same_bits_on_any_number_of_threads(tiny_folder, arch):
    """SDPA's CPU kernel splits one query's keys over the threads, and a step's threads
    follow what the owner's other programs leave free (core/cpu_share.py): a seeded reply
    drew another token at a near tie whenever the machine got busier. A CPU stage takes
    the two products for its decode steps, whose bits do not depend on the threads."""
    folder, _ = tiny_folder(arch)
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    before = torch.get_num_threads()

    def decode_at(threads: int, products: bool) -> torch.Tensor:
        s = StageModel(source, 0, L, device="cpu", products=ProductChoice(fixed="rows"))
        if not products:
            set_products(s.model, None)
        n = len(PROMPT) * 8                       # keys enough for SDPA's kernel to split them
        prompt = (PROMPT * 8)[:n]
        s.forward(StageBatch([0, 1, 2], [0, 0, 0], [n, n - 5, n - 9]), torch.tensor(prompt + prompt[:n - 5]
                                                                                 + prompt[:n - 9]))
        torch.set_num_threads(threads)
        try:
            with Bmm() as c:
                out = s.forward(StageBatch([0, 1, 2], [n, n - 5, n - 9], [1, 1, 1]), torch.tensor([5, 6, 7]))
        finally:
            torch.set_num_threads(before)
        assert (c.n > 0) == products     # the products ran where taken, and only there
        return out

    assert getattr(StageModel(source, 0, L, device="cpu").model.config, ATTR)   # the default on a CPU
    assert torch.equal(decode_at(1, True), decode_at(2, True))
    # what it is for: SDPA's bits move with the threads here (if this torch's kernel ever
    # stops splitting the keys, this line says so and the default may be looked at again)
    assert not torch.equal(decode_at(1, False), decode_at(2, False))


def test_the_default_models_stage_as_served_decodes_the_same_bits_on_a_busier_machine(default_source):
    """The default model's stage with every setting at its default (its matrix products
    timed and chosen at their first call, its attention as a CPU stage takes it): a
    decode step on two threads, then on one, as when another program takes a core. A
    product chosen per thread count could be timed anew and kept the other way here."""
    source = default_source
    L = source.config().num_hidden_layers
    before = torch.get_num_threads()
    s = StageModel(source, 0, L, device="cpu")
    # a few hundred tokens of context: keys enough for SDPA's kernel to split them
    ids = source.tokenizer()("The capital of France is Paris, and the capital of Italy is Rome. " * 20)["input_ids"]
    n = len(ids)
    s.forward(StageBatch([0, 1, 2], [0, 0, 0], [n, n, n]), torch.tensor(ids * 3))
    outs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            outs.append(s.forward(StageBatch([0, 1, 2], [n, n, n], [1, 1, 1]), torch.tensor([5, 6, 7])))
            for sid in (0, 1, 2):
                s.kv.truncate(sid, n)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])

