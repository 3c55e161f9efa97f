"""Which torch this process imports: the CPU build the installer ships, or the CUDA build
the app downloaded later (app/gpu_enable.py) into `<data dir>/gpu/site`.

The CUDA build is not installed over the shipped one: it sits beside it, and `activate()`
puts its folder first on sys.path before anything imports torch, so the shipped files
are never touched and going back to the CPU is deleting one file (ACTIVE). That holds in
a PyInstaller 6 bundle too: its frozen importer is a path-entry finder (sys.path_hooks)
that only answers for folders inside the bundle, so an earlier sys.path entry wins.

ACTIVE is written last, after a child process has imported torch from the new folder,
so a half-finished install is never picked up. POTLUCK_GPU_OVERLAY=<folder> tries a
staged folder instead (the installer's check); POTLUCK_GPU_OVERLAY=off ignores the
overlay (a way out if the CUDA build ever stops starting).

Standard library only (platformdirs, lazily, for the same data folder app/paths.py uses):
it runs before everything else, in every engine process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "POTLUCK_GPU_OVERLAY"
GPU_DIR = "gpu"          # under the data folder
SITE = "site"            # the installed overlay: a folder of unpacked wheels
ACTIVE = "ACTIVE"        # its presence switches the overlay on

_active: str | None = None


def data_dir() -> Path:
    """app/paths.py's data_dir() without creating it: POTLUCK_HOME, else the OS convention."""
    home = os.environ.get("POTLUCK_HOME")
    if home:
        return Path(home)
    from platformdirs import user_data_dir

    return Path(user_data_dir("potluck", appauthor=False))


def gpu_dir() -> Path:
    return data_dir() / GPU_DIR


def chosen() -> Path | None:
    """The folder this process should import torch from first, if any."""
    forced = os.environ.get(ENV, "")
    if forced == "off":
        return None
    if forced:
        return Path(forced) if Path(forced).is_dir() else None
    d = gpu_dir()
    # both, not just ACTIVE: a crash between the installer's renames leaves no site
    if (d / ACTIVE).is_file() and (d / SITE).is_dir():
        return d / SITE
    return None


def activate() -> str | None:
    """Put the overlay first on sys.path; returns its folder (None: the shipped torch).

    Never raises: a broken data folder must not stop the engine from starting."""
    global _active
    if _active is not None:
        return _active
    if "torch" in sys.modules:  # too late: mixing two torch builds in one process is worse
        return None
    try:
        path = chosen()
    except Exception:
        return None
    if path is None:
        return None
    _active = str(path)
    sys.path.insert(0, _active)
    return _active


def active() -> str | None:
    """The overlay folder activate() put on sys.path, if it did."""
    return _active
