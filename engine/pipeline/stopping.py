"""When the owner (or the system) asks a long-running engine process to stop, it leaves
gracefully: a shared stage tells its head first, so the head moves the layers at once
instead of waiting out a heartbeat.

POSIX: SIGTERM (service managers, `kill`, logout) and SIGINT (Ctrl+C), through the event
loop. Windows has neither SIGTERM nor `loop.add_signal_handler`; there a console process
hears Ctrl+C and Ctrl+Break as signals, and its console window closing, the user signing
out and the machine shutting down as console control events, which Windows delivers on a
thread of its own and ends the process once the handler returns (or after about 5 s):
the handler asks the loop to stop and waits for it up to `grace` seconds, so the leave
goes out first. The desktop app's node has no console; the app stops it by closing its
stdin (engine/pipeline/lifeline.py), on quitting, signing out or sleeping (app/power.py).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Callable

# what a reply still streaming reads when the process serving it is asked to stop (the
# app's quit, `potluck serve` or `host` told to by a signal): a reason, not a dropped connection
HOST_SHUTTING_DOWN = "Potluck on the host computer is shutting down"

# console control events (wincon.h)
CTRL_C_EVENT, CTRL_BREAK_EVENT, CTRL_CLOSE_EVENT = 0, 1, 2
CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT = 5, 6


class StopRequests:
    """Calls `on_stop()` in the loop's thread, once, when a stop is asked for; `done()`
    (after the leave went out) lets a waiting Windows console handler return."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_stop: Callable[[], None], grace: float = 4.5,
                 interrupts: bool = True):
        # interrupts=False: Ctrl+C (and Ctrl+Break) are ignored. A terminal sends them to
        # every process it started, a stage its head started included; the head decides
        # (in `potluck chat`, Ctrl+C stops a reply and the chat goes on), and its stage
        # goes when the head closes its stdin (engine/pipeline/lifeline.py)
        self._interrupts = interrupts
        self._loop = loop
        self._on_stop = on_stop
        self._grace = grace
        self._asked = False
        self._finished = threading.Event()
        self._handler = None    # the ctypes callback, kept alive while registered
        self.how: str | None = None   # which mechanism listens ("signals" or "windows-console")

    def install(self) -> "StopRequests":
        if sys.platform == "win32":
            self._install_windows()
        else:
            self._loop.add_signal_handler(signal.SIGTERM, self.ask)
            if self._interrupts:
                self._loop.add_signal_handler(signal.SIGINT, self.ask)
            elif threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.how = "signals"
        return self

    def ask(self) -> None:
        """A stop was asked for (any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._first)
        except RuntimeError:
            pass   # the loop already closed

    def _first(self):
        if not self._asked:
            self._asked = True
            self._on_stop()

    def done(self) -> None:
        self._finished.set()

    # ---- Windows ----------------------------------------------------------------------
    def _install_windows(self):
        # Ctrl+C / Ctrl+Break: Python's own signal handlers (it wakes the Proactor loop)
        for name in ("SIGINT", "SIGBREAK"):
            if hasattr(signal, name) and threading.current_thread() is threading.main_thread():
                signal.signal(getattr(signal, name), (lambda *_: self.ask()) if self._interrupts else signal.SIG_IGN)
        self.how = "signals"
        try:
            import ctypes
            from ctypes import wintypes

            proto = ctypes.WINFUNCTYPE(wintypes.BOOL, wintypes.DWORD)

            def on_event(event: int) -> bool:
                if event not in (CTRL_CLOSE_EVENT, CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT):
                    return False   # Ctrl+C and Ctrl+Break go on to Python's signal handlers
                self.ask()
                # returning lets Windows end the process: first give the leave its moment
                self._finished.wait(self._grace)
                return True

            self._handler = proto(on_event)
            if ctypes.windll.kernel32.SetConsoleCtrlHandler(self._handler, True):
                self.how = "windows-console"
        except (OSError, AttributeError):
            pass
