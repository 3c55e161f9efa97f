"""Small-batch linear layers on CPU (engine/model/cpu_linear.py): the same results whichever
product a call takes, W @ x^T batch-invariant, and each kind of call settling on the product
this machine runs faster."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from engine.core.product_choice import ProductChoice, row_bucket  # noqa: E402
from engine.model.cpu_linear import (PRODUCT, SMALL_ROWS, SmallBatchLinear, chosen_linear, small_batch_linear,  # noqa: E402
                                     use_small_batch_linear)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, SMALL_ROWS, SMALL_ROWS + 1, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(rows, bias, two_threads):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(2, rows, 96, generator=g)  # 3-D, as a model's hidden states come
    out = small_batch_linear(x, w, b)
    assert out.shape == (2, rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_batch_mates(two_threads):
    # a sequence decoded in a batch of up to 8 gets what it would get alone (MKL
    # switches kernels from 12 columns on; nn.Linear itself differs from 1 row to 3)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 128, generator=g)
    x = torch.randn(8, 128, generator=g)
    alone = small_batch_linear(x[:1], w, None)
    for rows in range(2, 9):
        assert torch.equal(small_batch_linear(x[:rows], w, None)[:1], alone), rows


@pytest.mark.parametrize("threads", [1, 2])
def test_each_kind_of_call_settles_on_one_product(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        w = torch.randn(600, 64, generator=g)
        b = torch.randn(600, generator=g)
        choice = ProductChoice()
        for rows in (1, 3, 8, 20):
            x = torch.randn(rows, 64, generator=g)
            key = (600, 64, row_bucket(rows))
            assert key not in choice.chosen()
            first = chosen_linear(x, w, b, choice)   # times both, TRIALS each, then answers
            kept = choice.chosen()[key]
            assert kept in ("rows", "columns"), rows
            torch.testing.assert_close(first, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            # the first answer already came from the kept product: the same bits from then on
            assert torch.equal(first, PRODUCT[kept](x, w, b))
            assert torch.equal(chosen_linear(x, w, b, choice), first)
        big = torch.randn(SMALL_ROWS + 1, 64, generator=g)   # a prompt: always x @ W^T, never timed
        assert torch.equal(chosen_linear(big, w, None, choice), F.linear(big, w))
        assert len(choice.chosen()) == 4
    finally:
        torch.set_num_threads(before)


def test_a_busier_machine_keeps_each_kinds_product_and_its_bits():
    """A step's threads follow what the owner's other programs leave (core/cpu_share.py);
    the product a kind of call keeps does not, so a row's bits do not either: the same
    seeded request answered twice by one server, the machine busy in between, is the same
    reply. Timings are forced apart here, so the choice is not a toss-up between runs."""
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(7)
    # the default model's up projection at four rows: the products' last bits differ
    w, x = torch.randn(1536, 576, generator=g), torch.randn(4, 576, generator=g)
    assert not torch.equal(PRODUCT["rows"](x, w, None), PRODUCT["columns"](x, w, None))   # what is at stake
    for kept in ("rows", "columns"):
        choice = ProductChoice()
        key = (1536, 576, row_bucket(4))
        other = "columns" if kept == "rows" else "rows"
        choice.observe(key, kept, 1.0)
        choice.observe(key, other, 2.0)
        try:
            torch.set_num_threads(2)
            quiet = chosen_linear(x, w, None, choice)
            torch.set_num_threads(1)      # another program took a core
            busy = chosen_linear(x, w, None, choice)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(quiet, busy) and torch.equal(busy, PRODUCT[kept](x, w, None))
        assert choice.chosen() == {key: kept}


def test_switch_covers_float32_linears_only_and_keeps_the_state_dict():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).to(torch.bfloat16), nn.Embedding(10, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    choice = use_small_batch_linear(model)
    assert type(model[0]) is SmallBatchLinear and type(model[2]) is nn.Linear
    assert model[0].choice is choice
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    again = use_small_batch_linear(model)   # layers kept for another stage take its choice
    assert again is not choice and model[0].choice is again


def test_int8_weights_compute_what_their_dequantized_matrix_does():
    """A CPU draft model's int8 layers: per-row absmax int8 weights, bfloat16 activations
    -- close to the float32 product of the dequantized matrix, at a quarter the bytes."""
    from engine.model.cpu_linear import Int8WeightLinear, int8_kernel_works, use_int8_weights
    if not int8_kernel_works():
        pytest.skip("no CPU weight-only int8 kernel in this torch")
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(96, 300, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 96, generator=g))
    q = Int8WeightLinear(lin)
    assert q.qweight.dtype == torch.int8 and not q.qweight.requires_grad
    deq = q.qweight.float() * q.scale.float()[:, None]
    assert (deq - lin.weight).abs().max() <= lin.weight.abs().amax(1).max() / 127   # rounding, not garbage
    for rows in (1, 4, 7):
        x = torch.randn(2, rows, 96, generator=g)
        out = q(x)
        ref = F.linear(x, deq, lin.bias)
        assert out.shape == (2, rows, 300) and out.dtype == torch.float32
        assert (out - ref).norm() / ref.norm() < 2e-2   # bfloat16 activations: ~3 digits
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(SmallBatchLinear(16, 4)))
    assert use_int8_weights(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model(torch.randn(3, 8)).shape == (3, 4)
