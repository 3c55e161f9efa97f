"""One message of the chat's transcript: who said it, its text (plain while a reply
streams, markdown once complete), and the line of figures under a reply."""

from __future__ import annotations

import re

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QKeySequence, QTextDocument
from PySide6.QtWidgets import QApplication, QFrame, QLabel, QMenu, QSizePolicy, QVBoxLayout

from .store import Message

ZWSP = "\u200b"   # a place a line may break, drawn as nothing
_TEXT_NODE = re.compile(r">([^<]+)<")
_LONG_RUN = re.compile(r"(?:&[#\w]+;|[^\s<>&]){%d,}" % 32)
_ATOM = re.compile(r"&[#\w]+;|.", re.S)


def breakable(text: str) -> str:
    """Long unbroken runs (a key, a hash, a URL) given places to wrap every 8 characters:
    one such run made a bubble, and with it the transcript, as wide as itself. Copying
    takes the places out again (MessageView.copy)."""
    def split(m: re.Match) -> str:
        atoms = _ATOM.findall(m.group(0))   # an entity (&amp;) is one character
        return ZWSP.join("".join(atoms[i:i + 8]) for i in range(0, len(atoms), 8))
    return _LONG_RUN.sub(split, text)


def markdown_html(text: str) -> str:
    """A reply's markdown as the label's rich text, through a document: there a code
    block's long line wraps (the label's own markdown kept it whole, and one such line
    widened every bubble of the transcript past the window). HTML in the reply is shown as
    the text it is, not interpreted (a model explaining <div> would lose it)."""
    doc = QTextDocument()
    feature = QTextDocument.MarkdownFeature
    doc.setMarkdown(text, feature.MarkdownDialectGitHub | feature.MarkdownNoHTML)
    # only between tags: a link's address stays whole
    return _TEXT_NODE.sub(lambda m: ">" + breakable(m.group(1)) + "<", doc.toHtml())


class MessageView(QFrame):
    def __init__(self, role: str, text: str = "", parent=None):
        super().__init__(parent)
        self.role = role
        self.setObjectName("msg_" + role)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        who = QLabel("You" if role == "user" else "Potluck")
        who.setStyleSheet("font-weight: bold; color: %s;" % ("#2563eb" if role == "user" else "#b45309"))
        self.body = QLabel()
        self.body.setWordWrap(True)
        self.body.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.LinksAccessibleByMouse)
        self.body.setOpenExternalLinks(True)
        self.body.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Preferred)
        # copying gives the text as written, without the wrap places (breakable)
        self.body.installEventFilter(self)
        self.body.setContextMenuPolicy(Qt.CustomContextMenu)
        self.body.customContextMenuRequested.connect(self._menu)
        self.stats = QLabel()
        self.stats.setStyleSheet("color: #6b7280; font-size: 11px;")
        self.stats.hide()
        lay.addWidget(who)
        lay.addWidget(self.body)
        lay.addWidget(self.stats)
        self.setStyleSheet("QFrame#msg_user { background: #eff6ff; border-radius: 8px; }"
                           "QFrame#msg_assistant { background: #fffbeb; border-radius: 8px; }")
        self.set_plain(text)

    def set_plain(self, text: str):
        self.body.setTextFormat(Qt.PlainText)
        self.body.setText(breakable(text))
        self.markdown = False

    def copy(self):
        chosen = self.body.selectedText() or ""
        QApplication.clipboard().setText(chosen.replace(ZWSP, ""))

    def eventFilter(self, obj, event):
        if obj is self.body and event.type() == QEvent.KeyPress and event.matches(QKeySequence.Copy):
            self.copy()
            return True
        return super().eventFilter(obj, event)

    def _menu(self, pos):
        menu = QMenu(self.body)
        copy = menu.addAction("Copy", self.copy)
        copy.setEnabled(self.body.hasSelectedText())
        menu.addAction("Select all", self.select_all)
        menu.exec(self.body.mapToGlobal(pos))

    def select_all(self):
        doc = QTextDocument()   # the label's positions count its text, not its HTML
        doc.setHtml(self.body.text()) if self.markdown else doc.setPlainText(self.body.text())
        self.body.setSelection(0, doc.characterCount() - 1)

    def set_markdown(self, text: str):
        self.body.setTextFormat(Qt.RichText)
        self.body.setText(markdown_html(text))
        self.markdown = True

    def set_stats(self, text: str, error: bool = False):
        self.stats.setText(text)
        self.stats.setStyleSheet("color: %s; font-size: 11px;" % ("#b91c1c" if error else "#6b7280"))
        self.stats.show()


def stats_line(m: Message) -> str:
    parts = []
    if m.ttft is not None:
        parts.append(f"first token after {m.ttft:.2f} s")
    if m.tokens_per_s is not None:
        parts.append(f"{m.tokens_per_s:.1f} tokens/s")
    if m.tokens:
        parts.append(f"{m.tokens} tokens")
    if m.finish == "cancelled":
        parts.append("stopped")
    elif m.finish == "length":
        parts.append("cut off at the length limit")
    return " · ".join(parts)
