"""Malformed HTTP requests said in one line, not a traceback (the API, the relay, the
app's node).

aiohttp answers a request it cannot parse (no Host header, garbage from a port scan) or
whose body it cannot read (a gzip body that is not gzip) with a 400 itself, then logs
it as an ERROR with a traceback of forty lines: any client could fill the owner's log
with them, and they read as if the server had failed. It has not: one line at INFO says
what was refused.
"""

from __future__ import annotations

import logging

log = logging.getLogger("potluck.http")


class BadRequestFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            words = " ".join(str(exc).split())
            log.info("bad request refused: %s", words[:160])
            return False
        return True


def quiet_bad_requests() -> None:
    """Once per process (idempotent): aiohttp's server logger says a bad request in one line."""
    lg = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadRequestFilter) for f in lg.filters):
        lg.addFilter(BadRequestFilter())
