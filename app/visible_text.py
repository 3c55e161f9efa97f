"""Every text a person sees in a window, and the engine's words among them: what the
plain-words test (tests/app/test_app_gui.py) and the tour check. The "Advanced"
section (dialogs.advanced_box) is exempt: ports, relays and keys live there on purpose."""

from __future__ import annotations

import re

from PySide6.QtWidgets import (QAbstractButton, QComboBox, QGroupBox, QLabel, QLineEdit, QPlainTextEdit,
                               QTableWidget, QTextBrowser, QWidget)

# the engine's words, which mean nothing to the person reading: addresses and binds,
# the GPU library's name and its error classes, cache units, a dtype beside another one
ENGINE_WORDS = re.compile(r"wss?://|0\.0\.0\.0|NVML|KV tokens|bf16 \(float32\)|\b[A-Z][A-Za-z0-9]*(?:Error|Exception)\b"
                          r"|Error_|Traceback|head \(this process\)")


def _advanced(w: QWidget, top: QWidget) -> bool:
    while w is not None and w is not top:
        if w.objectName() == "advanced":
            return True
        w = w.parentWidget()
    return False


def _plain(text: str) -> str:
    return re.sub(r"<[^>]+>", " ", text or "")


def visible_texts(window: QWidget) -> list[str]:
    """The window's title and every shown widget's text, placeholder and tooltip."""
    out = [window.windowTitle()]
    for w in window.findChildren(QWidget):
        if not w.isVisibleTo(window) or _advanced(w, window):
            continue
        texts = [w.toolTip()]
        if isinstance(w, QLabel):
            texts.append(_plain(w.text()))
        elif isinstance(w, QAbstractButton):
            texts.append(w.text())
        elif isinstance(w, QGroupBox):
            texts.append(w.title())
        elif isinstance(w, QLineEdit):
            texts += [w.text(), w.placeholderText()]
        elif isinstance(w, QPlainTextEdit):
            texts += [w.toPlainText(), w.placeholderText()]
        elif isinstance(w, QTextBrowser):
            texts.append(w.toPlainText())
        elif isinstance(w, QComboBox):
            texts += [w.itemText(i) for i in range(w.count())]
        elif isinstance(w, QTableWidget):
            for c in range(w.columnCount()):
                h = w.horizontalHeaderItem(c)
                texts.append(h.text() if h else "")
                texts += [w.item(r, c).text() for r in range(w.rowCount()) if w.item(r, c)]
        out += [t for t in texts if t]
    return out


def engine_words(window: QWidget) -> list[tuple[str, str]]:
    """(the engine word, the text it is in) for each one a person would see."""
    return [(m.group(0), t) for t in visible_texts(window) for m in ENGINE_WORDS.finditer(t)]
