"""How the app words a hop between friends and speculation (the chat window's header and
the Status window say the same): pure, from the node's status. The ring itself the node
words (engine/node/ring_view.py)."""

from __future__ import annotations


def tokens_written(n: int) -> str:
    """'1 token written', '1,234 tokens written': the tray, the chat's header and the Status
    window count the host's output in the same words."""
    return f"{n:,} token{'' if n == 1 else 's'} written"


def speculation_label(hosting: dict) -> str:
    """'guessing ahead: 2.4 tokens a pass through the model, 71% of guesses right' where
    speculative decoding ran, else '':
    the head says it in words (its status's speculation.summary, engine/core/speculation.py
    describe); the app, a client of the node's API, only shows it."""
    return str((hosting.get("speculation") or {}).get("summary") or "")


def hop_label(hop: dict) -> str:
    """'Ana → Ben: direct (punched), 31 ms': how one friend's stage reaches the next
    friend's (straight across, or through this computer where they found no direct path)."""
    path = hop.get("path") or "connecting"
    if path == "via the host":
        path = "through this computer"
    rtt = hop.get("rtt_ms")
    # until the friend who dials it reports (every few seconds), the round trip is the handshake's
    when = "" if hop.get("live", True) or path == "through this computer" else " when set up"
    return f"{hop.get('hop', '?')}: {path}{f', {rtt:.0f} ms{when}' if rtt is not None else ''}"
