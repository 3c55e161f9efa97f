"""Which web pages may call the API from a browser (CORS).

A chat front-end served from another origin (a web UI on localhost:3000) can reach the
API only if the API says so to the browser. None may by default: a page the user merely
visits could otherwise drive the model on this machine and read its replies. The owner
names the origins (`--cors-origin`); "*" (any page) only with an API key, which a page
that is not the owner's does not have.

CORS headers alone keep a page from reading the replies, not from asking: a "simple"
POST (Content-Type text/plain) needs no preflight, and aiohttp reads its body as JSON
all the same, so any page could have run generation here. A browser names the page's
origin on every such request and our clients never send one: a request from an origin
not named is refused (403) before it is read. And a page that rebinds its own name to
127.0.0.1 (DNS rebinding) is "same origin" to the browser but still names its own host:
an API on loopback answers only requests addressed to a loopback host.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from aiohttp import web

from engine.wire.stage_auth import is_loopback

METHODS = "GET, POST, OPTIONS"
HEADERS = "Authorization, Content-Type"
EXPOSED = "X-Potluck-Dropped-Messages, x-request-id"
# OpenAI's JavaScript client sends its own headers on every request (X-Stainless-Os,
# -Lang, -Retry-Count..., OpenAI-Organization): a preflight that allowed only the two
# above made the browser refuse every request of a page the owner had named. A named
# origin may send the headers it asks for (the key still decides what it may do); what it
# asks is echoed back only as header names, and only so many of them.
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
_MAX_ASKED = 32


def _refused(message: str, code: str) -> web.Response:
    """A 403 in OpenAI's error shape (api.ApiError's), which clients read."""
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": code}}, status=403)


def loopback_name(host_header: str, own_name: str = "") -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.x, [::1],
    0.0.0.0, or `own_name`, the machine's own (Debian resolves it to 127.0.1.1), with or
    without a port. A page that rebinds its own name to 127.0.0.1 names that name."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if is_loopback(host) or host in ("localhost.", own_name) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified    # (curl http://0.0.0.0:8000 reaches loopback)
    except ValueError:
        return False


def allow_headers(asked: str) -> str:
    """A preflight's Access-Control-Allow-Headers: ours and the header names the page asked
    for (its Access-Control-Request-Headers), well-formed names only, the first _MAX_ASKED."""
    names = [n.strip() for n in asked.split(",")[:_MAX_ASKED]]
    out, seen = HEADERS.split(", "), {h.lower() for h in HEADERS.split(", ")}
    for n in names:
        if _TOKEN.fullmatch(n) and n.lower() not in seen:
            seen.add(n.lower())
            out.append(n)
    return ", ".join(out)


def origin(text: str) -> str:
    """A named origin as a browser writes it in its Origin header (scheme://host[:port],
    lower case, the scheme's own port left out), or '*'. ValueError where it is not one:
    'localhost:3000' or a page's address with its path would never match any request, and
    the page would be refused with no word of why."""
    text = text.strip().rstrip("/")
    if text == "*":
        return text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or not parts.scheme or not parts.hostname or parts.path or parts.query
            or parts.fragment or parts.username or parts.password):
        raise ValueError(f"--cors-origin {text[:100]!r} is not a web page's origin: it is written "
                         "scheme://host or scheme://host:port, e.g. http://localhost:3000 (no path)")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    return f"{parts.scheme.lower()}://{host}" + ("" if port in (None, default) else f":{port}")


class Cors:
    def __init__(self, origins, api_key: str | None, loopback: bool = False):
        self.origins = frozenset(origin(o) for o in origins or () if o.strip())
        if "*" in self.origins and not api_key:
            raise ValueError("--cors-origin '*' lets any web page use the API: give an API key too "
                             "(--api-key), or name the page's origin (e.g. http://localhost:3000)")
        self.loopback = loopback   # the API listens on loopback: requests must name a loopback host
        self.own_name = socket.gethostname().lower()   # read once, not per request

    def _allowed(self, request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not self.origins:
            return None
        return "*" if "*" in self.origins else origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self._pages)
        if not self.origins:
            return
        app.middlewares.insert(1, self._preflight)   # before the key check: a preflight carries none
        app.on_response_prepare.append(self._headers)  # streamed replies too, before their first byte

    @web.middleware
    async def _pages(self, request, handler):
        origin = request.headers.get("Origin")
        if origin is not None and not self._allowed(request):
            return _refused(f"a web page at {origin[:100]} may not use this API: start the server with "
                            f"--cors-origin {origin[:100]} to let it", "origin_not_allowed")
        if self.loopback and not loopback_name(request.host or "", self.own_name):
            return _refused("this API answers requests to 127.0.0.1 or localhost only", "host_not_allowed")
        return await handler(request)

    @web.middleware
    async def _preflight(self, request, handler):
        if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method") \
                and self._allowed(request):
            return web.Response(status=204, headers={"Access-Control-Allow-Headers": allow_headers(
                request.headers.get("Access-Control-Request-Headers", ""))})
        return await handler(request)

    async def _headers(self, request, response):
        allowed = self._allowed(request)
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Vary"] = "Origin, Access-Control-Request-Headers"
            response.headers["Access-Control-Allow-Methods"] = METHODS
            response.headers.setdefault("Access-Control-Allow-Headers", HEADERS)
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
            response.headers["Access-Control-Max-Age"] = "600"
