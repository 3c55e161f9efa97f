"""The computer is about to sleep: the app hears it from logind (a real dbus-daemon
standing in for the system bus, a connection there owning logind's name) or from the
Windows power broadcast (a MSG laid out as Windows lays it, through the native filter)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from app.power import (LOGIND, LOGIND_MANAGER, LOGIND_PATH, PBT_APMRESUMEAUTOMATIC, PBT_APMSUSPEND,
                       WM_POWERBROADCAST, SleepWatcher, WindowsPowerFilter, _MSG)


@pytest.fixture
def private_bus():
    if shutil.which("dbus-daemon") is None:
        pytest.skip("dbus-daemon is not installed")
    d = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield d.stdout.readline().strip()
    finally:
        d.kill()
        d.wait()


def test_logind_prepare_for_sleep_is_heard(qtbot, private_bus):
    from PySide6.QtDBus import QDBusConnection, QDBusMessage

    logind = QDBusConnection.connectToBus(private_bus, "fake-logind")
    assert logind.isConnected() and logind.registerService(LOGIND)
    w = SleepWatcher(bus=QDBusConnection.connectToBus(private_bus, "potluck-app"))
    assert w.start() == "logind"
    # this stand-in answers no Inhibit: no delay lock, and the suspend is not held back
    assert not w.holding
    heard = []
    w.sleeping.connect(lambda: heard.append("sleeping"))
    w.woke.connect(lambda: heard.append("woke"))

    def signal(going: bool):
        m = QDBusMessage.createSignal(LOGIND_PATH, LOGIND_MANAGER, "PrepareForSleep")
        m.setArguments([going])
        assert logind.send(m)

    signal(True)
    qtbot.waitUntil(lambda: heard == ["sleeping"], timeout=5000)
    signal(False)
    qtbot.waitUntil(lambda: heard == ["sleeping", "woke"], timeout=5000)
    w.ready()  # nothing held: a no-op


def test_no_bus_means_heartbeats_only(qtbot):
    from PySide6.QtDBus import QDBusConnection

    w = SleepWatcher(bus=QDBusConnection.connectToBus("unix:path=/nonexistent/bus", "nowhere"))
    assert w.start() is None


def test_windows_power_broadcast_is_read_from_the_native_message():
    events = []
    f = WindowsPowerFilter(events.append)
    for message, wparam in [(WM_POWERBROADCAST, PBT_APMSUSPEND), (0x0010, 0), (WM_POWERBROADCAST,
                                                                                PBT_APMRESUMEAUTOMATIC)]:
        msg = _MSG(None, message, wparam, 0)
        assert f.nativeEventFilter(b"windows_generic_MSG", ctypes.addressof(msg)) == (False, 0)
    assert f.nativeEventFilter(b"xcb_generic_event_t", 0) == (False, 0)
    assert events == [PBT_APMSUSPEND, PBT_APMRESUMEAUTOMATIC]
    w = SleepWatcher()
    heard = []
    w.sleeping.connect(lambda: heard.append("sleeping"))
    w.woke.connect(lambda: heard.append("woke"))
    for e in events:
        w._on_windows(e)
    assert heard == ["sleeping", "woke"]
