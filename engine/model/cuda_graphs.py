"""Capture a stage's fixed-buffer decode step as CUDA graphs and replay them (issue 42).

`torch.cuda.CUDAGraph` over the buffers of engine/model/static_decode.py: no compiler,
so the installed app (which has none) gets it too. Per bucket (engine/core/graph_plan.py)
the runner warms the step up twice on a side stream (lazy initialisations, cuBLAS
workspaces, the KV store reaching its size), captures it into a pool all of a stage's
graphs share (they never run at once), and from then on replays it: one launch for the
whole step instead of thousands.

A graph holds the KV store's addresses: one captured before the store grew (a
reallocation bumps `KVStore.generation`) is dropped and captured again when next needed.
A step that reads a device value on the host or copies across (HostReadWatch, over the
first warm-up) is refused before any capture begins. A capture that fails all the same
-- memory, an operation the watch does not know -- is logged with its reason and the
stage captures nothing more (CUDA's and the allocator's state after a half-ended capture
is not to be trusted); a refused bucket runs eagerly from then on, and after a few
refusals the stage stops trying (GraphBook). Never a crash: the eager step is the same
computation.

The warm-up runs compute the real step (with the step's own inputs already in the
buffers) and write its keys and values where the replay writes them again: the same
values, so capturing inside a live step changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.core.graph_plan import GraphBook, StepShape

log = logging.getLogger("potluck.graphs")

WARMUP_RUNS = 2

aten = torch.ops.aten
# operators that hand a device value to the host (or size a result by one): a stream
# capture refuses them, and on a GPU the refusal can leave the capture half-ended
HOST_READS = frozenset({
    aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.is_nonzero.default,
    aten.equal.default, aten.masked_select.default, aten.unique_consecutive.default,
    aten._unique2.default, aten.repeat_interleave.Tensor, aten.unique_dim.default, aten.bincount.default})
# indexing by a boolean mask sizes its result by the mask's count: the kernel reads it on
# the host (a nonzero inside, which the watch does not see as an operator of its own)
MASK_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                           aten._index_put_impl_.default})
# copies: one between host memory and the device inside a capture is refused too
COPIES = frozenset({aten.copy_.default, aten._to_copy.default})

# torch allows one capture at a time in a process: two stages of one process (a head's
# own stage and its draft) capture in turn
_ONE_CAPTURE = threading.Lock()
# the threads warming up or capturing a step now: such a step does not park at the step
# gate's checkpoints (engine/core/step_gate.py) -- parked holding _ONE_CAPTURE, the decode
# step that cut in would wait for the lock to capture its own shape, and the parked one for it
_CAPTURING = threading.local()


def capturing() -> bool:
    """Whether this thread is warming up or capturing a step for a graph."""
    return getattr(_CAPTURING, "on", False)


def one_capture() -> threading.Lock:
    """Held while a stage of this process captures: what waits on the whole device (a
    synchronize, the allocator's cache given back) takes it too."""
    return _ONE_CAPTURE


def release_cached_memory() -> None:
    """Give the CUDA allocator's free cached blocks back to the device, never while a
    stage of this process is capturing (its pool's memory is the allocator's too)."""
    with _ONE_CAPTURE:
        torch.cuda.empty_cache()


class HostRead(RuntimeError):
    """The step reads a device value on the host or copies across: no graph can hold it."""


class HostReadWatch(TorchDispatchMode):
    """Raises HostRead at the first operator of the step that a capture would refuse.
    A warm-up runs under it, so such a step is refused before any capture begins: on the
    first H200 that ran these graphs, a capture that failed half-way left the allocator
    recording into its pool and every capture and step after it failed too. Dispatch
    modes are per thread: other threads' work is not watched."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostRead(f"the step reads a device value on the host ({func})")
        if func == aten.histc.default and _histc_without_range(args, kwargs):
            # the kernel reads the input's min and max on the host (a mixture of experts
            # counting its tokens gives a range, and is captured)
            raise HostRead(f"the step reads a device value on the host ({func} with no range)")
        if func in MASK_INDEXING and _by_mask(args):
            raise HostRead(f"the step indexes by a boolean mask ({func})")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in COPIES:
            kinds = {t.device.type for t in tensors}
            dst = kwargs.get("device")
            if dst is not None:
                kinds.add(torch.device(dst).type)
            if "cpu" in kinds and len(kinds) > 1:
                raise HostRead(f"the step copies between the host and the device ({func})")
        else:
            # a host tensor handed to a device operator (an index kept on the host): torch
            # copies it across inside the kernel's call, which a capture refuses half-way
            # through. A host scalar (no dimensions) is passed by value and is all right.
            kinds = {t.device.type for t in tensors if t.dim() > 0 or t.device.type != "cpu"}
            if "cpu" in kinds and len(kinds) > 1:
                raise HostRead(f"the step hands a host tensor to a device operator ({func})")
        return func(*args, **kwargs)


def _histc_without_range(args, kwargs) -> bool:
    """histc(input, bins=100, min=0, max=0) with min == max, however they were passed."""
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return lo == hi


def _by_mask(args) -> bool:
    """Whether an index / index_put's indices (its second argument) hold a boolean mask."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class GraphRunner:
    def __init__(self, stage, book: GraphBook, cuda=torch.cuda):
        # `cuda`: torch.cuda, or the tests' stand-in for a GPU this machine lacks
        self.stage, self.book, self.cuda = stage, book, cuda
        self.device = stage.device
        self.pool = cuda.graph_pool_handle()
        # one stream to warm up on and one to capture on, for every capture: cuBLAS keeps a
        # workspace per stream it ran on (tens of MiB on a Hopper GPU, some of them made
        # inside a graph's pool, which they then keep alive), and a new stream each time
        # cycles through torch's 32
        self.side = cuda.Stream(self.device)
        self.capture_stream = cuda.Stream(self.device)
        # shape -> (graph, output buffer, the KV generation it was captured under)
        self.graphs: dict[StepShape, tuple[object, torch.Tensor, int]] = {}

    def will_replay(self, shape: StepShape) -> bool:
        """Whether a step of this shape replays a graph, or captures one. If neither, the
        stage's own eager step at the batch's exact size is cheaper than this bucket's step
        run eagerly (rows padded to the bucket, keys to its floor, K/V gathered)."""
        entry = self.graphs.get(shape)
        return (entry is not None and entry[2] == self.stage.kv.generation) or self.book.may_capture(shape)

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
        began = []
        try:
            with _ONE_CAPTURE:
                _CAPTURING.on = True
                try:
                    return self._capture(shape, step, began)
                finally:
                    _CAPTURING.on = False
        except Exception as exc:  # noqa: BLE001 -- any failure: this bucket runs eagerly, logged
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            log.warning("decode step %s runs without a CUDA graph: %s", shape.label(), reason)
            self.book.capture_failed(shape, reason)
            if began:
                # it failed inside the capture: what CUDA and the allocator were left in
                # is not ours to trust, so no more captures; eager steps need neither
                self.book.disabled = self.book.disabled or f"a capture failed half-way: {reason}"
                self.drop_all()
            try:
                self.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 -- the error the capture left; the eager step says if it matters
                pass
            return step()

    def _capture(self, shape: StepShape, step, began: list) -> torch.Tensor:
        cuda = self.cuda
        t0 = time.perf_counter()
        reserved = cuda.memory_reserved(self.device)
        side = self.side
        side.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(side):
            with HostReadWatch():       # refused here, before any capture begins
                step()
            for _ in range(WARMUP_RUNS - 1):
                step()
        cuda.current_stream(self.device).wait_stream(side)
        generation = self.stage.kv.generation
        if any(g != generation for _, _, g in self.graphs.values()):
            self.drop_all()             # the warm-up grew the store
        if not self.graphs:
            # a pool whose graphs are all gone is not captured into again: the allocator
            # keeps it, at no graph's use, while any block of it lives (a library's cached
            # workspace, an old output), and a capture into it then fails an internal
            # assert (torch's use_count > 0: the nf4 stage on the H200, recapturing after
            # the store grew)
            self.pool = cuda.graph_pool_handle()
        graph = cuda.CUDAGraph()
        # the capture on a stream of our own, inside a context of our own: if the capture's
        # end raises, torch's context skips putting the thread's stream back, ours does not
        capture_stream = self.capture_stream
        capture_stream.wait_stream(cuda.current_stream(self.device))
        began.append(True)
        try:
            with cuda.stream(capture_stream):
                with cuda.graph(graph, pool=self.pool, stream=capture_stream, capture_error_mode="thread_local"):
                    out = step()
        except BaseException:
            self._stop_pool_recording()
            raise
        if self.stage.kv.generation != generation:
            raise RuntimeError("the KV store moved while the step was captured")
        graph.replay()
        self.graphs[shape] = (graph, out, generation)
        cuda.synchronize(self.device)
        for old in self.book.captured(shape, time.perf_counter() - t0, cuda.memory_reserved(self.device) - reserved):
            self.graphs.pop(old, None)
        return out

    def _stop_pool_recording(self) -> None:
        """After a capture that failed half-way: the allocator told to stop putting the
        capture stream's blocks in the pool. Some torch versions leave it recording when the
        capture's end raises, and then every empty_cache() fails an internal assert (the
        stage's memory given back, an allocation out of memory retried). Where torch stopped
        it already, it says so (an error), which is all right."""
        end = getattr(self.cuda, "end_pool_recording", None)     # the tests' stand-in
        try:
            if end is not None:
                end(self.device, self.pool)
            else:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                torch._C._cuda_endAllocateToPool(index, self.pool)
        except Exception as exc:  # noqa: BLE001 -- not recording any more: nothing to stop
            log.debug("the pool was not recording after the failed capture: %s", exc)

    def drop_all(self) -> None:
        self.graphs.clear()
        self.book.forget()
