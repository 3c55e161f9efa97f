"""How many processes a pipeline on this machine alone runs, when the user does not say.

Every local stage process computes on the same device (engine/model/device.py gives them
all the one GPU, cuda:0, or the CPU). On a GPU a second process holding half the layers
adds a hop to every step -- a copy to the host, a socket, a copy back, a second graph
launch -- and nothing runs beside it: the two processes' kernels take turns on the one
GPU. On an H200 two stage processes decoded at 0.69-0.78x one process's speed
(bench/gpu.py, bench/RESULTS.md 2026-12-04), and one process is where its decode steps
are launched ahead of their tokens (engine/core/ahead.py). So a host alone on a GPU runs
one process. On a CPU the default stays two processes (head and one stage), as it has
been: the cores are split between them (engine/model/cores.py), and the chat and the
tests were built and measured that way. A number the user gives is always kept.
"""

from __future__ import annotations

from engine.core.errors import ModelError

ON_A_CPU = 2
ON_A_GPU = 1
MOST = 8


def default_local_stages(device: str) -> int:
    """Stage processes on this machine, head included, for a pipeline with no friends'
    stages and no --stages: one on a GPU, two on a CPU."""
    return ON_A_GPU if str(device).startswith("cuda") else ON_A_CPU


def local_stages(requested: int | None, device: str) -> int:
    """The user's count (1..MOST) if given; None or 0: the default for `device`."""
    if isinstance(requested, bool) or not (requested is None or isinstance(requested, int)):
        raise ModelError(f"stages must be a whole number from 1 to {MOST}")
    if not requested:
        return default_local_stages(device)
    if not 1 <= requested <= MOST:
        raise ModelError(f"stages must be a whole number from 1 to {MOST}")
    return requested
