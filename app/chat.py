"""The chat window: conversations on the left, the transcript, and the message box.

Replies stream in; the view is refreshed by a timer (every FLUSH_MS) from what has
arrived, not once per token. While a reply streams, Send becomes Stop. When a reply
completes its text is rendered as markdown and its time to first token and tokens/s
appear under it. The header shows the model, which computer holds which layers, the
OpenAI-compatible URL, loading progress, and plain-language problems (with a Restart
button when the engine has stopped).
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QDoubleSpinBox, QFrame, QSpinBox, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit, QProgressBar, QPushButton,
                               QScrollArea, QSplitter, QVBoxLayout, QWidget)

from .client import ChatStream
from .message_view import MessageView, stats_line
from .pipeline_text import hop_label, hosting_headline, speculation_label, tokens_written
from .ring_view import RingView
from .store import FINISHES, ConversationGone, DamagedConversation, Message

FLUSH_MS = 80
MAX_MESSAGE_CHARS = 100_000
ENGINE_DOWN = "The Potluck engine is not running. Press Restart above."
STILL_COMING = "A reply is still coming: wait for it, or press Stop (Esc) first."


class ChatWindow(QMainWindow):
    restartRequested = Signal()

    def __init__(self, controller, actions=None, parent=None):
        super().__init__(parent)
        self.c = controller
        self.setWindowTitle("Potluck — chat")
        self.resize(980, 680)
        self.conversation_id: int | None = None
        self.messages: list[Message] = []
        self.stream: ChatStream | None = None
        self.reply_view: MessageView | None = None
        self.last_reply_view: MessageView | None = None    # the view of the last assistant message
        self.user_view: MessageView | None = None          # the view of the message last sent
        self.retrying: tuple[Message, MessageView] | None = None   # the reply a new draw may replace
        self.reply_text = ""
        self._pending: list[str] = []
        self.render_count = 0          # view refreshes during the current reply (tests: batched)
        self.delta_count = 0           # deltas received during the current reply
        self.last_error: str | None = None

        if actions is not None:
            menu = self.menuBar().addMenu("&Potluck")
            for a in actions:
                if a is None:
                    menu.addSeparator()
                else:
                    menu.addAction(a)

        # ---- left: conversations
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(6, 6, 6, 6)
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_conversation)
        self.conv_list = QListWidget()
        # long titles end in "…" (the whole title in the tooltip), never a sideways scrollbar
        self.conv_list.setTextElideMode(Qt.ElideRight)
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.conv_list.itemClicked.connect(self._open_item)
        self.delete_all_button = QPushButton("Delete all history")
        self.delete_all_button.clicked.connect(lambda: self.delete_all())   # not clicked(checked=False) as confirm
        ll.addWidget(self.new_button)
        ll.addWidget(self.conv_list, 1)
        ll.addWidget(self.delete_all_button)

        # ---- right: header, transcript, input
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(6, 6, 6, 6)
        self.model_label = QLabel("Starting the Potluck engine…")
        self.model_label.setStyleSheet("font-weight: bold; font-size: 14px;")
        # "… — ready (Ana left; rearranged in under a second, …)" wraps: unwrapped, it held
        # the window wider than a small screen
        self.model_label.setWordWrap(True)
        # the ring, drawn (app/ring_view.py): each computer, its share, its link
        self.ring_view = RingView()
        self.pipeline_label = QLabel("")
        self.pipeline_label.setWordWrap(True)
        self.pipeline_label.setStyleSheet("color: #374151;")
        url_row = QHBoxLayout()
        # the Status window's words: people who have no use for it skip a line they do not know
        url_label = QLabel("For other programs:")
        url_row.addWidget(url_label)
        self.url_field = QLineEdit()
        self.url_field.setReadOnly(True)
        for w in (url_label, self.url_field):
            w.setToolTip("The address of this model's OpenAI-compatible API: a program that talks to "
                         "OpenAI's API (an editor's assistant, a script) can use it instead")
        self.url_field.setPlaceholderText("(available once a model is running)")
        url_row.addWidget(self.url_field, 1)
        self.progress_box = QWidget()
        self.progress_layout = QVBoxLayout(self.progress_box)
        self.progress_layout.setContentsMargins(0, 0, 0, 0)
        self.progress_bars: dict[str, QProgressBar] = {}
        self.progress_box.hide()

        self.banner = QFrame()
        self.banner.setObjectName("banner")
        self.banner.setStyleSheet("QFrame#banner { background: #fef2f2; border: 1px solid #fca5a5; "
                                  "border-radius: 6px; }")
        bl = QHBoxLayout(self.banner)
        self.banner_label = QLabel()
        self.banner_label.setWordWrap(True)
        self.restart_button = QPushButton("Restart")
        self.restart_button.clicked.connect(self.restartRequested.emit)
        bl.addWidget(self.banner_label, 1)
        bl.addWidget(self.restart_button)
        self.banner.hide()

        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.transcript = QWidget()
        self.tl = QVBoxLayout(self.transcript)
        self.tl.addStretch(1)
        self.scroll.setWidget(self.transcript)
        # the transcript keeps to its newest message while it grows (a reply streaming, a
        # conversation laid out, the window resized), unless the reader scrolled up to read
        self._follow = True
        bar = self.scroll.verticalScrollBar()
        bar.rangeChanged.connect(self._keep_following)
        bar.valueChanged.connect(self._note_follow)

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Type a message (Enter sends, Shift+Enter starts a new line)")
        # Enter sends, as in every chat app; Shift+Enter is a new line; Tab moves on to Send
        self.input.installEventFilter(self)
        self.input.setTabChangesFocus(True)
        self.input.setFixedHeight(90)
        self.send_button = QPushButton("Send")
        self.send_button.setMinimumWidth(90)
        self.send_button.clicked.connect(self.send_or_stop)
        # another draw of the last reply: a small model's sampled reply wanders off now
        # and then (a first token from the tail), and the next draw usually does not
        self.retry_button = QPushButton("Try again")
        self.retry_button.setToolTip("Replace the last reply with a new one (at temperature 0 it comes out the same)")
        self.retry_button.clicked.connect(self.retry)
        self.retry_button.setEnabled(False)
        send_shortcut = QAction(self)
        send_shortcut.setShortcuts([QKeySequence("Ctrl+Return"), QKeySequence("Ctrl+Enter")])
        send_shortcut.triggered.connect(self._send_key)
        self.addAction(send_shortcut)
        stop_shortcut = QAction(self)
        stop_shortcut.setShortcut(QKeySequence("Escape"))
        stop_shortcut.triggered.connect(lambda: self.stream is not None and self.stop())
        self.addAction(stop_shortcut)
        self.hint = QLabel("")
        self.hint.setStyleSheet("color: #b91c1c;")
        self.hint.setWordWrap(True)
        # Sampling, shown and changeable where the user reads the replies: "model's
        # default" leaves it to the API (the model's generation_config, else chat-friendly
        # defaults, engine/core/sampling.py), a number sets the temperature (0: greedy)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(-0.05, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("model's default")
        self.temperature.setToolTip("Lower: steadier, more repetitive; higher: more varied. "
                                    "“model's default” uses what the model's authors suggest "
                                    "(else 0.7, top-p 0.9, repetition penalty 1.1).")
        t = self.c.settings.temperature
        self.temperature.setValue(self.temperature.minimum() if t is None else t)
        self.temperature.valueChanged.connect(self._temperature_changed)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(16, 8192)
        self.max_tokens.setSingleStep(64)
        self.max_tokens.setValue(self.c.settings.max_tokens)
        self.max_tokens.setToolTip("The longest reply, in tokens")
        self.max_tokens.valueChanged.connect(self._max_tokens_changed)
        # OpenAI's presence and frequency penalties (-2..2, 0: off): how much a token the
        # reply already holds is held back, once or by how often
        self.presence_penalty = self._penalty_box(
            "presence_penalty", "Presence penalty (-2 to 2, 0: off): above 0 holds back every token the reply "
            "already holds, so it moves on to new words; below 0 favours them.")
        self.frequency_penalty = self._penalty_box(
            "frequency_penalty", "Frequency penalty (-2 to 2, 0: off): above 0 holds back each token by how often "
            "the reply already holds it, so it repeats itself less; below 0 favours repeats.")
        sampling_row = QHBoxLayout()
        sampling_row.addWidget(QLabel("Temperature:"))
        sampling_row.addWidget(self.temperature)
        sampling_row.addWidget(QLabel("Longest reply:"))
        sampling_row.addWidget(self.max_tokens)
        # the penalties on a row of their own, folded unless one is on: in one row with the
        # rest they held the window at least 870 px wide
        self.more_button = QPushButton("More settings")
        self.more_button.setCheckable(True)
        self.more_button.setFlat(True)
        sampling_row.addWidget(self.more_button)
        sampling_row.addStretch(1)
        self.penalty_row = QWidget()
        pr = QHBoxLayout(self.penalty_row)
        pr.setContentsMargins(0, 0, 0, 0)
        pr.addWidget(QLabel("Presence penalty:"))
        pr.addWidget(self.presence_penalty)
        pr.addWidget(QLabel("Frequency penalty:"))
        pr.addWidget(self.frequency_penalty)
        pr.addStretch(1)
        self.more_button.toggled.connect(self.penalty_row.setVisible)
        self.more_button.setChecked(bool(self.presence_penalty.value() or self.frequency_penalty.value()))
        self.penalty_row.setVisible(self.more_button.isChecked())
        il = QHBoxLayout()
        il.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.retry_button)
        il.addLayout(buttons)

        rl.addWidget(self.model_label)
        rl.addWidget(self.ring_view)
        rl.addWidget(self.pipeline_label)
        rl.addLayout(url_row)
        rl.addWidget(self.progress_box)
        rl.addWidget(self.banner)
        rl.addWidget(self.scroll, 1)
        rl.addWidget(self.hint)
        rl.addLayout(sampling_row)
        rl.addWidget(self.penalty_row)
        rl.addLayout(il)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        split.setSizes([220, 760])
        self.setCentralWidget(split)

        self.flush_timer = QTimer(self)
        self.flush_timer.setInterval(FLUSH_MS)
        self.flush_timer.timeout.connect(self._flush)

        controller.statusChanged.connect(self.on_status)
        controller.nodeLost.connect(self.on_node_lost)
        controller.nodeStarted.connect(self.on_node_started)
        controller.historyCleared.connect(self._history_cleared)
        self._clear_after_reply = False
        self.reload_conversations()
        for p in controller.history.problems:
            self.show_hint(p)

    # ---- status ------------------------------------------------------------------
    hosting_headline = staticmethod(hosting_headline)   # pipeline_text.py: the Status window's words too

    def on_status(self, st: dict):
        hosting = st.get("hosting")
        state = st.get("state")
        if st.get("error") and state == "error" and not self.c.lost:
            self.show_banner(st["error"], restart=False)
        elif not self.c.lost:
            self.banner.hide()
        loading = st.get("loading")
        if loading:
            self.model_label.setText(loading.get("message") or "Loading…")
            self.pipeline_label.setText("The chat answers as soon as the model is ready.")
            self._show_progress(loading.get("stages") or {})
        else:
            self.progress_box.hide()
        if hosting:
            self.model_label.setText(self.hosting_headline(hosting))
            # the ring as the node words it (engine/node/ring_view.py): who computes what
            # share, on what, over which path; who left and why
            rows = hosting.get("ring") or []
            self.ring_view.set_rows(rows, rows[0].get("tokens_per_s") if rows else None)
            self.ring_view.show()
            parts = [hop_label(h) for h in hosting.get("hops") or []]
            parts.append(tokens_written(hosting.get("tokens_served", 0)) + " so far")
            spec = speculation_label(hosting)
            if spec:
                parts.append(spec)
            if loading and loading.get("message"):   # the next pipeline, while this one answers
                parts.insert(0, loading["message"])
            self.pipeline_label.setText("  ·  ".join(parts))
            self.url_field.setText(hosting.get("openai_url") or "")
        elif not loading:
            self.url_field.clear()
            self.ring_view.hide()
            sharing = st.get("sharing") or {}
            joined = sharing.get("joined") or {}
            joining = sharing.get("joining") or {}
            if state != "error" and joining and not joined:
                # joining (again, after a restart) a friend whose computer does not answer yet:
                # "No model is running" read as if nothing were happening
                self.model_label.setText("Joining your friend's computer…")
                self.pipeline_label.setText(
                    "It cannot be reached from here now (asleep, or Potluck closed there?): this computer joins "
                    "by itself as soon as it can, or once your friend uses the reply code under Status."
                    if joining.get("reply_code") else "Connecting…")
            elif state != "error" and joined and not sharing.get("joining") and not joined.get("via"):
                # the tunnel to the host is down (it reconnects by itself)
                self.model_label.setText("Your friend's computer cannot be reached now")
                self.pipeline_label.setText("This computer's share waits for it and takes part again when "
                                            "it is back (asleep, or Potluck closed there?).")
            elif state != "error" and (sharing.get("joined") or sharing.get("layers")):
                # a friend's computer: what it does is help, not "nothing running"
                self.model_label.setText("Sharing this computer with a friend")
                self.pipeline_label.setText("Its chat is on your friend's computer. To chat here too, choose "
                                            "“Host a model…” in the Potluck menu.")
            elif state != "error":
                self.model_label.setText("No model is running")
                self.pipeline_label.setText("Choose “Host a model…” in the Potluck menu to start one.")

    def _show_progress(self, stages: dict):
        # this loading's bars, in order: an earlier loading's (full) bars go, and nothing
        # shows while nothing loads yet (friends awaited)
        if sorted(self.progress_bars) != sorted(stages):
            for bar in self.progress_bars.values():
                self.progress_layout.removeWidget(bar)
                bar.deleteLater()
            self.progress_bars = {}
        self.progress_box.setVisible(bool(stages))
        for key, p in sorted(stages.items(), key=lambda kv: (len(str(kv[0])), str(kv[0]))):
            bar = self.progress_bars.get(key)
            if bar is None:
                bar = self.progress_bars[key] = QProgressBar()
                self.progress_layout.addWidget(bar)
            # per mille: a download counts bytes, beyond a progress bar's int range
            bar.setMaximum(1000)
            bar.setValue(int(1000 * min(1.0, p["done"] / p["total"])) if p["total"] else 0)
            # several bars: this computer's parts of the model, each loading its layers
            part = f"part {int(key) + 1}: " if len(stages) > 1 and str(key).isdigit() else ""
            # every tensor read, the stage still settles (its cache, its links): "100%" read
            # as done while the chat could not answer yet
            done = p["total"] and p["done"] >= p["total"]
            bar.setFormat(f"{part}{p['what']}: done, starting up…" if done else f"{part}{p['what']} %p%")

    def show_banner(self, text: str, restart: bool):
        self.banner_label.setText(text)
        self.restart_button.setVisible(restart)
        self.banner.show()

    def on_node_lost(self, why: str):
        self.show_banner(why + " Your conversations are safe.", restart=True)
        self.model_label.setText("The Potluck engine is not running")
        # what it was doing is over: no figures of a pipeline that is gone
        self.pipeline_label.setText("Restart it with the button above.")
        self.ring_view.hide()
        self.progress_box.hide()
        self.url_field.clear()
        if self.stream is not None:
            self.stream.stop()

    def on_node_started(self):
        self.banner.hide()
        if self.hint.text() == ENGINE_DOWN:   # said while it was down: no longer true
            self.hint.clear()

    def show_hint(self, text: str, error: bool = True):
        """A line under the transcript: a problem (red), or news about the conversation."""
        if error:
            self.last_error = text
        self.hint.setStyleSheet("color: #b91c1c;" if error else "color: #374151;")
        self.hint.setText(text)

    # ---- conversations -----------------------------------------------------------------
    def reload_conversations(self):
        self.conv_list.clear()
        for conv in self.c.history.conversations():
            item = QListWidgetItem(conv.title + ("  (damaged)" if conv.damaged else ""))
            item.setData(Qt.UserRole, conv.id)
            item.setToolTip(conv.title)
            if conv.damaged:
                item.setForeground(Qt.red)
            self.conv_list.addItem(item)
        self._mark_open()

    def _mark_open(self):
        """The open conversation stays selected in the list (none for a new chat)."""
        for i in range(self.conv_list.count()):
            if self.conv_list.item(i).data(Qt.UserRole) == self.conversation_id:
                self.conv_list.setCurrentRow(i)
                return
        self.conv_list.clearSelection()
        self.conv_list.setCurrentRow(-1)

    def _open_item(self, item: QListWidgetItem):
        self.open_conversation(item.data(Qt.UserRole))

    def _busy(self) -> bool:
        """A reply is coming: another conversation waits for it (the list's highlight moved
        and nothing else did, with no word of why)."""
        if self.stream is None:
            return False
        self.show_hint("A reply is still coming: press Stop, or wait for it, to open another conversation.",
                       error=False)
        self._mark_open()
        return True

    def open_conversation(self, cid: int) -> bool:
        if self._busy():
            return False
        try:
            conv = self.c.history.load(cid)
        except DamagedConversation as exc:
            self.show_hint(f"{exc}. Your other conversations are not affected.")
            self.reload_conversations()
            return False
        self._clear_view()
        self.conversation_id = cid
        self.messages = list(conv.messages)
        self.last_reply_view = None
        for m in self.messages:
            v = self._add_view(m.role, "")
            if m.role == "assistant":
                self.last_reply_view = v
                v.set_markdown(m.content)
                line = stats_line(m)
                if m.error:
                    v.set_stats(m.error, error=True)
                elif line:
                    v.set_stats(line)
            else:
                v.set_plain(m.content)
        self.hint.clear()
        self._update_retry()
        self._mark_open()
        return True

    def new_conversation(self):
        if self._busy():
            return
        self._clear_view()
        self.conversation_id = None
        self.messages = []
        self.last_reply_view = None
        self.hint.clear()
        self._update_retry()
        self._mark_open()

    def delete_all(self, confirm: bool = True):
        if confirm and QMessageBox.question(self, "Delete all history",
                                            "Delete every conversation? This cannot be undone.") != QMessageBox.Yes:
            return
        self.c.delete_history()

    def _history_cleared(self):
        """Every conversation was deleted (here or in Settings): the open one too. A reply
        still coming is stopped and saved nowhere; the window then starts afresh."""
        self.conversation_id = None
        self.reload_conversations()
        if self.stream is not None:
            self._clear_after_reply = True
            self.stop()
        else:
            self._afresh()

    def _afresh(self):
        self.new_conversation()
        self.show_hint("All chat history was deleted.", error=False)

    def _clear_view(self):
        while self.tl.count() > 1:
            w = self.tl.takeAt(0).widget()
            if w is not None:
                w.deleteLater()

    def _add_view(self, role: str, text: str) -> MessageView:
        v = MessageView(role, text)
        self.tl.insertWidget(self.tl.count() - 1, v)
        self._scroll_down()
        return v

    def _scroll_down(self):
        self._follow = True
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _keep_following(self, _low: int, high: int):
        if self._follow:
            self.scroll.verticalScrollBar().setValue(high)

    def _note_follow(self, value: int):
        self._follow = value >= self.scroll.verticalScrollBar().maximum() - 4

    # ---- sending -----------------------------------------------------------------------
    def send_or_stop(self):
        if self.stream is not None:
            self.stop()
        else:
            self.send()

    def eventFilter(self, obj, event):
        if obj is self.input and event.type() == QEvent.KeyPress and event.key() in (Qt.Key_Return, Qt.Key_Enter) \
                and not event.modifiers() & (Qt.ShiftModifier | Qt.ControlModifier | Qt.AltModifier):
            self._send_key()
            return True
        return super().eventFilter(obj, event)

    def _send_key(self):
        """Enter (or Ctrl+Enter) sends; while a reply comes it stops nothing (it used to stop the
        reply, the message typed meanwhile left unsent): Stop or Esc does that."""
        if self.stream is None:
            self.send()
        else:
            self.show_hint(STILL_COMING, error=False)

    def send(self, text: str | None = None) -> bool:
        text = self.input.toPlainText() if text is None else text
        if not text.strip():
            self.show_hint("Type a message first.")
            return False
        if len(text) > MAX_MESSAGE_CHARS:
            self.show_hint(f"This message is too long ({len(text):,} characters; at most "
                           f"{MAX_MESSAGE_CHARS:,}). Shorten it or split it up.")
            return False
        hosting = self._serving()
        if hosting is None:
            return False
        self.hint.clear()
        self.input.clear()
        user = Message("user", text)
        self._save_question(user)
        self.messages.append(user)
        self.user_view = self._add_view("user", text)
        self._start_reply(hosting)
        return True

    def _save_question(self, user: Message) -> None:
        title = " ".join(user.content.split())[:60]
        if self.conversation_id is None:
            self.conversation_id = self.c.history.new_conversation(title)
            self.reload_conversations()
        try:
            self.c.history.add_message(self.conversation_id, user)
        except ConversationGone:   # deleted meanwhile: the question starts a new one, not lost
            self.conversation_id = self.c.history.new_conversation(title)
            self.c.history.add_message(self.conversation_id, user)
            self.reload_conversations()

    def retry(self) -> bool:
        """The last reply drawn again: the conversation before it is sent, and the new
        reply takes the old one's place once it holds any text; stopped or failed before
        that, the old reply stays as it was."""
        view = self.last_reply_view
        if self.stream is not None or not self.messages or self.messages[-1].role != "assistant" or view is None:
            return False
        hosting = self._serving()
        if hosting is None:
            return False
        self.hint.clear()
        # what a send that got nothing back left below the reply (its question went back
        # into the box) is no longer the conversation's
        at = self.tl.indexOf(view)
        while self.tl.count() - 1 > at + 1:
            w = self.tl.takeAt(at + 1).widget()
            if w is not None:
                w.deleteLater()
        view.hide()
        self.retrying = (self.messages.pop(), view)
        self._start_reply(hosting)
        return True

    def _serving(self) -> dict | None:
        """The pipeline's hosting status when a message can be sent, else None (said in the hint)."""
        if self.c.lost:
            self.show_hint(ENGINE_DOWN)
            return None
        hosting = (self.c.status or {}).get("hosting")
        if not hosting or not hosting.get("openai_url"):
            if (self.c.status or {}).get("loading"):
                self.show_hint("The model is still loading; try again in a moment.")
            else:
                self.show_hint("No model is running. Choose “Host a model…” in the Potluck menu first.")
            return None
        return hosting

    def _start_reply(self, hosting: dict) -> None:
        self.reply_view = self._add_view("assistant", "…")
        self.reply_text = ""
        self._pending = []
        self.render_count = self.delta_count = 0
        convo = [{"role": m.role, "content": m.content} for m in self.messages if not m.error]
        self.stream = ChatStream(self.c.worker, hosting["openai_url"], hosting["model"], convo,
                                 self.c.settings.max_tokens, self.c.settings.temperature, self,
                                 penalties=self.c.settings.penalties())
        self.stream.delta.connect(self._on_delta)
        self.stream.finished.connect(self._on_finished)
        self.send_button.setText("Stop")
        self.retry_button.setEnabled(False)
        self.flush_timer.start()
        self.stream.start()

    def stop(self):
        if self.stream is not None:
            self.stream.stop()

    def _temperature_changed(self, value: float):
        at_default = value <= self.temperature.minimum() + 1e-9
        self.c.settings.temperature = None if at_default else round(max(0.0, value), 2)
        self.c.settings.save()

    def _penalty_box(self, name: str, tip: str) -> QDoubleSpinBox:
        box = QDoubleSpinBox()
        box.setRange(-2.0, 2.0)
        box.setSingleStep(0.1)
        box.setDecimals(2)
        box.setToolTip(tip)
        box.setValue(getattr(self.c.settings, name))
        box.valueChanged.connect(lambda value: self._penalty_changed(name, value))
        return box

    def _penalty_changed(self, name: str, value: float):
        setattr(self.c.settings, name, round(value, 2))
        self.c.settings.save()

    def _max_tokens_changed(self, value: int):
        self.c.settings.max_tokens = value
        self.c.settings.save()

    def _on_delta(self, text: str):
        self._pending.append(text)
        self.delta_count += 1

    def _flush(self):
        if not self._pending or self.reply_view is None:
            return
        self.reply_text += "".join(self._pending)
        self._pending.clear()
        self.reply_view.set_plain(self.reply_text)
        self.render_count += 1

    def _on_finished(self, info: dict):
        if self.hint.text() == STILL_COMING:   # it came
            self.hint.clear()
        self._flush()
        self.flush_timer.stop()
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.deleteLater()
        self.send_button.setText("Send")
        finish = info.get("finish_reason")
        m = Message("assistant", self.reply_text, info.get("ttft"), info.get("tokens_per_s"), info.get("tokens"),
                    info.get("error"), finish=finish if finish in FINISHES else None)
        view = self.reply_view
        if info.get("finish_reason") == "error":
            if not self.reply_text:
                view.set_plain("(no reply)")
            view.set_stats(info.get("error") or "The reply failed.", error=True)
            self.show_hint(info.get("error") or "The reply failed.")
        else:
            view.set_markdown(self.reply_text or "(empty reply)")
            view.set_stats(stats_line(m))
            if info.get("dropped"):
                n = info["dropped"]
                self.show_hint(f"This conversation has grown longer than the model can read at once: it no longer "
                               f"sees the first {n} message{'s' if n != 1 else ''}. Start a new chat to begin afresh.",
                               error=False)
        retried, self.retrying = self.retrying, None
        if retried is not None and not self.reply_text:
            # a new draw stopped or failed before its first word: the old reply stays
            old, old_view = retried
            self.messages.append(old)
            old_view.show()
            self.tl.removeWidget(view)
            view.deleteLater()
        elif self.reply_text or not m.error:
            if retried is not None:    # the new draw takes the old one's place
                old, old_view = retried
                if old.id is not None:
                    self.c.history.delete_message(old.id)
                self.tl.removeWidget(old_view)
                old_view.deleteLater()
            self.messages.append(m)
            self.last_reply_view = view
            if self.conversation_id is not None:
                try:
                    self.c.history.add_message(self.conversation_id, m)
                except ConversationGone:
                    self.conversation_id = None
        elif self.messages and self.messages[-1].role == "user":
            # nothing came back: the question leaves the conversation (it would fail again with
            # every later message) and goes back into the box to be edited
            user = self.messages.pop()
            if user.id is not None:
                self.c.history.delete_message(user.id)
            if not self.messages and self.conversation_id is not None:
                # it was the chat's first message: no conversation is left to keep in the list
                self.c.history.delete_conversation(self.conversation_id)
                self.conversation_id = None
                self.reload_conversations()
            if not self.input.toPlainText():
                self.input.setPlainText(user.content)
                # back in the box, whatever its length: the question and its empty reply
                # leave the transcript (the hint says why), so nothing there is left to retry
                for v in (self.user_view, view):
                    if v is not None and self.tl.indexOf(v) >= 0:
                        self.tl.removeWidget(v)
                        v.deleteLater()
        self.reply_view = None
        self.last_finish = info
        self._update_retry()
        if self._clear_after_reply:
            self._clear_after_reply = False
            self._afresh()

    def _update_retry(self):
        self.retry_button.setEnabled(self.stream is None and bool(self.messages)
                                     and self.messages[-1].role == "assistant" and self.last_reply_view is not None)

    @property
    def generating(self) -> bool:
        return self.stream is not None
