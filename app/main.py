"""`potluck-app` (or `potluck app`): the tray app.

It starts this machine's node process, hosts the default model (unless told not to)
so the chat answers right away, and sits in the tray. One instance per user: a second
launch asks the first to show its chat window and exits. With no display it says so
and runs the terminal chat (`potluck chat`) instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from engine.boot.selfcmd import engine_command

from .links import is_link

SERVER_NAME = "potluck-app"
# a message between launches is one line: "show" or "link <potluck://…>" (links.MAX_LINK_CHARS)
MAX_MESSAGE = 8192


def has_display() -> bool:
    if sys.platform in ("win32", "darwin"):
        return True
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs",
                                                                 "linuxfb"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


# Qt 6.5+ aborts the whole process (it cannot be caught) when its X11 plugin lacks a
# system library; these are the ones a stock desktop may not have (Ubuntu 22.04 lacks
# libxcb-cursor0), with the Debian/Ubuntu package that brings each.
X11_LIBS = {"xcb-cursor": "libxcb-cursor0", "xkbcommon-x11": "libxkbcommon-x11-0", "xcb-icccm": "libxcb-icccm4",
            "xcb-keysyms": "libxcb-keysyms1", "xcb-shape": "libxcb-shape0", "xcb-render-util": "libxcb-render-util0",
            "xcb-image": "libxcb-image0"}


def on_x11() -> bool:
    """Whether Qt will use its X11 (xcb) plugin here."""
    if sys.platform != "linux" or os.environ.get("WAYLAND_DISPLAY") or not os.environ.get("DISPLAY"):
        return False
    return os.environ.get("QT_QPA_PLATFORM", "xcb").split(":")[0] == "xcb"


def missing_x11_packages() -> list[str]:
    """Packages of X11_LIBS whose library this (Linux) machine cannot find."""
    import ctypes.util

    return [pkg for lib, pkg in X11_LIBS.items() if ctypes.util.find_library(lib) is None]


def terminal_fallback(args, why: str | None = None) -> int:
    why = why or "no display found (DISPLAY and WAYLAND_DISPLAY are unset), so the tray app cannot open"
    print(f"potluck-app: {why}; starting the terminal chat instead (`potluck chat`).", file=sys.stderr, flush=True)
    cmd = engine_command() + ["chat", "--model", args.model or "default"] \
        + (["--stages", str(args.stages)] if args.stages else [])
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


class SingleInstance:
    """A QLockFile per user; the running instance listens on a QLocalServer for one-line
    messages from later launches: "show", or "link <potluck://…>" (an invite clicked)."""

    def __init__(self, name: str = SERVER_NAME, lock_dir=None):
        from PySide6.QtCore import QLockFile

        from . import paths

        where = lock_dir or paths.runtime_dir()
        # the server's name follows the lock's folder (per user, per POTLUCK_HOME): Windows
        # has no uid, and its named pipes are machine-wide, so two people signed in at once
        # (or a portable copy beside an installed one) would otherwise hand each other links
        digest = hashlib.sha256(str(Path(where).resolve()).encode("utf-8")).hexdigest()[:16]
        self.name = f"{name}-{digest}"
        self.lock = QLockFile(str(where / f"{name}.lock"))
        self.lock.setStaleLockTime(0)
        self.server = None

    def acquire(self, on_message) -> bool:
        """on_message(text) runs in the GUI thread for each message a later launch sends."""
        from PySide6.QtNetwork import QLocalServer

        if not self.lock.tryLock(100):
            return False
        QLocalServer.removeServer(self.name)
        self.server = QLocalServer()
        self.server.newConnection.connect(lambda: self._serve(on_message))
        self.server.listen(self.name)
        return True

    def _serve(self, on_message):
        sock = self.server.nextPendingConnection()
        if sock is None:
            return
        buf = bytearray()

        def read():
            buf.extend(bytes(sock.readAll()))
            # another local program could connect too: read one bounded line, nothing more
            if b"\n" in buf or len(buf) > MAX_MESSAGE:
                line = bytes(buf[:MAX_MESSAGE]).split(b"\n", 1)[0].decode("utf-8", "replace").strip()
                buf.clear()
                sock.disconnectFromServer()
                on_message(line)

        sock.readyRead.connect(read)
        sock.disconnected.connect(sock.deleteLater)

    def notify_running(self, message: str = "show") -> bool:
        from PySide6.QtNetwork import QLocalSocket

        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if not sock.waitForConnected(2000):
            return False
        sock.write(message.encode("utf-8")[:MAX_MESSAGE - 1] + b"\n")
        sock.waitForBytesWritten(1000)
        sock.disconnectFromServer()
        return True

    def release(self):
        if self.server is not None:
            self.server.close()
        self.lock.unlock()


def screenshot_menu(path: str) -> int:
    """The tray menu rendered into a PNG, without starting the engine: proves an installed
    bundle's Qt, its plugins, fonts and our SVG icons load (the installers' smoke tests)."""
    if not has_display():
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtCore import QCoreApplication, QEvent, QPoint
    from PySide6.QtWidgets import QApplication

    from .controller import Controller
    from .settings import Settings
    from .store import History
    from .tray import Shell

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Potluck")
    controller = Controller(Settings(), history=History(None, keep=False))
    shell = Shell(controller, use_tray=False)
    shell.chat.hide()
    shell.menu.popup(QPoint(10, 10))
    for _ in range(5):
        app.processEvents()
    ok = shell.menu.grab().save(path)
    shell.menu.hide()
    # Qt deletes the windows and the menu now, not Python's collector at exit: left to it,
    # the teardown order aborted the process ("shared QObject was deleted directly")
    shell.close()
    controller.shutdown()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    app.processEvents()
    if not ok:
        print(f"potluck-app: could not write {path}", file=sys.stderr)
        return 1
    print(f"saved the tray menu to {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="potluck-app", description="Potluck desktop app (tray icon and chat window)")
    p.add_argument("--model", default=None, help="model to host at start (default: the settings', 'default')")
    p.add_argument("--stages", type=int, default=None,
                   help="local stages when hosting (default: the setting, automatic unless changed: 1)")
    p.add_argument("--no-host", action="store_true", help="do not host a model at start")
    p.add_argument("--no-tray", action="store_true", help="open the chat window instead of a tray icon")
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine process")
    p.add_argument("--screenshot", metavar="PNG", default=None,
                   help="render the tray menu into this PNG and exit (no engine; checks an install)")
    p.add_argument("--tour", metavar="DIR", default=None,
                   help="walk through the app (chat, tray menu, host dialog), save screenshots and "
                        "tour.json into DIR, and quit (checks an install; shows what the app shows)")
    p.add_argument("--tour-timeout", type=float, default=900, metavar="SECONDS",
                   help="with --tour: how long each wait (the engine, the pipeline, a reply) may take "
                        "before the tour stops and says where (default 900)")
    p.add_argument("--tour-link", action="store_true",
                   help="with --tour: also wait for a potluck:// link from another launch")
    p.add_argument("--tour-friend", action="store_true",
                   help="with --tour: host with a friend's computer (a second node here), draw the ring, "
                        "let the friend leave and chat on")
    p.add_argument("link", nargs="?", default=None,
                   help="a potluck://join/<code> link: opens the join dialog with it filled in")
    args = p.parse_args(argv)
    if args.link is not None and not is_link(args.link):
        p.error(f"'{args.link}' is not a potluck:// link")
    if args.screenshot:
        return screenshot_menu(args.screenshot)
    if not has_display():
        return terminal_fallback(args)
    missing = missing_x11_packages() if on_x11() else []
    if missing:
        return terminal_fallback(args, "Qt's X11 support needs system libraries this machine lacks; install them "
                                       f"with `sudo apt-get install -y {' '.join(missing)}` (or `make qt-libs` as "
                                       "root) and start Potluck again")

    from PySide6.QtWidgets import QApplication

    from .controller import Controller
    from .settings import Settings
    from .tray import Shell, state_icon

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Potluck")
    app.setWindowIcon(state_icon("serving"))
    single = SingleInstance()
    shell_ref = {}

    def on_message(text: str):
        shell = shell_ref.get("shell")
        if shell is None:
            return
        if text.startswith("link "):
            shell.open_link(text[5:])
        else:
            shell.open_chat()

    if not single.acquire(on_message):
        if single.notify_running(f"link {args.link}" if args.link else "show"):
            print("Potluck is already running; " + ("the link was handed to it." if args.link else
                                                    "its chat window was brought up."), file=sys.stderr)
            return 0
        print("potluck-app: another instance holds the lock but does not answer.", file=sys.stderr)
        return 1
    settings = Settings.load()
    if args.model:
        settings.default_model = args.model
    if args.stages:
        settings.local_stages = args.stages
    node_args = ["--threads", str(args.threads)] if args.threads else []
    host = False if args.no_host else bool(args.model) or settings.host_on_start
    controller = Controller(settings, node_args=node_args, host_on_start=host)
    shell = Shell(controller, use_tray=False if args.no_tray else None)
    shell_ref["shell"] = shell
    app.setQuitOnLastWindowClosed(shell.tray is None)
    app.aboutToQuit.connect(lambda: controller.closing or controller.shutdown())
    # Ctrl+C or SIGTERM quits cleanly (the node and its stages with it); the timer lets
    # Python run its signal handlers while Qt's loop waits
    import signal

    from PySide6.QtCore import QTimer

    def _on_signal(*_):
        # a signal may arrive before the event loop runs (while the node starts): queue the quit
        QTimer.singleShot(0, shell.quit)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    tick = QTimer()
    tick.timeout.connect(lambda: None)
    tick.start(250)
    # the node starts while the event loop runs: the windows paint at once and say
    # "starting" instead of staying blank until the engine answers
    controller.start_node(wait=False)
    shell.look_for_gpu()  # an NVIDIA GPU next to the shipped CPU torch: the tray offers the CUDA build
    # Windows asks every app before a sign-out or shutdown (WM_QUERYENDSESSION; on X11 the
    # session manager does): the node leaves its pipelines now, while it still may
    app.commitDataRequest.connect(lambda _manager: controller.closing or controller.shutdown())
    if args.link:
        shell.open_link(args.link)
    elif shell.tray is not None:
        shell.open_chat()  # first launch: show where the chat is
    if args.tour:
        from .tour import Tour

        def tour():
            code = Tour(app, shell, controller, Path(args.tour), load_timeout=args.tour_timeout).run(
                wait_link=args.tour_link, friend=args.tour_friend)
            shell.close()
            controller.shutdown()
            QApplication.exit(code)

        QTimer.singleShot(0, tour)
    try:
        return app.exec()
    finally:
        single.release()
        # what quitting handed to deleteLater goes now, while Qt still runs, not in
        # whatever order Python's collector picks at exit (that order can abort)
        from PySide6.QtCore import QCoreApplication, QEvent

        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


if __name__ == "__main__":
    sys.exit(main())
