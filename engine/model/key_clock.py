"""What a decode step's keys cost on this device, timed at load (issue 42).

A graph captured for few rows attends over a floor of keys (engine/core/graph_plan.py
row_floors) so that a chat crosses no key bucket -- each crossing a capture in the
middle of a reply -- until its context is that long. The floor was weighed in bytes: one
user's 2,048 keys on an 8B model are under 2% of the bytes of its weights. But one row's
attention reads its keys far below the GPU's bandwidth: with one new token a row, SDPA's
kernel runs one block per key/value head (8 on an 8B Llama), each walking every key
alone. On the H200 one user's attention took 13 us a layer at 256 keys (bench/RESULTS.md,
2026-12-04: 0.42 ms of a 6.8 ms step); at 2,048 keys that rate is some 70 us a layer,
about 1.8 ms a step beside the weights' 6.7 -- not 2%. So on a GPU each floor is weighed
in time too (graph_plan.timed_floors): the model's own attention call, timed at each key
count the byte rule allows, against the step's weights read at the device's copy
bandwidth.

Timed on the GPU alone: a spin kernel is queued first, so the calls timed are all queued
behind it and run back to back (launching them from Python takes longer than running
the short ones, which would otherwise be timed).
"""

from __future__ import annotations

import types

import torch

from engine.model.device import attention_kernels

REPS = 10
COPY_BYTES = 32 * 2**20
SPIN_CYCLES = 5_000_000     # ~2.5 ms at 2 GHz: longer than queueing REPS calls from Python


class KeyClock:
    """Times a stage's decode attention and its device's copy bandwidth. On a CPU (the
    tests) the same calls are timed by the wall clock."""

    def __init__(self, stage):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cfg = stage.source.config()
        cfg = getattr(cfg, "text_config", None) or cfg
        self.device = stage.device
        self.dtype = stage.kv.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        impl = stage.model.config._attn_implementation
        self.attend = ALL_ATTENTION_FUNCTIONS[impl]
        # what the attention functions read of the module that calls them
        self.module = types.SimpleNamespace(num_key_value_groups=self.heads // self.kv_heads, is_causal=True,
                                            training=False, config=stage.model.config)
        self.seen: dict[tuple[int, int], float] = {}

    def attention(self, rows: int, keys: int) -> float:
        """Seconds one layer's attention takes for `rows` rows of one new token over
        `keys` keys (an additive mask over them, as a decode graph's)."""
        if (rows, keys) not in self.seen:
            q, k, v, mask, scale = self._inputs(rows, keys)
            with torch.inference_mode(), attention_kernels(self.device):
                self.seen[(rows, keys)] = self._time(
                    lambda: self.attend(self.module, q, k, v, mask, dropout=0.0, scaling=scale))
        return self.seen[(rows, keys)]

    def two_products(self, rows: int, keys: int) -> float:
        """The same attention as two batched matrix products and a softmax between them
        (scores kept in the compute dtype): not what a step runs. bench/gpu.py prints it
        beside `attention` at long contexts: a product's grid covers the keys, where
        SDPA's covers the key/value heads, so this says what a kernel that splits the keys
        would give."""
        q, k, v, mask, scale = self._inputs(rows, keys)
        n_rep = self.heads // self.kv_heads
        qp = q.reshape(rows, self.kv_heads, n_rep, self.head_dim)

        def call():
            s = torch.add(mask, torch.matmul(qp, k.transpose(-1, -2)), alpha=scale)
            return torch.matmul(torch.softmax(s, -1), v)

        with torch.inference_mode():
            return self._time(call)

    def _inputs(self, rows: int, keys: int):
        kw = dict(device=self.device, dtype=self.dtype)
        q = torch.randn(rows, self.heads, 1, self.head_dim, **kw)
        k = torch.randn(rows, self.kv_heads, keys, self.head_dim, **kw)
        v = torch.randn(rows, self.kv_heads, keys, self.head_dim, **kw)
        return q, k, v, torch.zeros(rows, 1, 1, keys, **kw), self.head_dim ** -0.5

    def seconds_per_byte_read(self) -> float:
        """A device-to-device copy's seconds per byte read (each byte read is written too:
        what a step's matrix products, which read their weights once, come near)."""
        a = torch.empty(COPY_BYTES, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        return self._time(lambda: b.copy_(a)) / (2 * COPY_BYTES)

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
        # one): a synchronize of the device would break its capture
        with one_capture():
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
