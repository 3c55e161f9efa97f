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


def hosting_headline(hosting: dict) -> str:
    """The model and whether it is ready, or rearranging because a computer left or
    came back, or waiting for one (the head replays every conversation: nothing typed
    is lost)."""
    model = hosting["model"]
    events = hosting.get("events") or []
    last = events[-1] if events else {}
    left = [e for e in events if e.get("event") == "left"]
    who = (left[-1].get("who") if left else None) or "a computer"   # the node names it
    recovering = hosting.get("recovering")
    if recovering and last.get("event") == "waiting":
        return f"{model} — {who} left; {recovering}… your conversation waits"
    someone = last.get("who") or "a computer"
    if hosting.get("leaving") and not recovering and last.get("event") == "leaving":
        return f"{model} — {someone} is leaving; handing its part to the others… your conversation goes on"
    if hosting.get("joining") and not recovering and last.get("event") in ("back", "joined"):
        verb = "is back" if last["event"] == "back" else "joined"
        far = hosting.get("joining_progress")
        far = f" ({int(far * 100)}%)" if isinstance(far, (int, float)) else ""
        return f"{model} — {someone} {verb}; loading its share{far}… your conversation goes on"
    if recovering and last.get("event") in ("back", "joined"):
        verb = "is back" if last["event"] == "back" else "joined"
        return f"{model} — {last.get('who') or 'a computer'} {verb}; rearranging the model…"
    if recovering:
        return f"{model} — {who} left; rearranging the model over the others… your conversation goes on"
    took = last.get("seconds")
    took = None if took is None else "under a second" if took < 1 else f"{took:.0f} s"
    if last.get("event") == "recovered" and took is not None:
        return f"{model} — ready ({who} left; rearranged in {took}, no conversation lost)"
    if last.get("event") == "rejoined" and took is not None:
        came = [e for e in events if e.get("event") in ("back", "joined")]
        verb = "came back" if came and came[-1]["event"] == "back" else "joined"
        newcomer = (came[-1].get("who") if came else None) or "a computer"
        return f"{model} — ready ({newcomer} {verb}; rearranged in {took}, no conversation lost)"
    return f"{model} — ready"
