"""Capture a stage's fixed-buffer decode step as CUDA graphs and replay them (issue 42).

`torch.cuda.CUDAGraph` over the buffers of engine/model/static_decode.py: no compiler,
so the installed app (which has none) gets it too. Per bucket (engine/core/graph_plan.py)
the runner warms the step up twice on a side stream (lazy initialisations, cuBLAS
workspaces, the KV store reaching its size), captures it into a pool all of a stage's
graphs share (they never run at once), and from then on replays it: one launch for the
whole step instead of thousands.

A graph holds the KV store's addresses: one captured before the store grew (a
reallocation bumps `KVStore.generation`) is dropped and captured again when next needed.
A capture that fails -- an operation a graph cannot hold, a host copy inside the step,
memory -- is logged with its reason and that bucket runs eagerly from then on; after a
few failures the stage stops trying (GraphBook). Never a crash: the eager step is the
same computation.

The warm-up runs compute the real step (with the step's own inputs already in the
buffers) and write its keys and values where the replay writes them again: the same
values, so capturing inside a live step changes nothing.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.core.graph_plan import GraphBook, StepShape

log = logging.getLogger("potluck.graphs")

WARMUP_RUNS = 2


class GraphRunner:
    def __init__(self, stage, book: GraphBook, cuda=torch.cuda):
        # `cuda`: torch.cuda, or the tests' stand-in for a GPU this machine lacks
        self.stage, self.book, self.cuda = stage, book, cuda
        self.device = stage.device
        self.pool = cuda.graph_pool_handle()
        # shape -> (graph, output buffer, the KV generation it was captured under)
        self.graphs: dict[StepShape, tuple[object, torch.Tensor, int]] = {}

    def run(self, shape: StepShape, step) -> torch.Tensor:
        kv = self.stage.kv
        entry = self.graphs.get(shape)
        if entry is not None and entry[2] == kv.generation:
            entry[0].replay()
            self.book.used(shape)
            return entry[1]
        if entry is not None:           # the store grew since: every graph holds old addresses
            self.drop_all()
        if not self.book.may_capture(shape):
            self.book.ran_eagerly("capture failed before")
            return step()
        try:
            return self._capture(shape, step)
        except Exception as exc:  # noqa: BLE001 -- any failure: this bucket runs eagerly, logged
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            log.warning("decode step %s runs without a CUDA graph: %s", shape.label(), reason)
            self.book.capture_failed(shape, reason)
            self.cuda.synchronize(self.device)
            return step()

    def _capture(self, shape: StepShape, step) -> torch.Tensor:
        cuda = self.cuda
        t0 = time.perf_counter()
        reserved = cuda.memory_reserved(self.device)
        side = cuda.Stream(self.device)
        side.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
        cuda.current_stream(self.device).wait_stream(side)
        generation = self.stage.kv.generation
        if any(g != generation for _, _, g in self.graphs.values()):
            self.drop_all()             # the warm-up grew the store
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        if self.stage.kv.generation != generation:
            raise RuntimeError("the KV store moved while the step was captured")
        graph.replay()
        self.graphs[shape] = (graph, out, generation)
        cuda.synchronize(self.device)
        for old in self.book.captured(shape, time.perf_counter() - t0, cuda.memory_reserved(self.device) - reserved):
            self.graphs.pop(old, None)
        return out

    def drop_all(self) -> None:
        self.graphs.clear()
        self.book.forget()
