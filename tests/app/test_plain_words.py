"""The engine's words a person would see (app/visible_text.py), and the dialogs as they
open without a node (the live windows are read in test_app_gui.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
pytest.importorskip("pytestqt")


def test_engine_words_are_found_where_a_person_sees_them_and_not_under_advanced(qtbot):
    from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

    from app.dialogs import advanced_box
    from app.visible_text import engine_words

    w = QWidget()
    qtbot.addWidget(w)
    lay = QVBoxLayout(w)
    lay.addWidget(QLabel("Connected to ws://10.0.0.2:7860 — <b>NVMLError_LibraryNotFound</b>"))
    lay.addWidget(QLabel("ClientConnectorError: cannot connect"))
    box, form = advanced_box(lay)
    port = QLabel("0.0.0.0:7870")
    form.addRow("Accept friends on:", port)
    w.show()
    # folded, the section is its one line (no empty frame beneath that reads as a field)
    assert not port.isVisible() and box.isVisible() and box.text() == "Advanced"
    assert box.parentWidget().sizeHint().height() <= box.sizeHint().height() + 2
    box.setChecked(True)          # even unfolded, Advanced is exempt
    assert port.isVisible()
    found = sorted(word for word, _ in engine_words(w))
    assert found == ["ClientConnectorError", "Error_", "NVML", "ws://"], found
    assert [word for word, _ in engine_words(QLabel("19 of 30 layers, direct, 23 ms"))] == []


def test_the_host_and_join_dialogs_open_in_plain_words(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.dialogs import HostDialog
    from app.join_dialog import JoinDialog
    from app.settings import Settings
    from app.store import History
    from app.visible_text import engine_words
    from engine.node.gpu import gpu_summary

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    c.status = {"state": "idle", "gpu": gpu_summary()}   # what this machine's node would say
    try:
        for d in (HostDialog(c), JoinDialog(c)):
            qtbot.addWidget(d)
            d.show()
            assert engine_words(d) == [], engine_words(d)
    finally:
        c.shutdown()
