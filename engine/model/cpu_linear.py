"""Linear layers for decode-sized batches on CPU: weight @ x^T, not x @ weight^T.

`nn.Linear` computes x @ W^T. For the few rows of a decode step, MKL's sgemm takes
that as a product whose *big* operand is the transposed one, and it copies (packs)
the whole weight matrix on every call: on this project's 2-core test machine the
default model's LM head (49152 x 576) took two to over three times as long for 3-8
rows as for a single row (a plain matrix-vector product). Computing W @ x^T instead
streams W as it lies, split over the threads: about half the time for 8 rows, a
quarter for 4 -- and a lone row padded to 4 comes out faster than the matrix-vector
product. The decoder layers' matrices gain most at 4 rows (about twice as fast),
little or nothing from 8 rows on. A whole decode step of the default model on 2
threads is more than a tenth faster, for 1 row and for 8 (`python -m
engine.model.cpu_linear` prints the per-matrix comparison; see bench/RESULTS.md).

On one thread the whole step loses (slower by a tenth to a third): the decoder
layers' x @ W^T is not slow there, it just gains nothing from a second thread.
Only the LM head, vocabulary-wide, still gains (2-8 rows: up to about twice as
fast), so on one thread it alone switches. The choice is made per call, on torch's
thread count -- a pipeline stage's changes as it borrows cores.

Up to 11 rows MKL computes every column with the same arithmetic, so a sequence
decoded in a batch of up to 8 gets bit for bit what it would get alone
(tests/test_cpu_linear.py; nn.Linear's own results already differ between 1 row
and 3). Results differ from x @ W^T in the last bits (~1e-6 relative), as any two
GEMM kernels' do. Prompts (many rows) keep x @ W^T, which is faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# up to this many rows, W @ x^T wins for every matrix of the default model (measured
# at 16-48 rows by a modest margin; from 64 rows the LM head is faster the usual way
# round; see bench/RESULTS.md)
SMALL_ROWS = 32
# fewer rows are padded to this many: MKL's kernel for 1-3 columns is slower than for 4
PAD_ROWS = 4
# on one thread, only matrices with at least this many outputs (an LM head) switch
WIDE_OUT = 16384


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    pad = PAD_ROWS
    if torch.get_num_threads() < 2:
        # one thread: only a vocabulary-wide matrix gains (the LM head, 2-8 rows),
        # and padding a lone row would just do 4 rows' work
        if rows < 2 or weight.shape[0] < WIDE_OUT:
            return F.linear(x, weight, bias)
        pad = 0
    flat = x.reshape(rows, k)
    if rows < pad:
        flat = torch.cat([flat, flat.new_zeros(pad - rows, k)])
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class SmallBatchLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) with the small-batch product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Switch the model's float32 CPU nn.Linear layers over; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            m.__class__ = SmallBatchLinear
            n += 1
    return n


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
