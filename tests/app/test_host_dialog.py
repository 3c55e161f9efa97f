"""The host dialog as a thin client of the node's plan/host API, without a node: the
curated model list, the weights choice in the host request, and the per-precision
table drawn from a plan reply (the live dialog is exercised in test_app_gui.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
pytest.importorskip("pytestqt")


@pytest.fixture
def dialog(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.dialogs import HostDialog
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False, local_stages=2), history=History(tmp_path / "h.sqlite3"))
    sent = []
    c.plan = lambda request, cb: sent.append(("plan", request))
    c.models = lambda cb: cb({"models": catalog_reply()}, None)  # what the node's GET /models answers
    c.host = lambda request, cb=None: sent.append(("host", request))
    d = HostDialog(c)
    qtbot.addWidget(d)
    d.sent = sent
    yield d
    c.shutdown()


def catalog_reply() -> list[dict]:
    from engine.core.group_fit import group_fit
    from engine.model import catalog

    # as a node with 12 GB free and Ana's 8 GB in its ring answers
    return [{"id": e.id, "name": e.name, "label": e.label(), "params": e.params, "gated": e.gated,
             "draft": e.draft, "sizes": e.sizes(), "fits_here": {},
             "group": group_fit(e.sizes(), 12 * 10**9, [("Ana", 8 * 10**9)])} for e in catalog.MODELS]


def test_the_chosen_model_says_whether_the_group_can_run_it(dialog):
    d = dialog
    assert d.fit_label.text().count("Fits on this computer") == 1          # the default
    items = [d.model.itemText(i) for i in range(d.model.count())]
    d.model.setCurrentIndex(next(i for i, t in enumerate(items) if t.startswith("Qwen2.5-7B-Instruct — ")))
    assert "Fits with your friends as int8" in d.fit_label.text() and "Ana 8.0 GB" in d.fit_label.text()
    # with no friend to invite, the start would host on this computer alone: said so
    assert "With “Friends to invite” at 0 it would start on this computer alone" in d.fit_label.text()
    d.invitees.setValue(1)
    assert "Fits with your friends as int8" in d.fit_label.text() and "at 0" not in d.fit_label.text()
    d.invitees.setValue(0)
    d.model.setCurrentIndex(next(i for i, t in enumerate(items) if "70B" in t))
    assert "invite one more friend with a" in d.fit_label.text() or "invite friends with" in d.fit_label.text()


def test_the_model_list_is_the_curated_one_with_sizes(dialog):
    from engine.model import catalog

    d = dialog
    items = [d.model.itemText(i) for i in range(d.model.count())]
    assert len(items) == len(catalog.MODELS) >= 8
    assert d.model.currentIndex() == 0 and "default" in d.model.currentText()
    assert d.model.lineEdit().cursorPosition() == 0     # as it opens: the name, not the label's tail
    widest = max(d.model.fontMetrics().horizontalAdvance(t) for t in items)
    assert d.model.view().minimumWidth() > widest        # the open list shows each label whole
    assert not d.split_table.isVisibleTo(d)               # no empty table before a plan
    for text, entry in zip(items, catalog.MODELS):
        # in people's words, not the engine's ("full (float32)", "nf4")
        assert entry.name in text and " full precision · " in text and " 8-bit · " in text and " 4-bit" in text
        assert "float32" not in text and "nf4" not in text and "bf16" not in text
    qwen7 = next(t for t in items if t.startswith("Qwen2.5-7B-Instruct — "))
    assert "GB full precision" in qwen7
    # a listed model hosts by its hub id; typed text goes as typed
    d.model.setCurrentIndex(items.index(qwen7))
    assert d.request()["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert d.model.lineEdit().cursorPosition() == 0     # the long line shows its name, not its tail
    d.model.setCurrentIndex(0)
    assert d.request()["model"] == "default"
    d.model.setEditText("/models/my-llama")
    assert d.request()["model"] == "/models/my-llama"
    d.model.setEditText("meta-llama/Llama-3.1-70B-Instruct")
    assert d.request()["model"] == "meta-llama/Llama-3.1-70B-Instruct"


def test_the_weights_choice_reaches_the_host_request(dialog):
    d = dialog
    labels = [d.weights.itemText(i) for i in range(d.weights.count())]
    assert labels[0] == "Auto (recommended)" and d.request()["weights"] == "auto"
    d.weights.setCurrentIndex([d.weights.itemData(i) for i in range(d.weights.count())].index("nf4"))
    d.check()
    d.start()
    assert [kind for kind, _ in d.sent] == ["plan", "host"]
    assert all(req["weights"] == "nf4" for _, req in d.sent)


def test_the_draft_model_pairing_is_shown_and_chosen_into_the_host_request(dialog):
    from engine.model import catalog

    d = dialog
    assert "draft" not in d.request()            # prompt lookup only unless asked
    d.draft.setCurrentIndex(1)
    assert "none for this model" in d.draft.currentText() and "draft" not in d.request()   # the default pairs none
    seventy = next(e for e in catalog.MODELS if e.draft and "70B" in e.name)
    d.model.setCurrentIndex([d.model.itemData(i) for i in range(d.model.count())].index(seventy.id))
    assert d.draft.itemText(1) == f"Recommended: {seventy.draft}"
    assert d.request()["draft"] == "auto"
    d.draft.setEditText("default@int8")          # any model of the same tokenizer, typed
    d.check()
    assert d.sent[-1] == ("plan", d.request()) and d.request()["draft"] == "default@int8"
    d.draft.setCurrentIndex(0)
    assert "draft" not in d.request()


def _plan(chosen="int8", fits=True):
    gib = 2**30
    return {
        "model": "Qwen/Qwen2.5-7B-Instruct", "spec": "Qwen/Qwen2.5-7B-Instruct", "layers": 28,
        "needed_bytes": 9 * gib, "needed_here_bytes": 9 * gib, "available_bytes": 16 * gib,
        "device": "cuda:0", "dtype": "bfloat16", "fits": fits, "weights": chosen,
        "message": "Qwen/Qwen2.5-7B-Instruct needs about 9.7 GB on the GPU with int8 weights",
        "split": [{"where": "this machine", "layers": [0, 14]}, {"where": "this machine", "layers": [14, 28]}],
        "precisions": [
            {"weights": "bf16", "bytes": 16 * gib, "here_bytes": 16 * gib, "fits_here": False, "available": True},
            {"weights": "int8", "bytes": 9 * gib, "here_bytes": 9 * gib, "fits_here": True, "available": True},
            {"weights": "nf4", "bytes": 6 * gib, "here_bytes": 6 * gib, "fits_here": True, "available": True},
        ],
    }


def test_the_precision_table_renders_from_a_plan_reply(dialog):
    d = dialog
    d._show_plan(_plan(), None)
    t = d.weights_table
    assert t.isVisibleTo(d) and t.rowCount() == 3
    rows = [[t.item(r, c).text() for c in range(3)] for r in range(3)]
    assert [r[0] for r in rows] == ["Full precision", "8-bit (int8)", "4-bit (nf4)"]
    assert rows[0][1] == "17.2 GB" and rows[0][2] == "does not fit"
    assert rows[1][2] == "fits ← will be used" and t.item(1, 0).font().bold()
    assert rows[2][2] == "fits" and not t.item(2, 0).font().bold()
    assert "weights: 8-bit (int8)" in d.plan_label.text() and "28 layers" not in d.plan_label.text()
    assert [d.split_table.item(i, 1).text() for i in range(2)] == ["14 of 28 layers"] * 2
    assert d.split_table.isVisibleTo(d)
    # a node that says what each needs with room for the conversations: that, in the
    # model list's rounding, beside the plan's one figure for the same
    plan = _plan()
    for r in plan["precisions"]:
        r["needs_here_words"] = r["needs_words"] = f"{r['here_bytes'] / 0.6 / 1e9:.0f} GB"
    plan.update(needs_here_words="16 GB", available_words="17 GB")
    d._show_plan(plan, None)
    assert t.item(1, 1).text() == "16 GB" and "Memory needed here: 16 GB · free: 17 GB" in d.plan_label.text()

    # a CPU computes "bf16" at float32: full precision all the same; without bitsandbytes
    # the quantized rows say so;
    # friends' stages: this computer's part of the whole
    plan = _plan(chosen="bf16")
    plan["dtype"] = "float32"
    plan["precisions"][0].update(fits_here=True, here_bytes=8 * 2**30)
    for r in plan["precisions"][1:]:
        r["available"] = False
    d._show_plan(plan, None)
    rows = [[t.item(r, c).text() for c in range(3)] for r in range(3)]
    assert rows[0][0] == "Full precision" and rows[0][2] == "fits ← will be used"
    assert rows[0][1] == "8.6 GB (of 17.2 GB in all)"
    assert rows[1][2] == rows[2][2] == "not available on this computer"

    # an error clears it; a reply from a node without per-precision rows shows none
    d._show_plan(None, "there is no model 'x' on the Hugging Face hub")
    assert not t.isVisibleTo(d)
    old = _plan()
    del old["precisions"], old["weights"]
    d._show_plan(old, None)
    assert not t.isVisibleTo(d) and "GB" in d.plan_label.text()


def test_download_progress_shows_in_the_loading_bar(dialog):
    d = dialog
    d.started = True
    gb = 10**9
    d.on_status({"state": "loading", "loading": {"message": "Loading…", "stages": {
        "0": {"done": 2 * gb, "total": 4 * gb, "what": "downloading the model, part 1 of 4 (2.0 of 4.0 GB)"},
        "1": {"done": 0, "total": 100, "what": "loading weights"}}}})
    assert d.progress.value() == 250 and d.progress.maximum() == 1000  # bytes beyond a C int are fine
    assert d.progress.format().startswith("downloading the model, part 1 of 4")
    # every tensor read, the stages still settle: not "100%", which read as ready
    d.on_status({"state": "loading", "loading": {"message": "Loading…", "stages": {
        "0": {"done": 100, "total": 100, "what": "loading weights"}}}})
    assert d.progress.format() == "Loaded: starting up…"


def test_the_api_for_the_network_is_asked_for_with_a_key_kept_in_the_keyring(dialog):
    from app.secrets_store import get_secret

    assert "api_lan_port" not in dialog.request()            # off by default: loopback only
    dialog.api_lan.setChecked(True)
    dialog.api_port.setValue(8123)
    req = dialog.request()
    assert req["api_lan_port"] == 8123 and len(req["api_key"]) >= 20     # a key is made for you
    assert get_secret("api_key") == req["api_key"] == dialog.api_key.text()
    assert dialog.request()["api_key"] == req["api_key"]              # and kept
    dialog.api_key.setText("my-own-key-123")
    assert dialog.request()["api_key"] == "my-own-key-123" == get_secret("api_key")


def test_a_friends_reply_code_is_taken_while_friends_are_awaited(dialog):
    """While the pipeline waits for friends, the dialog offers a field for a friend's reply
    code (they could not reach this computer); it goes to the node as POST /host/reply."""
    d = dialog
    replies = []
    d.c.reply = lambda code, cb=None: (replies.append(code), cb and cb({}, None))
    d.started = True
    asked = []
    d.c.models = lambda cb: asked.append(cb)
    d.on_status({"loading": {"message": "Waiting for friends to join: 1 of 2", "invite": "0411V-648F8",
                             "arrived": [{"name": "Ana", "path": "direct"},
                                         {"name": "Ben", "path": "through the relay",
                                          "gives": "NVIDIA GeForce RTX 3060, 12 GB free"}]}})
    assert "Ana joined (direct)" in d.result.text()
    assert "Ben joined: NVIDIA GeForce RTX 3060, 12 GB free (through the relay)" in d.result.text()
    assert len(asked) == 1     # the group grew: what it can run is asked again (GET /models)
    assert not d.short_code.isVisibleTo(d)             # no relay: no short code
    d.on_status({"loading": {"message": "Waiting for friends to join: 1 of 2", "invite": "0411V-648F8",
                             "short_code": "4821-917305", "arrived": []}})
    assert d.short_code.isVisibleTo(d) and "4821-917305" in d.short_code.text()
    assert d.invite.text() == "0411V-648F8" and d.reply_row.isVisibleTo(d)
    # the invite three ways: the code, a link that opens the join window, a QR code of the link
    from app.links import parse_link

    assert d.invite_box.isVisibleTo(d) and parse_link(d.invite_link.text()).code == "0411V-648F8"
    assert d.invite_link.cursorPosition() == 0 == d.invite.cursorPosition()   # shown from the start
    assert d.invite_qr.pixmap() is not None and d.invite_qr.pixmap().width() > 60
    d.reply.setText("  7M2QK-ABCDE  ")
    d.reply_button.click()
    assert replies == ["7M2QK-ABCDE"] and d.reply.text() == "" and "reply code" in d.result.text()
    d.on_status({"hosting": {"invite": "0411V-648F8", "stages": []}})    # everyone came: no more replies
    assert not d.reply_row.isVisibleTo(d)


def test_hosting_with_friends_while_the_chat_runs_keeps_it_answering_until_they_come(dialog):
    """The node keeps a pipeline on this computer alone serving while the friends invited
    come (routes.h_host): nothing to confirm, and the dialog says the chat still answers.
    Without friends it would stop at once: that is asked first."""
    d = dialog
    d.c.status = {"state": "serving", "hosting": {"model": "SmolLM2 135M", "friends": [], "stages": []}}
    d.invitees.setValue(1)
    d.start()
    assert [what for what, _ in d.sent] == ["host"] and d.start_button.text() != "Stop it and host"
    d.started = True    # as the node's answer sets it
    d.on_status({"state": "serving", "hosting": {"model": "SmolLM2 135M", "friends": [], "stages": []},
                 "loading": {"message": "Waiting for friends to join: 0 of 1", "invite": "0411V-648F8"}})
    assert "Until they have, the chat answers with SmolLM2 135M" in d.result.text()
    assert "Ready" not in d.result.text() and d.reply_row.isVisibleTo(d)
    d.on_status({"state": "serving", "hosting": {"model": "SmolLM2 135M", "invite": "0411V-648F8", "stages": [],
                                                 "friends": [{"name": "Ana"}], "openai_url": "http://x/v1"}})
    assert "Ready" in d.result.text() and "Ana" in d.result.text()
    assert d.progress.format() == "Ready"        # not "Loaded: starting up…" under "Ready."
    d2_sent = len(d.sent)
    d.invitees.setValue(0)       # on this computer alone: the running one stops first, said first
    d._replace_ok = False
    d.start()
    assert len(d.sent) == d2_sent and d.start_button.text() == "Stop it and host"
    assert "are kept). Press “Stop it and host”" in d.result.text()


def test_the_invite_and_the_buttons_stay_on_a_laptops_screen(dialog, qtbot):
    """On a 900-px screen the dialog grew to 1015 px once the invite showed (Advanced open):
    the code and Close were below the screen's edge. Its content scrolls now, the invite
    is scrolled into view and Advanced folds away."""
    d = dialog
    d.resize(620, 600)
    d.show()
    d.advanced.setChecked(True)
    d.started = True
    d.on_status({"loading": {"message": "Waiting for friends to join: 0 of 1", "invite": "0411V-648F8",
                             "short_code": "4821-917305", "arrived": [], "invite_hours": 24, "invite_uses": 1}})
    # what the code admits, said: a second friend given it met "used by as many computers as it admits"
    assert "It works for 24 hours, for one computer:" in d.send_label.text()
    qtbot.waitUntil(lambda: d.scroll.verticalScrollBar().value() > 0 or not d.scroll.verticalScrollBar().maximum())
    assert d.minimumSizeHint().height() <= 600 and d.height() <= 600
    assert not d.advanced.isChecked()
    # nor sideways: the long model labels made the content 873 px wide in a 620-px window,
    # and every line lost its first letters
    d.resize(520, 600)      # a window made narrower still: its content narrows with it
    qtbot.wait(10)
    assert d.scroll.widget().minimumSizeHint().width() <= d.scroll.viewport().width()
    top = d.invite_box.mapTo(d.scroll.viewport(), d.invite_box.rect().topLeft()).y()
    assert 0 <= top < d.scroll.viewport().height()      # the invite is in view
    assert d.buttons.isVisible() and d.buttons.geometry().bottom() <= d.height()
    d.resize(620, 600)
    d.advanced.setChecked(True)     # Advanced open too (the draft model's long labels, the API's row)
    qtbot.wait(10)
    assert d.scroll.widget().minimumSizeHint().width() <= d.scroll.viewport().width()


def test_stages_on_this_computer_are_automatic_unless_set(qtbot, tmp_path, monkeypatch):
    """A new user's setting is "Automatic": the host request carries 0 and the node runs
    one process (tests/node/test_plan_weights.py)."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.dialogs import HostDialog
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    c.models = lambda cb: cb({"models": catalog_reply()}, None)
    c.plan = lambda request, cb: None
    try:
        d = HostDialog(c)
        qtbot.addWidget(d)
        assert d.stages.text() == "Automatic" and d.request()["stages"] == 0
        d.stages.setValue(3)
        assert d.request()["stages"] == 3
    finally:
        c.shutdown()


def test_an_invite_out_is_shown_again_and_can_be_withdrawn(qtbot, tmp_path, monkeypatch):
    """Closed while friends were awaited, the window opened again showed nothing: the
    invite (valid for a day) and the wait were out of reach, with no way to stop them."""
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.dialogs import HostDialog
    from app.settings import Settings
    from app.store import History

    c = Controller(Settings(host_on_start=False), history=History(tmp_path / "h.sqlite3"))
    c.models = lambda cb: None
    withdrawn = []
    c.stop_waiting = lambda cb: withdrawn.append(cb)
    c.status = {"state": "serving", "hosting": {"model": "SmolLM2 135M", "friends": [], "stages": []},
                "loading": {"message": "Waiting for friends to join: 0 of 1", "invite": "0411V-648F8",
                            "arrived": [], "stages": {}},
                "host_request": {"model": "default", "friends": 1, "stages": 0}}
    try:
        d = HostDialog(c)
        qtbot.addWidget(d)
        assert d.invite.text() == "0411V-648F8" and d.invite_box.isVisibleTo(d)
        assert d.invitees.value() == 1          # as asked, not this window's 0
        assert "Waiting for friends" in d.result.text() and not d.start_button.isEnabled()
        assert not d.progress.isVisibleTo(d)            # nothing loads while friends are awaited
        assert d.stop_waiting_button.isVisibleTo(d)
        d.stop_waiting_button.click()
        assert len(withdrawn) == 1
        withdrawn[0]({"hosting": {"model": "SmolLM2 135M"}}, None)       # the node's answer
        assert not d.invite_box.isVisibleTo(d) and d.start_button.isEnabled()
        assert "withdrawn" in d.result.text() and "answers on this computer" in d.result.text()
        # a friend has come: the pipeline is theirs too, no withdrawing
        d.started = True
        d.on_status({"loading": {"message": "Waiting for friends to join: 1 of 2", "invite": "0411V-648F8",
                                 "friends": ["Ana"], "arrived": [{"name": "Ana"}]}})
        assert not d.stop_waiting_button.isVisibleTo(d)
    finally:
        c.shutdown()


def test_why_start_asks_again_is_scrolled_into_view(dialog, qtbot):
    """Pressing "Start hosting" while a model runs renamed the button to "Stop it and host"
    and said why below the tables, out of sight: it seemed to do nothing."""
    d = dialog
    d.resize(620, 420)
    d.show()
    d.c.status = {"state": "serving", "hosting": {"model": "SmolLM2 135M", "friends": [], "stages": []}}
    d.on_status(d.c.status)
    d.split_table.setRowCount(12)          # a tall split table, as a ring of friends has
    d.split_table.setMinimumHeight(360)
    d.split_table.show()
    d.weights_table.show()
    qtbot.wait(50)                         # laid out, as a plan shown before the press is
    d.invitees.setValue(0)
    d.start()
    assert d.start_button.text() == "Stop it and host" and "is running now" in d.result.text()

    def in_view() -> bool:
        top = d.result.mapTo(d.scroll.viewport(), d.result.rect().topLeft()).y()
        return 0 <= top < d.scroll.viewport().height()

    qtbot.waitUntil(in_view, timeout=2000)
    assert d.scroll.verticalScrollBar().value() > 0


def test_a_start_that_fails_later_gives_the_window_back_with_the_reason_in_view(dialog, qtbot):
    """The node took the request, then failed (friends' port taken by another program): the
    reason showed below the tables, out of sight, and "Start hosting" stayed greyed out, so
    the port could not be changed and tried again without closing the window."""
    d = dialog
    d.resize(620, 420)
    d.show()
    d.split_table.setRowCount(12)
    d.split_table.setMinimumHeight(360)
    d.split_table.show()
    d.weights_table.show()
    d.c.host = lambda request, cb=None: cb({"plan": _plan()}, None)     # the node took it
    d.start()
    assert not d.start_button.isEnabled() and d.started
    d.on_status({"state": "idle", "error": "port 7870 is already in use on this computer (another Potluck, or "
                                           "another program): stop it, or accept friends on another port"})
    assert d.start_button.isEnabled() and d.start_button.text() == "Start hosting" and not d.started
    assert "already in use" in d.result.text() and not d.progress.isVisible()

    def in_view() -> bool:
        top = d.result.mapTo(d.scroll.viewport(), d.result.rect().topLeft()).y()
        return 0 <= top < d.scroll.viewport().height()

    qtbot.waitUntil(in_view, timeout=2000)


def test_the_weights_chosen_for_the_group_read_as_a_sentence(dialog):
    """While loading with friends the window showed the engine's table as it prints it
    ("against the 21 GB that 2 stage(s) (CPU) can give them", "<- chosen"); it then read
    that table's text. It reads the node's fields (core/precision.Chosen) now."""
    from engine.core.precision import chosen, table
    from engine.model.sources import resolve

    cfg = resolve("default").config()
    for weights, words in (("nf4", "with 4-bit (nf4) weights ("), ("bf16", "with full precision weights (")):
        c = chosen(cfg, 4, "float32", weights, "2 stages (CPU)")
        d = dialog
        d.started = True
        d.on_status({"state": "loading", "loading": {
            "message": "Loading SmolLM2 across 2 computers…", "arrived": [], "weights": c.as_dict(),
            "weights_table": table(cfg, 4, "float32", [8 * 10**9, 4 * 10**9], chosen=weights)}})
        shown = d.result.text()
        assert words + c.as_dict()["size"] + ")" in shown, shown
        assert "<pre>" not in shown and "2 stages" not in shown and "chosen" not in shown
