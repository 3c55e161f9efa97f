"""`potluck doctor`: can this machine compute on its GPU, and if not, what to do.

The facts come from NVML (is there an NVIDIA GPU and driver: node/gpu.py) and from torch
(is this a CUDA build, does it see the GPU); `advise` turns them into plain words and is
pure, so each case is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# PyTorch's own package index for CUDA builds; the suffix is the CUDA version
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


@dataclass
class Facts:
    gpus: list[str]              # NVIDIA GPUs NVML sees, by name
    nvml_why: str | None         # why NVML sees none (no driver, no library)
    torch_version: str
    torch_cuda: str | None       # the CUDA version torch was built for (None: a CPU build)
    cuda_available: bool         # torch can use a GPU now
    device: str                  # what `--device auto` picks


def gather() -> Facts:
    import torch

    from engine.model.device import pick_device
    from engine.node.gpu import read_gpus

    readings, why = read_gpus()
    return Facts([g.name for g in readings], why, torch.__version__.split("+")[0], torch.version.cuda,
                 torch.cuda.is_available(), pick_device("auto"))


def advise(f: Facts) -> tuple[bool, list[str]]:
    """(whether the GPU is used or there is none to use, what to tell the user)."""
    lines = [f"torch {f.torch_version} ({'CUDA ' + f.torch_cuda if f.torch_cuda else 'CPU build'})",
             f"NVIDIA GPUs: {', '.join(f.gpus) if f.gpus else 'none found (' + (f.nvml_why or 'no driver') + ')'}",
             f"--device auto computes on: {f.device}"]
    if not f.gpus:
        if f.cuda_available:      # a GPU torch sees without NVML (no nvidia-ml-py): it is used
            return True, lines + ["ok: computing on the GPU (install nvidia-ml-py for the tray's GPU readings)"]
        return True, lines + ["ok: no NVIDIA GPU here, so Potluck computes on the CPU"]
    if f.cuda_available:
        return True, lines + ["ok: computing on the GPU"]
    if not f.torch_cuda:
        return False, lines + [
            "this torch is a CPU build, so your GPU sits idle. Install the CUDA build into Potluck's "
            "environment (about 2.5 GB):",
            f"  .venv/bin/pip install --force-reinstall 'torch=={f.torch_version}' --index-url {TORCH_CUDA_INDEX}",
            "  (cu128 = CUDA 12.8: pick the index of a CUDA version your driver supports; `nvidia-smi` shows "
            "the newest it supports, top right)"]
    return False, lines + [
        f"this torch is built for CUDA {f.torch_cuda} but cannot use the GPU: the NVIDIA driver is "
        "probably older than that CUDA version needs. Update the driver (`nvidia-smi` shows the CUDA "
        "version it supports), or install a torch built for an older CUDA, then run `potluck doctor` again"]


def main() -> int:
    ok, lines = advise(gather())
    print("\n".join(lines))
    return 0 if ok else 1
