"""The computer is about to sleep, or woke up: a shared GPU hands its work over first.

A laptop lid closed mid-reply would otherwise leave the head waiting out a heartbeat
timeout; told in advance, the node says "leaving" and the head moves the layers at
once. The GUI process hears it (it lives in the owner's session) and tells the node
(`POST /power`), whose sharing policy acts.

  * Linux: logind's PrepareForSleep(bool) signal on the system bus. A "delay" sleep
    inhibitor lock holds the suspend back (logind's InhibitDelayMaxSec, 5 s by default)
    until the node has answered; a new lock is taken on waking.
  * Windows: WM_POWERBROADCAST through Qt's native event filter (PBT_APMSUSPEND, then
    PBT_APMRESUMESUSPEND / PBT_APMRESUMEAUTOMATIC). Windows gives the broadcast about
    2 s; the node's answer is not awaited there.

Elsewhere (macOS, no system bus) nothing is heard and a sleeping machine is noticed
by the heads' heartbeats instead.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from PySide6.QtCore import SLOT, QAbstractNativeEventFilter, QObject, Signal, Slot

log = logging.getLogger("potluck.power")

LOGIND = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
LOGIND_MANAGER = "org.freedesktop.login1.Manager"

WM_POWERBROADCAST = 0x0218
PBT_APMSUSPEND, PBT_APMRESUMESUSPEND, PBT_APMRESUMEAUTOMATIC = 0x4, 0x7, 0x12


class SleepWatcher(QObject):
    """Emits `sleeping` before the computer suspends and `woke` after; call `ready()`
    once the node has been told, to let a held-back suspend go on."""
    sleeping = Signal()
    woke = Signal()

    def __init__(self, parent=None, bus=None):
        super().__init__(parent)
        self._bus = bus        # a QDBusConnection (tests: a private bus); None: the system bus
        self._lock = None      # logind's delay lock (a file descriptor), while held
        self._filter = None
        self.backend: str | None = None

    def start(self) -> str | None:
        """Listen; returns which backend listens (None: none here)."""
        if sys.platform == "win32":
            from PySide6.QtCore import QCoreApplication

            self._filter = WindowsPowerFilter(self._on_windows)
            QCoreApplication.instance().installNativeEventFilter(self._filter)
            self.backend = "windows"
        elif sys.platform.startswith("linux") or self._bus is not None:
            self.backend = "logind" if self._listen_logind() else None
        return self.backend

    # ---- logind ------------------------------------------------------------------------
    def _listen_logind(self) -> bool:
        try:
            from PySide6.QtDBus import QDBusConnection
        except ImportError:
            return False
        bus = self._bus if self._bus is not None else QDBusConnection.systemBus()
        if not bus.isConnected():
            log.info("no system bus: sleep is noticed by heartbeats only")
            return False
        self._bus = bus
        if not bus.connect(LOGIND, LOGIND_PATH, LOGIND_MANAGER, "PrepareForSleep", self,
                           SLOT("_on_prepare(bool)")):
            log.info("cannot listen to logind's PrepareForSleep")
            return False
        self._inhibit()
        return True

    def _inhibit(self):
        """Take logind's delay lock: suspend waits (up to its limit) until we let go."""
        from PySide6.QtDBus import QDBusMessage

        call = QDBusMessage.createMethodCall(LOGIND, LOGIND_PATH, LOGIND_MANAGER, "Inhibit")
        call.setArguments(["sleep", "Potluck", "Handing this GPU's work to the other computers", "delay"])
        reply = self._bus.call(call, timeout=2000)
        if reply.type() != QDBusMessage.MessageType.ReplyMessage or not reply.arguments():
            log.info("no sleep delay lock (%s): sleep goes ahead without waiting for us", reply.errorMessage())
            return
        self._lock = reply.arguments()[0]

    @Slot(bool)
    def _on_prepare(self, going: bool):
        if going:
            self.sleeping.emit()
        else:
            if self._lock is None and self._bus is not None:
                self._inhibit()
            self.woke.emit()

    def ready(self):
        """The node has been told: let the suspend go on (release the delay lock)."""
        lock, self._lock = self._lock, None
        if lock is not None and hasattr(lock, "swap"):
            from PySide6.QtDBus import QDBusUnixFileDescriptor

            lock.swap(QDBusUnixFileDescriptor())  # closes our copy of the fd

    @property
    def holding(self) -> bool:
        """Whether a delay lock is held (the next suspend waits for ready())."""
        return self._lock is not None

    # ---- Windows -----------------------------------------------------------------------
    def _on_windows(self, event: int):
        if event == PBT_APMSUSPEND:
            self.sleeping.emit()
        elif event in (PBT_APMRESUMESUSPEND, PBT_APMRESUMEAUTOMATIC):
            self.woke.emit()


class _MSG(ctypes.Structure):
    """The head of Windows' MSG (winuser.h): what a power broadcast is read from."""
    _fields_ = [("hwnd", ctypes.c_void_p), ("message", ctypes.c_uint), ("wParam", ctypes.c_size_t),
                ("lParam", ctypes.c_ssize_t)]


class WindowsPowerFilter(QAbstractNativeEventFilter):
    """Qt's native event filter, reading WM_POWERBROADCAST from the messages Qt's
    windows receive; calls on_event(wParam) and lets every message through."""

    def __init__(self, on_event):
        super().__init__()
        self.on_event = on_event

    def nativeEventFilter(self, event_type, message):
        if bytes(event_type) == b"windows_generic_MSG" and message:
            msg = _MSG.from_address(int(message))
            if msg.message == WM_POWERBROADCAST:
                self.on_event(int(msg.wParam))
        return False, 0
