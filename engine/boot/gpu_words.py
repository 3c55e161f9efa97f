"""What NVML's errors mean to the person at this computer, in words (standard library
only: the app, which never imports the engine, says them too: app/gpu_enable.py)."""

from __future__ import annotations

# NVML's class names are the library's words: the app and the terminal show these instead
_NVML_WORDS = (("LibraryNotFound", "no NVIDIA driver is installed"),
               ("Library Not Found", "no NVIDIA driver is installed"),
               ("DriverNotLoaded", "the NVIDIA driver is installed but not running: restart the computer"),
               ("NoPermission", "this user may not read the GPU"),
               ("InsufficientPower", "the GPU's power cable is not connected"),
               ("GpuIsLost", "the GPU stopped answering: restart the computer"))


def nvml_reason(exc: BaseException) -> str:
    text = f"{exc.__class__.__name__} {exc}"
    return next((words for key, words in _NVML_WORDS if key in text), "the NVIDIA driver did not answer")
