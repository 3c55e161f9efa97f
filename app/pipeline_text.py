"""How the app names a friend's stage and the path to it (the chat window's header and
Pipeline status say the same): pure, from the node's status."""

from __future__ import annotations



def speculation_label(hosting: dict) -> str:
    """'speculation: 2.4 tokens/trip, 71% accepted' where speculative decoding ran, else '':
    the head says it in words (its status's speculation.summary, engine/core/speculation.py
    describe); the app, a client of the node's API, only shows it."""
    return str((hosting.get("speculation") or {}).get("summary") or "")


def friend_label(stage: dict) -> str:
    """'Ana (direct (mapped), 23 ms)': who holds the stage, the tunnel's path (direct, and
    how: LAN, the router's mapping, a punched hole, IPv6, a public address; or relayed) and its round
    trip; a stage reached by address is named by it."""
    if not stage.get("name"):
        return stage.get("address", "?")
    via = stage.get("via") or "connecting"
    if via == "relay":
        via = "relayed"
    rtt = (stage.get("tunnel") or {}).get("rtt_ms")
    return f"{stage['name']} ({via}{f', {rtt:.0f} ms' if rtt is not None else ''})"


def hop_label(hop: dict) -> str:
    """'Ana → Ben: direct (punched), 31 ms': how one friend's stage reaches the next
    friend's (straight across, or through this computer where they found no direct path)."""
    path = hop.get("path") or "connecting"
    if path == "via the host":
        path = "through this computer"
    rtt = hop.get("rtt_ms")
    return f"{hop.get('hop', '?')}: {path}{f', {rtt:.0f} ms' if rtt is not None else ''}"
