"""Host a model… (Join: join_dialog.py, Settings: settings_dialog.py, Status:
status_dialog.py). Thin: the work is the node's."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QDialog, QDialogButtonBox, QFormLayout, QFrame,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QProgressBar, QPushButton,
                               QScrollArea, QSpinBox, QTableWidget, QTableWidgetItem, QToolButton, QVBoxLayout,
                               QWidget)

from .gpu_enable import format_size
from .secrets_store import get_secret, set_secret

# Shown until the node's curated list (GET /models, with sizes) arrives, and if it never does.
# (SmolLM2 135M is there to try Potluck with: its answers are a small model's)
DEFAULT_NOTE = "(built in, works offline; small, for trying Potluck out: a larger model answers better)"
DEFAULT_CHOICE = f"default — SmolLM2-135M-Instruct {DEFAULT_NOTE}"


def new_api_key() -> str:
    import secrets

    return "pl-" + secrets.token_urlsafe(24)


# the model list's sizes in people's words (the node's label names the engine's
# precisions: "full (float32)", "nf4")
SIZE_WORDS = {"bf16": "full precision", "int8": "8-bit", "nf4": "4-bit", "int4": "4-bit"}


def model_label(m: dict) -> str:
    """One line of the model list, from the node's /models entry: its name and its
    weights' size at each precision."""
    sizes = m.get("sizes") or {}
    label = (f"{m['name']} — " + " · ".join(f"{format_size(b)} {SIZE_WORDS.get(w, w)}" for w, b in sizes.items())
             if sizes and m.get("name") else m["label"])
    if m["id"] == "default":
        return f"default: {label} {DEFAULT_NOTE}"
    return label + (" (accept its license on huggingface.co first)" if m.get("gated") else "")


DRAFT_NONE = "None: guesses from the conversation only"


def _draft_pairing_label(pairing: str) -> str:
    if not pairing:
        return "Recommended: none for this model (guesses from the conversation)"
    return f"Recommended: {pairing}"


# people read "8-bit" and "4-bit"; the engine's names stay in brackets (the terminal's
# tables and the model cards use them)
WEIGHTS_NAMES = {"bf16": "Full precision", "int8": "8-bit (int8)", "nf4": "4-bit (nf4)", "int4": "4-bit (int4)"}
WEIGHTS_CHOICES = [("Auto (recommended)", "auto"), ("Full precision (bf16)", "bf16"),
                   ("8-bit (int8) — about half the memory", "int8"),
                   ("4-bit (nf4) — about a quarter of the memory", "nf4"),
                   ("4-bit (int4) — about a quarter of the memory, faster on some computers", "int4")]


def _needs(plan: dict) -> str:
    """The memory the plan needs here, in the node's words (weights and room for the
    conversations' cache, rounded as its model list rounds; a node from before it said
    so: the weights)."""
    return plan.get("needs_here_words") or format_size(plan["needed_here_bytes"])


def _weights_name(weights: str) -> str:
    """"8-bit (int8)"; unquantized weights are "Full precision" whatever the computer
    computes them in (bfloat16 on a GPU, float32 on a CPU: "bf16" there was untrue)."""
    return WEIGHTS_NAMES.get(weights, weights)


# the host request's fields (engine/node/hosting.py names them in its errors) by the
# labels this window gives them
FIELD_LABELS = {"model": "Model", "friends": "Friends to invite", "weights": "Weights", "draft": "Draft model",
                "stages": "Parts on this computer", "listen": "Accept friends on", "relay": "Relay",
                "stage_addr": "Friends' addresses", "api_lan_port": "API on the network", "api_key": "API key"}


def field_words(message: str) -> str:
    """A node's error about the host request, with each field it names ('listen') said
    as the label a person filled in (“Accept friends on”)."""
    for field, label in FIELD_LABELS.items():
        message = message.replace(f"'{field}'", f"“{label}”")
    return message


def advanced_box(lay) -> tuple[QToolButton, QFormLayout]:
    """A folded "Advanced" section appended to lay (its form inside): ports, relays,
    addresses and keys, which work as they are for most people. Folded it is one line, an
    arrow and its name (a checkable group box drew an empty frame under its title, which
    read as a field to fill in); the toggle it returns folds and unfolds it."""
    section = QWidget()
    section.setObjectName("advanced")        # visible_text: what is in here is exempt
    col = QVBoxLayout(section)
    col.setContentsMargins(0, 0, 0, 0)
    toggle = QToolButton()
    toggle.setText("Advanced")
    toggle.setCheckable(True)
    toggle.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
    toggle.setArrowType(Qt.RightArrow)
    toggle.setAutoRaise(True)
    inner = QWidget()
    form = QFormLayout(inner)
    form.setContentsMargins(16, 0, 0, 0)
    inner.setVisible(False)

    def fold(unfolded: bool):
        toggle.setArrowType(Qt.DownArrow if unfolded else Qt.RightArrow)
        inner.setVisible(unfolded)

    toggle.toggled.connect(fold)
    col.addWidget(toggle, 0, Qt.AlignLeft)
    col.addWidget(inner)
    lay.addWidget(section)
    return toggle, form


class HostDialog(QDialog):
    """Pick a model, see memory needed vs available and the split, start, follow the loading."""

    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.c = controller
        self.setWindowTitle("Host a model")
        self.resize(620, 520)
        outer = QVBoxLayout(self)
        # what it shows grows as hosting goes on (the split, the loading, the invite): it
        # scrolls inside a window that fits a laptop's screen, the buttons always in view
        body = QWidget()
        lay = QVBoxLayout(body)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.NoFrame)
        # it scrolls down, never sideways: a sideways scroll cut the first letters off every line
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.scroll.setWidget(body)
        outer.addWidget(self.scroll, 1)
        form = QFormLayout()
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.addItem(DEFAULT_CHOICE, "default")
        self.model.setCurrentIndex(0)
        self.models: list[dict] = []
        self.model.setToolTip("Pick a model (sizes: its weights at each precision), or type a Hugging Face "
                              "model id, a local folder or a .gguf file")
        form.addRow("Model:", self.model)
        # the model list's labels are long (name, size per precision): whole in the open list,
        # while the box itself fits the window (sized to its contents it was wider than the
        # window, and everything scrolled sideways)
        self.model.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.model.setMinimumContentsLength(24)
        self.model.view().setMinimumWidth(560)
        self.model.view().setTextElideMode(Qt.ElideNone)
        # a choice from the list shows from its start (the model's name), not its end
        self.model.currentIndexChanged.connect(lambda _i: self.model.lineEdit().setCursorPosition(0))
        self.model.lineEdit().setCursorPosition(0)
        # which model this group can run: the node's answer for the chosen model (GET /models'
        # `group`: this computer's memory and the friends' in the ring, against the weights)
        self.fit_label = QLabel("")
        self.fit_label.setWordWrap(True)
        form.addRow("", self.fit_label)
        self.invitees = QSpinBox()
        self.invitees.setRange(0, 8)
        self.invitees.valueChanged.connect(self._show_fit)
        self.invitees.setToolTip("How many friends' computers join with the invite code")
        form.addRow("Friends to invite:", self.invitees)
        lay.addLayout(form)
        # what only someone who knows their network needs: defaults that work, folded away
        self.advanced, form = advanced_box(lay)
        self.weights = QComboBox()
        for label, value in WEIGHTS_CHOICES:
            self.weights.addItem(label, value)
        self.weights.setToolTip("How the model's weights are stored in memory. Auto picks the highest precision "
                                "that fits: int8 and nf4 let a bigger model fit, with slightly lower quality")
        form.addRow("Weights:", self.weights)
        # speculative decoding's drafts (issue 34): prompt lookup always; a small draft model
        # of the same tokenizer beside this computer's stage where the catalog pairs one
        # (or one typed: MODEL[@WEIGHTS]); it never leaves this computer
        self.draft = QComboBox()
        self.draft.setEditable(True)
        self.draft.addItem(DRAFT_NONE, "")
        self.draft.addItem(_draft_pairing_label(""), "auto")
        self.draft.setToolTip("Between homes every token travels the whole ring; a draft model on this computer "
                              "guesses a few tokens ahead and the model checks them in one trip. It costs this "
                              "computer its memory and a download; Potluck drafts only where it pays")
        form.addRow("Draft model:", self.draft)
        for box in (self.weights, self.draft):   # as the model's box: they fit the window
            box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(16)
        self.model.currentTextChanged.connect(self._show_draft_pairing)
        self.model.currentTextChanged.connect(self._show_fit)
        self.model.currentIndexChanged.connect(self._show_start)   # a choice from the list, not typing
        controller.models(self._show_models)   # the list fills in when the node answers
        self.stages = QSpinBox()
        self.stages.setRange(0, 8)
        self.stages.setSpecialValueText("Automatic")   # shown at 0
        self.stages.setToolTip("Automatic: one. More would only take turns on the same graphics card or "
                               "processor, and pass each word between them")
        self.stages.setValue(controller.settings.local_stages)
        form.addRow("Parts on this computer:", self.stages)
        self.listen = QLineEdit("0.0.0.0:7870")
        self.listen.setToolTip("Where friends reach this computer directly: Potluck asks your router to map this "
                               "port (UPnP); where it will not, a friend gets a reply code to paste below, or use a relay")
        form.addRow("Accept friends on:", self.listen)
        self.relay = QLineEdit()
        self.relay.setPlaceholderText("optional: ws://relay:8765, reachable from both homes")
        form.addRow("Relay:", self.relay)
        self.friends = QPlainTextEdit()
        self.friends.setPlaceholderText("or friends' addresses, one per line (ws://friend:7860#secret, as their "
                                        "Status shows it), "
                                        "from “Join with invite code…” with a host's name")
        self.friends.setFixedHeight(50)
        form.addRow("Friends' addresses:", self.friends)
        # the OpenAI-compatible API for the other computers of this network: always behind a
        # key (kept in the system keyring), on a port of its own; this app's chat keeps using
        # the loopback one
        self.api_lan = QCheckBox("Let other computers on my network use the API")
        self.api_port = QSpinBox()
        self.api_port.setRange(1024, 65535)
        self.api_port.setValue(8000)
        self.api_key = QLineEdit(get_secret("api_key") or "")
        self.api_key.setPlaceholderText("made for you when you host")
        self.api_key.setToolTip("Clients send it as their API key (Authorization: Bearer …)")
        self.api_key.setMinimumWidth(80)
        new_key = QPushButton("New key")
        new_key.clicked.connect(lambda: self.api_key.setText(new_api_key()))
        api_row = QHBoxLayout()
        api_row.addWidget(QLabel("port"))
        api_row.addWidget(self.api_port)
        api_row.addWidget(QLabel("key"))
        api_row.addWidget(self.api_key, 1)
        api_row.addWidget(new_key)
        form.addRow(self.api_lan)
        form.addRow("API on the network:", api_row)
        self.check_button = QPushButton("Check if it fits")
        self.check_button.clicked.connect(self.check)
        lay.addWidget(self.check_button)
        self.plan_label = QLabel("")
        self.plan_label.setWordWrap(True)
        lay.addWidget(self.plan_label)
        self.weights_table = QTableWidget(0, 3)
        self.weights_table.setHorizontalHeaderLabels(["Weights", "Memory needed here", "Fits here?"])
        self.weights_table.setToolTip("What the model's weights need at each precision, against this computer's "
                                      "free memory; friends' memory counts once they join")
        self.weights_table.horizontalHeader().setStretchLastSection(True)
        self.weights_table.verticalHeader().hide()
        self.weights_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.weights_table.setFixedHeight(150)   # a header and four precisions
        self.weights_table.hide()
        lay.addWidget(self.weights_table)
        self.split_table = QTableWidget(0, 2)
        self.split_table.setHorizontalHeaderLabels(["Computer", "Share of the model (proposed)"])
        self.split_table.setToolTip("When the model starts, the host adjusts the split to each computer's "
                                    "measured speed and free memory")
        self.split_table.horizontalHeader().setStretchLastSection(True)
        self.split_table.hide()     # until a plan fills it: empty, it took half the window
        lay.addWidget(self.split_table, 1)
        self.progress = QProgressBar()
        self.progress.hide()
        lay.addWidget(self.progress)
        self.result = QLabel("")
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self.result)
        # the invite, three ways: a link to click, the code to paste, a QR code for a phone
        self.invite_box = QGroupBox("Invite your friends")
        ib = QHBoxLayout(self.invite_box)
        texts = QVBoxLayout()
        self.send_label = send = QLabel(SEND_INVITE + ":")
        send.setWordWrap(True)   # beside the QR code: unwrapped, it made the window scroll sideways
        texts.addWidget(send)
        self.invite_link = QLineEdit()
        self.invite_link.setReadOnly(True)
        texts.addWidget(self.invite_link)
        self.invite = QLineEdit()
        self.invite.setReadOnly(True)
        texts.addWidget(self.invite)
        copies = QHBoxLayout()
        copy = QPushButton("Copy the link")
        copy.clicked.connect(lambda: QApplication.clipboard().setText(self.invite_link.text()))
        copies.addWidget(copy)
        copy_code = QPushButton("Copy the code")
        copy_code.clicked.connect(lambda: QApplication.clipboard().setText(self.invite.text()))
        copies.addWidget(copy_code)
        # friends awaited, none come yet: the invite withdrawn, the chat answering on as it does
        self.stop_waiting_button = QPushButton("Stop waiting")
        self.stop_waiting_button.setToolTip("Withdraw this invite: its code stops working, and the chat goes on "
                                            "answering on this computer")
        self.stop_waiting_button.clicked.connect(self.stop_waiting)
        self.stop_waiting_button.hide()
        copies.addWidget(self.stop_waiting_button)
        texts.addLayout(copies)
        # hosting with a relay: a short code to read out over the phone (one friend, 10 minutes)
        self.short_code = QLabel("")
        self.short_code.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.short_code.setWordWrap(True)
        self.short_code.hide()
        texts.addWidget(self.short_code)
        ib.addLayout(texts, 1)
        self.invite_qr = QLabel()
        self.invite_qr.setToolTip("The link as a QR code: a friend can scan it with a phone and send it on")
        ib.addWidget(self.invite_qr)
        self.invite_box.hide()
        lay.addWidget(self.invite_box)
        # a friend who cannot reach this computer gets a reply code (their router may map a
        # port where ours does not): pasted here, this computer connects to them instead
        self.reply_row = QWidget()
        row = QHBoxLayout(self.reply_row)
        row.setContentsMargins(0, 0, 0, 0)
        self.reply = QLineEdit()
        self.reply.setPlaceholderText("a friend's reply code, if they got one instead of joining")
        self.reply_button = QPushButton("Connect to them")
        self.reply_button.clicked.connect(self.take_reply)
        row.addWidget(self.reply)
        row.addWidget(self.reply_button)
        self.reply_row.hide()
        lay.addWidget(self.reply_row)
        self.buttons = QDialogButtonBox()
        self.start_button = self.buttons.addButton("Start hosting", QDialogButtonBox.AcceptRole)
        self.buttons.addButton(QDialogButtonBox.Close)
        self.start_button.clicked.connect(self.start)
        self.buttons.rejected.connect(self.reject)
        outer.addWidget(self.buttons)
        self.last_plan: dict | None = None
        self.last_error: str | None = None
        self.started = False
        self._replace_ok = False   # told that starting stops the pipeline running now
        self._arrived = 0      # friends who joined, as last shown
        controller.statusChanged.connect(self.on_status)
        # opened again while an invite is out (the window was closed meanwhile): the same
        # invite, its friends and its progress, as it was left
        st = controller.status or {}
        if (st.get("loading") or {}).get("invite"):
            self.started = True
            asked = st.get("host_request") or {}
            if asked.get("model"):   # what was asked for, not this window's defaults
                i = self.model.findData(asked["model"])
                if i >= 0:
                    self.model.setCurrentIndex(i)
                else:
                    self.model.setEditText(str(asked["model"]))
            self.invitees.setValue(int(asked.get("friends") or 0))
            self.progress.show()
            self.start_button.setEnabled(False)
            self.on_status(st)

    def _show_models(self, reply, error):
        """The node's curated list with each model's size per precision (GET /models)."""
        if error or not reply:
            return  # the default stays; any id, folder or .gguf can still be typed
        typed = self.model.currentText()
        self.models = list(reply["models"])
        self.model.clear()
        for m in self.models:
            self.model.addItem(model_label(m), m["id"])
        # the open list as wide as its longest label (cut mid-word at 560 px: "its licens")
        widest = max((self.model.fontMetrics().horizontalAdvance(model_label(m)) for m in self.models), default=0)
        self.model.view().setMinimumWidth(max(560, widest + 40))
        if typed != DEFAULT_CHOICE:
            self.model.setEditText(typed)
        self.model.lineEdit().setCursorPosition(0)
        self._show_start(self.model.currentText())
        self._show_draft_pairing()
        self._show_fit()

    def _show_start(self, *_):
        """A long line shows from its start (its name), not its end."""
        self.model.lineEdit().setCursorPosition(0)

    def _show_fit(self, *_):
        """'fits on this computer', 'fits with your friends as int8…', or the friend to invite."""
        spec = self.model_spec(self.model.currentText())
        fit = next((m.get("group") for m in self.models if m["id"] == spec), None)
        if not fit:
            self.fit_label.setText("" if self.models else "Checking what this computer can run…")
            return
        color = "#15803d" if fit["fits"] else "#b91c1c"
        words = fit["words"][:1].upper() + fit["words"][1:]
        if fit["fits"] and not fit.get("fits_here") and fit.get("friends") and not self.invitees.value():
            # the friends in the ring now, but a start with none to invite hosts on this computer
            # alone (it read "Fits with your friends" over the plan's red "does not fit")
            words += (". With “Friends to invite” at 0 it would start on this computer alone, which is too "
                      "small for it")
            color = "#b45309"
        self.fit_label.setText(f"<span style='color:{color}'>{html.escape(words)}</span>")

    def draft_pairing(self) -> str:
        """The catalog's draft model for the chosen model ('' where it pairs none)."""
        spec = self.model_spec(self.model.currentText())
        return next((m.get("draft") or "" for m in self.models if m["id"] == spec), "")

    def _show_draft_pairing(self, *_):
        self.draft.setItemText(1, _draft_pairing_label(self.draft_pairing()))

    def draft_choice(self) -> str | None:
        """What the host request's `draft` says: None (prompt lookup only), "auto" (the
        catalog's pairing) or a typed MODEL[@WEIGHTS]."""
        text = self.draft.currentText().strip()
        i = self.draft.currentIndex()
        if i >= 0 and text == self.draft.itemText(i):
            data = self.draft.itemData(i)
            return None if not data or (data == "auto" and not self.draft_pairing()) else data
        return text or None

    def model_spec(self, text: str) -> str:
        """What to host for the model box's text: a listed model's id, else what was typed."""
        text = text.strip()
        if text == DEFAULT_CHOICE or not text:
            return "default"
        for m in self.models:
            if text in (model_label(m), m["label"]) or text.lower() in (m["id"].lower(), m["name"].lower()):
                return m["id"]
        return text

    def request(self) -> dict:
        model = self.model_spec(self.model.currentText())
        addrs = [a.strip() for a in self.friends.toPlainText().splitlines() if a.strip()]
        req = {"model": model, "stages": self.stages.value(), "stage_addr": addrs,
               "weights": self.weights.currentData() or "auto"}
        draft = self.draft_choice()
        if draft:
            req["draft"] = draft
        if self.invitees.value():
            req.update(friends=self.invitees.value(), listen=self.listen.text().strip(),
                       relay=self.relay.text().strip())
        if self.api_lan.isChecked():
            if len(self.api_key.text().strip()) < 8:
                self.api_key.setText(new_api_key())
            key = self.api_key.text().strip()
            set_secret("api_key", key)
            req.update(api_lan_port=self.api_port.value(), api_key=key)
        return req

    def check(self):
        self.plan_label.setText("Checking…")
        self.c.plan(self.request(), self._show_plan)

    def _show_plan(self, plan, error):
        if error:
            self.last_error = error = field_words(error)
            self.plan_label.setText(f"<span style='color:#b91c1c'>{html.escape(error, quote=False)}</span>")
            self.split_table.setRowCount(0)
            self.split_table.hide()
            self.weights_table.hide()
            return
        self.last_plan = plan
        self.last_error = None
        color = "#15803d" if plan["fits"] else "#b91c1c"
        weights = f" · weights: {_weights_name(plan['weights']).lower()}" if plan.get("weights") else ""
        self.plan_label.setText(f"<span style='color:{color}'>{plan['message']}</span><br>"
                                f"Memory needed here: {_needs(plan)} · free: "
                                f"{plan.get('available_words') or format_size(plan['available_bytes'])}{weights}")
        self._show_precisions(plan)
        self.split_table.setRowCount(len(plan["split"]))
        self.split_table.setVisible(bool(plan["split"]))
        for i, s in enumerate(plan["split"]):
            a, b = s["layers"]
            self.split_table.setItem(i, 0, QTableWidgetItem(s["where"]))
            # as the Status window's ring says it (engine/node/ring_view.py share_words)
            share = "the whole model" if (a, b) == (0, plan["layers"]) else f"{b - a} of {plan['layers']} layers"
            self.split_table.setItem(i, 1, QTableWidgetItem(share))

    def _show_precisions(self, plan: dict):
        """Each precision's memory here and whether it fits, the one that will load marked."""
        rows = plan.get("precisions") or []
        self.weights_table.setVisible(bool(rows))
        self.weights_table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            chosen = r["weights"] == plan.get("weights")
            name = _weights_name(r["weights"])
            if not r.get("available", True):
                verdict = "not available on this computer"
            else:
                verdict = "fits" if r["fits_here"] else "does not fit"
            if chosen:
                verdict += " ← will be used"
            here = r.get("needs_here_words") or format_size(r.get("here_bytes", r["bytes"]))
            whole = r.get("needs_words") or format_size(r["bytes"])
            size = here if r.get("here_bytes", r["bytes"]) == r["bytes"] else f"{here} (of {whole} in all)"
            for col, text in enumerate((name, size, verdict)):
                item = QTableWidgetItem(text)
                if chosen:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                self.weights_table.setItem(i, col, item)
        self.weights_table.resizeColumnsToContents()

    def _error(self, message: str) -> None:
        self.last_error = message = field_words(message)
        self.result.setText(f"<span style='color:#b91c1c'>{html.escape(message, quote=False)}</span>")
        self._show_result()

    def _show_result(self) -> None:
        """Scrolled into view once laid out: below the tables, it was out of sight, and a
        press of "Start hosting" seemed only to rename the button."""
        QTimer.singleShot(0, lambda: self.scroll.ensureWidgetVisible(self.result))

    def start(self):
        running = (self.c.status or {}).get("hosting")
        if running and not self._replace_ok and not (self.invitees.value() and not running.get("friends")):
            # the node stops the pipeline the chat uses before it starts this one: say so once
            # (one on this computer alone, replaced by one with friends, serves until they come)
            self._replace_ok = True
            self.start_button.setText("Stop it and host")
            self.result.setText(f"<b>{html.escape(str(running.get('model') or 'The model'))} is running now.</b> "
                                "It stops while the new one starts (your conversations are kept)"
                                + ("; the chat answers again once your friends have joined. "
                                   if self.invitees.value() else ". ")
                                + "Press “Stop it and host” to go on.")
            self._show_result()
            return
        self.result.setText("Starting…")

        def done(result, error):
            if error:
                return self._error(error)
            self.started = True
            self._show_plan(result["plan"], None)
            self.progress.show()
            self.start_button.setEnabled(False)

        self.c.host(self.request(), done)

    def stop_waiting(self):
        def done(result, error):
            if error:
                return self._error(error)
            self.started = False
            self.invite_box.hide()
            self.reply_row.hide()
            self.progress.hide()
            self.start_button.setEnabled(True)
            self.c.models(self._show_models)   # what the group can run, without the friends awaited
            self.result.setText("The invite was withdrawn: its code no longer works."
                                + (" The chat answers on this computer as before."
                                   if (result or {}).get("hosting") else ""))

        self.c.stop_waiting(done)

    def take_reply(self):
        code = self.reply.text().strip()
        if not code:
            return

        def done(result, error):
            if error:
                self.result.setText(f"<span style='color:#b91c1c'>{html.escape(str(error))}</span>")
            else:
                self.reply.clear()
                self.result.setText("Connecting to your friend with their reply code…")

        self.c.reply(code, done)

    def on_status(self, st: dict):
        if not self.started:
            return
        loading, hosting = st.get("loading"), st.get("hosting")
        code = (loading or {}).get("invite") or (hosting or {}).get("invite")
        if code and code != self.invite.text():
            from PySide6.QtGui import QPixmap

            from .links import join_link, qr_png

            link = join_link(code)
            self.invite.setText(code)
            self.invite_link.setText(link)
            self.send_label.setText(SEND_INVITE + invite_limits(loading or hosting or {}) + ":")
            for field in (self.invite, self.invite_link):   # from its start: "potluck://join/…"
                field.setCursorPosition(0)
            qr = QPixmap()
            qr.loadFromData(qr_png(link, scale=3))
            self.invite_qr.setPixmap(qr)
            self.invite_box.show()
            self.advanced.setChecked(False)   # what it set is in use now: the invite is what matters
            QTimer.singleShot(0, lambda: self.scroll.ensureWidgetVisible(self.invite_box))
        if code:
            self.reply_row.setVisible(bool(loading))       # while friends are awaited
        # withdrawn only while no friend has come (once one has, the pipeline is theirs too)
        self.stop_waiting_button.setVisible(bool(loading and loading.get("invite") and not loading.get("friends")))
        short = (loading or {}).get("short_code")
        self.short_code.setVisible(bool(short))
        if short:
            self.short_code.setText(f"Or read out this short code: <b>{html.escape(short)}</b> (for one friend, "
                                    "10 minutes; they also need your relay address, under Advanced)")
        if loading and loading.get("message"):
            arrived = loading.get("arrived") or []
            text = html.escape(loading["message"]) + friends_list(arrived)
            if len(arrived) != self._arrived:   # the group grew: what it can run, asked again
                self._arrived = len(arrived)
                self.c.models(self._show_models)
            chosen = chosen_words(loading.get("weights"))
            if chosen:  # what the head settled, against the whole group's memory
                text += f"<br>{html.escape(chosen)}"
            if hosting:   # the pipeline running now serves until the friends have come
                text += (f"<br>Until they have, the chat answers with "
                         f"{html.escape(str(hosting.get('model') or 'the model'))} on this computer.")
            self.result.setText(text)
        if loading:   # nothing loads while friends are awaited: an empty bar says nothing
            self.progress.setVisible(bool(loading.get("stages")))
        if loading and loading.get("stages"):
            stages = list(loading["stages"].values())
            # each stage's share done (a download counts bytes, loading counts tensors)
            share = sum(min(1.0, p["done"] / p["total"]) if p["total"] else 0.0 for p in stages) / len(stages)
            self.progress.setMaximum(1000)
            self.progress.setValue(int(share * 1000))
            downloading = [str(p.get("what")) for p in stages if str(p.get("what", "")).startswith("downloading")]
            self.progress.setFormat(f"{downloading[0]} · %p%" if downloading else
                                    "Loaded: starting up…" if share >= 0.999 else "Loading the model %p%")
        if st.get("error") and not loading:   # the friends never came: what serves on stays
            self.result.setText(f"<span style='color:#b91c1c'>{html.escape(field_words(st['error']), quote=False)}"
                                "</span>")
            if not self.start_button.isEnabled():
                # it failed after it started (a port taken, friends never came): the window is
                # as before the press, to change a field and start again, the reason in view
                self.start_button.setEnabled(True)
                self.start_button.setText("Start hosting")
                self._replace_ok = False
                self._show_result()
            if not hosting:
                self.started = False
                self.progress.hide()
        elif hosting and not loading:
            self.progress.show()
            self.progress.setValue(self.progress.maximum())
            self.progress.setFormat("Ready")     # not the loading's last "Loaded: starting up…"
            self.result.setText(
                f"<b>Ready.</b> Chat from “Open chat”. Other tools can use "
                f"<code>{hosting.get('openai_url')}</code>." + (
                    friends_list(hosting["friends"]) if hosting.get("friends") else
                    "<br>To add friends' GPUs, set “Friends to invite” and start again: they paste the "
                    "invite code into “Join with invite code…”."))


def chosen_words(chosen: dict | None) -> str:
    """The precision the head settled across the group (the node's loading `weights`:
    core/precision.Chosen) as one sentence: what was picked, and its size."""
    if not chosen or not chosen.get("weights"):
        return ""
    kind = _weights_name(chosen["weights"]).lower()   # as the Weights choice names them
    return f"The whole group's memory holds the model with {kind} weights ({chosen.get('size') or '?'})."


SEND_INVITE = "Send this link (it opens Potluck's join window) or the code in it"


def invite_limits(info: dict) -> str:
    """How long the invite works and for how many computers (the node's figures): a second
    friend given the same link met "used by as many computers as it admits", unwarned."""
    hours, uses = info.get("invite_hours"), info.get("invite_uses")
    if not (hours and uses):
        return ""
    who = "one computer" if uses == 1 else f"{uses} computers, one for each friend you invite"
    return f". It works for {hours:g} hours, for {who}"


def friends_list(friends: list[dict]) -> str:
    """Friends as they joined (the node's words): who, what their computer gives, the path."""
    if not friends:
        return ""
    return "<ul>" + "".join(
        f"<li>{html.escape(str(a.get('name') or a.get('node_id') or 'A friend'))} joined"
        + (f": {html.escape(a['gives'])}" if a.get("gives") else "")
        + (f" ({html.escape(a['path'])})" if a.get("path") else "") + "</li>" for a in friends) + "</ul>"
