"""Status: the ring drawn, who holds which layers and the memory it takes, what
happened (who left, who came back), sharing and the GPU panel. Thin: the node's status,
in words."""

from __future__ import annotations

import html
import time

from PySide6.QtWidgets import QDialog, QHBoxLayout, QPushButton, QTextBrowser, QVBoxLayout

from .pipeline_text import hop_label, hosting_headline, speculation_label, tokens_written
from .ring_view import RingView


class StatusDialog(QDialog):
    """Status: who holds which layers, KV use, sharing, the GPU panel."""

    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Status")
        self.resize(600, 460)
        lay = QVBoxLayout(self)
        # the ring drawn above the words (as in the chat's header): one card per computer
        self.ring_view = RingView()
        self.ring_view.hide()
        lay.addWidget(self.ring_view)
        self.view = QTextBrowser()
        lay.addWidget(self.view)
        row = QHBoxLayout()
        close = QPushButton("Close")
        close.clicked.connect(self.accept)
        row.addStretch(1)
        row.addWidget(close)
        lay.addLayout(row)
        controller.statusChanged.connect(self.on_status)
        self.on_status(controller.status)

    def on_status(self, st: dict):
        rows = ((st or {}).get("hosting") or {}).get("ring") or []
        self.ring_view.set_rows(rows, rows[0].get("tokens_per_s") if rows else None)
        self.ring_view.setVisible(bool(rows))
        self.view.setHtml(status_html(st))


STATE_WORDS = {"idle": "Not hosting or sharing", "loading": "Starting…", "serving": "Hosting",
               "sharing": "Sharing this computer with a friend", "paused": "Sharing paused",
               "error": "Something went wrong"}


def event_line(e: dict) -> str:
    """One failover event (the head's `events`, each named by the node: `who`), in words."""
    when = time.strftime("%H:%M:%S", time.localtime(e["t"])) if isinstance(e.get("t"), (int, float)) else ""
    kind = e.get("event")
    who = e.get("who") or "a computer"
    if kind == "left":
        text = f"{who} left: {e.get('why_words') or 'it stopped answering'}"   # the node words it
    elif kind == "refused":
        text = f"{who} could not take a share of the model: {e.get('why') or 'it refused'}"
    elif kind == "leaving":
        text = f"{who} is leaving: the others load its layers while it still serves"
    elif kind == "waiting":
        text = e.get("why") or "waiting for a computer to join"
    elif kind == "slow":   # back: it held layers here before; else it asked to join
        text = (f"{who} {'answers again' if e.get('back', True) else 'asked to join'}, but "
                f"{e.get('why') or 'its connection is too slow for now'}; the others go on without it, "
                "and it is asked again later")
    elif kind in ("back", "joined"):
        text = f"{who} {'is back' if kind == 'back' else 'joined'}"
    elif kind in ("recovered", "rejoined"):
        replayed = e.get("replayed", 0)
        text = (f"rearranged over {_count(e.get('stages') or 0, 'computer')} in {e.get('seconds', 0):.1f} s; "
                + (f"{_count(replayed, 'conversation')} carried on, none lost" if replayed
                   else "no conversation was running"))
        if e.get("ahead_s"):
            text += f" (its share loaded beforehand in {e['ahead_s']:.0f} s while the chat went on)"
    else:
        text = str(kind)
    return f"{when} {html.escape(text)}".strip()


def ring_table(h: dict) -> str:
    """The ring (the node's `ring` rows): each computer, what it computes on, its share
    and the memory it takes, the path and round trip of its link; those who left, and why."""
    # headers whole (a narrow window broke them mid-word: "Compute r", "Connecti on")
    out = ["<table border=1 cellpadding=4><tr><th nowrap>Computer</th><th nowrap>Computes on</th>"
           "<th nowrap>Share of the model</th><th nowrap>Memory</th><th nowrap>Connection</th></tr>"]
    for r in h.get("ring") or []:
        if r.get("state") == "left":
            out.append(f"<tr><td>{html.escape(r['who'])}</td><td colspan=4><i>left: "
                       f"{html.escape(r.get('why') or '')}</i></td></tr>")
            continue
        link = ", ".join(x for x in (r.get("path"), f"{r['rtt_ms']:.0f} ms" if r.get("rtt_ms") is not None else None)
                         if x) or "this computer"
        out.append(f"<tr><td>{html.escape(r['who'])}</td><td>{html.escape(str(r.get('device')))}</td>"
                   f"<td>{html.escape(r.get('share') or '')}</td><td>{html.escape(r.get('memory') or '')}</td>"
                   f"<td>{html.escape(link)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def other_computers(h: dict) -> bool:
    """Whether the pipeline spans other computers than this one (the ring names its own
    parts "This computer…"); without a ring, whether it has several stages."""
    ring = [r for r in h.get("ring") or [] if r.get("state") != "left"]
    if ring:
        return any(not str(r.get("who", "")).startswith("This computer") for r in ring)
    return len(h.get("stages") or []) > 1


def _count(n: int, noun: str) -> str:
    """'no conversation', '1 conversation', '3 conversations'."""
    return f"no {noun}" if not n else f"{n} {noun}{'' if n == 1 else 's'}"


def status_html(st: dict) -> str:
    st = st or {}
    state = st.get("state", "unknown")
    sh = st.get("sharing") or {}
    headline = STATE_WORDS.get(state, state)
    if state in ("idle", "sharing") and sh.get("on") and not sh.get("connected"):
        # on, and no pipeline of a friend's connected (not yet, or its host went away)
        headline = "Sharing this computer: waiting for a friend to use it"
    out = [f"<h3>{headline}</h3>"]
    if st.get("error"):
        out.append(f"<p style='color:#b91c1c'>{html.escape(st['error'])}</p>")
    loading = st.get("loading") or {}
    if loading.get("message"):
        # what loads and how far, as the chat window's bars show it ("Starting…" said nothing)
        parts = [f"{p.get('what') or 'loading'} {100 * min(1.0, p['done'] / p['total']):.0f}%"
                 for _, p in sorted((loading.get("stages") or {}).items()) if p.get("total")]
        out.append(f"<p>{html.escape(loading['message'])}"
                   + (f" — {html.escape(', '.join(parts))}" if parts else "") + "</p>")
    h = st.get("hosting")
    if h:
        ring_rows = h.get("ring") or []
        rate = ring_rows[0].get("tokens_per_s") if ring_rows else None
        out.append(f"<p><b>Hosting {html.escape(h['model'])}</b> — {tokens_written(h.get('tokens_served', 0))}"
                   + (f", {rate:.1f} tokens/s served over the last 10 s" if rate else "")
                   + f"; {_count(h.get('running', 0), 'conversation')} being answered, "
                     f"{h.get('waiting') or 'none'} waiting<br>"
                   f"For other programs (OpenAI-compatible): <code>{h.get('openai_url')}</code>"
                   + (f"<br>On your network: <code>{h['api_lan_url']}</code> (with the API key from "
                      "Host a model…)" if h.get("api_lan_url") else "")
                   + "</p>" + ring_table(h))
        hops = [hop_label(x) for x in h.get("hops") or []]
        if hops:    # friend to friend: straight across, or through this computer
            out.append("<p><b>Between friends</b><br>" + "<br>".join(html.escape(x) for x in hops) + "</p>")
        spec = speculation_label(h)   # where speculation ran: tokens per trip, acceptance
        if spec:
            out.append(f"<p>{html.escape(spec)}</p>")
        if h.get("recovering"):
            # the chat header's words (the head's own name stages and their addresses)
            now = hosting_headline(h).split(" — ", 1)[-1]
            out.append(f"<p><b>Now:</b> {html.escape(now)}</p>")
        elif h.get("leaving"):
            going = [e for e in (h.get("events") or []) if e.get("event") == "leaving"]
            who = (going[-1].get("who") if going else None) or "a computer"
            out.append(f"<p><b>Now:</b> {html.escape(who)} is leaving; the others are loading its layers "
                       "while it still serves</p>")
        elif h.get("joining"):   # its words name an address: the node's event names the computer
            came = [e for e in (h.get("events") or []) if e.get("event") in ("back", "joined")]
            who = (came[-1].get("who") if came else None) or "a computer"
            out.append(f"<p><b>Now:</b> {html.escape(who)} is loading its share of the model; "
                       "conversations go on meanwhile</p>")
        elif h.get("spare_layers") and other_computers(h):
            # held beside each computer's share: a friend dropping off without a word costs no loading
            out.append(f"<p>Ready if a computer drops off: the others hold {h['spare_layers']} spare layers "
                       "of the model, so nothing needs loading before conversations go on</p>")
        lines = [event_line(e) for e in (h.get("events") or [])[-8:]]
        if lines:
            out.append("<p><b>What happened</b></p><ul>" + "".join(f"<li>{x}</li>" for x in lines) + "</ul>")
    if sh.get("on"):
        line = f"<p><b>Sharing this computer</b> ({sh.get('device_name') or sh.get('device') or '?'})"
        if sh.get("layers"):
            a, b = sh["layers"]
            line += f": {b - a} layers of a friend's model"
            if not sh.get("connected"):
                line += (" — your friend's computer is not connected now (it may have quit or gone to sleep); "
                         "they stay loaded for when it comes back")
        elif not sh.get("paused"):
            line += ": waiting for a friend to use it"
            if sh.get("address"):   # shared by address (no invite): what a host adds by hand
                line += (f"<br>A friend's host adds this computer with this address (it holds a secret: "
                         f"send it to them only): <code style='white-space:nowrap'>"
                         f"{html.escape(sh['address'])}</code>")
        reply = (sh.get("joining") or {}).get("reply_code")
        if reply:
            line += (f"<br>Your friend's computer cannot be reached from here: send them this reply code to "
                     f"paste into their host window's “Connect to them”: <code>{html.escape(reply)}</code>")
        if sh.get("paused"):
            line += f" — paused: {html.escape(str(sh.get('reason')))}"
        if sh.get("restarts"):
            line += f" — {html.escape(sh.get('stopped') or 'restarted')} ({sh['restarts']}×)"
        out.append(line + "</p>")
    elif "sharing" in st:
        out.append("<p>Sharing this computer: off</p>")
    else:   # the engine is gone (the app's own account): nothing of it to read, only what to do
        out.append("<p>Restart it with the button in the chat window; your conversations are safe.</p>")
    gpu = st.get("gpu") or {}
    if gpu.get("message"):
        out.append(f"<p><b>GPU:</b> {html.escape(gpu['message'])}</p>")
    for g in gpu.get("gpus") or []:
        power = f", {g['power_w']:.0f} W" if g.get("power_w") is not None else ""
        out.append(f"<p>{g['name']}: {g['utilization_pct']:.0f}% · {g['memory_used_mb']:.0f}/"
                   f"{g['memory_total_mb']:.0f} MB · {g['temperature_c']:.0f} °C{power}</p>")
    return "".join(out)
