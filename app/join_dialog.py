"""Join with invite code…: paste the invite (or share under a pipeline name, under
Advanced), see what of this computer is used, accept. Thin: the node joins."""

from __future__ import annotations

import html
import re

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFrame, QGroupBox, QLabel, QLineEdit, QScrollArea, QSpinBox,
                               QVBoxLayout)

from .dialogs import advanced_box
from .links import LinkError, is_link, parse_link


class JoinDialog(QDialog):
    """Paste the invite (or, until invite codes exist, the pipeline's name), see what is used, accept."""

    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.c = controller
        self.setWindowTitle("Join a friend")
        self.resize(560, 420)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel("Paste the invite code your friend sent you:"))
        self.code = QLineEdit()
        self.code.setPlaceholderText("the invite code or potluck:// link, or a short code (with its relay below)")
        lay.addWidget(self.code)
        self.advanced, form = advanced_box(lay)
        self.relay = QLineEdit()
        self.relay.setPlaceholderText("only for a short code like 4821-917305: the host's relay, ws://…")
        form.addRow("Relay:", self.relay)
        # sharing by name instead of a code: the friend's host adds this computer's address
        self.pipeline = QLineEdit()
        self.pipeline.setPlaceholderText("instead of a code: the name the host gave (letters, digits, - and _)")
        form.addRow("Host's name:", self.pipeline)
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(controller.settings.share_port)
        self.port.setToolTip("Only when joining by the host's name: the host then connects to this port")
        form.addRow("Port (joining by name):", self.port)
        box = QGroupBox("What will be used of this computer")
        bl = QVBoxLayout(box)
        self.usage = QLabel("")
        self.usage.setWordWrap(True)
        bl.addWidget(self.usage)
        lay.addWidget(box)
        self.result = QLabel("")
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.result.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        # a long answer (a reply code and what to do with it) scrolls in a small window
        # instead of pushing the buttons out of it
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        scroll.setWidget(self.result)
        lay.addWidget(scroll, 1)
        self.buttons = QDialogButtonBox()
        self.accept_button = self.buttons.addButton("Accept and share", QDialogButtonBox.AcceptRole)
        self.buttons.addButton(QDialogButtonBox.Cancel)
        self.accept_button.clicked.connect(self.join)
        self.buttons.rejected.connect(self.reject)
        lay.addWidget(self.buttons)
        self.last_error: str | None = None
        self.reply_code: str | None = None
        self.leave_confirmed = False     # pressed once already while joined elsewhere
        for edit in (self.code, self.pipeline):
            edit.textEdited.connect(self._unconfirm)
        self.describe(controller.status)
        # the node may still be starting (a link opened the app): its reading comes later
        controller.statusChanged.connect(self.describe)

    def describe(self, st: dict):
        gpu = (st or {}).get("gpu") or {}
        cap = self.c.settings.limits.get("vram_cap_mb")
        compute = gpu.get("message") if gpu.get("message") not in (None, "not read yet") else "checking…"
        # what pauses it by itself (engine/node/sharing.py): the GPU's heat and other programs
        # on it, or the owner's "only while I am away"; a computer with no GPU has only the last
        # the menu's own words (tray.py): "computer" once the node found no GPU here
        no_gpu = not gpu.get("gpus") and gpu.get("message") not in (None, "not read yet")
        share = "Share this computer" if no_gpu else "Share this GPU"
        pauses = ("when the GPU runs hot or a game needs it" if gpu.get("gpus") else
                  "while you are at the computer, if you choose “Share only while I am away” in Settings")
        self.usage.setText(
            f"• Compute: {compute}<br>"
            f"• Memory: your friend's computer gives this one a part of the model that fits its memory"
            f"{f' (at most {cap:.0f} MB, your limit)' if cap else ''}.<br>"
            "• Disk: only the files of that part of the model are downloaded.<br>"
            "• Network: a few KB per word written, a few MB per long message.<br>"
            f"• You can switch sharing off at any moment (untick “{share}” in the Potluck menu); it pauses "
            f"by itself "
            f"{pauses}.")

    def _error(self, message: str) -> None:
        self.last_error = message
        self.result.setText(f"<span style='color:#b91c1c'>{html.escape(message, quote=False)}</span>")

    def start_over(self) -> None:
        """Ready for another code: the window opened again while it still showed an earlier
        join ("Joined.", its button greyed out), where a new code could not be accepted."""
        self.last_error = None
        self.reply_code = None
        self.code.clear()   # a bad link leaves no earlier code behind to be joined by mistake
        self._unconfirm()
        self.result.clear()
        self.accept_button.setEnabled(True)
        self.buttons.button(QDialogButtonBox.Cancel).setText("Cancel")

    def finished_join(self) -> bool:
        """It shows a join that is done (its button greyed out, Close to leave)."""
        return not self.accept_button.isEnabled()

    def fill_from_link(self, text: str) -> None:
        """A potluck:// link opened while this window may still show an earlier join: it
        starts over, filled in; the user still presses the button."""
        self.start_over()
        try:
            link = parse_link(text)
        except LinkError as e:
            return self._error(bad_link(e))
        if not looks_like_code(link.code):
            return self._error(NOT_A_CODE)
        self.code.setText(link.code)
        if link.relay:
            self.relay.setText(link.relay)
        self.result.setText("Filled in from the invite link. Check what will be used, then press “Accept and share”.")

    def join(self):
        self.last_error = None
        text = self.code.text().strip()
        name = self.pipeline.text().strip()
        if not text and name:   # sharing by name (Advanced): no code
            if not PIPELINE_NAME.fullmatch(name):
                return self._error("A host's name is letters, digits, “-” and “_” (at most 64), "
                                   "as the host wrote it.")
            if self._asks_to_leave():
                return
            self.result.setText("Connecting…")
            return self.c.join(pipeline=name, port=self.port.value(), cb=self._done)
        if not text:
            return self._error("Paste the invite code first.")
        if is_link(text):   # the host window's "Copy the link" gives a potluck://join/… link
            try:
                link = parse_link(text)
            except LinkError as exc:
                return self._error(bad_link(exc))
            text = link.code
            if link.relay and not self.relay.text().strip():
                self.relay.setText(link.relay)
        if not looks_like_code(text):
            # never a share under a name typed by mistake: that opens a port and shows its secret
            return self._error(NOT_A_CODE)
        if self._shared_with() and not self.leave_confirmed and not is_short_code(text):
            # whose code it is first (the node reads it): the same friend again is no reason
            # to leave them, and a typo is said before any question (a short code's friend
            # only the relay knows: asked as before)
            self.result.setText("Checking the code…")
            return self.c.check_invite(text, lambda answer, error: self._checked(text, answer, error))
        if self._asks_to_leave():
            return
        self._join_code(text)

    def _checked(self, text: str, answer, error):
        if error:
            return self._error(error)
        if answer.get("pipeline") and answer["pipeline"] == answer.get("shared_with"):
            self.result.setText("<b>This computer already shares with this friend.</b> Nothing to do: a new "
                                "code from them is not needed while it does.")
            return
        if not self._asks_to_leave():
            self._join_code(text)

    def _join_code(self, text: str):
        self.result.setText("Connecting…")
        self.c.join(code=text, relay=self.relay.text().strip() or None, cb=self._done)

    def _shared_with(self) -> str | None:
        """The pipeline this computer shares with now, or is joining (as the status says)."""
        sharing = (self.c.status or {}).get("sharing") or {}
        return (sharing.get("joined") or sharing.get("joining") or {}).get("pipeline")

    def _asks_to_leave(self) -> bool:
        """Joined to a friend's pipeline already: a second join leaves it, so the first press
        says so and the second goes ahead (it used to leave without a word)."""
        sharing = (self.c.status or {}).get("sharing") or {}
        if not (sharing.get("joined") or sharing.get("joining")) or self.leave_confirmed:
            return False
        self.leave_confirmed = True
        self.accept_button.setText("Leave it and join")
        self.result.setText("<b>This computer already shares with a friend.</b> Joining this one "
                            "leaves it: that friend's model carries on without this computer's share. Press "
                            "“Leave it and join” to go on, or Cancel to stay.")
        return True

    def _unconfirm(self, *_):
        if self.leave_confirmed:
            self.leave_confirmed = False
            self.accept_button.setText("Accept and share")
            self.result.clear()

    def _done(self, result, error):
        """The node's answer to a join: joined, waiting on a reply code, or sharing by name."""
        if error:
            return self._error(error)
        sharing = result.get("sharing") or {}
        joined = sharing.get("joined")
        joining = sharing.get("joining") or {}
        if joining.get("reply_code"):
            # the host's addresses do not answer from here; the host can reach us instead
            self.reply_code = joining["reply_code"]
            # (15 minutes: the engine's wait, engine/wire/tunnel_join.py REPLY_WAIT_S)
            self.result.setText(
                "<b>Your friend's computer cannot be reached from here.</b> It can reach this one "
                "instead: send your friend this <b>reply code</b> (select it and copy), to paste into "
                "their host window's “Connect to them”. You can close this window; Potluck joins as "
                "soon as they do, and stops waiting after 15 minutes. (If they are not hosting now, or "
                "withdrew this invite, ask them for a new one instead.)"
                f"<br><br><code>{html.escape(self.reply_code)}</code>")
        elif joined:
            via = joined.get("via") or ""
            how = "through the relay" if via == "relay" else "directly" if via.startswith("direct") else ""
            self.result.setText(f"<b>Joined.</b> This computer is connected to your friend's model"
                                f"{' ' + how if how else ''}: the host gives this computer its share of the "
                                "model's layers. You can close this window.")
            self.accept_button.setEnabled(False)
            self.buttons.button(QDialogButtonBox.Cancel).setText("Close")
        elif sharing.get("paused"):
            self.result.setText(f"<b>Sharing is on but paused:</b> {sharing.get('reason')}")
        else:
            self.result.setText(f"<b>Sharing is on.</b> Send your friend this address: "
                                f"<code style='white-space:nowrap'>{html.escape(str(sharing.get('address')))}</code>")


def bad_link(exc: Exception) -> str:
    """One wording whether the link was opened from outside or pasted in."""
    return f"That link is not a Potluck invite ({exc}): ask your friend to copy it again."


NOT_A_CODE = ("That doesn't look like an invite code. An invite code is a long line of letters and digits "
              "(or a short code like 4821-917305, with the host's relay under Advanced): ask your friend to "
              "copy it again, or to send the potluck:// link.")
PIPELINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def is_short_code(text: str) -> bool:
    """A short code (4821-917305): digits with a dash, read out by the host."""
    compact = text.replace(" ", "")
    return compact.replace("-", "").isdigit() and "-" in compact


def looks_like_code(text: str) -> bool:
    """Invite codes are long; short codes are digits with a dash; a pipeline name is neither."""
    return len(text.replace(" ", "")) > 40 or is_short_code(text)
