"""What this machine offers a pipeline: compute device, free memory, a quick speed figure."""

from __future__ import annotations

import time

import torch


def pick_device(requested: str | None = None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_memory(device: str) -> int:
    """Bytes this stage could use for weights and KV cache."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def speed_score(device: str, seconds: float = 0.15) -> float:
    """Dense matmul throughput in GFLOP/s: a short, honest proxy for layer speed."""
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
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return 2 * n**3 * reps / dt / 1e9


# the compute dtypes a head may ask a stage for (wire name -> torch dtype)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_budget_tokens_for(cfg, layer_range, dtype, device: str) -> int:
    """How many tokens of KV cache a stage offers: a quarter of its free memory, capped."""
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * heads * head_dim * (layer_range[1] - layer_range[0]) * dtype.itemsize
    return int(min(1 << 18, max(1024, free_memory(device) // 4 // max(per_token, 1))))
