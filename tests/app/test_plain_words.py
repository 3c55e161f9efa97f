"""The engine's words a person would see (app/visible_text.py), and the dialogs as they
open without a node (the live windows are read in test_app_gui.py)."""

from __future__ import annotations

import time

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


def test_what_the_head_refuses_reaches_the_chat_in_plain_words():
    """The chat showed the head's own account: "The model is not ready. the pipeline is
    not serving: stage 1 (ws://127.0.0.1:41235) left", "(link to stage 1 closed)", "needs
    300 tokens of KV cache but the pipeline holds at most 256"."""
    from app.client import plain_error

    said = {
        # refused once the head gave up going on without a computer: sending again would not help
        (503, "the pipeline is not serving: stage 1 (ws://127.0.0.1:41235#s3cr3t) left: connection lost"): "Host again",
        (None, "link to stage 2 (ws://10.0.0.2:7860) closed mid-reply"): "dropped out",
        (400, "this request needs 300 tokens of KV cache but the pipeline holds at most 256; lower "
              "max_tokens or n, or shorten the prompt"): "“Longest reply”",
        (400, "'max_tokens' is 9000 but the context window is 8192"): "8,192 tokens",
        (400, "the prompt is 9001 tokens; the context window is 8192"): "Shorten it",
        # a reply that broke off mid-stream: the head's failover account, and a step out of memory
        (None, "generation failed: stage 2 (ws://10.0.0.2:7860#s3cr3t) stopped answering; no machine joined "
               "within 300 s"): "Send the message again",
        (None, "generation failed: out of memory on NVIDIA GeForce RTX 3060 while computing this request's step; "
               "it was stopped so the others could go on. Send fewer or shorter requests at once, or give the "
               "pipeline more memory (a higher VRAM cap, another computer)"): "ran out of memory",
    }
    for (status, message), hint in said.items():
        words = plain_error(status, message)
        assert hint in words, (message, words)
        for engine_word in ("ws://", "stage", "pipeline", "KV", "max_tokens", "s3cr3t", "VRAM", "generation"):
            assert engine_word not in words, (engine_word, words)
    # a conversation's first message has no conversation to start afresh from
    assert "new chat" not in plain_error(400, "the prompt is 9001 tokens; the context window is 8192", alone=True)
    # what the head says in a person's words already goes through as it is
    assert plain_error(400, "'temperature' must be at most 100") == "'temperature' must be at most 100"


def test_an_engine_that_stops_while_starting_is_said_once_with_its_last_words():
    """The banner read "The Potluck engine could not start: the Potluck engine did not
    start: ..." and might lose the engine's last words, which its stderr says a moment
    after its exit."""
    from app.nodeproc import NodeProcess, NodeStartError

    node = NodeProcess(["--no-such-flag"])
    with pytest.raises(NodeStartError) as err:
        node.start(timeout=120)
    said = str(err.value)
    assert said.startswith("it stopped before it was ready") and "Potluck engine" not in said, said
    assert "--no-such-flag" in said, said
    assert not node.alive()
    # said once: a start that failed is not also an exit of a running engine
    exits = []
    node = NodeProcess(["--no-such-flag"], on_exit=exits.append)
    with pytest.raises(NodeStartError):
        node.start(timeout=120)
    time.sleep(0.5)   # long enough for the exit's watcher to have spoken, were it to
    assert exits == []


def test_the_node_refusing_a_host_request_is_said_with_the_host_windows_labels(qtbot, tmp_path, monkeypatch):
    """"'listen' must be HOST:PORT" and "give a relay address and/or a listen address"
    reached the Host window as the node's field names; it says them as its labels."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.dialogs import FIELD_LABELS, HostDialog, field_words
    from app.settings import Settings
    from app.store import History
    from engine.node.control import Node, NodeError

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    try:
        d = HostDialog(c)
        qtbot.addWidget(d)
        d.invitees.setValue(1)
        d.listen.setText("")
        req = d.request()
        # every field the window sends is one it can name
        assert set(req) <= set(FIELD_LABELS) | {"layers", "api_lan", "pipeline", "wait_timeout_s"}, set(req)
        node = Node("token")
        refused = []
        for change in ({"listen": "", "relay": ""}, {"listen": "nope"}, {"stage_addr": ["http://ana-pc:7860"]},
                       {"stage_addr": ["ws://ana-pc:7860"]}, {"weights": "fp8"}):
            with pytest.raises(NodeError) as err:
                node.host_args({**req, **change})
            refused.append(field_words(str(err.value)))
        assert "“Accept friends on”" in refused[0] and "“Relay”" in refused[0], refused[0]
        for words in refused:
            assert not any(f"'{f}'" in words for f in FIELD_LABELS), words
        # the window shows them so, escaped
        d._show_plan(None, "'listen' must be HOST:PORT <e.g. 0.0.0.0:7870>")
        assert "“Accept friends on” must be" in d.last_error
        assert "&lt;e.g." in d.plan_label.text()
    finally:
        c.shutdown()
