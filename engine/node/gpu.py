"""What the GPU is doing right now, from NVML (nvidia-ml-py): the tray's GPU panel and
the inputs of the sharing policy (sharing.py).

`read_gpus()` never raises: on a machine without an NVIDIA GPU or driver it returns
an empty list and `gpu_summary()` says so in plain words. No torch here: the node's
control API and the policy loop call this without touching CUDA.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from engine.boot.gpu_words import nvml_reason


@dataclass
class ProcessUse:
    pid: int
    memory_mb: float


@dataclass
class GpuReading:
    index: int
    name: str
    utilization_pct: float          # the whole GPU, every process
    memory_used_mb: float
    memory_total_mb: float
    temperature_c: float
    power_w: float | None
    processes: list[ProcessUse] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, nvml_reason(exc)
    return pynvml, None


def read_gpus() -> tuple[list[GpuReading], str | None]:
    """(readings, why none): one reading per NVIDIA GPU, or [] and the reason."""
    nvml, why = _nvml()
    if nvml is None:
        return [], why
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            temp = nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
            try:
                power = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except Exception:
                power = None
            procs = []
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(nvml, getter)(h):
                        used = getattr(p, "usedGpuMemory", None) or 0
                        procs.append(ProcessUse(int(p.pid), used / 2**20))
                except Exception:
                    pass
            out.append(GpuReading(i, name, float(util), mem.used / 2**20, mem.total / 2**20, float(temp),
                                  power, procs))
    except Exception as exc:
        return [], nvml_reason(exc)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return out, None


def gpu_summary() -> dict:
    """JSON for the control API: {"available": bool, "gpus": [...], "message": str}."""
    gpus, why = read_gpus()
    if not gpus:
        return {"available": False, "gpus": [],
                "message": f"No NVIDIA GPU to use ({why}): Potluck computes on the processor." if why
                else "No NVIDIA GPU to use: Potluck computes on the processor."}
    g = gpus[0]
    return {"available": True, "gpus": [r.to_json() for r in gpus],
            "message": f"{g.name}: {g.utilization_pct:.0f}% busy, {g.memory_used_mb:.0f}/"
                       f"{g.memory_total_mb:.0f} MB, {g.temperature_c:.0f} °C"}


def own_pids() -> set[int]:
    """This process and its children: the GPU use that is Potluck's own."""
    pids = {os.getpid()}
    try:
        import psutil

        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    except Exception:
        pass
    return pids
