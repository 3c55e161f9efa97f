"""The join dialog as a thin client of the node's /join: what it shows for each answer,
without a node (the live join is tests/node/test_node.py's)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
pytest.importorskip("pytestqt")

CODE = "0AX1D-9RACJ-TCJYY-40NYW-0XC5Q-WWXAF-WRA1E-HZMSF-4R5TW-CTYX7-5X51J-7NPTF"


@pytest.fixture
def dialog(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.join_dialog import JoinDialog
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False, local_stages=2), history=History(tmp_path / "h.sqlite3"))
    d = JoinDialog(c)
    qtbot.addWidget(d)
    d.answers = []
    # what the node's POST /join answers, set per test
    d.asked = []

    def join(code=None, pipeline=None, port=None, relay=None, cb=None):
        d.asked.append({"code": code, "pipeline": pipeline, "relay": relay})
        cb(*d.answers.pop(0))

    def check_invite(code, cb):   # as the node reads a code (engine/node/share_stage.py check_invite)
        from engine.wire.invite import InviteError, parse

        d.checked.append(code)
        try:
            cb({"pipeline": parse(code).pipeline_id, "shared_with": d._shared_with()}, None)
        except InviteError as exc:
            cb(None, f"That invite code cannot be used: {exc}")

    d.checked = []
    c.join = join
    c.check_invite = check_invite
    yield d
    c.shutdown()


def test_a_join_that_needs_the_host_to_connect_shows_the_reply_code_to_send(dialog):
    d = dialog
    reply = "R1ABC-DEFGH-JKMNP-QRSTV"
    d.answers.append(({"state": "idle", "sharing": {"joining": {"pipeline": "5c55ab92", "reply_code": reply,
                                                                "events": []}}}, None))
    d.code.setText(CODE)
    d.join()
    text = d.result.text()
    assert d.reply_code == reply and reply in text and "reply code" in text and "Connect to them" in text


def test_a_direct_join_and_a_refusal_read_as_such(dialog):
    d = dialog
    d.answers.append(({"state": "sharing", "sharing": {"joined": {"pipeline": "5c55ab92fc", "via": "direct (punched)"}}},
                      None))
    d.code.setText(CODE)
    d.join()
    assert "Joined." in d.result.text() and "directly" in d.result.text() and d.reply_code is None
    assert "5c55ab92" not in d.result.text() and not d.accept_button.isEnabled()
    d.answers.append((None, "could not reach the host's pipeline: the host refused: invite revoked"))
    d.join()
    assert "invite revoked" in d.result.text() and d.last_error


def test_the_link_the_host_window_copies_joins_as_its_code(dialog):
    """The host window's one copy button gives a potluck://join/ link: pasted here, it
    used to be refused as "not a whole invite code"."""
    from app.links import join_link

    d = dialog
    d.answers.append(({"state": "sharing", "sharing": {"joined": {"pipeline": "5c55ab92fc", "via": "relay"}}}, None))
    d.code.setText(join_link(CODE, relay="wss://relay.example:8443"))
    d.join()
    assert d.asked == [{"code": CODE, "pipeline": None, "relay": "wss://relay.example:8443"}]
    assert "through the relay" in d.result.text()
    d.code.setText("potluck://host/whatever")
    d.join()
    assert len(d.asked) == 1 and "not a Potluck invite" in d.result.text() and d.last_error


def _real_code(tmp_path, name: str) -> tuple[str, str]:
    """A whole invite code of a host of its own, and its pipeline."""
    import os

    from engine.wire.invite import HostState, parse

    (tmp_path / name).mkdir()
    _, code = HostState(tmp_path / name).create_invite(os.urandom(32), "", ["ws://127.0.0.1:9"], kinds=["lan"])
    return code, parse(code).pipeline_id


def test_a_second_invite_while_joined_asks_before_leaving_the_first(dialog, qtbot, tmp_path):
    d = dialog
    code, _ = _real_code(tmp_path, "other-host")
    d.c.status = {"state": "sharing", "sharing": {"on": True, "joined": {"pipeline": "5c55ab92fc", "via": "relay"}}}
    d.code.setText(code)
    d.join()
    assert d.asked == [] and "already shares" in d.result.text() and d.accept_button.text() == "Leave it and join"
    # another code typed: asked again
    qtbot.keyClicks(d.code, " ")
    assert d.accept_button.text() == "Accept and share"
    d.join()
    assert d.asked == []
    d.answers.append(({"state": "sharing", "sharing": {"joined": {"pipeline": "77aa", "via": "relay"}}}, None))
    d.join()
    assert len(d.asked) == 1 and "Joined." in d.result.text()


def test_the_same_friends_code_again_or_a_typo_does_not_ask_to_leave(dialog, tmp_path):
    """A second invite from the friend already joined was met with "Joining this one leaves
    it", and a code with a typo with that question before the typo was said."""
    d = dialog
    code, pipeline = _real_code(tmp_path, "host")
    d.c.status = {"state": "sharing", "sharing": {"on": True, "joined": {"pipeline": pipeline, "via": "direct"}}}
    d.code.setText(code)
    d.join()
    assert d.asked == [] and "already shares with this friend" in d.result.text()
    assert d.accept_button.text() == "Accept and share"
    d.code.setText(code[:-3] + ("AAA" if not code.endswith("AAA") else "BBB"))   # a typo: the node says so
    d.join()
    assert d.asked == [] and "typo" in d.result.text() and d.accept_button.text() == "Accept and share"
    d.code.setText("4821-917305")          # a short code: whose it is, only the relay knows
    d.join()
    assert d.asked == [] and d.accept_button.text() == "Leave it and join" and len(d.checked) == 2


def test_the_compute_line_follows_the_node_once_it_has_read_the_gpu(dialog):
    d = dialog
    assert "checking" in d.usage.text()
    d.c.statusChanged.emit({"gpu": {"available": False, "gpus": [],
                                    "message": "No NVIDIA GPU to use (no driver): Potluck computes on the processor."}})
    assert "computes on the processor" in d.usage.text()


def test_what_is_used_is_said_in_words_and_for_the_computer_there_is(dialog):
    d = dialog
    d.describe({"gpu": {"message": "No NVIDIA GPU: computing on the processor"}})
    text = d.usage.text()
    assert "GPU runs hot" not in text and "Share only while I am away" in text
    assert not any(w in text for w in ("layers", "token", "slice"))
    d.describe({"gpu": {"message": "NVIDIA GeForce RTX 3060", "gpus": [{"name": "NVIDIA GeForce RTX 3060"}]}})
    assert "GPU runs hot" in d.usage.text()


def test_a_long_answer_in_a_small_window_keeps_the_buttons_in_it(dialog, qtbot):
    """At 420×300 a reply code and what to do with it cut the window's last lines and
    pushed "Accept and share" out of it: the answer scrolls instead."""
    d = dialog
    d.show()
    d.resize(420, 300)
    reply = "R1ABC-DEFGH-JKMNP-QRSTV"
    d.answers.append(({"state": "idle", "sharing": {"joining": {"pipeline": "5c55ab92", "reply_code": reply,
                                                                "events": ["tried the host's addresses"] * 6}}}, None))
    d.code.setText(CODE)
    d.join()
    qtbot.wait(50)
    assert reply in d.result.text() and d.height() <= 340
    # the answer whole: its label as tall as its wrapped lines (the scroll area shows them)
    assert d.result.height() >= d.result.heightForWidth(d.result.width()), (d.result.height(), d.size())
    bottom = d.accept_button.mapTo(d, d.accept_button.rect().bottomLeft()).y()
    assert 0 < bottom <= d.height()
