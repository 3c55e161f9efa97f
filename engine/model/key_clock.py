"""What a decode step's keys cost on this device, timed at load (issue 42).

A graph captured for few rows attends over a floor of keys (engine/core/graph_plan.py
row_floors) so that a chat crosses no key bucket -- each crossing a capture in the
middle of a reply -- until its context is that long. The floor was weighed in bytes: one
user's 2,048 keys on an 8B model are under 2% of the bytes of its weights. But one row's
attention reads its keys far below the GPU's bandwidth: with one new token a row, SDPA's
kernel runs one block per key/value head (8 on an 8B Llama), each walking every key
alone. On the H200 one user's attention took 13 us a layer at 256 keys (bench/RESULTS.md,
2026-12-04: 0.42 ms of a 6.8 ms step); at 2,048 keys that rate is some 70 us a layer,
about 1.8 ms a step beside the weights' 6.7 -- not 2%.

So on a GPU a stage times, while it loads, its attention both ways -- the model's SDPA
call, and two batched products spread over the keys (engine/model/product_attention.py)
-- for each row bucket over growing key counts, takes the products where they are
faster (engine/core/attention_choice.py) once they gave SDPA's output on this device,
and weighs each floor in the time the chosen attention takes (graph_plan.timed_floors)
against the step's weights read at the device's copy bandwidth.

Timed on the GPU alone: a spin kernel is queued first, so the calls timed are all queued
behind it and run back to back (launching them from Python takes longer than running
the short ones, which would otherwise be timed).
"""

from __future__ import annotations

import types

import torch

from engine.core.attention_choice import chosen_seconds, products_from
from engine.model.device import attention_kernels
from engine.model.product_attention import agrees, product_attention

REPS = 10
# well past a GPU's L2 cache (50 MB on an H100), so the copy reads and writes memory
COPY_BYTES = 128 * 2**20
SPIN_CYCLES = 5_000_000     # ~2.5 ms at 2 GHz: longer than queueing REPS calls from Python
# the most a timing's keys and values may take on the device at once
TIMING_BYTES = 128 * 2**20
MOST_KEYS = 8192


class KeyClock:
    """Times a stage's decode attention, both ways, and its device's copy bandwidth. On
    a CPU (the tests) the same calls are timed by the wall clock."""

    def __init__(self, stage):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cfg = stage.source.config()
        cfg = getattr(cfg, "text_config", None) or cfg
        self.device = stage.device
        self.dtype = stage.kv.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.attend = ALL_ATTENTION_FUNCTIONS[stage.model.config._attn_implementation]
        # what the attention functions read of the module that calls them: a config of
        # its own, so the model's choice of products (set later) does not time itself
        self.module = types.SimpleNamespace(num_key_value_groups=self.heads // self.kv_heads, is_causal=True,
                                            training=False, config=types.SimpleNamespace())
        self.timed: dict[tuple[int, int], tuple[float, float | None]] = {}   # (SDPA, products) seconds
        self.table: dict[int, int] = {}   # the products' choice, once made
        self.unused: str | None = None    # why the products were not considered

    def key_counts(self, rows: int, least: int) -> list[int]:
        """Key counts to time for `rows` rows: powers of two from `least`, as long as a
        timing's keys and values fit TIMING_BYTES, to MOST_KEYS."""
        per_key = rows * self.kv_heads * self.head_dim * 2 * torch.finfo(self.dtype).bits // 8
        out, keys = [], least
        while keys <= MOST_KEYS and (keys == least or keys * per_key <= TIMING_BYTES):
            out.append(keys)
            keys *= 2
        return out

    def sdpa(self, rows: int, keys: int) -> float:
        """Seconds one layer's attention takes the model's SDPA call for `rows` rows of one
        new token over `keys` keys (an additive mask over them, as a decode graph's)."""
        if (rows, keys) not in self.timed:
            q, k, v, mask, scale = self._inputs(rows, keys)
            with torch.inference_mode(), attention_kernels(self.device):
                t = self._time(lambda: self.attend(self.module, q, k, v, mask, dropout=0.0, scaling=scale))
            self.timed[(rows, keys)] = (t, None)
        return self.timed[(rows, keys)][0]

    def products(self, rows: int, keys: int) -> float:
        """The same, as two batched products (product_attention)."""
        sdpa = self.sdpa(rows, keys)
        if self.timed[(rows, keys)][1] is None:
            q, k, v, mask, scale = self._inputs(rows, keys)
            with torch.inference_mode():
                t = self._time(lambda: product_attention(q, k, v, mask, scale))
            self.timed[(rows, keys)] = (sdpa, t)
        return self.timed[(rows, keys)][1]

    def attention(self, rows: int, keys: int) -> float:
        """What a step's attention takes with the choice made (`choose`): the floors'
        measure (graph_plan.timed_floors)."""
        if not self.table:
            return self.sdpa(rows, keys)
        self.products(rows, keys)
        return chosen_seconds(self.timed, self.table, rows, keys)

    def choose(self, row_buckets, least: int) -> dict[int, int]:
        """Time both ways for each row bucket over growing key counts; the products are
        taken where faster (attention_choice.products_from), and only if at each row
        count's first such key count they give SDPA's output on this device."""
        both = {}
        try:
            for rows in row_buckets:
                for keys in self.key_counts(rows, least):
                    both[(rows, keys)] = (self.sdpa(rows, keys), self.products(rows, keys))
            table = products_from(both)
            wrong = [rows for rows, keys in table.items() if not self._agrees(rows, keys)]
            if wrong:
                self.unused = f"two products disagreed with SDPA at {len(wrong)} row count(s)"
                table = {}
        except Exception as exc:  # noqa: BLE001 -- SDPA stays; the floors are timed on it
            if not any(t for t, _ in self.timed.values()):
                raise
            self.unused = f"two products failed: {type(exc).__name__}: {exc}"[:200]
            table = {}
        self.table = table
        return table

    def seconds_per_byte_read(self) -> float:
        """A device-to-device copy's seconds per byte read (each byte read is written too:
        what a step's matrix products, which read their weights once, come near)."""
        a = torch.empty(COPY_BYTES, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        return self._time(lambda: b.copy_(a)) / (2 * COPY_BYTES)

    def _agrees(self, rows: int, keys: int) -> bool:
        q, k, v, _, scale = self._inputs(rows, keys)
        q = q * 4   # peaked attention: each output near a few keys' values, not their mean
        # each row sees a different prefix of the keys, as rows of different lengths do
        seen = torch.arange(keys, device=self.device) < torch.linspace(keys // 4, keys, rows,
                                                                         device=self.device).view(rows, 1)
        mask = torch.zeros(rows, 1, 1, keys, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~seen.view(rows, 1, 1, keys), torch.finfo(self.dtype).min)
        with torch.inference_mode(), attention_kernels(self.device):
            want, _ = self.attend(self.module, q, k, v, mask, dropout=0.0, scaling=scale)
            return agrees(q, k, v, mask, scale, want)

    def _inputs(self, rows: int, keys: int):
        kw = dict(device=self.device, dtype=self.dtype)
        q = torch.randn(rows, self.heads, 1, self.head_dim, **kw)
        k = torch.randn(rows, self.kv_heads, keys, self.head_dim, **kw)
        v = torch.randn(rows, self.kv_heads, keys, self.head_dim, **kw)
        return q, k, v, torch.zeros(rows, 1, 1, keys, **kw), self.head_dim ** -0.5

    def _time(self, call) -> float:
        if self.device.type != "cuda":
            import time

            call()   # warm
            t0 = time.perf_counter()
            for _ in range(REPS):
                call()
            return (time.perf_counter() - t0) / REPS
        from engine.model.cuda_graphs import one_capture

        # another stage of this process may be capturing (one loaded beside a serving
        # one): a synchronize of the device would break its capture. The spin, the events
        # and the calls on the stage's device, whichever is current (cuda:1 is a choice)
        with one_capture(), torch.cuda.device(self.device):
            call()   # warm: kernels chosen, workspaces made
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            spin = getattr(torch.cuda, "_sleep", None)
            if spin is not None:
                spin(SPIN_CYCLES)
            start.record()
            for _ in range(REPS):
                call()
            end.record()
            end.synchronize()
        return start.elapsed_time(end) / 1e3 / REPS
