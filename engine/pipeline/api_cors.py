"""Which web pages may call the API from a browser (CORS).

A chat front-end served from another origin (a web UI on localhost:3000) can reach the
API only if the API says so to the browser. None may by default: a page the user merely
visits could otherwise drive the model on this machine and read its replies. The owner
names the origins (`--cors-origin`); "*" (any page) only with an API key, which a page
that is not the owner's does not have.
"""

from __future__ import annotations

from aiohttp import web

METHODS = "GET, POST, OPTIONS"
HEADERS = "Authorization, Content-Type"
EXPOSED = "X-Potluck-Dropped-Messages"


class Cors:
    def __init__(self, origins, api_key: str | None):
        self.origins = frozenset(o.strip().rstrip("/") for o in origins or () if o.strip())
        if "*" in self.origins and not api_key:
            raise ValueError("--cors-origin '*' lets any web page use the API: give an API key too "
                             "(--api-key), or name the page's origin (e.g. http://localhost:3000)")

    def _allowed(self, request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not self.origins:
            return None
        return "*" if "*" in self.origins else origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        if not self.origins:
            return
        app.middlewares.insert(0, self._preflight)   # before the key check: a preflight carries none
        app.on_response_prepare.append(self._headers)  # streamed replies too, before their first byte

    @web.middleware
    async def _preflight(self, request, handler):
        if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method") \
                and self._allowed(request):
            return web.Response(status=204)
        return await handler(request)

    async def _headers(self, request, response):
        allowed = self._allowed(request)
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Vary"] = "Origin"
            response.headers["Access-Control-Allow-Methods"] = METHODS
            response.headers["Access-Control-Allow-Headers"] = HEADERS
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
            response.headers["Access-Control-Max-Age"] = "600"
