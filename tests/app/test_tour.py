"""`potluck app --tour DIR`: the real app, started the way the Start menu and the desktop
entry start it (defaults: the default model hosted on its default stages, no pinned
threads), answers in its chat window, shows its menu and host dialog, and opens the join
dialog when a second launch hands it a potluck:// link; it hosts for a friend from the Host
dialog, the friend's computer joins with the invite link shown there, the ring is drawn, the friend leaves and the chat goes on; then it quits
leaving no process.
The installed Windows build runs the same tour under wine (tests/installer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.tour import LINK_READY

ROOT = Path(__file__).resolve().parents[2]


def test_the_tour_answers_and_a_second_launch_hands_over_a_link(tmp_path):
    pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
    out = tmp_path / "tour"
    env = {**os.environ, "POTLUCK_HOME": str(tmp_path / "home"), "POTLUCK_KEYSTORE": "file",
           "QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1"}
    app = subprocess.Popen([sys.executable, "-m", "app.launcher", "app", "--no-tray", "--tour", str(out),
                            "--tour-link", "--tour-friend"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline = time.time() + 600
        while not (out / LINK_READY).exists():
            assert app.poll() is None, app.stdout.read()[-3000:]
            assert time.time() < deadline, "the tour never reached its link step"
            time.sleep(0.5)
        family = [app.pid] + [c.pid for c in psutil.Process(app.pid).children(recursive=True)]
        link = "potluck://join/4821-917305"
        second = subprocess.run([sys.executable, "-m", "app.launcher", "app", link], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 0 and "handed to it" in second.stderr, second.stderr
        code = app.wait(300)
        log = app.stdout.read()
        assert code == 0, log[-6000:]
    finally:
        if app.poll() is None:
            app.kill()
    report = json.loads((out / "tour.json").read_text())
    assert report["ok"], report
    steps = {s["step"]: s for s in report["steps"]}
    assert "Paris" in steps["chat"]["reply"], steps["chat"]
    assert steps["host-dialog"]["plan"] and not steps["host-dialog"]["error"]
    assert steps["link"]["code"] == "4821-917305"
    for png in ("chat-answered.png", "tray-menu.png", "host-dialog.png", "join-from-link.png", "invite.png",
                "friend-joined.png", "ring.png", "friend-left.png", "chat-after.png"):
        assert (out / png).stat().st_size > 2000, png
    # hosting for a friend from the Host dialog gave a link; the friend joined with it and
    # appeared there with what their computer gives
    assert steps["invite"]["link"].startswith("potluck://join/")
    assert "joined" in steps["friend-joined"]["seen"] and " free" in steps["friend-joined"]["seen"]
    # a friend joined with the code, was drawn in the ring, left; the chat went on
    assert steps["ring"]["joined"] and " → " in steps["ring"]["ring"] and "Paris" in steps["ring"]["reply"]
    assert "left" in steps["friend-left"]["ring"] and "left" in steps["friend-left"]["headline"]
    assert "Paris" in steps["after"]["reply"]
    # and no step showed a person the engine's words
    assert all(found == [] for found in report["engine_words"].values()), report["engine_words"]
    time.sleep(1)
    assert not [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], \
        "the app's node or stages outlived it"
