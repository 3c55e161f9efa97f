"""The device is chosen for the user (engine/model/device.py). CUDA is the edge that
cannot exist here: torch.cuda's answers are patched to play a machine with GPUs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import device as dev
from engine.model.device import DeviceError, compute_dtype, pick_device

ROOT = Path(__file__).resolve().parents[2]


def gpus(monkeypatch, n: int, bf16: bool = True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_auto_is_the_gpu_when_torch_sees_one(monkeypatch):
    gpus(monkeypatch, 0)
    assert pick_device("auto") == pick_device(None) == "cpu" and compute_dtype("cpu") == "float32"
    gpus(monkeypatch, 2)
    assert pick_device("auto") == "cuda:0" and pick_device("cuda") == "cuda:0" and pick_device("CUDA:1") == "cuda:1"
    assert pick_device("cpu") == "cpu"                    # the override wins
    assert compute_dtype("cuda:0") == "bfloat16"
    gpus(monkeypatch, 1, bf16=False)
    assert compute_dtype("cuda:0") == "float16"           # a GPU without bf16


@pytest.mark.parametrize("asked, why", [("cuda", "sees no CUDA GPU"), ("cuda:0", "sees no CUDA GPU"),
                                        ("gpu", "use auto, cpu, cuda or cuda:N"),
                                        ("cuda:x", r"use auto, cpu, cuda or cuda:N \(N from 0\)")])
def test_a_device_that_is_not_there_is_refused_with_what_to_do(monkeypatch, asked, why):
    gpus(monkeypatch, 0)
    with pytest.raises(DeviceError, match=why):
        pick_device(asked)


def test_a_gpu_number_beyond_the_machine_is_refused(monkeypatch):
    gpus(monkeypatch, 2)
    with pytest.raises(DeviceError, match="has 2 CUDA GPU"):
        pick_device("cuda:2")


def test_device_name(monkeypatch):
    assert dev.device_name("cpu") == "CPU"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA GeForce RTX 4090")
    assert dev.device_name("cuda:0") == "NVIDIA GeForce RTX 4090"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_cli_says_so_before_loading_anything():
    out = subprocess.run([sys.executable, "-m", "engine", "chat", "--device", "cuda", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2
    assert "sees no CUDA GPU" in out.stderr and "potluck doctor" in out.stderr and "Traceback" not in out.stderr


def test_kv_gets_what_is_left_beside_the_weights_on_a_gpu_or_under_a_cap(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(dev, "free_memory", lambda device: 10 * gib)
    assert dev.memory_for_kv(4 * gib, "cuda:0") == int(6 * gib * dev.KV_HEADROOM)
    assert dev.memory_for_kv(4 * gib, "cuda:0", cap=5 * gib) == int(1 * gib * dev.KV_HEADROOM)
    assert dev.memory_for_kv(4 * gib, "cpu", cap=5 * gib) == int(1 * gib * dev.KV_HEADROOM)
    assert dev.memory_for_kv(12 * gib, "cuda:0") == 0          # weights alone overflow: no KV
    assert dev.memory_for_kv(4 * gib, "cpu") is None             # host memory: the usual rule


def test_kv_budget_within_the_memory_given():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_key_value_heads=8, num_attention_heads=32, hidden_size=4096, head_dim=128)
    per_token = 2 * 8 * 128 * 10 * 2                              # 10 layers of bf16
    assert dev.kv_budget_tokens_for(cfg, (0, 10), torch.bfloat16, "cpu", 1000 * per_token) == 1000
    assert dev.kv_budget_tokens_for(cfg, (0, 10), torch.bfloat16, "cpu", 0) == 0


@pytest.mark.gpu
async def test_the_default_model_answers_on_the_gpu_without_a_flag():
    """On a GPU machine the defaults compute there, in bf16, and the status says so."""
    from conftest import pipeline_config
    from engine.core.sampling import SamplingParams
    from engine.pipeline.launch import launch
    from engine.pipeline.terminal import ask, reply

    pipe = await launch(pipeline_config(stages=2))
    try:
        info = pipe.head.info()
        assert {s["device"] for s in info["stages"]} == {"cuda:0"} and info["dtype"] in ("bfloat16", "float16")
        text, done = await reply(ask(pipe.head, [{"role": "user", "content": "What is the capital of France?"}],
                                     SamplingParams(greedy=True, max_tokens=24)))
        assert done.error is None and "Paris" in text
    finally:
        await pipe.close()


def test_gpu_steps_keep_off_cudnn_attention_which_plans_anew_for_every_length():
    """cuDNN's attention builds a plan per key length (each decode token): on an H200 that
    was most of a batch-1 step. A GPU stage's steps run with it off; a CPU's touch nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with dev.attention_kernels(torch.device("cpu")):
            assert torch.backends.cuda.cudnn_sdp_enabled()
        # two threads' steps, interleaved: the first out must not switch it back on under
        # the second (torch's flag is the process's; sdpa_kernel restored what it found)
        first, second = dev.attention_kernels(torch.device("cuda", 0)), dev.attention_kernels(torch.device("cuda", 0))
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()           # the fallback stays
        second.__exit__(None, None, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_quiet_stage_trims_once_after_its_last_conversation_and_not_while_busy():
    """QuietTrim: the trim waits out the quiet time, a new quiet moment restarts the
    wait (one trim, not one per reply), and a stage that got busy meanwhile is left be."""
    import time

    from engine.model.device import QuietTrim

    busy, calls = [False], []
    # the quiet time is 5x the gap between the two replies' ends, and the trim is waited
    # for, not slept for: a loaded machine only makes the test take longer
    asked = []

    def is_quiet():
        asked.append(busy[0])
        return not busy[0]

    def waited(cond):
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)

    q = QuietTrim(is_quiet, after_s=0.5, trim=lambda: calls.append(time.monotonic()) or True)
    t0 = time.monotonic()
    q.quiet()
    time.sleep(0.1)
    t1 = time.monotonic()
    q.quiet()                      # another reply ended: the wait starts again
    waited(lambda: calls)
    time.sleep(0.2)
    assert len(calls) == 1 and calls[0] - t1 >= 0.49 and q.trims == 1, (calls, t0, t1)
    busy[0] = True                 # a conversation started before the timer fired
    q.quiet()
    waited(lambda: len(asked) == 2)
    assert asked == [False, True] and len(calls) == 1
    busy[0] = False
    q.quiet()
    q.cancel()                     # a dropped stage: nothing fires later
    time.sleep(0.8)
    assert len(calls) == 1


def test_a_cpu_stage_gives_its_freed_cache_back_when_its_last_conversation_ends(default_source):
    """The real stage: freeing the last sequence arms the trim; freeing one of two does not."""
    from engine.model.device import QuietTrim
    from engine.model.stage import StageBatch, StageModel

    torch.set_num_threads(1)
    stage = StageModel(default_source, 10, 12, device="cpu")
    trims = []
    stage.quiet_trim = QuietTrim(lambda: not stage.kv.seqs, after_s=0.1, trim=lambda: trims.append(1) or True)
    h = torch.randn(2 * 64, stage.hidden_size)
    stage.forward(StageBatch([1, 2], [0, 0], [64, 64]), h)
    assert stage.kv.allocated_bytes() > 0
    stage.free(1)
    import time
    time.sleep(0.3)
    assert trims == []             # sequence 2 still lives
    stage.free(2)
    time.sleep(0.3)
    assert trims == [1] and stage.kv.allocated_bytes() == 0


def test_trimming_the_heap_hands_freed_tensors_back_to_the_system():
    """What the trim is for, in a process of its own: tensors of a reply's size freed
    among small live ones, and the RSS back near where it started."""
    code = """
import torch
from engine.model.device import trim_heap
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
keep = []
for i in range(4):
    big = [torch.ones(3, 3, 1024, 64) for _ in range(40)]   # a reply's cache, layer by layer
    keep += [torch.ones(100) for _ in range(500)]
    del big
held = rss() - base             # glibc keeps the freed pages below the live small ones
assert trim_heap()
print(held, rss() - base)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    held, after = map(int, out.stdout.split())
    assert held > 64 << 20 and after < held * 0.3, (held, after)


def test_a_dropped_stage_is_freed_at_once_not_at_the_collectors_next_full_pass(default_source):
    """Nothing a stage holds may hold it back (its model's hooks, its quiet trim): a stage let
    go after a rearrangement must give its weights and cache back when its last reference
    goes, not minutes later when Python's collector next looks at old objects."""
    import gc
    import weakref

    from engine.model.stage import StageBatch, StageModel

    torch.set_num_threads(1)
    StageModel(default_source, 10, 11, device="cpu")   # the first build's imports out of the way
    gc.collect()
    gc.disable()
    try:
        for start, end in ((10, 12), (0, 2), (28, 30)):
            stage = StageModel(default_source, start, end, device="cpu")
            x = torch.arange(8) if start == 0 else torch.randn(8, stage.hidden_size)
            stage.forward(StageBatch([1], [0], [8]), x)
            stage.free(1)
            ref = weakref.ref(stage)
            del stage, x
            assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    finally:
        gc.enable()
