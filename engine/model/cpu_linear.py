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


if __name__ == "__main__":
    _compare()
