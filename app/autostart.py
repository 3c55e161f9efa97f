""""Start Potluck when I sign in": the OS's own autostart entry, not a setting of ours,
so the installers' checkbox (Windows: the Run key value below) and the Settings dialog's
checkbox read and write the same thing.

Linux: an XDG autostart file, $XDG_CONFIG_HOME/autostart/potluck.desktop.
Windows: HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run, value "Potluck".
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE = "Potluck"


def app_command() -> list[str]:
    """How the OS should start the app at sign-in, from what is running now."""
    if getattr(sys, "frozen", False):          # the PyInstaller bundle: `potluck` itself
        return [sys.executable, "app"]
    exe = Path(sys.executable)
    if os.name == "nt":
        # the Windows installer's layout: <dir>\python\pythonw.exe beside <dir>\Potluck-App.exe
        launcher = exe.parent.parent / "Potluck-App.exe"
        if launcher.exists():
            return [str(launcher)]
        pythonw = exe.with_name("pythonw.exe")
        return [str(pythonw if pythonw.exists() else exe), "-m", "app.launcher", "app"]
    return [str(exe), "-m", "app.launcher", "app"]


def _desktop_file() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "autostart" / "potluck.desktop"


def is_enabled() -> bool:
    if os.name == "nt":
        import winreg

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as k:
                winreg.QueryValueEx(k, RUN_VALUE)
            return True
        except OSError:
            return False
    return _desktop_file().exists()


def enable(command: list[str] | None = None) -> None:
    cmd = command or app_command()
    if os.name == "nt":
        import subprocess
        import winreg

        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as k:
            winreg.SetValueEx(k, RUN_VALUE, 0, winreg.REG_SZ, subprocess.list2cmdline(cmd))
        return
    path = _desktop_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # the Exec key has its own quoting rules; shlex quoting is a subset of what they allow
    path.write_text("[Desktop Entry]\nType=Application\nName=Potluck\n"
                    "Comment=Pool friends' GPUs to run one model\n"
                    f"Exec={' '.join(shlex.quote(c) for c in cmd)}\nIcon=potluck\nTerminal=false\n"
                    "X-GNOME-Autostart-enabled=true\n")


def disable() -> None:
    if os.name == "nt":
        import winreg

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as k:
                winreg.DeleteValue(k, RUN_VALUE)
        except OSError:
            pass
        return
    _desktop_file().unlink(missing_ok=True)
