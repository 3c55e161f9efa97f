"""The chat window's headline while a friend's computer leaves and after (the node's
status carries the head's failover events)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")


def test_the_headline_says_a_computer_left_and_that_the_chat_goes_on():
    from app.chat import ChatWindow

    left = {"event": "left", "address": "ws://ana-pc:7860", "who": "Ana", "why": "disconnected", "t": 1.0}
    hosting = {"model": "SmolLM2", "recovering": "stage 1 disconnected", "events": [left]}
    text = ChatWindow.hosting_headline(hosting)
    assert "Ana left" in text and "goes on" in text and "ws://" not in text
    hosting = {"model": "SmolLM2", "recovering": None,
               "events": [left, {"event": "recovered", "seconds": 4.2, "t": 5.2}]}
    assert "Ana left; rearranged in 4 s" in ChatWindow.hosting_headline(hosting)
    assert ChatWindow.hosting_headline({"model": "SmolLM2"}) == "SmolLM2 — ready"


def test_the_status_window_says_what_is_happening_in_the_headlines_words():
    """Its "Now:" line showed the head's own account: "stage 1 (ws://10.0.0.2:7860#s3cr3t)
    left: connection lost: rearranging the pipeline"."""
    from app.status_dialog import status_html

    left = {"event": "left", "address": "ws://10.0.0.2:7860", "who": "Ana", "why": "disconnected", "t": 1.0}
    hosting = {"model": "SmolLM2", "recovering": "stage 1 (ws://10.0.0.2:7860#s3cr3t) left: connection lost: "
                                                 "rearranging the pipeline", "events": [left]}
    page = status_html({"state": "serving", "hosting": hosting})
    now = page[page.index("<b>Now:</b>"):].split("</p>")[0]
    assert "Ana left; rearranging" in now and "goes on" in now, now
    assert "ws://" not in now and "s3cr3t" not in now and "stage" not in now and "pipeline" not in now, now


def test_the_headline_says_what_the_pipeline_waits_for_and_who_came_back():
    from app.chat import ChatWindow

    left = {"event": "left", "address": "ws://ana-pc:7860", "who": "Ana", "why": "disconnected", "t": 1.0}
    waiting = {"event": "waiting", "why": "waiting for a computer to hold layers 12–23", "t": 2.0}
    status = "waiting for a computer to hold layers 12–23 (the stages left hold 20 of 32 layers)"
    text = ChatWindow.hosting_headline({"model": "M", "recovering": status, "events": [left, waiting]})
    assert "Ana left" in text and "layers 12–23" in text and "waits" in text
    back = {"event": "back", "address": "ws://ana-pc:7860", "who": "Ana", "t": 9.0}
    text = ChatWindow.hosting_headline({"model": "M", "recovering": "back", "events": [left, back]})
    assert "Ana is back" in text
    rejoined = {"event": "rejoined", "seconds": 3.4, "t": 12.0}
    text = ChatWindow.hosting_headline({"model": "M", "recovering": None, "events": [left, back, rejoined]})
    assert "Ana came back" in text and "rearranged in 3 s" in text
    rejoined = dict(rejoined, seconds=0.4)
    text = ChatWindow.hosting_headline({"model": "M", "recovering": None, "events": [left, back, rejoined]})
    assert "rearranged in under a second" in text and "0 s" not in text


def test_while_a_friend_loads_its_share_the_chat_says_it_goes_on():
    """A computer taken in loads its layers while the pipeline serves: the headline and the
    status window say so by its name, and the rearrangement after says how long it took."""
    from app.chat import ChatWindow
    from app.status_dialog import status_html

    joined = {"event": "joined", "address": "ws://ana-pc:7860", "who": "Ana", "t": 9.0}
    hosting = {"model": "M", "recovering": None, "events": [joined],
               "joining": "ws://ana-pc:7860 joined: loading layers 12–29 while the pipeline serves",
               "stages": [{"address": "head (this process)", "layers": [0, 30]}]}
    text = ChatWindow.hosting_headline(hosting)
    assert "Ana joined" in text and "goes on" in text and "ws://" not in text
    assert "%" not in text   # no progress said yet
    assert "loading its share (40%)" in ChatWindow.hosting_headline(dict(hosting, joining_progress=0.4))
    page = status_html({"state": "serving", "hosting": hosting})
    assert "Ana is loading its share" in page and "ws://" not in page
    rejoined = {"event": "rejoined", "stages": 2, "seconds": 1.6, "replayed": 1, "ahead_s": 7.9, "t": 18.0}
    hosting.update(joining=None, events=[joined, rejoined])
    assert "rearranged in 2 s" in ChatWindow.hosting_headline(hosting)
    assert "loaded beforehand in 8 s while the chat went on" in status_html({"state": "serving", "hosting": hosting})


def test_while_a_friend_leaves_with_notice_the_chat_says_it_goes_on():
    from app.chat import ChatWindow
    from app.status_dialog import status_html

    leaving = {"event": "leaving", "address": "ws://ana-pc:7860", "who": "Ana", "t": 9.0,
               "why": "stage 1 (ws://ana-pc:7860) is leaving: this computer is going to sleep"}
    hosting = {"model": "M", "recovering": None, "events": [leaving], "joining": None,
               "leaving": "stage 1 (ws://ana-pc:7860) is leaving: …: the others load its layers",
               "stages": [{"address": "head (this process)", "layers": [0, 30]}]}
    text = ChatWindow.hosting_headline(hosting)
    assert "Ana is leaving" in text and "goes on" in text and "ws://" not in text
    page = status_html({"state": "serving", "hosting": hosting})
    assert "Ana is leaving; the others are loading its layers" in page and "ws://" not in page


def test_the_status_window_says_when_the_others_hold_spare_layers():
    from app.status_dialog import status_html

    stages = [{"address": "head (this process)", "layers": [0, 15]}, {"address": "ws://ana-pc:7860", "layers": [15, 30]}]
    hosting = {"model": "M", "recovering": None, "events": [], "joining": None, "leaving": None,
               "stages": stages, "spare_layers": 30}
    assert "the others hold 30 spare layers" in status_html({"state": "serving", "hosting": hosting})
    # this computer alone, in two parts (a CPU's default): no other computer to drop off
    alone = [{"who": "This computer", "share": "15 of 30 layers"}, {"who": "This computer, part 2"}]
    for quiet in (dict(hosting, spare_layers=0), dict(hosting, stages=stages[:1]), dict(hosting, ring=alone),
                  dict(hosting, recovering="stage 1 left: rearranging")):
        assert "spare layers" not in status_html({"state": "serving", "hosting": quiet})


def test_the_status_window_lists_what_happened():
    from app.status_dialog import status_html

    st = {"state": "serving", "hosting": {
        "model": "M", "stages": [{"address": "head (this process)", "layers": [0, 30]}],
        "recovering": None,
        "events": [{"event": "left", "address": "ws://ana-pc:7860", "who": "Ana", "why_words": "<sleep>",
                    "why": "stage 1 (ws://ana-pc:7860) is leaving: <sleep>", "t": 1.0},
                   {"event": "recovered", "stages": 1, "seconds": 4.25, "replayed": 3, "t": 5.0}]}}
    page = status_html(st)
    assert "Ana left: &lt;sleep&gt;" in page and "ws://" not in page
    assert "rearranged over 1 computer in 4.2 s; 3 conversations carried on, none lost" in page
    assert "speculation" not in page   # none ran
    st["hosting"]["speculation"] = {"mode": "auto", "draft": "prompt lookup", "tokens_per_trip": 2.4,
                                    "acceptance": 0.712, "rounds": 30,
                                    "summary": "guessing ahead: 2.4 tokens a pass through the model, 71% of guesses right"}
    assert "<p>guessing ahead: 2.4 tokens a pass through the model, 71% of guesses right</p>" in status_html(st)


def test_the_status_window_says_the_share_was_started_again():
    from app.status_dialog import status_html

    page = status_html({"state": "sharing", "sharing": {
        "on": True, "running": True, "address": "ws://10.0.0.2:7860", "restarts": 1,
        "stopped": "its part of your friend's model stopped by itself; started again"}})
    assert "stopped by itself; started again (1×)" in page


def test_the_status_window_says_when_the_friends_pipeline_is_gone_or_not_yet_there():
    """After the host quit, a friend's status still read "Sharing this computer with a
    friend: 11 layers of a friend's model"; with sharing on and nothing connected the
    headline said "Not hosting or sharing" above "waiting for a friend's pipeline"."""
    from app.status_dialog import status_html

    held = {"on": True, "layers": [0, 11], "device_name": "CPU", "connected": False}
    page = status_html({"state": "sharing", "sharing": held})
    assert "waiting for a friend to use it</h3>" in page and "not connected now" in page
    page = status_html({"state": "sharing", "sharing": dict(held, connected=True)})
    assert "Sharing this computer with a friend</h3>" in page and "not connected" not in page
    page = status_html({"state": "idle", "sharing": {"on": True, "joining": {"reply_code": "R1ABC-DEFGH"}}})
    assert "Not hosting" not in page and "R1ABC-DEFGH" in page and "Connect to them" in page


def test_a_friend_back_on_a_line_too_slow_is_said_in_the_status_and_the_chat_stays_ready():
    from app.chat import ChatWindow
    from app.status_dialog import event_line

    slow = {"event": "slow", "address": "ws://ana-pc:7860", "who": "Ana", "t": 20.0,
            "why": "its line carries 256 kbit/s: taking it back would keep every conversation waiting about 43 s"}
    line = event_line(slow)
    assert "Ana answers again, but its line carries 256 kbit/s" in line and "go on without it" in line
    assert "Ana asked to join, but" in event_line(dict(slow, back=False))
    left = {"event": "left", "address": "ws://ana-pc:7860", "who": "Ana", "why": "disconnected", "t": 1.0}
    recovered = {"event": "recovered", "seconds": 4.2, "t": 5.2}
    text = ChatWindow.hosting_headline({"model": "M", "events": [left, recovered, slow]})
    assert text == "M — ready"


@pytest.fixture
def chat_window(qtbot, tmp_path, monkeypatch):
    """A chat window on a controller with no node: its status is what a test hands it."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.chat import ChatWindow
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(None, keep=False))
    try:
        w = ChatWindow(c)
        qtbot.addWidget(w)
        yield w
    finally:
        c.shutdown()


def test_while_friends_are_awaited_the_chat_says_so_and_shows_no_old_loading_bars(chat_window):
    """Hosting with friends while the chat's pipeline answers: the first load's full bars
    stayed up ("part 2: loading weights 100%" above part 1) for as long as the friends took,
    and nothing said they were awaited."""
    w = chat_window
    w.show()
    w.on_status({"state": "loading", "loading": {"message": "Loading SmolLM2…", "stages": {
        "1": {"done": 5, "total": 10, "what": "loading weights"},
        "0": {"done": 10, "total": 10, "what": "loading weights"}}}})
    bars = [w.progress_layout.itemAt(i).widget().format() for i in range(w.progress_layout.count())]
    # a part whose every tensor is read still settles: not "100%", which read as ready
    assert bars == ["part 1: loading weights: done, starting up…", "part 2: loading weights %p%"]
    w.on_status({"state": "serving", "hosting": {"model": "SmolLM2", "openai_url": "http://x/v1"},
                 "loading": {"message": "Waiting for friends to join: 0 of 1", "invite": "0411V", "stages": {}}})
    assert not w.progress_box.isVisibleTo(w)
    assert "Waiting for friends to join: 0 of 1" in w.pipeline_label.text()


def test_a_long_line_of_code_in_a_reply_wraps_inside_its_bubble(qtbot):
    """A reply's code block with one long line made the transcript as wide as that line,
    every bubble with it (sideways scrolling to read the prose)."""
    from app.message_view import MessageView

    code = "x = " + " + ".join(["'a'"] * 80)
    v = MessageView("assistant")
    qtbot.addWidget(v)
    v.set_markdown(f"Like this:\n\n```python\n{code}\n```\n\nand **that** is <all>.")
    assert v.body.minimumSizeHint().width() < 400
    text = v.body.text()
    assert "&lt;all&gt;" in text and "'a' + 'a'" in text     # HTML in a reply shown as text


def test_a_long_unbroken_string_wraps_and_copies_as_written(qtbot):
    """A key or a hash (no spaces) in a reply or a message made its bubble, and the whole
    transcript, as wide as itself; it wraps now, and what is copied is what was written."""
    from PySide6.QtWidgets import QApplication

    from app.message_view import ZWSP, MessageView

    key = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" * 3
    url = "https://example.com/" + "p" * 90
    reply = MessageView("assistant")
    qtbot.addWidget(reply)
    reply.set_markdown(f"The key: `{key}` or {key} — [see]({url}) & <b>")
    mine = MessageView("user")
    qtbot.addWidget(mine)
    mine.set_plain(key)
    for v in (reply, mine):
        assert v.body.minimumSizeHint().width() < 400
        v.select_all()
        v.copy()
        copied = QApplication.clipboard().text()
        assert ZWSP not in copied and copied.count(key) == (2 if v is reply else 1)
    assert f'href="{url}"' in reply.body.text() and "&amp;" in reply.body.text()


def test_a_friends_computer_says_it_shares_not_that_nothing_runs(chat_window):
    w = chat_window
    w.on_status({"state": "sharing", "sharing": {"on": True, "joined": {"pipeline": "ab12", "via": "direct"}}})
    assert "Sharing this computer" in w.model_label.text() and "No model" not in w.model_label.text()
    w.on_status({"state": "idle", "sharing": {"on": False}})
    assert w.model_label.text() == "No model is running"


def test_a_friends_computer_says_when_the_host_cannot_be_reached(chat_window):
    """After the host quit, the friend's chat header still read "Sharing this computer with
    a friend's pipeline" for as long as the host was gone."""
    w = chat_window
    joined = {"on": True, "layers": [0, 11], "connected": True, "joined": {"pipeline": "ab12", "via": "direct"}}
    w.on_status({"state": "sharing", "sharing": joined})
    assert "Sharing this computer" in w.model_label.text()
    gone = dict(joined, connected=False, joined={"pipeline": "ab12", "via": None})
    w.on_status({"state": "sharing", "sharing": gone})
    assert "cannot be reached" in w.model_label.text() and "waits for it" in w.pipeline_label.text()
    # while it joins (no tunnel yet), it is not said to be gone
    w.on_status({"state": "sharing", "sharing": dict(gone, joining={"pipeline": "ab12", "reply_code": None})})
    assert "cannot be reached" not in w.model_label.text()
    # joining again after a restart, the host not answering yet: not "No model is running"
    w.on_status({"state": "idle", "sharing": {"on": True, "joined": None,
                                              "joining": {"pipeline": "ab12", "reply_code": "7M2QK"}}})
    assert w.model_label.text() == "Joining your friend's computer…"
    assert "joins by itself" in w.pipeline_label.text() and "reply code under Status" in w.pipeline_label.text()


def test_a_long_headline_wraps_and_leaves_the_window_narrow(chat_window):
    """'… — ready (Ana left; rearranged in under a second, no conversation lost)' held the
    window at least 891 px wide."""
    w = chat_window
    w.show()
    w.model_label.setText("SmolLM2-135M-Instruct — ready (Ana's laptop left; rearranged in under a second, "
                          "no conversation lost, and the others hold every layer now)")
    assert w.minimumSizeHint().width() < 700, w.minimumSizeHint()


def test_a_lost_engine_leaves_no_figures_of_the_pipeline_it_ran(chat_window):
    w = chat_window
    w.show()
    w.on_status({"state": "serving", "hosting": {"model": "SmolLM2", "openai_url": "http://x/v1",
                                                 "tokens_served": 175, "ring": [{"who": "This computer"}]}})
    assert "175 tokens" in w.pipeline_label.text() and w.ring_view.isVisibleTo(w)
    w.on_node_lost("The Potluck engine stopped unexpectedly (exit code -9).")
    assert "175" not in w.pipeline_label.text() and not w.ring_view.isVisibleTo(w)
    assert w.banner.isVisibleTo(w) and w.restart_button.isVisibleTo(w)


def test_a_lost_engine_is_said_in_words_not_its_exit_code():
    """The banner said "(exit code -9)": why it went, in words, and its own last error."""
    from app.controller import stopped_words

    assert "the system ended it" in stopped_words(-9, ["12:00:01 serving"])
    assert "short of memory" in stopped_words(0xC0000005, [])
    traceback = ["Traceback (most recent call last):", '  File "x.py", line 3, in <module>',
                 "RuntimeError: the model's files are damaged: download it again", ""]
    assert stopped_words(1, traceback) == ("The Potluck engine stopped unexpectedly: the model's files are "
                                           "damaged: download it again")
    assert stopped_words(1, ["12:00:03 cannot bind the control port"]).endswith(": cannot bind the control port")
    assert stopped_words(1, []) == "The Potluck engine stopped unexpectedly."
    assert stopped_words(2, ['  File "x.py", line 3']) == "The Potluck engine stopped unexpectedly."


def test_the_tray_says_what_loads_and_never_ready_with_no_model():
    from app.tray import tooltip

    assert tooltip({"state": "idle"}) == "Potluck — no model running"
    tip = tooltip({"state": "loading", "loading": {"message": "Loading SmolLM2… (layers 1–30: 40%)", "stages": {}}})
    assert tip.startswith("Potluck — starting\nLoading SmolLM2…")


def test_the_status_window_shows_what_loads_and_how_far():
    from app.status_dialog import status_html

    page = status_html({"state": "loading", "loading": {"message": "Loading SmolLM2…", "stages": {
        "0": {"done": 5, "total": 10, "what": "loading weights"}}}})
    assert "Loading SmolLM2… — loading weights 50%" in page


def test_the_status_window_of_a_lost_engine_says_what_to_do_not_stale_lines():
    """It said "Sharing this computer: off" (it had been on) and an empty "GPU:" line."""
    from app.status_dialog import status_html

    page = status_html({"state": "error", "error": "The Potluck engine stopped unexpectedly (exit code -9)."})
    assert "stopped unexpectedly" in page and "Restart it" in page
    assert "Sharing this computer" not in page and "GPU:" not in page
