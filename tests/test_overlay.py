"""A CUDA build of torch downloaded later sits beside the shipped one and wins only when it
is switched on (engine/overlay.py); `potluck gpu --check` says which torch a process got.

A stand-in torch package plays the downloaded build: the mechanism is the same for a
2 GB wheel, and this machine has no GPU for the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = '''__version__ = "9.9.9+cu999"
from . import cuda, version
'''


def _stand_in(site: Path) -> None:
    pkg = site / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STAND_IN)
    (pkg / "version.py").write_text('cuda = "99.9"\n')
    (pkg / "cuda.py").write_text("def is_available():\n    return True\n\n"
                                 "def get_device_name(i):\n    return 'Stand-in GPU'\n")


def _check(home: Path, **env) -> tuple[int, dict]:
    e = {k: v for k, v in os.environ.items() if k != "POTLUCK_GPU_OVERLAY"}
    home.mkdir(parents=True, exist_ok=True)
    e.update(POTLUCK_HOME=str(home), PYTHONPATH=str(ROOT), **env)
    p = subprocess.run([sys.executable, "-m", "engine", "gpu", "--check"], capture_output=True,
                       text=True, timeout=300, cwd=str(home), env=e)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_the_shipped_torch_runs_until_a_finished_overlay_is_switched_on(tmp_path):
    home = tmp_path / "home"
    code, out = _check(home)
    assert code == 0 and out["overlay"] is None and out["torch"].startswith("2.")

    site = home / "gpu" / "site"
    _stand_in(site)
    code, out = _check(home)             # unpacked but not switched on: a half-finished install
    assert out["overlay"] is None and out["torch"].startswith("2.")

    (home / "gpu" / "ACTIVE").write_text("9.9.9+cu999\n")
    code, out = _check(home)
    assert code == 0 and out == {"torch": "9.9.9+cu999", "cuda": "99.9", "cuda_available": True,
                                 "device_name": "Stand-in GPU", "overlay": str(site)}

    code, out = _check(home, POTLUCK_GPU_OVERLAY="off")   # the way back without deleting anything
    assert out["overlay"] is None and out["torch"].startswith("2.")


def test_a_staged_folder_is_tried_before_it_is_installed_and_a_broken_one_says_why(tmp_path):
    staged = tmp_path / "staged"
    _stand_in(staged)
    code, out = _check(tmp_path / "home", POTLUCK_GPU_OVERLAY=str(staged))
    assert code == 0 and out["torch"] == "9.9.9+cu999" and out["overlay"] == str(staged)

    (staged / "torch" / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open')\n")
    code, out = _check(tmp_path / "home", POTLUCK_GPU_OVERLAY=str(staged))
    assert code == 1 and "libcudart" in out["error"] and out["torch"] is None
