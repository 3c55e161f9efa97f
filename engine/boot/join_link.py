"""potluck:// links: the join request an invite link carries (sans-I/O; standard library
only: the app, which never imports the engine, reads them too).

An invite clicked in a chat app opens the app's join dialog, filled in (app/links.py);
the same link pasted whole into `potluck join` joins (engine/node/homes.py redeem).

The installers register the scheme (Windows: HKCU\\Software\\Classes\\potluck; Linux: the
.desktop file's x-scheme-handler/potluck), so the OS starts `potluck app <link>`; a
running app gets the link through its single-instance socket instead (app/main.py).

    potluck://join/<invite code>
    potluck://join/4821-917305?relay=wss://relay.example   (a short code needs its relay)
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SCHEME = "potluck"
# an invite is a few hundred characters of base32 and dashes; anything far longer is not one
MAX_LINK_CHARS = 4096


class LinkError(ValueError):
    pass


@dataclass(frozen=True)
class JoinLink:
    code: str
    relay: str | None = None


def is_link(text: str) -> bool:
    return isinstance(text, str) and text.lower().startswith(SCHEME + ":")


def parse_link(text: str) -> JoinLink:
    """The join request in a potluck:// link, or LinkError saying what is wrong with it."""
    if not is_link(text):
        raise LinkError("not a potluck:// link")
    if len(text) > MAX_LINK_CHARS:
        raise LinkError("this link is far too long to be an invite")
    parts = urlsplit(text.strip())
    # potluck://join/CODE puts "join" in the netloc; potluck:join/CODE leaves it in the path
    path = (parts.netloc + parts.path) if parts.netloc else parts.path
    action, _, rest = path.lstrip("/").partition("/")
    if action.lower() != "join":
        raise LinkError(f"unknown potluck link '{action}' (this version knows potluck://join/<code>)")
    code = unquote(rest).strip().strip("/")
    if not code:
        raise LinkError("the link has no invite code after join/")
    if any(not (c.isalnum() or c in "-_ ") for c in code):
        raise LinkError("the invite code in the link has characters an invite never has")
    relay = (parse_qs(parts.query).get("relay") or [None])[0]
    if relay is not None and not relay.lower().startswith(("ws://", "wss://")):
        raise LinkError("the link's relay must be a ws:// or wss:// address")
    return JoinLink(code=code, relay=relay)


def join_link(code: str, relay: str | None = None) -> str:
    """The link to send a friend for an invite code (parse_link reads it back)."""
    from urllib.parse import quote

    return f"{SCHEME}://join/{code.strip()}" + (f"?relay={quote(relay, safe=':/')}" if relay else "")
