"""The ring in people's words: who computes which share of the model, on what, over
which path, and who left. Pure, from the hosting status the node builds (control.py);
the app's chat header and Status window show it, and so can any other front end.

    rows = ring(hosting, tokens_per_s=12.5)
    ring_text(rows)  # 'This computer (CPU): 19 of 30 layers → Ana (RTX 4090): 11 layers,
                     #  direct, 23 ms · 12.5 tokens/s'
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from engine.core.sizes import size_words


class TokenRate:
    """Tokens per second from a running total read now and then (each status read):
    over the last WINDOW_S, so a pause shows as a falling figure, not a frozen one."""
    WINDOW_S = 10.0

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.points: list[tuple[float, int]] = []

    def update(self, total: int) -> float | None:
        now = self.clock()
        if self.points and total < self.points[-1][1]:
            self.points = []          # a new pipeline counts from 0
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[1][0] >= self.WINDOW_S:
            self.points.pop(0)
        (t0, n0) = self.points[0]
        return None if now - t0 < 0.5 else (total - n0) / (now - t0)


def _who(i: int, stage: dict) -> str:
    if i == 0:
        return "This computer"
    if stage.get("name"):
        return str(stage["name"])
    host = urlsplit(str(stage.get("address", ""))).hostname or "?"
    if host in ("127.0.0.1", "localhost", "::1"):
        return f"This computer, part {i + 1}"   # another of this computer's own stages
    return f"A computer at {host}"


def _path(stage: dict) -> str | None:
    via = stage.get("via")
    if not via:
        return None
    if via == "relay":
        return "through the relay"
    if via.startswith("direct"):
        return "direct"
    return str(via)


def name_of(hosting: dict, address: str | None) -> str:
    """Who is at a stage address, in words: a friend's name, this computer, or the host
    part of a plain address ('a computer at 192.168.1.5')."""
    if not address:
        return "a computer"
    for f in hosting.get("friends") or []:
        if isinstance(f, dict) and f.get("address") == address and (f.get("name") or f.get("node_id")):
            return str(f.get("name") or f.get("node_id"))
    who = _who(1, {"address": address})
    return "a part of this computer" if who.startswith("This computer") else who.replace("A computer", "a computer")


def with_names(hosting: dict) -> list[dict]:
    """The head's events, each with `who` (name_of its address) and, for one that left,
    `why_words` (plain_why), for front ends to show."""
    out = []
    for e in hosting.get("events") or []:
        e = dict(e)
        if e.get("address"):
            e["who"] = name_of(hosting, e["address"])
        if e.get("event") == "left":
            e["why_words"] = plain_why(e.get("why"))
        out.append(e)
    return out


def ring(hosting: dict, tokens_per_s: float | None = None) -> list[dict]:
    """One row per machine in ring order, then one per machine that left and has not come
    back: who, device, layers (first, end), share ('11 of 30 layers', 'the whole model'), path, rtt_ms,
    state ('computing', 'left') and why."""
    stages = hosting.get("stages") or []
    total = max((s["layers"][1] for s in stages), default=0)
    rows = []
    for i, s in enumerate(stages):
        a, b = s["layers"]
        rtt = (s.get("tunnel") or {}).get("rtt_ms")
        if rtt is None:
            rtt = (s.get("link") or {}).get("rtt_ms")
        rows.append({"who": _who(i, s), "device": s.get("device_name") or s.get("device") or "?",
                     "layers": [a, b], "share": share_words(a, b, total), "path": _path(s) if i else None,
                     "rtt_ms": None if rtt is None else round(float(rtt), 1), "state": "computing", "why": None,
                     "memory": memory_words(s.get("memory"))})
    here = {s.get("address") for s in stages}
    away: dict[str, dict] = {}
    for e in hosting.get("events") or []:
        addr = e.get("address")
        if not addr:
            continue
        if e.get("event") == "left" and addr not in here:
            away[addr] = e
        elif e.get("event") == "slow" and addr in away:   # it answers; its line is the matter
            away[addr] = dict(away[addr], slow=e.get("why"))
        elif e.get("event") in ("back", "joined"):
            away.pop(addr, None)
    names = {f.get("address"): f.get("name") for f in hosting.get("friends") or [] if isinstance(f, dict)}
    for addr, e in away.items():
        rows.append({"who": names.get(addr) or _who(1, {"address": addr}), "device": None, "layers": None,
                     "share": None, "path": None, "rtt_ms": None, "state": "left",
                     "why": f"answers again, but {e['slow']}" if e.get("slow") else plain_why(e.get("why")),
                     "memory": None})
    if rows and tokens_per_s is not None:
        rows[0]["tokens_per_s"] = round(tokens_per_s, 1)
    return rows


def share_words(a: int, b: int, total: int) -> str:
    """A machine's part of the model: '11 of 30 layers', or 'the whole model' where one
    machine holds every layer (its count is in the host's own line)."""
    return "the whole model" if a == 0 and b == total else f"{b - a} of {total} layers"


def memory_words(mem: dict | None) -> str | None:
    """A stage's memory ({"weights", "cache", "offered"} in bytes) as '3.1 GB of 24 GB':
    its share of the model and its replies' cache as it is now, of what its machine offered."""
    if not mem:
        return None
    used = size_words(mem["weights"] + (mem.get("cache") or 0))
    return f"{used} of {size_words(mem['offered'])}" if mem.get("offered") else used


def path_words(path: str | None) -> str:
    """'direct' or 'through the relay' for a friend's tunnel path ('direct (mapped)', 'relay')."""
    if not path or path == "offline":
        return "connecting"
    return "through the relay" if path == "relay" else "direct" if path.startswith("direct") else path


def gives_words(about: dict | None) -> str | None:
    """What a friend's computer said it gives as it joined: 'RTX 4090, 24 GB free'."""
    if not about:
        return None
    parts = [about.get("device"), f"{size_words(about['memory'])} free" if about.get("memory") else None]
    return ", ".join(p for p in parts if p) or None


def plain_why(why: str | None) -> str:
    """A left event's reason without the engine's address ('stage 2 (ws://…) is leaving: X' -> 'X')."""
    if not why:
        return "it stopped answering"
    for marker in ("is leaving: ", "left: "):
        if marker in why:
            # the friend's node said it of itself: "this computer is going to sleep"
            return why.split(marker, 1)[1].replace("this computer", "their computer")
    if "disconnected" in why or "connection closed" in why:
        return "its connection closed"
    if any(w in why for w in ("silent", "no answer", "heartbeat", "stopped answering")):
        return "it stopped answering (asleep, or its network went)"
    return "it stopped answering" if "ws://" in why else why


def ring_text(rows: list[dict], tokens_per_s: float | None = None) -> str:
    """The ring in one line, for a header."""
    parts = []
    for r in rows:
        if r["state"] == "left":
            parts.append(f"{r['who']}: left ({r['why']})")
            continue
        link = ", ".join(x for x in (r["path"], f"{r['rtt_ms']:.0f} ms" if r["rtt_ms"] is not None else None) if x)
        share = f"{r['share']} in {r['memory']}" if r.get("memory") else r["share"]
        parts.append(f"{r['who']} ({r['device']}): {share}" + (f", {link}" if link else ""))
    line = " → ".join(p for p, r in zip(parts, rows) if r["state"] != "left")
    gone = [p for p, r in zip(parts, rows) if r["state"] == "left"]
    if gone:
        line += " · " + " · ".join(gone)
    rate = tokens_per_s if tokens_per_s is not None else (rows[0].get("tokens_per_s") if rows else None)
    if rate:
        line += f" · {rate:.1f} tokens/s"
    return line
