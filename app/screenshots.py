"""Screenshots of the desktop app, for people to look at: the tray menu, the chat window
mid-conversation, the host and join dialogs, the pipeline status.

    .venv/bin/python -m app.screenshots --out screenshots/

It starts a virtual X display (Xvfb) unless --use-display is given, starts the app's
node hosting the default model, holds a short conversation, and saves PNGs into the
folder. Xvfb and Qt's X11 libraries come from the system's packages; on Debian/Ubuntu:

    sudo apt-get install -y xvfb libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 \\
        libxcb-keysyms1 libxcb-shape0 libxcb-render-util0 libxcb-image0 fonts-dejavu-core

(`--install` runs that apt-get line itself when you are root.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .tour import settle, shoot, wait

APT = ["xvfb", "libxkbcommon-x11-0", "libxcb-cursor0", "libxcb-icccm4", "libxcb-keysyms1", "libxcb-shape0",
       "libxcb-render-util0", "libxcb-image0", "libxcb-randr0", "libxcb-xinerama0", "libegl1", "libgl1",
       "libfontconfig1", "libdbus-1-3", "fonts-dejavu-core"]


def start_xvfb(size: str) -> tuple[subprocess.Popen, str]:
    for n in range(99, 140):
        if Path(f"/tmp/.X11-unix/X{n}").exists() or Path(f"/tmp/.X{n}-lock").exists():
            continue
        proc = subprocess.Popen(["Xvfb", f":{n}", "-screen", "0", f"{size}x24", "-nolisten", "tcp"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if Path(f"/tmp/.X11-unix/X{n}").exists():
                return proc, f":{n}"
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.kill()
    raise RuntimeError("could not start Xvfb on any display :99-:139")


def icons_sheet(path: Path):
    """The tray icon in each state, side by side with its name."""
    from PySide6.QtCore import QRect, Qt
    from PySide6.QtGui import QColor, QPainter, QPixmap

    from .tray import STATES, state_icon

    cell = 110
    sheet = QPixmap(cell * len(STATES), 120)
    sheet.fill(QColor("#f3f4f6"))
    p = QPainter(sheet)
    for i, s in enumerate(STATES):
        p.drawPixmap(i * cell + 23, 10, state_icon(s).pixmap(64, 64))
        p.drawText(QRect(i * cell, 80, cell, 30), Qt.AlignCenter, s)
    p.end()
    sheet.save(str(path))
    print(f"  saved {path}", flush=True)


def capture(out: Path, threads: int | None):
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QApplication

    from .controller import Controller
    from .settings import Settings
    from .store import History
    from .tray import Shell, state_icon

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Potluck")
    app.setWindowIcon(state_icon("serving"))
    settings = Settings(temperature=0.0, max_tokens=220, share_port=0)
    node_args = ["--share-host", "127.0.0.1", "--share-port", "0"] + (["--threads", str(threads)] if threads else [])
    c = Controller(settings, node_args=node_args, history=History(None, keep=False))
    shell = Shell(c, use_tray=False)
    try:
        print("Starting the engine and loading the default model…", flush=True)
        if not c.start_node():
            raise RuntimeError(c.lost)
        chat = shell.chat
        chat.resize(1100, 720)
        chat.show()
        wait(app, lambda: bool((c.status.get("hosting") or {}).get("openai_url")), 600, "the pipeline")
        settle(app, 1.5)

        chat.send("What is the capital of France?")
        wait(app, lambda: not chat.generating, 300, "the first reply")
        chat.send("Give me three tips for baking bread at home, as a short list.")
        wait(app, lambda: chat.delta_count >= 25 or not chat.generating, 300, "the reply to start")
        settle(app, 0.3)
        shoot(chat, out / "chat-mid-reply.png")
        wait(app, lambda: not chat.generating, 300, "the second reply")
        settle(app, 1.2)
        shoot(chat, out / "chat-complete.png")

        icons_sheet(out / "tray-icons.png")
        # the tray menu (an X server without a tray shows the same menu as a popup)
        shell.on_status(c.status)
        shell.menu.popup(QPoint(900, 40))
        settle(app, 0.5)
        shoot(shell.menu, out / "tray-menu.png")
        shell.menu.hide()

        host = shell.open_host()
        host.check()
        wait(app, lambda: host.last_plan is not None or host.last_error is not None, 120, "the plan")
        settle(app, 0.5)
        shoot(host, out / "host-dialog.png")
        host.close()

        join = shell.open_join()
        # by a pipeline's name (under Advanced): a code needs a host to answer it, and a name
        # typed where the code goes is refused as no code
        join.advanced.setChecked(True)
        join.pipeline.setText("alices-pipeline")
        join.port.setValue(0)
        settle(app, 0.3)
        shoot(join, out / "join-dialog.png")
        join.join()
        wait(app, lambda: "ws://" in join.result.text() or join.last_error is not None, 60, "joining")
        wait(app, lambda: bool((c.status.get("sharing") or {}).get("running")), 30, "sharing")
        settle(app, 1.5)
        shoot(join, out / "join-accepted.png")
        join.close()

        status = shell.open_status()
        status.resize(640, 480)
        settle(app, 1.5)
        shoot(status, out / "pipeline-status.png")
        status.close()
    finally:
        shell.quit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.screenshots", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="screenshots", help="folder for the PNGs (default ./screenshots)")
    p.add_argument("--use-display", action="store_true", help="use the current DISPLAY instead of Xvfb")
    p.add_argument("--size", default="1280x900", help="virtual screen size")
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine process")
    p.add_argument("--install", action="store_true", help="apt-get install Xvfb and Qt's X11 libraries (root)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    xvfb = None
    if not args.use_display:
        from .main import missing_x11_packages

        if (shutil.which("Xvfb") is None or missing_x11_packages()) and args.install:
            subprocess.check_call(["apt-get", "update", "-qq"])
            subprocess.check_call(["apt-get", "install", "-y", "-qq", *APT])
        if shutil.which("Xvfb") is None or missing_x11_packages():
            print("app.screenshots: Xvfb or Qt's X11 libraries are not installed. Install them with\n"
                  f"  sudo apt-get install -y {' '.join(APT)}\n"
                  "or run with --install (as root), or --use-display on a desktop.", file=sys.stderr)
            return 2
        xvfb, display = start_xvfb(args.size)
        os.environ["DISPLAY"] = display
        os.environ["QT_QPA_PLATFORM"] = "xcb"
        os.environ.pop("WAYLAND_DISPLAY", None)
    try:
        capture(out, args.threads)
    finally:
        if xvfb is not None:
            xvfb.terminate()
            xvfb.wait(10)
    print(f"Screenshots in {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
