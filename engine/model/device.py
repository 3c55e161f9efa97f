"""What this machine offers a pipeline: compute device, free memory, a quick speed figure."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from engine.core.errors import ModelError
from engine.core.sizes import counted


class DeviceError(ModelError):
    """A device that cannot be used here, with what to do instead."""


AUTO = "auto"


def attention_kernels(device: torch.device):
    """The scaled-dot-product-attention kernels a step may use on this device.

    On CUDA, torch prefers cuDNN's attention on Hopper, and cuDNN builds an execution
    plan for every new key length: a decode step has a new one each token, so at batch 1
    the plan building, on the CPU, was most of the step (bench/RESULTS.md, "GPU"). Flash
    and memory-efficient attention take any length without a plan; the math kernel stays
    as the fallback for what neither supports.

    cuDNN's is switched off for the process, not around each step: the switch is one of
    torch's process-wide flags, and `sdpa_kernel` restores on its way out what it found
    on its way in, so two threads' steps (a draft beside a verification, the two lanes of
    decode-first) turned it back on under each other, and a step, or a graph captured
    then, took cuDNN after all. A stage process computes only its own steps.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return contextlib.nullcontext()


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A step's few host numbers (slots, positions, input ids; a row's temperature, its
    uniform, the penalties' pairs) on `device`, queued behind the step without waiting for it. A copy from pageable memory
    may wait for the GPU's queue to drain first (CUDA stages it through pinned memory and
    may synchronise the stream to do so): the draw's launches would then start only once
    the step's forward had finished. From pinned memory it is queued like any kernel."""
    t = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class HostStaging:
    """Device-to-host copies of a step's output through a reusable pinned buffer per
    thread (issue 42): a copy from the GPU into pageable memory goes through a driver
    staging buffer at a fraction of the bus's speed, and allocating pinned memory per
    step costs more than the copy. The tensor returned is a view of the buffer, valid
    until the same thread's next call: frames.encode turns it into bytes at once."""

    def __init__(self):
        self._local = threading.local()

    def __call__(self, t):
        t = t.detach()
        if t.device.type != "cuda":
            return t.contiguous().cpu()
        n = t.numel() * t.element_size()
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n:
            buf = self._local.buf = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
        out = buf[:n].view(t.dtype).view(t.shape)
        out.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()   # the result leaves the process now
        return out


def pick_device(requested: str | None = AUTO) -> str:
    """The device a stage computes on. 'auto' (or None): the GPU when torch sees one, else
    the CPU. 'cpu', 'cuda' and 'cuda:N' are checked here, before anything loads."""
    requested = (requested or AUTO).strip().lower()
    if requested == AUTO:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" or requested.startswith("cuda:"):
        index = requested.partition(":")[2] or "0"
        if not index.isdigit():
            raise DeviceError(f"cannot read device {requested!r}: use auto, cpu, cuda or cuda:N (N from 0)")
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: this torch sees no CUDA GPU (`potluck doctor` says why "
                              "and what to install); use --device auto or cpu")
        if int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--device {requested}: this machine has {counted(torch.cuda.device_count(), 'CUDA GPU')}, "
                              f"numbered from 0")
        return f"cuda:{int(index)}"
    raise DeviceError(f"cannot read device {requested!r}: use auto, cpu, cuda or cuda:N")


def compute_dtype(device: str) -> str:
    """The dtype a stage computes in by default: bf16 on a GPU that has it (fp16 on an
    older one), float32 on the CPU (its bf16 matmuls are slow on most CPUs)."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def step_failure(exc: BaseException, device: str) -> str:
    """What to tell the sequences of a step that failed. An out-of-memory step gives the
    GPU's cached blocks back first, so the steps after it (smaller ones, other
    sequences) find the memory this one could not."""
    if isinstance(exc, torch.OutOfMemoryError):
        if device.startswith("cuda"):
            from engine.model.cuda_graphs import release_cached_memory

            release_cached_memory()
        return (f"out of memory on {device_name(device)} while computing this request's step; it was "
                "stopped so the others could go on. Send fewer or shorter requests at once, or give "
                "the pipeline more memory (a higher VRAM cap, another computer)")
    return str(exc)[:500]


def device_name(device: str) -> str:
    """What to call the device in a status: the GPU's name, or 'CPU'."""
    if device.startswith("cuda"):
        try:
            return torch.cuda.get_device_name(torch.device(device))
        except (RuntimeError, AssertionError):
            return device
    return "CPU"


def release_memory(device: str) -> None:
    """Give what a dropped slice held back to the system: Python's cycles, the CUDA
    allocator's cache, and on Linux glibc's free lists. Without the last, the heap keeps
    a dropped slice's pages: a friend's computer that handed layers back (or took fewer
    after a rearrangement) would go on holding their memory."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        from engine.model.cuda_graphs import release_cached_memory

        release_cached_memory()
    else:
        trim_heap()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). False where
    there is nothing to call (not Linux, or not glibc)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):   # not glibc (musl): nothing to trim
        return False


QUIET_TRIM_S = 3.0


class QuietTrim:
    """Once a CPU stage has held no conversation for a few seconds, its freed cache goes
    back to the computer's owner. A reply's KV cache is freed when it ends, but glibc
    keeps the pages for the process: without this a friend's node would hold the memory
    of the busiest moment of the evening until it quits. The trim runs on a timer thread,
    never on a step's path; it costs milliseconds, and a step starting meanwhile waits
    at most for one arena's lock."""

    def __init__(self, is_quiet, after_s: float = QUIET_TRIM_S, trim=trim_heap):
        self._is_quiet, self._after_s, self._trim = is_quiet, after_s, trim
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.trims = 0

    def quiet(self) -> None:
        """The stage's last conversation ended: trim if nothing starts for after_s."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self._after_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
        if self._is_quiet() and self._trim():
            self.trims += 1

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


def free_memory(device: str) -> int:
    """Bytes this stage could use for weights and KV cache."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def speed_score(device: str, seconds: float = 0.15) -> float:
    """Dense matmul throughput in GFLOP/s: a short, honest proxy for layer speed."""
    if device.startswith("cuda"):
        from engine.model.cuda_graphs import one_capture

        # it waits for the device, which must not happen while a stage captures its steps
        with one_capture():
            return _speed_score(device, seconds)
    return _speed_score(device, seconds)


def _speed_score(device: str, seconds: float) -> float:
    n = 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm up
    reps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)   # its own GPU's queue: cuda:1's, not the current one's
    dt = time.perf_counter() - t0
    return 2 * n**3 * reps / dt / 1e9


# the compute dtypes a head may ask a stage for (wire name -> torch dtype)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# of the memory left beside a slice's weights, what its KV cache may take: activations,
# the allocator's blocks and the CUDA context need the rest
KV_HEADROOM = 0.8


def memory_for_kv(weight_bytes: int, device: str, cap: int | None = None) -> int | None:
    """Bytes a stage's KV cache may take, asked before its weights load: on a GPU or
    under the owner's cap, what is left beside the weights (free memory, at most the
    cap), with headroom. None on an uncapped CPU stage: its budget follows free host
    memory (kv_budget_tokens_for), which the OS shares with everything else anyway."""
    if cap is None and not device.startswith("cuda"):
        return None
    room = free_memory(device) if cap is None else min(free_memory(device), cap)
    return max(0, int((room - weight_bytes) * KV_HEADROOM))


def kv_bytes_per_token(cfg, layer_range, dtype) -> int:
    """Bytes one token's keys and values take over a slice of layers."""
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return max(1, 2 * heads * head_dim * (layer_range[1] - layer_range[0]) * dtype.itemsize)


def kv_budget_tokens_for(cfg, layer_range, dtype, device: str, available: int | None = None) -> int:
    """How many tokens of KV cache a stage offers: a quarter of its free memory, capped.
    With `available` (memory_for_kv: a GPU, or the owner's cap) it stays within that,
    even below the usual floor of 1024 tokens."""
    per_token = kv_bytes_per_token(cfg, layer_range, dtype)
    if available is not None:
        return int(min(1 << 18, max(0, available) // per_token))
    return int(min(1 << 18, max(1024, free_memory(device) // 4 // per_token)))
