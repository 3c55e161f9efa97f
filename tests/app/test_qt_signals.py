"""The Qt binding the app runs on keeps Python's reference counts: PySide6 6.12.0 lost a
reference to True at every signal emitted, and CPython 3.11 aborted ("deallocating True
or False") once they ran out: the desktop app died by itself some minutes into a chat,
its status polls and streamed text emitting all the while (pyproject.toml keeps 6.12 off
such Pythons)."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal


class _Sender(QObject):
    text = Signal(str)
    flag = Signal(bool)


def test_emitting_signals_keeps_the_reference_counts_of_what_they_carry(qapp):
    got = []
    s = _Sender()
    s.text.connect(got.append)
    s.flag.connect(got.append)
    before = sys.getrefcount(True), sys.getrefcount(None)
    for _ in range(200):
        s.text.emit("a token")
        s.flag.emit(True)
    assert len(got) == 400
    del got[:]
    # (from 3.12 on True and None are immortal: their counts say nothing, and cannot run out)
    if sys.version_info < (3, 12):
        assert abs(sys.getrefcount(True) - before[0]) <= 20   # 6.12.0: 200 fewer
        assert abs(sys.getrefcount(None) - before[1]) <= 20
