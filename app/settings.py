"""The app's settings: one JSON file in the OS's config folder, written atomically.

Unknown keys are ignored and bad values fall back to defaults, so a hand-edited or
half-written file never stops the app from starting.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from . import paths

FILE = "settings.json"
# the chat's presence and frequency penalties (the engine's PENALTIES; the GUI does not import it)
PENALTIES = ("presence_penalty", "frequency_penalty")


def default_limits() -> dict:
    # mirrors engine/node/sharing.py Limits (the GUI does not import the engine)
    return {"vram_cap_mb": None, "temp_pause_c": 83.0, "temp_resume_c": 75.0,
            "pause_for_other_processes": True, "other_process_mb": 1024.0, "other_grace_s": 30.0,
            "only_when_idle": False, "idle_after_s": 300.0}


@dataclass
class Settings:
    keep_history: bool = True
    host_on_start: bool = True
    default_model: str = "default"
    # stage processes on this computer when hosting alone; 0: automatic (one:
    # engine/core/local_stages.py)
    local_stages: int = 0
    share_on_start: bool = False
    # how friends see this computer when it joins them ("" : its computer name, which on a
    # real PC reads DESKTOP-7QK2J1)
    display_name: str = ""
    # the host request of a pipeline hosted with friends, for the next start: hosted again,
    # the friends' Potluck rejoining by itself (no API key kept here: that is the keyring's)
    host_with_friends: dict = field(default_factory=dict)
    share_port: int = 7860
    # the chat's OpenAI-compatible API on this computer: the same address from one start
    # to the next, so a tool set up with it keeps working (a free one if another program
    # holds it; 0: a free one every time)
    api_port: int = 8400
    pipeline_name: str = "potluck"
    max_tokens: int = 512
    # None: the model's sampling defaults, the same as the API's and `potluck chat`'s
    # (engine/core/sampling.py); a number: this temperature, the other settings neutral
    temperature: float | None = None
    # OpenAI's presence and frequency penalties, -2..2 (0: off), sent with every chat
    # request whatever the temperature setting (engine/core/sampling.py PENALTIES)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    limits: dict = field(default_factory=default_limits)

    @classmethod
    def load(cls, folder: Path | None = None) -> "Settings":
        path = (folder or paths.config_dir()) / FILE
        s = cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return s
        if not isinstance(raw, dict):
            return s
        for f in fields(cls):
            if f.name in raw:
                v, default = raw[f.name], getattr(s, f.name)
                if f.name == "limits" and isinstance(v, dict):
                    setattr(s, f.name, {**default_limits(), **{k: v[k] for k in v if k in default_limits()}})
                elif f.name in PENALTIES:
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and -2.0 <= v <= 2.0:
                        setattr(s, f.name, float(v))
                elif type(v) is type(default) or ((isinstance(default, float) or f.name == "temperature")
                                                  and isinstance(v, (int, float)) and not isinstance(v, bool)):
                    setattr(s, f.name, v)
        return s

    def penalties(self) -> dict:
        """The penalties a chat request carries: only those that are on."""
        return {k: getattr(self, k) for k in PENALTIES if getattr(self, k)}

    def save(self, folder: Path | None = None) -> Path:
        folder = folder or paths.config_dir()
        path = folder / FILE
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".settings-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path
