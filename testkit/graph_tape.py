"""CUDA graphs' replay semantics on the CPU, for the decode graphs' tests (issue 42).

The first GPU run of engine/model/cuda_graphs.py (an H200, bench/RESULTS.md 2026-11-29)
captured fine and then hit a device-side "index out of bounds" at replay, which no CPU
test had seen: the CPU tests' stand-in replayed nothing. What makes a replay differ from
running the step again is that no Python runs: the same kernels, with the sizes and
scalars the capture saw, over the same memory. That is what `TapeCuda` does here:

* a capture records every aten operator the step dispatches (TorchDispatchMode) with
  its arguments and results: the tensors made before the capture (weights, the KV
  store, the step's buffers) are held as they are, the ones made inside are the graph's
  own memory;
* a replay calls those operators again in order on the recorded arguments: an in-place
  operator writes where it wrote at capture (the KV store as it was then, the buffers'
  current values read), a view is the view the capture made (not called again), and any
  other operator's result is copied into the tensor the capture made, which later
  operators read.

So a replay reads the values the buffers hold now and every size and scalar the capture
baked in. Index past what a tensor held at capture and it raises IndexError here, where a
GPU asserts. A host read inside the step (`.item()`, `nonzero`) fails the capture, as
CUDA's capture does. Not emulated: the memory pool's reuse of addresses between graphs,
and streams (there is one).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.model.cuda_graphs import HOST_READS  # what a CUDA stream capture refuses

aten = torch.ops.aten


class CaptureRefused(RuntimeError):
    pass


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise CaptureRefused(f"operation not permitted when stream is capturing ({func})")
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            copy_back = ()          # writes its arguments in place: replayed as it is
        else:
            # what the operator made (not a view of its inputs) is the graph's memory, which
            # a replay writes again. Aliasing is read off the storage, not the schema:
            # `reshape`, `contiguous` and `to` are views in their schema and copies when
            # they must be.
            inputs = _storages((args, kwargs))
            copy_back = tuple(i for i, t in enumerate(tree_flatten(out)[0])
                              if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
            if not copy_back:
                return out          # a view of the inputs: it sees what they hold at replay
        self.tape.append((func, args, kwargs, out, copy_back))
        return out


class TapeGraph:
    """A captured step: its operators, replayed over the memory of the capture."""

    def __init__(self):
        self.tape: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode(), torch.no_grad():
            for func, args, kwargs, out, copy_back in self.tape:
                fresh = func(*args, **kwargs)
                if not copy_back:
                    continue        # wrote in place, where the capture wrote
                mine, got = tree_flatten(out)[0], tree_flatten(fresh)[0]
                for i in copy_back:
                    if mine[i].shape != got[i].shape:
                        raise RuntimeError(f"{func} replayed to {tuple(got[i].shape)}, captured {tuple(mine[i].shape)}")
                    mine[i].copy_(got[i])


class TapeCuda:
    """The part of torch.cuda that engine/model/cuda_graphs.py GraphRunner uses, for a
    stage on the CPU. `captures` counts captures, `graphs` holds every one made."""

    CUDAGraph = TapeGraph

    def __init__(self):
        self.captures = 0
        self.graphs: list[TapeGraph] = []
        self.pools_stopped: list = []     # pools the runner stopped recording into

    def graph_pool_handle(self):
        return object()

    def Stream(self, device):  # noqa: N802 -- torch.cuda's name
        return self

    def current_stream(self, device):
        return self

    def wait_stream(self, other):
        pass

    def stream(self, s):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def graph(self, g: TapeGraph, pool=None, stream=None, capture_error_mode=None):
        self.captures += 1
        self.graphs.append(g)
        with _Recorder(g.tape):
            yield

    def memory_reserved(self, device):
        return 0

    def end_pool_recording(self, device, pool):    # torch._C._cuda_endAllocateToPool
        self.pools_stopped.append(pool)

    def synchronize(self, device):
        pass
