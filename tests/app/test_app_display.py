"""The app's start-up checks: no display, or an X11 display Qt cannot use, lead to the
terminal chat with a message that says what to do (Qt itself would abort the process)."""

from __future__ import annotations

import ctypes.util

import app.main as appmain


def _x11_env(monkeypatch, platform=None):
    monkeypatch.setattr(appmain.sys, "platform", "linux")
    monkeypatch.setenv("DISPLAY", ":5")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if platform is None:
        monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    else:
        monkeypatch.setenv("QT_QPA_PLATFORM", platform)


def test_missing_xcb_library_falls_back_with_the_install_line(monkeypatch):
    _x11_env(monkeypatch)
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None if name == "xcb-cursor" else real(name)
                        or f"lib{name}.so")
    seen = {}

    def fallback(args, why=None):
        seen["why"] = why
        return 7

    monkeypatch.setattr(appmain, "terminal_fallback", fallback)
    assert appmain.on_x11()
    assert appmain.missing_x11_packages() == ["libxcb-cursor0"]
    assert appmain.main(["--no-host"]) == 7
    assert "sudo apt-get install -y libxcb-cursor0" in seen["why"]


def test_no_display_falls_back(monkeypatch):
    monkeypatch.setattr(appmain.sys, "platform", "linux")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    seen = {}
    monkeypatch.setattr(appmain, "terminal_fallback", lambda args, why=None: seen.setdefault("called", 3))
    assert appmain.main([]) == 3


def test_only_x11_is_checked(monkeypatch):
    _x11_env(monkeypatch, platform="offscreen")
    assert not appmain.on_x11()
    _x11_env(monkeypatch)
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    assert not appmain.on_x11()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so")
    assert appmain.missing_x11_packages() == []
