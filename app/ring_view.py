"""The ring, drawn: one card per computer in pipeline order (who, what it computes on,
its share of the model and the memory it takes, the path and round trip of its link), arrows between, a faded
card for each computer that left (and why), the live tokens per second at the end.
Pure drawing of the node's `hosting.ring` rows (engine/node/ring_view.py words them)."""

from __future__ import annotations

import html

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QWidget

CARD = ("QFrame#card {{ border: 1px solid {border}; border-radius: 6px; background: {bg}; }}"
        " QLabel {{ color: {fg}; }}")


def card_html(row: dict) -> str:
    who = html.escape(row["who"])
    if row.get("state") == "left":
        return f"<b>{who}</b><br>left<br><i>{html.escape(row.get('why') or '')}</i>"
    link = ", ".join(x for x in (row.get("path"), f"{row['rtt_ms']:.0f} ms" if row.get("rtt_ms") is not None else None)
                     if x)
    lines = [f"<b>{who}</b>", html.escape(str(row.get("device") or "")), html.escape(row.get("share") or "")]
    if row.get("memory"):
        lines.append(f"memory {html.escape(row['memory'])}")
    if link:
        lines.append(html.escape(link))
    return "<br>".join(lines)


class RingView(QWidget):
    """Cards for the rows; set_rows() redraws (the status arrives every second or so)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.row_layout = QHBoxLayout(self)
        self.row_layout.setContentsMargins(0, 0, 0, 0)
        self.cards: list[QLabel] = []
        self._shown: list | None = None

    def set_rows(self, rows: list[dict], tokens_per_s: float | None = None):
        key = [rows, tokens_per_s]
        if key == self._shown:
            return
        self._shown = key
        while self.row_layout.count():
            item = self.row_layout.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.cards = []
        for i, row in enumerate(rows):
            if i and row.get("state") != "left":
                self.row_layout.addWidget(QLabel("→"))
            frame = QFrame()
            frame.setObjectName("card")
            left = row.get("state") == "left"
            frame.setStyleSheet(CARD.format(border="#d1d5db" if left else "#60a5fa",
                                            bg="#f3f4f6" if left else "#eff6ff", fg="#6b7280" if left else "#111827"))
            inner = QHBoxLayout(frame)
            inner.setContentsMargins(8, 4, 8, 4)
            label = QLabel(card_html(row))
            inner.addWidget(label)
            self.cards.append(label)
            self.row_layout.addWidget(frame)
        if tokens_per_s:
            # every reply together over the last 10 s, idle time included: not one reply's
            # pace, which its own line under the reply says (they read 4.0 beside 15.5)
            self.row_layout.addWidget(QLabel(f"{tokens_per_s:.1f} tokens/s served (last 10 s)"))
        self.row_layout.addStretch(1)
