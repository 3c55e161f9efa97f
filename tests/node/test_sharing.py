"""The sharing policy (engine/node/sharing.py) and the NVML readings (engine/node/gpu.py).

No GPU exists here, so NVML is a fake module put in sys.modules: the policy is pure
and is fed readings by hand.
"""

from __future__ import annotations

import sys
import types

import pytest

from engine.node import gpu
from engine.node.gpu import GpuReading, ProcessUse
from engine.node.sharing import Limits, SharePolicy

OWN = {100, 101}


def reading(temp=60.0, procs=(), util=10.0, used=1000.0, total=8000.0):
    return GpuReading(0, "Fake RTX", util, used, total, temp, 120.0, [ProcessUse(p, mb) for p, mb in procs])


def test_nothing_to_complain_about():
    d = SharePolicy().evaluate(reading(), OWN, None, 0.0)
    assert not d.paused and d.reasons == []


def test_temperature_hysteresis():
    pol = SharePolicy(Limits(temp_pause_c=80, temp_resume_c=70))
    assert not pol.evaluate(reading(79), OWN, None, 0).paused
    d = pol.evaluate(reading(80), OWN, None, 1)
    assert d.paused and "hot" in d.reason and "70" in d.reason
    # cooling a little is not enough: no flapping around the limit
    assert pol.evaluate(reading(78), OWN, None, 2).paused
    assert pol.evaluate(reading(71), OWN, None, 3).paused
    assert not pol.evaluate(reading(70), OWN, None, 4).paused
    assert not pol.evaluate(reading(79), OWN, None, 5).paused  # below the pause limit again


def test_other_heavy_process_pauses_with_grace_period():
    pol = SharePolicy(Limits(other_process_mb=1000, other_grace_s=30))
    assert not pol.evaluate(reading(procs=[(100, 5000), (555, 200)]), OWN, None, 0).paused  # ours, and small
    d = pol.evaluate(reading(procs=[(555, 3000)]), OWN, None, 10)
    assert d.paused and "another program" in d.reason and "555" not in d.reason
    d = pol.evaluate(reading(procs=[]), OWN, None, 20)  # the game just quit
    assert d.paused and "resuming in 20 s" in d.reason
    assert not pol.evaluate(reading(procs=[]), OWN, None, 41).paused


def test_other_processes_ignored_when_switched_off():
    pol = SharePolicy(Limits(pause_for_other_processes=False))
    assert not pol.evaluate(reading(procs=[(555, 9000)]), OWN, None, 0).paused


def test_vram_cap():
    pol = SharePolicy(Limits(vram_cap_mb=2000))
    assert not pol.evaluate(reading(procs=[(100, 1500)]), OWN, None, 0).paused
    d = pol.evaluate(reading(procs=[(100, 1500), (101, 800)]), OWN, None, 0)
    assert d.paused and "2300 MB" in d.reason
    assert pol.vram_allowance_mb(reading(total=8000, procs=[(555, 7000)]), OWN) == 1000
    assert pol.vram_allowance_mb(reading(total=8000), OWN) == 2000
    assert pol.vram_allowance_mb(None, OWN) is None


def test_only_when_idle():
    pol = SharePolicy(Limits(only_when_idle=True, idle_after_s=300))
    assert pol.evaluate(None, OWN, None, 0).paused          # cannot tell: stay polite
    assert pol.evaluate(None, OWN, 10, 0).paused
    assert not pol.evaluate(None, OWN, 301, 0).paused
    assert not pol.evaluate(reading(), OWN, 301, 0).paused


def test_no_gpu_only_idle_rule_applies():
    assert not SharePolicy(Limits(vram_cap_mb=1)).evaluate(None, OWN, None, 0).paused


def test_several_reasons_reported():
    pol = SharePolicy(Limits(temp_pause_c=80, temp_resume_c=70, only_when_idle=True))
    d = pol.evaluate(reading(90, procs=[(555, 5000)]), OWN, 0, 0)
    assert len(d.reasons) == 3


@pytest.mark.parametrize("bad", [
    dict(vram_cap_mb=0), dict(temp_pause_c=70, temp_resume_c=80), dict(temp_pause_c=None),
    dict(other_process_mb=-1), dict(idle_after_s=-5)])
def test_bad_limits_refused(bad):
    with pytest.raises(ValueError):
        Limits(**bad).validate()


@pytest.mark.parametrize("bad, said", [
    (dict(vram_cap_mb="x"), "vram_cap_mb must be a number (or empty)"),
    (dict(other_grace_s=None), "other_grace_s must be a number"),
    (dict(idle_after_s=float("nan")), "idle_after_s must be a number"),
    (dict(only_when_idle="yes"), "only_when_idle must be true or false"),
    (dict(other_process_mb=True), "other_process_mb must be a number")])
def test_a_limit_of_the_wrong_type_is_named(bad, said):
    """The app's settings (and the node's POST /limits) are told which value is wrong,
    not Python's "'<=' not supported between instances of 'str' and 'int'"."""
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        Limits.from_json(bad)


def test_limits_json_round_trip_ignores_unknown_keys():
    lim = Limits.from_json({"vram_cap_mb": 4096, "nonsense": 1})
    assert lim.vram_cap_mb == 4096
    assert Limits.from_json(lim.to_json()) == lim


def test_no_nvidia_gpu_reads_cleanly(monkeypatch):
    fake = types.ModuleType("pynvml")

    class LibraryNotFound(Exception):
        pass

    def init():
        raise LibraryNotFound("libnvidia-ml.so.1 not found")

    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus, why = gpu.read_gpus()
    assert gpus == [] and why == "no NVIDIA driver is installed"     # in words, not the library's class
    s = gpu.gpu_summary()
    assert s["available"] is False and "No NVIDIA GPU" in s["message"] and "processor" in s["message"]
    assert "NVML" not in s["message"] and "Error" not in s["message"]


def test_nvml_readings(monkeypatch):
    fake = types.ModuleType("pynvml")
    ns = types.SimpleNamespace
    fake.NVML_TEMPERATURE_GPU = 0
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda i: "h0"
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 3060"
    fake.nvmlDeviceGetUtilizationRates = lambda h: ns(gpu=42, memory=10)
    fake.nvmlDeviceGetMemoryInfo = lambda h: ns(used=3 * 2**30, total=12 * 2**30, free=9 * 2**30)
    fake.nvmlDeviceGetTemperature = lambda h, kind: 67
    fake.nvmlDeviceGetPowerUsage = lambda h: 145000
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [ns(pid=4242, usedGpuMemory=2 * 2**30)]
    fake.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [ns(pid=777, usedGpuMemory=None)]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus, why = gpu.read_gpus()
    assert why is None and len(gpus) == 1
    g = gpus[0]
    assert g.name == "NVIDIA GeForce RTX 3060" and g.utilization_pct == 42 and g.temperature_c == 67
    assert g.memory_total_mb == 12 * 1024 and g.power_w == 145.0
    assert [(p.pid, p.memory_mb) for p in g.processes] == [(4242, 2048.0), (777, 0.0)]
    s = gpu.gpu_summary()
    assert s["available"] and "42% busy" in s["message"] and "67 °C" in s["message"]
    # and the policy reads it: pid 4242 is someone else's 2 GB job
    assert SharePolicy(Limits(other_process_mb=1024)).evaluate(g, OWN, None, 0).paused
