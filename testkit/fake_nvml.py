"""pynvml without a GPU: what NVML reports on a computer with an NVIDIA card, for tests
of what the app offers there (nothing else is faked: this machine has no such card).

    fake_nvml(names=("NVIDIA GeForce RTX 3060",), driver=13000)   # a module-like object
    PYNVML_SOURCE   # the same as a pynvml.py to put first on a child process's PYTHONPATH
"""

from __future__ import annotations

import types


def fake_nvml(names=("NVIDIA GeForce RTX 3060",), driver: int = 13000, capability=(8, 6), init_error=None):
    m = types.SimpleNamespace()

    def init():
        if init_error is not None:
            raise init_error

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: names[h]
    m.nvmlDeviceGetCudaComputeCapability = lambda h: capability
    m.nvmlSystemGetCudaDriverVersion = lambda: driver
    return m


PYNVML_SOURCE = '''
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetName(h): return b"Stand-in GPU"
def nvmlDeviceGetCudaComputeCapability(h): return (8, 6)
def nvmlSystemGetCudaDriverVersion(): return 13000
'''
