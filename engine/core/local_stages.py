"""How many processes a pipeline on this machine alone runs, when the user does not say.

One, on a GPU and on a CPU. Every local stage process computes on the same device
(engine/model/device.py gives them all the one GPU, cuda:0, or the CPU), and a token
passes through every stage in turn: a second process holding half the layers computes
nothing beside the first for one user, and adds a hop to every step -- a frame, a socket,
a thread's wake-up, and on a GPU a copy to the host and back and a second graph launch.
On an H200 two stage processes decoded at 0.69-0.78x one process's speed (bench/gpu.py,
bench/RESULTS.md 2026-12-04), and one process is where a GPU's decode steps are launched
ahead of their tokens (engine/core/ahead.py). On a 2-core CPU two processes decoded at
0.84-0.86x one at 1 user and 0.89-0.91x at 8 (bench/cpu_stages.py, RESULTS 2026-12-05
and 2026-12-06): each process's share of the cores computes its half no faster than all
of them compute it, and pays a step's fixed costs again. A CPU with many cores serving
many users might gain from two processes' micro-batches overlapping; there `--stages 2`
says so (unmeasured: every machine here has 2 cores). A number the user gives is always
kept.
"""

from __future__ import annotations

from engine.core.errors import ModelError

ALONE = 1
MOST = 8


def default_local_stages(device: str) -> int:
    """Stage processes on this machine, head included, for a pipeline with no friends'
    stages and no --stages: one, whatever the device (the module's docstring says why)."""
    return ALONE


def local_stages(requested: int | None, device: str) -> int:
    """The user's count (1..MOST) if given; None or 0: the default for `device`."""
    if isinstance(requested, bool) or not (requested is None or isinstance(requested, int)):
        raise ModelError(f"stages must be a whole number from 1 to {MOST}")
    if not requested:
        return default_local_stages(device)
    if not 1 <= requested <= MOST:
        raise ModelError(f"stages must be a whole number from 1 to {MOST}")
    return requested
