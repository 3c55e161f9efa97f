"""`potluck relay`: pairs a joiner with a host by pipeline id and forwards opaque frames.

Both homes connect out to it (so it works behind NATs):

    GET /v1/host/{pipeline}/{key}     the host's control connection (one per pipeline and
                                      host key), once it proved it holds the key
                                      (engine/wire/relay_auth.py); then the relay sends
                                      {"type": "incoming", "session": id}
    GET /v1/join/{pipeline}/{key}     a joiner (the invite names both); waits until the
                                      host accepts
    GET /v1/accept/{pipeline}/{key}/{id}   the host's side of that joiner's channel
    GET /v1/stats                     counters (JSON)

After pairing it copies binary frames from one side to the other and never looks
inside: the tunnel (engine/wire/tunnel.py) is end-to-end encrypted, so all it ever holds
is ciphertext. Limits, each with a clear close reason: frame size, channels per
pipeline, pipelines in all, time to pair, idle time, bytes per second per pipeline
(throttled, not dropped: a fast sender waits, then TCP pushes back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import WSMsgType, web

from engine.wire.quiet_http import quiet_bad_requests
from engine.wire.relay_auth import Challenge

log = logging.getLogger("potluck.relay")

_ID = re.compile(r"^[0-9a-f]{16}$")
_KEY = re.compile(r"^[0-9a-f]{64}$")
_SID = re.compile(r"^[0-9a-f]{32}$")
_CHANNEL = re.compile(r"^[0-9]{4}$")


@dataclass
class Limits:
    max_frame: int = 128 << 10          # bytes per frame
    max_channels: int = 8               # paired or waiting joiner channels per pipeline
    max_pipelines: int = 1000
    pair_timeout: float = 15.0          # seconds a joiner waits for the host to accept
    idle_timeout: float = 120.0         # seconds without a frame on a channel
    rate: float = 20e6                  # bytes per second per pipeline (both ways together)
    burst: float = 4e6
    handshake_timeout: float = 10.0     # seconds for a new connection to send its request
    pake_timeout: float = 600.0         # seconds a short-code mailbox waits for its other side
    max_mailboxes: int = 1000
    # listings and short-code mailboxes one client address holds at once: anyone may list
    # under a key of their own, and without this one client held all max_pipelines (or
    # every mailbox, 600 s each) and the relay said "relay full" to every real host. 0: no
    # limit (a relay behind a proxy, where every client has the proxy's address)
    per_address: int = 8


class _Bucket:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, time.monotonic()

    async def take(self, n: int):
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= min(n, self.burst):
                self.tokens -= n
                return
            await asyncio.sleep((min(n, self.burst) - self.tokens) / self.rate)


@dataclass
class _Pipeline:
    host: web.WebSocketResponse
    bucket: _Bucket
    pending: dict = field(default_factory=dict)     # session id -> Future[host side ws]
    channels: int = 0


class Relay:
    def __init__(self, limits: Limits | None = None, dump=None):
        self.limits = limits or Limits()
        self.pipelines: dict[str, _Pipeline] = {}
        self.stats: Counter = Counter()
        self.refused: Counter = Counter()
        self.dump = dump        # a callable(bytes) that sees every forwarded frame (tests)
        self._served: set[int] = set()
        self.mailboxes: dict[str, asyncio.Future] = {}
        self._held: Counter = Counter()    # client address -> listings and mailboxes it holds
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4096, middlewares=[self._mark_served])
        app.router.add_get("/", self.index)
        app.router.add_get("/v1/stats", self.stats_view)
        app.router.add_get("/v1/host/{pipeline}/{key}", self.host)
        app.router.add_get("/v1/join/{pipeline}/{key}", self.join)
        app.router.add_get("/v1/accept/{pipeline}/{key}/{session}", self.accept)
        # what an older Potluck asks, without the host's key: told why, not a bare 404
        app.router.add_get("/v1/host/{pipeline}", self.outdated)
        app.router.add_get("/v1/join/{pipeline}", self.outdated)
        app.router.add_get("/v1/pake/{channel}", self.pake)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "Relay":
        quiet_bad_requests()
        self.runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self._sweeper = asyncio.ensure_future(self._sweep())
        return self

    async def _sweep(self):
        """aiohttp waits forever for a request that never ends: every connection gets
        `handshake_timeout` seconds to make one (after that the WebSocket's own idle
        timeout applies)."""
        first_seen: dict = {}
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            conns = dict(getattr(self.runner.server, "_connections", {}) or {})
            for handler, transport in conns.items():
                t0 = first_seen.setdefault(handler, now)
                if now - t0 > self.limits.handshake_timeout and id(transport) not in self._served \
                        and not transport.is_closing():
                    self.refused["no request within the handshake timeout"] += 1
                    transport.close()
            for handler in list(first_seen):
                if handler not in conns:
                    del first_seen[handler]
            live = {id(t) for t in conns.values()}
            self._served &= live

    @web.middleware
    async def _mark_served(self, request, handler):
        self._served.add(id(request.transport))
        if "Origin" in request.headers and request.headers.get("Upgrade", "").lower() == "websocket":
            # a web page's handshake (every browser sends an Origin; our clients never do):
            # refused as every WebSocket server of ours refuses it (ws_server.py), so a page
            # a person visits cannot hold mailboxes or listings in their name
            self.refused["a web page's handshake"] += 1
            return web.Response(status=403, text="a web page may not use this relay\n")
        return await handler(request)

    async def close(self):
        if getattr(self, "_sweeper", None) is not None:
            self._sweeper.cancel()
        if self.runner is not None:
            await self.runner.cleanup()

    def _ws(self) -> web.WebSocketResponse:
        return web.WebSocketResponse(max_msg_size=self.limits.max_frame, heartbeat=30.0, compress=False)

    async def _refuse(self, request, reason: str, code: int = 4000):
        self.refused[reason] += 1
        ws = self._ws()
        await ws.prepare(request)
        await ws.close(code=code, message=reason.encode()[:120])
        return ws

    async def index(self, request):
        return web.Response(text="potluck relay\n")

    async def stats_view(self, request):
        return web.json_response({"pipelines": len(self.pipelines), "counters": dict(self.stats),
                                  "refused": dict(self.refused)})

    def _crowding(self, request) -> bool:
        """Whether the request's address holds its share of listings and mailboxes."""
        return bool(self.limits.per_address) and self._held[request.remote] >= self.limits.per_address

    def _let_go(self, address) -> None:
        self._held[address] -= 1
        if self._held[address] <= 0:
            del self._held[address]

    async def outdated(self, request):
        return await self._refuse(request, "this relay needs a newer Potluck (one that names the host's key)", 4426)

    def _listing(self, request) -> str | None:
        """The pipeline id and host key a request names, as the relay lists a host; None
        if either is malformed."""
        pid, key = request.match_info["pipeline"], request.match_info["key"]
        return f"{pid}/{key}" if _ID.match(pid) and _KEY.match(key) else None

    async def host(self, request):
        listing = self._listing(request)
        if listing is None:
            return await self._refuse(request, "bad pipeline id or host key")
        if listing in self.pipelines:
            return await self._refuse(request, "a host is already registered for this pipeline")
        if len(self.pipelines) >= self.limits.max_pipelines:
            return await self._refuse(request, "relay full")
        if self._crowding(request):
            return await self._refuse(request, "too many listings and codes from this address", 4429)
        ws = self._ws()
        await ws.prepare(request)
        # listed only once it proves it holds the key its friends' invites name
        challenge = Challenge(request.match_info["pipeline"], bytes.fromhex(request.match_info["key"]))
        try:
            await ws.send_str(json.dumps(challenge.message()))
            answer = await ws.receive(timeout=self.limits.handshake_timeout)
            proven = answer.type == WSMsgType.TEXT and len(answer.data) < 1024 and challenge.check(json.loads(answer.data))
        except (asyncio.TimeoutError, ValueError, ConnectionError):
            proven = False
        why = ("the host did not prove its key" if not proven
               else "a host is already registered for this pipeline" if listing in self.pipelines   # meanwhile
               else "relay full" if len(self.pipelines) >= self.limits.max_pipelines else None)
        if why is not None:
            self.refused[why] += 1
            await ws.close(code=4403 if not proven else 4000, message=why.encode())
            return ws
        p = _Pipeline(ws, _Bucket(self.limits.rate, self.limits.burst))
        self.pipelines[listing] = p
        self.stats["hosts"] += 1
        self._held[request.remote] += 1
        try:
            await ws.send_str(json.dumps({"type": "registered"}))
            async for msg in ws:        # the host sends nothing; anything else ends it
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await ws.close(code=4000, message=b"the control connection carries no frames")
                    break
        finally:
            self._let_go(request.remote)
            if self.pipelines.get(listing) is p:
                del self.pipelines[listing]
            for fut in p.pending.values():
                if not fut.done():
                    fut.cancel()
        return ws

    async def join(self, request):
        listing = self._listing(request)
        if listing is None:
            return await self._refuse(request, "bad pipeline id or host key")
        p = self.pipelines.get(listing)
        if p is None:
            return await self._refuse(request, "no host online for this pipeline", 4404)
        if p.channels >= self.limits.max_channels:
            return await self._refuse(request, "too many connections for this pipeline", 4429)
        ws = self._ws()
        await ws.prepare(request)
        sid = secrets.token_hex(16)
        fut = asyncio.get_running_loop().create_future()
        p.pending[sid] = fut
        p.channels += 1
        try:
            try:
                await p.host.send_str(json.dumps({"type": "incoming", "session": sid}))
                other = await asyncio.wait_for(fut, self.limits.pair_timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError, ConnectionError, RuntimeError):
                self.refused["the host did not accept in time"] += 1
                await ws.close(code=4408, message=b"the host did not accept in time")
                return ws
            finally:
                p.pending.pop(sid, None)
            self.stats["paired"] += 1
            host_ws, host_done = other
            try:
                a = asyncio.ensure_future(self._forward(ws, host_ws, p.bucket))
                b = asyncio.ensure_future(self._forward(host_ws, ws, p.bucket))
                _, pending = await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)
                for t in pending:
                    t.cancel()
            finally:
                await ws.close(code=1000, message=b"the other side left")
                await host_ws.close(code=1000, message=b"the other side left")
                host_done.set()
        finally:
            p.channels -= 1
        return ws

    async def accept(self, request):
        listing, sid = self._listing(request), request.match_info["session"]
        p = self.pipelines.get(listing) if listing is not None else None
        fut = p.pending.get(sid) if (p is not None and _SID.match(sid)) else None
        if fut is None or fut.done():
            return await self._refuse(request, "no such waiting joiner")
        ws = self._ws()
        await ws.prepare(request)
        done = asyncio.Event()
        fut.set_result((ws, done))
        await done.wait()       # the joiner's handler forwards both ways, then sets it
        return ws

    async def pake(self, request):
        """Short codes (engine/wire/shortcode.py): the first two connections on a 4-digit
        channel are paired for one SPAKE2 exchange; small frames only, then it is gone."""
        ch = request.match_info["channel"]
        if not _CHANNEL.match(ch):
            return await self._refuse(request, "bad channel")
        waiting = self.mailboxes.get(ch)
        if waiting is not None and waiting.done():
            return await self._refuse(request, "channel busy")
        if waiting is None and len(self.mailboxes) >= self.limits.max_mailboxes:
            return await self._refuse(request, "relay full")
        if waiting is None and self._crowding(request):
            return await self._refuse(request, "too many listings and codes from this address", 4429)
        ws = web.WebSocketResponse(max_msg_size=4096, heartbeat=30.0, compress=False)
        await ws.prepare(request)
        if waiting is not None:                 # the second side: pair and forward both ways
            done = asyncio.Event()
            waiting.set_result((ws, done))
            await done.wait()
            return ws
        fut = asyncio.get_running_loop().create_future()
        self.mailboxes[ch] = fut
        self._held[request.remote] += 1
        try:
            held = await self._wait_in_mailbox(ws, fut)
        finally:
            self._let_go(request.remote)
            if self.mailboxes.get(ch) is fut:
                del self.mailboxes[ch]
        if held is None:
            return ws
        other, done = fut.result()
        self.stats["pake"] += 1
        bucket = _Bucket(64 << 10, 64 << 10)
        try:
            for data in held:   # what the first side said while it waited (its SPAKE2 message)
                await self._pass_on(data, other, bucket)
            a = asyncio.ensure_future(self._forward(ws, other, bucket))
            b = asyncio.ensure_future(self._forward(other, ws, bucket))
            _, pending = await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        finally:
            await ws.close()
            await other.close()
            done.set()
        return ws

    async def _wait_in_mailbox(self, ws: web.WebSocketResponse, fut: asyncio.Future) -> list[bytes] | None:
        """The first side of a short code waits for the second: what it sends meanwhile is
        held for it (a few small frames), and if it leaves, or nobody comes in time, None
        (the mailbox is let go at once: a joiner who mistyped the code must not hold it,
        nor the relay's shutdown, for the ten minutes a host's offer lasts)."""
        held: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + self.limits.pake_timeout
        while True:
            recv = asyncio.ensure_future(ws.receive())
            left = deadline - asyncio.get_running_loop().time()
            await asyncio.wait([fut, recv], timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                await asyncio.gather(recv, return_exceptions=True)
                if fut.done():
                    return held
                await ws.close(code=4408, message=b"nobody came")
                return None
            msg = recv.result()
            if msg.type == WSMsgType.BINARY and len(held) < 4 and len(msg.data) <= 4096:
                held.append(msg.data)
                if fut.done():
                    return held
                continue
            await ws.close()
            if fut.done():   # the second side came just as the first left: let it go too
                other, done = fut.result()
                await other.close()
                done.set()
            return None

    async def _pass_on(self, data: bytes, dst: web.WebSocketResponse, bucket: _Bucket) -> bool:
        """One frame to the other side, within the rate, counted (and dumped, in tests);
        False once the other side is gone."""
        await bucket.take(len(data))
        if self.dump is not None:
            self.dump(data)
        try:
            await dst.send_bytes(data)
        except (ConnectionError, RuntimeError):
            return False
        self.stats["frames"] += 1
        self.stats["bytes"] += len(data)
        return True

    async def _forward(self, src: web.WebSocketResponse, dst: web.WebSocketResponse, bucket: _Bucket):
        lim = self.limits
        while True:
            try:
                msg = await src.receive(timeout=lim.idle_timeout)
            except asyncio.TimeoutError:
                self.refused["idle"] += 1
                await src.close(code=4408, message=b"idle for too long")
                return
            if msg.type == WSMsgType.BINARY:
                if not await self._pass_on(msg.data, dst, bucket):
                    return
            elif msg.type == WSMsgType.TEXT:
                self.refused["text frame"] += 1
                await src.close(code=4000, message=b"binary frames only")
                return
            elif msg.type == WSMsgType.ERROR:
                exc = src.exception()
                reason = "frame too large" if "size" in str(exc).lower() else "protocol error"
                self.refused[reason] += 1
                return
            else:           # CLOSE, CLOSING, CLOSED
                return


async def serve_relay(host: str, port: int, limits: Limits | None = None, dump=None) -> Relay:
    return await Relay(limits, dump).start(host, port)
