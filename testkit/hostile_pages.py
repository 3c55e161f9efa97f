"""The hostile suite's web page (testkit/hostile.py): what a site open in the user's
browser can send to Potluck on this machine.

A page may open a WebSocket to any address, loopback included, and POST to any URL; the
browser names the page's origin in both, and for a page that rebound its own name to
127.0.0.1, that name in the Host header. Each must be refused:

  * a WebSocket handshake with an Origin, to the host's tunnel port and to the joiner's
    stage server (a 403 before any message);
  * the API from a page of an origin not named: a "simple" text/plain POST (no CORS
    preflight), a JSON POST, a GET of the status;
  * the API addressed to another host name (DNS rebinding).
"""

from __future__ import annotations

import json

import aiohttp
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

EVIL = "http://evil.example"


async def attack_pages(t, w: dict, stage_url: str | None):
    """t: the suite's Tally; w: its world (api, direct_url)."""
    name = "web pages: handshakes and requests"
    for url in [w["direct_url"]] + ([stage_url] if stage_url else []):
        for _ in range(5):
            try:
                async with connect(url, origin=EVIL, open_timeout=20):
                    t.accepted(name, f"{url}: a page's handshake taken")
            except InvalidStatus as exc:
                got = exc.response.status_code
                (t.rejected if got == 403 else t.accepted)(name, f"websocket: HTTP {got}")
            except OSError as exc:
                t.crash(name, f"websocket {url}: {type(exc).__name__}")
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    asks = [("POST", "/chat/completions", {"Origin": EVIL, "Content-Type": "text/plain"}, chat),
            ("POST", "/chat/completions", {"Origin": EVIL, "Content-Type": "application/json"}, chat),
            ("GET", "/potluck/status", {"Origin": EVIL}, None),
            ("GET", "/potluck/status", {"Host": "evil.example:8000"}, None),
            ("POST", "/chat/completions", {"Host": "rebound.evil.example", "Content-Type": "application/json"}, chat)]
    async with aiohttp.ClientSession() as s:
        for method, path, headers, body in asks * 4:
            try:
                async with s.request(method, w["api"] + path, data=body, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=60)) as r:
                    status = r.status
                    code = (await r.json(content_type=None)).get("error", {}).get("code") if status == 403 else None
            except Exception as exc:  # noqa: BLE001 -- a dropped connection is a crash here
                t.crash(name, f"api {path}: {type(exc).__name__}")
                continue
            if status >= 500:
                t.crash(name, f"api {path}: HTTP {status}")
            else:
                (t.rejected if status == 403 else t.accepted)(name, f"api: HTTP {status} {code or ''}".strip())
