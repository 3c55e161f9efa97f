"""How this program starts another copy of itself (stage processes, the app's node, the
terminal-chat fallback).

From a source checkout or a virtualenv the engine runs as `python -m engine`; inside the
installed bundle (PyInstaller sets sys.frozen) there is no interpreter to pass `-m` to:
the `potluck` executable *is* the entry point and takes the engine's arguments itself.
"""

from __future__ import annotations

import sys


def engine_command() -> list[str]:
    """argv prefix that runs the engine's command line: append e.g. ["stage", ...]."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, *interpreter_flags(), "-m", "engine"]


def interpreter_flags() -> list[str]:
    """The flags this interpreter was started with that a copy of it must keep.

    The Windows launcher starts the embedded Python with `-s` (the user's own
    site-packages, .pth files and usercustomize must not change Potluck: its `._pth` file
    does not keep them out) and `-X utf8` (replies are UTF-8 through a pipe, not cp1252;
    the `._pth` file makes Python ignore PYTHONUTF8 and PYTHONIOENCODING). Environment
    variables would not reach the copies for the same reason, so the flags travel."""
    flags = []
    if sys.flags.no_user_site and not sys.flags.isolated:
        flags.append("-s")
    if sys.flags.isolated:
        flags.append("-I")
    if sys.flags.utf8_mode == 1:
        flags += ["-X", "utf8"]
    return flags
