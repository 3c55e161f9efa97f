"""What a ws:// address must look like (a stage's, a relay's), said before anything is
dialled: a mistake there surfaced as a library's error after the model loaded, or a
retry loop that never said why. Pure."""

from __future__ import annotations

from urllib.parse import urlsplit


def address_problem(address: str, what: str = "a stage's address", relay: bool = False) -> str | None:
    """Why `address` is not `what` ('ws[s]://host:port', a '#secret' after it), or None.
    A relay may leave its port to the scheme's and sit under a path (wss://example.com/
    potluck behind a web server): its routes are made by adding to it."""
    url = address.strip().partition("#")[0]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url!r} is not {what} ({exc})"
    if parts.scheme not in ("ws", "wss") or not parts.hostname or (port is None and not relay):
        return f"{url!r} is not {what}: it is written ws://host:port (or wss://)"
    if (parts.path not in ("", "/") and not relay) or parts.query:
        return f"{url!r} is not {what}: ws://host:port, with nothing after the port"
    return None
