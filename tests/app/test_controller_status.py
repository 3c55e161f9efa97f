"""What the controller reports while a host request is on its way (the app's status,
without a node): the chat said "No pipeline is running" for the seconds between the
app's automatic host request and the node's answer."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
pytest.importorskip("pytestqt")


def test_a_host_request_on_its_way_reads_as_starting_not_as_no_pipeline(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.chat import ChatWindow
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    calls = {}
    c.client.call = lambda method, path, body=None, cb=None, timeout=None: calls.__setitem__(path, cb)
    c.client.base = "http://127.0.0.1:1"   # as if attached to a node
    w = ChatWindow(c)
    qtbot.addWidget(w)
    try:
        c.host({"model": "default"})
        c.poll()
        calls["/status"]({"state": "idle"}, None)        # the node has not begun it yet
        assert c.status["loading"]["message"] == "Starting the model…"
        assert "No model" not in w.model_label.text() and "Host a model" not in w.pipeline_label.text()
        assert "answers as soon as the model is ready" in w.pipeline_label.text()
        calls["/host"]({"state": "loading"}, None)        # answered: the node's own status from now on
        c._polling = False
        c.poll()
        calls["/status"]({"state": "idle"}, None)
        assert "loading" not in c.status and w.model_label.text() == "No model is running"
    finally:
        c.shutdown()


def test_ctrl_enter_while_a_reply_comes_stops_nothing_and_escape_stops_it(qtbot, tmp_path, monkeypatch):
    """Ctrl+Enter stopped a streaming reply, and the message typed meanwhile was not sent."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from PySide6.QtCore import Qt

    from app.chat import ChatWindow
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    w = ChatWindow(c)
    qtbot.addWidget(w)
    stopped = []
    w.stop = lambda: stopped.append(1)
    try:
        w.show()
        w.activateWindow()
        qtbot.waitUntil(w.isActiveWindow, timeout=5_000)   # shortcuts go to the active window
        w.stream = object()          # a reply on its way
        w.input.setPlainText("and another thing")
        w.input.setFocus()
        qtbot.keyClick(w.input, Qt.Key_Return, Qt.ControlModifier)
        assert stopped == [] and w.input.toPlainText() == "and another thing" and "still coming" in w.hint.text()
        qtbot.keyClick(w.input, Qt.Key_Escape)
        assert stopped == [1]
        # Enter sends (as in any chat app), Shift+Enter is a new line in the message
        w.stream = None
        sent = []
        w.send = lambda: sent.append(w.input.toPlainText())
        w.input.setPlainText("first line")
        w.input.moveCursor(w.input.textCursor().MoveOperation.End)
        qtbot.keyClick(w.input, Qt.Key_Return, Qt.ShiftModifier)
        qtbot.keyClicks(w.input, "second")
        assert sent == [] and w.input.toPlainText() == "first line\nsecond"
        qtbot.keyClick(w.input, Qt.Key_Return)
        assert sent == ["first line\nsecond"]
    finally:
        w.stream = None
        c.shutdown()


@pytest.fixture
def recorded(qtbot, tmp_path, monkeypatch):
    """A controller whose node calls are recorded, not sent; (controller, calls, notices).
    It was hosting with one friend awaited when the engine went."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    calls, notices = [], []
    c.client.call = lambda method, path, body=None, cb=None, timeout=None: calls.append((path, body))
    c.client.attach = lambda url, token: None
    c.notice.connect(notices.append)
    c.news.connect(lambda text: notices.append("news: " + text))
    c.last_host = {"model": "default", "stages": 0, "friends": 1, "listen": "0.0.0.0:7870", "weights": "auto"}
    try:
        yield c, calls, notices
    finally:
        c.timer.stop()
        c.shutdown()


def _engine_started_again(c):
    from types import SimpleNamespace

    c.node = SimpleNamespace(url="http://127.0.0.1:1", token="t", stop=lambda: None)
    c._attach()


def test_a_restart_after_a_crash_hosts_alone_then_brings_the_friends_back(qtbot, recorded):
    """The engine died while hosting with a friend. Restart hosted the same request again,
    friends included: the chat "still loading" until they came. Then it hosted alone and
    said to invite them again, where the friends' Potluck rejoins by itself (members need
    no new code). Now: alone first, the chat answering; then the friends again."""
    from app.chat import ENGINE_DOWN, ChatWindow

    c, calls, notices = recorded
    answers = []
    c.client.call = lambda method, path, body=None, cb=None, timeout=None: (calls.append((path, body)),
                                                                            answers.append((path, cb)))
    w = ChatWindow(c)
    qtbot.addWidget(w)
    w.show_hint(ENGINE_DOWN)            # what a send said while the engine was down
    _engine_started_again(c)
    alone = {"model": "default", "stages": 0, "weights": "auto"}
    assert [b for p, b in calls if p == "/host"] == [alone]
    assert notices and notices[0].startswith("news: ") and "join again by themselves" in notices[0]
    assert w.hint.text() != ENGINE_DOWN
    next(cb for p, cb in answers if p == "/host")({"state": "loading"}, None)
    c.client.base = "http://127.0.0.1:1"   # as if attached to a node
    c._polling = False
    c.poll()
    answers[-1][1]({"state": "serving", "hosting": {"model": "SmolLM2"}}, None)   # the chat answers
    assert [b for p, b in calls if p == "/host"] == [alone, {**alone, "friends": 1, "listen": "0.0.0.0:7870"}]
    # and Potluck started anew (not only its engine) does the same
    from app.settings import Settings

    assert Settings.load().host_with_friends == {}     # only a request that succeeded is kept
    next(cb for p, cb in reversed(answers) if p == "/host")({"state": "loading"}, None)
    assert Settings.load().host_with_friends == {**alone, "friends": 1, "listen": "0.0.0.0:7870"}


def test_sharing_ticked_while_the_engine_starts_waits_for_it(recorded):
    """It asked the node that was not up yet: "the Potluck engine is not running", in red,
    under "Starting the Potluck engine…", and it stayed; the share never came."""
    c, calls, notices = recorded
    c.status = {"state": "starting"}
    c.set_share(True)
    assert calls == [] and notices == ["news: This computer is shared as soon as Potluck's engine has started."]
    c.last_host = None
    _engine_started_again(c)
    assert [p for p, _ in calls if p == "/share"] == ["/share"]
    calls.clear()
    c.status = {"state": "starting"}
    c.set_share(False)                 # and unticked before it is up: nothing shared
    _engine_started_again(c)
    assert [p for p, _ in calls if p == "/share"] == []


def test_an_invite_withdrawn_is_not_said_to_have_ended_after_a_restart(recorded):
    """The person withdrew the invite ("Stop waiting"), the engine restarted: the app said
    in red that the friends' invite ended with it, and to invite them again."""
    c, calls, notices = recorded
    c.stop_waiting()
    assert ("/stop", {"what": "invite"}) in calls
    _engine_started_again(c)
    assert ("/host", {"model": "default", "stages": 0, "weights": "auto"}) in calls
    assert notices == []


def test_how_to_join_is_said_while_it_helps_and_goes_once_joined_or_off(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History
    from app.tray import Shell

    c = Controller(Settings(host_on_start=False), history=History(None, keep=False))
    c.client.call = lambda *a, **kw: None
    shell = Shell(c, use_tray=False)
    try:
        on = {"state": "idle", "sharing": {"on": True}}
        shell._share_answered(on, None)
        assert shell.chat.hint.text().startswith("Sharing is on.")
        shell.on_status(on)                                  # still waiting: still said
        assert shell.chat.hint.text().startswith("Sharing is on.")
        shell.on_status({"state": "sharing", "sharing": {"on": True, "joined": {"pipeline": "ab", "via": "direct"}}})
        assert shell.chat.hint.text() == ""
        shell._share_answered(on, None)
        shell.on_status({"state": "idle", "sharing": {"on": False}})   # switched off
        assert shell.chat.hint.text() == ""
        shell.chat.show_hint("something else")
        shell.on_status({"state": "idle", "sharing": {"on": False}})
        assert shell.chat.hint.text() == "something else"        # only its own line goes
    finally:
        shell.closed = True
        c.timer.stop()
        c.shutdown()


def test_sharing_as_it_was_when_potluck_stopped_is_kept_for_the_next_start(qtbot, tmp_path, monkeypatch):
    """Joined to a friend, then Potluck quit: it came back with sharing off and the friend's
    code to paste again. A join and the share toggle set what the next start does (the
    node keeps whom to join: tests/node/test_node.py)."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False, display_name="Ana"), history=History(tmp_path / "h.sqlite3"))
    answers = {"/join": ({"state": "sharing"}, None), "/share": ({"state": "idle"}, None)}
    bodies = []
    c.client.call = lambda method, path, body=None, cb=None, timeout=None: (
        bodies.append(body), cb and cb(*answers.get(path, ({}, None))))
    try:
        c.join(code="0AX1D-9RACJ", cb=lambda r, e: None)
        assert Settings.load().share_on_start
        assert bodies[0] == {"code": "0AX1D-9RACJ", "name": "Ana"}     # how friends see this computer
        c.set_share(False)
        assert not Settings.load().share_on_start
        answers["/join"] = (None, "that invite code cannot be used")     # a join refused changes nothing
        c.join(code="0AX1D-9RACJ", cb=lambda r, e: None)
        assert not Settings.load().share_on_start
        c.set_share(True)
        assert Settings.load().share_on_start
    finally:
        c.shutdown()


def test_potluck_started_anew_brings_back_a_pipeline_hosted_with_friends(qtbot, tmp_path, monkeypatch):
    """Quit while hosting with a friend and opened again: it hosted the default model alone,
    and the friend's Potluck waited for a host that never came back to them."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    kept = {"model": "Qwen/Qwen2.5-7B-Instruct", "stages": 0, "friends": 2, "relay": "ws://relay:8765", "weights": "nf4"}
    c = Controller(Settings(host_on_start=True, host_with_friends=kept), history=History(tmp_path / "h.sqlite3"))
    calls = []
    c.client.call = lambda method, path, body=None, cb=None, timeout=None: calls.append((path, body))
    c.client.attach = lambda url, token: None
    try:
        _engine_started_again(c)
        assert [b for p, b in calls if p == "/host"] == [{"model": "Qwen/Qwen2.5-7B-Instruct", "stages": 0,
                                                          "weights": "nf4"}]
        assert c._friends_back == kept
        c.stop_hosting()                              # the person's word: nothing comes back next time
        assert c._friends_back is None and Settings.load().host_with_friends == {}
    finally:
        c.timer.stop()
        c.shutdown()
