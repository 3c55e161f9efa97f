""""Start Potluck when I sign in" writes the OS's own autostart entry (XDG autostart on
Linux), from the Settings dialog, and the entry starts what is running now."""

from __future__ import annotations

import shlex
import sys

import pytest

from app import autostart


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    return tmp_path / "config" / "autostart" / "potluck.desktop"


@pytest.mark.skipif(sys.platform == "win32", reason="the Run key is tested by the Windows installer's smoke test")
def test_enable_disable(xdg):
    assert not autostart.is_enabled()
    autostart.enable(["/opt/potluck dir/potluck", "app"])
    assert autostart.is_enabled()
    exec_line = next(line for line in xdg.read_text().splitlines() if line.startswith("Exec="))
    assert shlex.split(exec_line[5:]) == ["/opt/potluck dir/potluck", "app"]
    autostart.disable()
    assert not autostart.is_enabled() and not xdg.exists()
    autostart.disable()  # twice is fine


def test_command_starts_the_app_from_here():
    cmd = autostart.app_command()
    assert cmd[0] == sys.executable and cmd[-1] == "app"


@pytest.mark.skipif(sys.platform == "win32", reason="XDG autostart")
def test_settings_dialog_checkbox(qtbot, xdg):
    pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
    from app.controller import Controller
    from app.settings_dialog import SettingsDialog
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(None, keep=False))
    c.set_limits = lambda limits: None   # no node here; the limits are tested with one elsewhere
    try:
        d = SettingsDialog(c)
        qtbot.addWidget(d)
        assert not d.autostart.isChecked()
        d.autostart.setChecked(True)
        d.save()
        assert xdg.exists() and "app" in xdg.read_text()
        d2 = SettingsDialog(c)
        qtbot.addWidget(d2)
        assert d2.autostart.isChecked()
        d2.autostart.setChecked(False)
        d2.save()
        assert not xdg.exists()
    finally:
        c.shutdown()
