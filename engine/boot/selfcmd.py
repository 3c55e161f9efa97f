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
    return [sys.executable, "-m", "engine"]
