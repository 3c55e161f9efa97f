"""Where the app keeps its files, per OS convention (platformdirs).

Linux: ~/.config/potluck (settings), ~/.local/share/potluck (chat history);
macOS: ~/Library/Application Support/Potluck; Windows: %APPDATA%\\Potluck.
POTLUCK_HOME puts everything in one folder instead (tests, portable installs) — the
same variable engine/wire/identity.py honours for the node key.
"""

from __future__ import annotations

import os
from pathlib import Path


def _home() -> Path | None:
    v = os.environ.get("POTLUCK_HOME")
    return Path(v) if v else None


def _made(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    return p


def config_dir() -> Path:
    if _home():
        return _made(_home())
    from platformdirs import user_config_dir

    return _made(Path(user_config_dir("potluck", appauthor=False)))


def data_dir() -> Path:
    if _home():
        return _made(_home())
    from platformdirs import user_data_dir

    return _made(Path(user_data_dir("potluck", appauthor=False)))


def runtime_dir() -> Path:
    if _home():
        return _made(_home() / "run")
    import warnings

    from platformdirs import user_runtime_dir

    with warnings.catch_warnings():   # no XDG_RUNTIME_DIR (a bare session): its /tmp fallback is fine
        warnings.simplefilter("ignore")
        return _made(Path(user_runtime_dir("potluck", appauthor=False)))


def assets_dir() -> Path:
    """assets/ beside the app package (source checkout, PyInstaller bundle)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "assets", here / "assets"):
        if cand.is_dir():
            return cand
    return here.parent / "assets"
