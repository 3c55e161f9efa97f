"""Linear layers for decode-sized batches on CPU: x @ W^T or W @ x^T, whichever this machine runs faster.

`nn.Linear` computes x @ W^T. For the few rows of a decode step, some BLAS builds take
that as a product whose *big* operand is the transposed one and copy (pack) the whole
weight matrix on every call; there, computing W @ x^T instead streams W as it lies,
split over the threads (on the 2-core machine this engine was first tuned on, about half
the time for the default model's LM head at 8 rows and its layers' matrices at 4). Other
machines run x @ W^T for a lone row as a matrix-vector product several times faster
than W @ x^T: on an AVX-512 machine with the same torch, W @ x^T made a single user's
decode step twice as long (bench/RESULTS.md, 2026-12-03). So each kind of call -- matrix shape, bucket of rows
(not the thread count: see product_choice.py) -- times both at its first call and keeps the faster
(engine/core/product_choice.py; `python -m engine.model.cpu_linear` prints the
per-matrix comparison).

W @ x^T pads fewer than four rows to four: MKL's kernel for 1-3 columns was slower than
for four, and up to 11 rows it computes every column with the same arithmetic, so there
a row gets bit for bit what it would get alone. With x @ W^T a row in a batch gets other
last bits than alone (~1e-6 relative), as with nn.Linear itself. Prompts (more than
SMALL_ROWS rows) keep x @ W^T, which is faster there.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.product_choice import ProductChoice, row_bucket

# up to this many rows a call chooses its product; more (a prompt) takes x @ W^T
SMALL_ROWS = 32
# fewer rows are padded to this many for W @ x^T: MKL's kernel for 1-3 columns is slower than for 4
PAD_ROWS = 4


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W @ x^T over the rows of x (padded to PAD_ROWS), shaped as F.linear's result."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, k)
    if rows < PAD_ROWS:
        flat = torch.cat([flat, flat.new_zeros(PAD_ROWS - rows, k)])
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


PRODUCT = {"rows": F.linear, "columns": small_batch_linear}


def chosen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  choice: ProductChoice) -> torch.Tensor:
    """x @ W^T or W @ x^T, as `choice` has found faster for this kind of call (timing
    this call if it is one of the trials)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    key = (weight.shape[0], k, row_bucket(rows))
    product, timed = choice.pick(key)
    # the first call of a kind runs all its trials on its own input before it answers:
    # every result that leaves this call comes from the product the kind keeps, so the
    # same step gives the same bits on its first call and its thousandth (trials spread
    # over calls answered some steps with one product and some with the other, and two
    # asks of one greedy reply read different logprobs)
    # The kept product's last trial is the answer: no call beyond the trials
    outs = {}
    while timed:
        t0 = time.perf_counter()
        outs[product] = PRODUCT[product](x, weight, bias)
        choice.observe(key, product, time.perf_counter() - t0)
        product, timed = choice.pick(key)
    return outs[product] if product in outs else PRODUCT[product](x, weight, bias)


class SmallBatchLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose decode-sized calls take the
    product this machine runs faster. `choice`: the stage's (use_small_batch_linear)."""

    choice: ProductChoice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.choice is None:
            return F.linear(x, self.weight, self.bias)
        return chosen_linear(x, self.weight, self.bias, self.choice)


def use_small_batch_linear(model: nn.Module, choice: ProductChoice | None = None) -> ProductChoice:
    """Switch the model's float32 CPU nn.Linear layers over (layers switched before, kept
    from an earlier stage, take this one's choice too); returns the choice they share."""
    choice = choice if choice is not None else ProductChoice()
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            m.__class__ = SmallBatchLinear
        if type(m) is SmallBatchLinear:
            m.choice = choice
    return choice


class Int8WeightLinear(nn.Module):
    """A linear layer with int8 weights for a CPU draft model (issue 34): one absmax scale
    per output row (as bitsandbytes keeps int8 weights), computed by torch's weight-only
    int8 kernel on bfloat16 activations. A decode step streams the weights from memory,
    so a quarter of float32's bytes is what makes the draft cheaper: on this project's
    2-core test machine a matrix of the default model takes ~0.6x float32's time at 1-4
    rows, its LM head ~0.6x at 1 row and ~0.4x at 4 (`python -m engine.model.cpu_linear`),
    where bitsandbytes' CPU kernels take three to four times float32's. Outputs differ
    from the float32 model's (int8 weights, bfloat16 activations): fine for guesses the
    target checks, never for the target itself."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        # parameters (frozen), not buffers: the memory a stage counts is its parameters'
        self.qweight = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8).contiguous(),
                                    requires_grad=False)
        self.scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def int8_kernel_works() -> bool:
    """Whether this torch has the CPU weight-only int8 kernel (and it runs)."""
    from engine.model.build_lock import BUILD_LOCK

    try:
        with BUILD_LOCK:   # not on the meta device of a stage being built on another thread
            w = Int8WeightLinear(nn.Linear(64, 8, bias=False))
        return tuple(w(torch.ones(2, 64)).shape) == (2, 8)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def use_int8_weights(model: nn.Module) -> int:
    """Replace every CPU nn.Linear (the LM head too) by an Int8WeightLinear; returns how
    many. The float32 weights they held are dropped (a tied LM head's stay: the embedding
    holds them)."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(parent, name, Int8WeightLinear(child))
                n += 1
    return n


def _compare() -> None:
    """Print x @ W^T vs the small-batch product for the default model's shapes."""
    import timeit

    shapes = {"q/o proj": (576, 576), "gate/up proj": (1536, 576), "down proj": (576, 1536),
              "LM head": (49152, 576)}
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'matrix':14s} {'rows':>4s} {'x @ W^T':>10s} {'W @ x^T':>10s} {'speed-up':>8s}")
    for name, (n_out, n_in) in shapes.items():
        # enough copies that they do not all sit in cache, as a model's layers do not
        copies = max(1, 120_000_000 // (n_out * n_in * 4))
        ws = [torch.randn(n_out, n_in) for _ in range(copies)]
        for rows in (1, 4, 8, 16, 32):
            x = torch.randn(rows, n_in)
            a = min(timeit.repeat(lambda: [F.linear(x, w) for w in ws], number=3, repeat=3)) / 3 / copies
            b = min(timeit.repeat(lambda: [small_batch_linear(x, w, None) for w in ws], number=3, repeat=3)) \
                / 3 / copies
            print(f"{name:14s} {rows:4d} {a * 1e6:8.0f}us {b * 1e6:8.0f}us {a / b:7.2f}x")
    if not int8_kernel_works():
        print("\nno CPU weight-only int8 kernel in this torch")
        return
    print(f"\n{'matrix':14s} {'rows':>4s} {'float32':>10s} {'int8 w':>10s} {'speed-up':>8s}   (a draft model's int8)")
    for name, (n_out, n_in) in shapes.items():
        copies = max(1, 120_000_000 // (n_out * n_in * 4))
        lins = [nn.Linear(n_in, n_out, bias=False) for _ in range(copies)]
        q8 = [Int8WeightLinear(m) for m in lins]
        for rows in (1, 4):
            x = torch.randn(rows, n_in)
            with torch.inference_mode():
                a = min(timeit.repeat(lambda: [F.linear(x, m.weight) for m in lins], number=3, repeat=3)) / 3 / copies
                b = min(timeit.repeat(lambda: [m(x) for m in q8], number=3, repeat=3)) / 3 / copies
            print(f"{name:14s} {rows:4d} {a * 1e6:8.0f}us {b * 1e6:8.0f}us {a / b:7.2f}x")


if __name__ == "__main__":
    _compare()
