"""The chat window's headline while a friend's computer leaves and after (the node's
status carries the head's failover events)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")


def test_the_headline_says_a_computer_left_and_that_the_chat_goes_on():
    from app.chat import ChatWindow

    left = {"event": "left", "address": "ws://ana-pc:7860", "why": "disconnected", "t": 1.0}
    hosting = {"model": "SmolLM2", "recovering": "stage 1 disconnected", "events": [left]}
    text = ChatWindow.hosting_headline(hosting)
    assert "ws://ana-pc:7860 left" in text and "goes on" in text
    hosting = {"model": "SmolLM2", "recovering": None,
               "events": [left, {"event": "recovered", "seconds": 4.2, "t": 5.2}]}
    assert "rearranged in 4 s" in ChatWindow.hosting_headline(hosting)
    assert ChatWindow.hosting_headline({"model": "SmolLM2"}) == "SmolLM2 — ready"
