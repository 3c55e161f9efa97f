"""Encrypted tunnels between homes: the head keeps talking to `ws://127.0.0.1:PORT`.

A joiner (a friend's machine contributing a stage) runs an ordinary StageServer on
its own loopback and reaches the host with an outbound WebSocket: straight to an
address in the invite when one answers ("direct"), else through a relay ("relay").
Over that channel the two run a Noise IK handshake (engine/wire/noise.py: psk1 with the
invite's join secret the first time, the allowlisted node key after that) and then
carry *streams*: for each TCP connection the head opens to the peer's loopback port
on the host, one stream to the joiner's stage server. head.py and stage_server.py
are unchanged; they see loopback addresses.

Channel messages (WebSocket binary frames):

    joiner -> host   "PLT1" | mode u8 (1 join, 2 member) | pipeline 8 B | invite id 8 B
                     | Noise message 1   (the 21 bytes before it are the prologue)
    host -> joiner   0x01 | Noise message 2      or      0x00 | reason (UTF-8, plaintext)
    then both ways   TransportCipher frames: counter u64 | ChaCha20-Poly1305(inner)
    inner            type u8 | stream u32 | payload

A relayed session looks for a direct path (Joiner._seek_direct): the invite's addresses
again, then hole punching (engine/wire/punch.py): the joiner sends PUNCH {"udp": its
STUN-mapped and LAN UDP addresses}, the host answers PUNCH with its own, both punch at
once, and the joiner opens QUIC on the punched socket; over it the session resumes and
moves like any direct channel (MODE_RESUME, Session.move_to), path "direct (punched)".

The joiner's first inner frame is CONFIRM (proof it holds the session keys; only then
does the host count an invite use and allowlist the key), the host answers READY or
BYE(reason). A stream's far end connects only to a target that end registered: a
joiner's own stage server, or on the host a hop it set up; a peer never names an
address to connect to.

Three or more homes: stage i must reach stage i+1, which lives in another home. The
host asks the first joiner (LISTEN) for a loopback port whose connections it opens as
streams to a *hop* the host registered; the host connects each such stream to the
second joiner's loopback port on the host, i.e. into the second tunnel. Stage-to-stage
traffic thus goes through the host's machine (both tunnels encrypted end to end with
the host); a direct joiner-to-joiner tunnel would save that detour and is not built.
The head asks for each stage's next hop at every arrangement (Head.hop: Friends.hop).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from engine.wire import stage_auth
from engine.wire.identity import Identity, node_id
from engine.wire.invite import HostState, Invite, InviteError, Reply, encode_reply, rendezvous_key, udp_addresses
from engine.wire.noise import Initiator, NoiseError, Responder, TransportCipher
from engine.wire.punch import punch_key

log = logging.getLogger("potluck.tunnel")

MAGIC = b"PLT1"
MODE_JOIN, MODE_MEMBER = 1, 2
PROLOGUE_LEN = 4 + 1 + 8 + 8
CHUNK = 32 << 10                 # bytes of a stream per DATA frame
MAX_MESSAGE = 64 << 10           # channel messages beyond this are refused
HANDSHAKE_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
PING_INTERVAL = 15.0
DEAD_AFTER = 60.0
MAX_STREAMS = 32
WS_OPTIONS = dict(max_size=MAX_MESSAGE + 1024, compression=None, ping_interval=None, max_queue=32)

CONFIRM, READY, OPEN, DATA, CLOSE, PING, PONG, BYE, LISTEN, LISTENING, MOVE, PUNCH = range(1, 13)
DIRECT_RETRY_S = 30.0
PUNCH_TIMEOUT = 5.0              # seconds of hole punching before a try gives up
REPLY_QUEUE = 8                  # connections to a joiner's reply listener waiting their turn
MODE_RESUME = 3                  # a second channel for a session that exists: see Session.move_to
STAGE = 0                        # OPEN's target on a joiner: its own stage server
_INNER = struct.Struct("<BI")


class TunnelError(RuntimeError):
    """A tunnel could not be set up or was refused; str() says why."""


class HostRefused(TunnelError):
    """Whoever answered refused us in words. Before the Noise answer such a refusal is not
    authenticated (anyone at that address may say it), so it never ends a joiner by
    itself: other addresses are still tried, and a joiner gives up only when refusals
    keep coming (Joiner.GIVE_UP_AFTER)."""


def pack_inner(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return _INNER.pack(kind, stream) + payload


def parse_inner(data: bytes) -> tuple[int, int, bytes]:
    if len(data) < _INNER.size:
        raise NoiseError("inner frame shorter than its header")
    kind, stream = _INNER.unpack_from(data)
    if not CONFIRM <= kind <= PUNCH:
        raise NoiseError(f"unknown inner frame type {kind}")
    return kind, stream, bytes(data[_INNER.size:])


def parse_hello(msg) -> tuple[int, bytes, bytes, bytes, bytes]:
    """(mode, pipeline, invite id, prologue, noise message 1) of a joiner's first message."""
    if not isinstance(msg, (bytes, bytearray)):
        raise NoiseError("expected a binary handshake message")
    msg = bytes(msg)
    if len(msg) < PROLOGUE_LEN or msg[:4] != MAGIC:
        raise NoiseError("not a Potluck tunnel handshake")
    mode = msg[4]
    if mode not in (MODE_JOIN, MODE_MEMBER, MODE_RESUME):
        raise NoiseError(f"unknown handshake mode {mode}")
    return mode, msg[5:13], msg[13:21], msg[:PROLOGUE_LEN], msg[PROLOGUE_LEN:]


# ---- a session: streams over one authenticated channel ------------------------------
class Session:
    """Streams over one authenticated channel, which may move to another mid-stream.

    Moving (relayed -> direct): the joiner opens a second channel and proves on it that it
    holds this session's keys (TunnelHost._resume); then each side sends MOVE as its last
    frame on the old channel and goes on, with the same ciphers and counters, on the new
    one, and each reads the old channel until the other's MOVE. Both channels are ordered,
    so nothing is lost or repeated, and a frame on the new channel opens only under the
    session's keys at the next counter."""

    def __init__(self, ws, send_key: bytes, recv_key: bytes, *, role: str, peer_key: bytes, path: str,
                 target: tuple[str, int] | None = None, name: str = ""):
        self.ws_in = self.ws_out = ws
        self._next: tuple | None = None      # (channel, path) proven for a move, not yet moved to
        # hole punching (engine/wire/punch.py): the host answers a joiner's PUNCH offer with
        # its own UDP candidates (on_punch_offer); a joiner waits for that answer here
        self.on_punch_offer = None
        self._punch_answer: asyncio.Future | None = None
        self._punching = False
        # the key a second channel is proven with: from the session's secret keys (never
        # from the handshake hash, which an observer of a member's IK handshake can compute)
        i2r, r2i = (send_key, recv_key) if role == "joiner" else (recv_key, send_key)
        self.resume_key = hmac.new(i2r + r2i, b"potluck resume", hashlib.sha256).digest()
        self.resume_id = hashlib.sha256(self.resume_key).digest()[:8]
        self.punch_key = punch_key(self.resume_key)     # what its punch packets prove
        self.moves = 0
        self.moved = asyncio.Event()         # set at each completed move (both directions)
        self.rtt: float | None = None        # seconds, from the keepalive's PING/PONG
        self._ping_sent: float | None = None
        self._recent: deque = deque(maxlen=4096)   # (time, bytes) of recent frames both ways
        self.tx, self.rx = TransportCipher(send_key), TransportCipher(recv_key)
        self.role, self.peer_key, self.path, self.target, self.name = role, peer_key, path, target, name
        self.streams: dict[int, asyncio.StreamWriter] = {}
        self._pumps: dict[int, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()
        # stream ids: odd from the host, even from the joiner
        self._next_stream = 1 if role == "host" else 2
        # what the peer may open streams to: target id -> (host, port) on this machine.
        # A joiner offers its stage (STAGE); the host offers hops it set up (see
        # TunnelHost.open_hop), nothing else.
        self.targets: dict[int, tuple[str, int]] = {STAGE: target} if target else {}
        self._hop_listeners: dict[int, asyncio.AbstractServer] = {}
        self._listening: dict[int, asyncio.Future] = {}
        self.closed = asyncio.Event()
        self._closing = False
        self.close_reason = ""
        self.last_rx = time.monotonic()
        self.bytes_in = self.bytes_out = 0
        self._tasks: list[asyncio.Task] = []

    @property
    def peer_id(self) -> str:
        return node_id(self.peer_key)

    async def send(self, kind: int, stream: int = 0, payload: bytes = b""):
        async with self._send_lock:  # counters must go out in the order they were taken
            frame = self.tx.encrypt(pack_inner(kind, stream, payload))
            self.bytes_out += len(frame)
            self._recent.append((time.monotonic(), len(frame)))
            await self.ws_out.send(frame)

    async def recv_inner(self, timeout: float | None = None) -> tuple[int, int, bytes]:
        ws = self.ws_in
        data = await asyncio.wait_for(ws.recv(), timeout) if timeout else await ws.recv()
        if not isinstance(data, (bytes, bytearray)):
            raise NoiseError("text frame inside a tunnel")
        self.bytes_in += len(data)
        self.last_rx = time.monotonic()
        self._recent.append((self.last_rx, len(data)))
        return parse_inner(self.rx.decrypt(data))

    def start(self):
        self._tasks = [asyncio.ensure_future(self._reader()), asyncio.ensure_future(self._keepalive())]
        return self

    async def close(self, reason: str = "closed"):
        if self._closing:
            return
        self._closing = True
        self.close_reason = self.close_reason or reason
        try:
            await asyncio.wait_for(self.send(BYE, 0, reason.encode()[:200]), 2)
        except Exception:   # noqa: BLE001  the channel may be gone already
            pass
        self.closed.set()
        # at once, together: a closing handshake the peer no longer answers must not hold
        # up the streams' end (each would wait websockets' close timeout in turn)
        channels = {self.ws_in, self.ws_out} | ({self._next[0]} if self._next else set())
        await asyncio.gather(*(asyncio.wait_for(ws.close(), 2.0) for ws in channels), return_exceptions=True)
        for t in list(self._pumps.values()) + self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        for w in self.streams.values():
            w.close()
        self.streams.clear()
        for srv in self._hop_listeners.values():
            srv.close()
        for fut in self._listening.values():
            if not fut.done():
                fut.cancel()

    def _spawn_send(self, kind: int):
        async def send():
            try:
                await self.send(kind)
            except (ConnectionClosed, OSError):
                pass

        task = asyncio.ensure_future(send())
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    def link(self, window: float = 5.0) -> dict:
        """What the status shows of this tunnel: its path, round trip and recent goodput."""
        now = time.monotonic()
        recent = sum(n for t, n in self._recent if now - t <= window)
        return {"path": self.path, "rtt_ms": None if self.rtt is None else self.rtt * 1000,
                "mbit_s": recent * 8 / window / 1e6}

    async def _keepalive(self):
        first = True
        while not self.closed.is_set():
            await asyncio.sleep(0.0 if first else PING_INTERVAL)   # a round trip to show at once
            first = False
            if time.monotonic() - self.last_rx > DEAD_AFTER:
                await self.close(f"no traffic from the peer for {DEAD_AFTER:g} s")
                return
            try:
                self._ping_sent = time.monotonic()
                await self.send(PING)
            except (ConnectionClosed, OSError):
                await self.close("channel closed")
                return

    async def _reader(self):
        try:
            while True:
                kind, sid, payload = await self.recv_inner()
                if kind == DATA:
                    w = self.streams.get(sid)
                    if w is not None:
                        w.write(payload)
                        await w.drain()
                elif kind == OPEN:
                    await self._on_open(sid, payload)
                elif kind == LISTEN:
                    await self._on_listen(sid)
                elif kind == LISTENING:
                    fut = self._listening.pop(sid, None)
                    if fut is None or len(payload) != 2:
                        raise NoiseError("unexpected LISTENING frame")
                    fut.set_result(struct.unpack("<H", payload)[0])
                elif kind == CLOSE:
                    w = self.streams.pop(sid, None)
                    if w is not None:
                        w.close()
                    t = self._pumps.pop(sid, None)
                    if t is not None:
                        t.cancel()
                elif kind == PING:
                    # not awaited here: the reader must never wait on the send lock (a send
                    # blocked on a full channel would then stop the reading that frees it)
                    self._spawn_send(PONG)
                elif kind == PONG and self._ping_sent is not None:
                    self.rtt, self._ping_sent = time.monotonic() - self._ping_sent, None
                elif kind == BYE:
                    self.close_reason = f"the peer closed the tunnel: {payload.decode(errors='replace')[:200]}"
                    break
                elif kind == MOVE:
                    await self._moved_in()
                elif kind == PUNCH:
                    self._on_punch(payload)
                elif kind in (CONFIRM, READY):
                    raise NoiseError("handshake frame after the handshake")
        except NoiseError as exc:
            log.warning("tunnel from %s: %s", self.peer_id, exc)
            self.close_reason = str(exc)
        except (ConnectionClosed, OSError, ConnectionError) as exc:
            self.close_reason = self.close_reason or f"channel closed ({exc})"
        await self.close(self.close_reason or "closed")

    def expect_move(self, ws, path: str):
        """A channel proven to reach the peer of this session (TunnelHost._resume, or the
        joiner's own resume): the peer's MOVE will switch reading to it."""
        if self._next is not None:
            raise NoiseError("a move is under way already")
        self._next = (ws, path)

    async def move_to(self, ws, path: str):
        """The joiner's side of a move, once `ws` is proven: say MOVE on the old channel and
        send on the new one from now on; reading follows at the host's MOVE."""
        self.expect_move(ws, path)
        async with self._send_lock:
            await self.ws_out.send(self.tx.encrypt(pack_inner(MOVE, 0)))
            self.ws_out = ws

    async def _moved_in(self):
        """The peer's MOVE: its frames come on the new channel from now on. The host then
        moves its own sending (its MOVE ends the old channel); the side that moved both
        ways last closes the old channel."""
        if self._next is None:
            raise NoiseError("MOVE without a proven channel to move to")
        old = self.ws_in
        new, path = self._next
        self.ws_in = new
        if self.ws_out is old:
            async with self._send_lock:
                await old.send(self.tx.encrypt(pack_inner(MOVE, 0)))
                self.ws_out = new
        self._next = None
        self.path = path
        self.moves += 1
        self.moved.set()
        # the old channel carried its last frame; its closing handshake must not hold up
        # this reader (a relay answers it late, if at all)
        asyncio.ensure_future(old.close())

    def _on_punch(self, payload: bytes):
        """A PUNCH frame: {"udp": [[address, port], ...]} (an offer from the joiner, the
        answer from the host; an empty list and "why" when the host cannot punch)."""
        from engine.wire.punch import parse_candidates

        try:
            msg = json.loads(payload)
            cands = parse_candidates(msg.get("udp"))
            why = str(msg.get("why", ""))[:200]
        except (ValueError, AttributeError):
            raise NoiseError("malformed PUNCH frame") from None
        if self.role == "joiner":
            if self._punch_answer is not None and not self._punch_answer.done():
                self._punch_answer.set_result((cands, why))
        elif self.on_punch_offer is not None and not self._punching and self.path == "relay":
            self._punching = True              # one try at a time per session

            async def run():
                try:
                    await self.on_punch_offer(self, cands)
                finally:
                    self._punching = False

            task = asyncio.ensure_future(run())
            self._tasks.append(task)
            task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def offer_punch(self, cands: list, timeout: float) -> tuple[list, str]:
        """Joiner: send our UDP candidates, return the host's (and its reason when none)."""
        self._punch_answer = asyncio.get_running_loop().create_future()
        try:
            await self.send(PUNCH, 0, json.dumps({"udp": [list(c) for c in cands]}).encode())
            return await asyncio.wait_for(self._punch_answer, timeout)
        finally:
            self._punch_answer = None

    async def _on_open(self, sid: int, payload: bytes):
        target_id = struct.unpack("<I", payload)[0] if len(payload) == 4 else (STAGE if not payload else -1)
        target = self.targets.get(target_id)
        if target is None:
            raise NoiseError("this end does not accept streams" if not self.targets
                             else f"no stream target {target_id} here")
        mine = 1 if self.role == "host" else 0
        if sid % 2 == mine or sid in self.streams or len(self.streams) >= MAX_STREAMS:
            raise NoiseError("bad stream id, or too many streams")
        try:
            reader, writer = await asyncio.open_connection(*target)
        except OSError as exc:
            await self.send(CLOSE, sid, f"cannot reach the local stage: {exc}".encode())
            return
        self._add_stream(sid, reader, writer)

    async def _on_listen(self, hop: int):
        """The host asks this joiner for a loopback port whose connections become
        streams to hop `hop` (the next stage, in another home, reached via the host)."""
        if self.role != "joiner" or hop in self._hop_listeners or len(self._hop_listeners) >= 4:
            raise NoiseError("unexpected LISTEN frame")

        async def on_conn(reader, writer):
            await self.open_stream(reader, writer, target=hop)

        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        self._hop_listeners[hop] = srv
        await self.send(LISTENING, hop, struct.pack("<H", srv.sockets[0].getsockname()[1]))

    async def request_listener(self, hop: int, target: tuple[str, int], timeout: float = 30.0) -> int:
        """Host side: accept streams to `hop` from this peer (they go to `target`, a
        loopback port on the host) and have the peer listen for them; returns the
        peer's local port."""
        self.targets[hop] = target
        fut = asyncio.get_running_loop().create_future()
        self._listening[hop] = fut
        await self.send(LISTEN, hop)
        return await asyncio.wait_for(fut, timeout)

    def _add_stream(self, sid, reader, writer):
        _nodelay(writer)
        self.streams[sid] = writer
        self._pumps[sid] = asyncio.ensure_future(self._pump(sid, reader))

    async def _pump(self, sid: int, reader: asyncio.StreamReader):
        """Local socket -> tunnel, until EOF."""
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self.send(DATA, sid, data)
        except (ConnectionClosed, OSError, NoiseError):
            pass
        finally:
            self._pumps.pop(sid, None)
            w = self.streams.pop(sid, None)
            if w is not None:
                w.close()
                if not self.closed.is_set():
                    try:
                        await self.send(CLOSE, sid)
                    except (ConnectionClosed, OSError):
                        pass

    async def open_stream(self, reader, writer, target: int = STAGE):
        """Carry this local connection to the peer's `target` (host side: the peer's
        stage server; joiner side: a hop the host set up)."""
        if self.closed.is_set():
            writer.close()
            return
        sid = self._next_stream
        self._next_stream += 2
        self._add_stream(sid, reader, writer)
        await self.send(OPEN, sid, b"" if target == STAGE else struct.pack("<I", target))


def _nodelay(writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


# ---- the host's side ------------------------------------------------------------------
@dataclass
class Peer:
    key: bytes
    name: str
    session: Session | None = None
    server: asyncio.AbstractServer | None = None
    port: int = 0
    joined: float = field(default_factory=time.time)

    @property
    def node_id(self) -> str:
        return node_id(self.key)

    @property
    def address(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def path(self) -> str:
        return self.session.path if self.session else "offline"


class TunnelHost:
    """Accepts joiners over direct WebSockets and through a relay.

        host = TunnelHost(identity, HostState(folder), on_peer=callback)
        await host.listen("0.0.0.0", 7870)        # direct, optional
        await host.use_relay("ws://relay:8765")   # optional
        code = host.invite(ttl_s=3600, uses=1)    # carries the relay and direct addresses
        peer = await host.wait_peer()             # a Peer: peer.address is loopback
    """

    def __init__(self, identity: Identity, state: HostState, on_peer=None, on_event=None):
        self.identity, self.state = identity, state
        self.pipeline = state.pipeline
        self.peers: dict[bytes, Peer] = {}
        self.on_peer = on_peer
        self.on_event = on_event or (lambda text: log.info(text))
        self._joined: asyncio.Queue = asyncio.Queue()
        self.rejected: Counter = Counter()
        self.accepted = 0
        self._seen_ephemeral: OrderedDict = OrderedDict()
        self._server = None
        self.direct_addresses: list[str] = []
        self.direct_kinds: list[str] = []
        self.gathered = None            # candidates.Gathered: the mapping, the NAT, for status/doctor
        self._mapper = None
        self.relay_url = ""
        self._relay_task: asyncio.Task | None = None
        self._tasks: set = set()
        self._revoke_watch: asyncio.Task | None = None
        self._dialers: dict[str, asyncio.Task] = {}   # reply key -> the task dialing that joiner
        self._hops = 0
        # the socket whose public address invites carry for hole punching (kind "udp"):
        # a friend's reply code with its own lets the two punch with no relay
        self._udp = None

    # -- setup
    async def listen(self, host: str = "0.0.0.0", port: int = 0, advertise: list[str] | None = None,
                     upnp: bool | None = None):
        """Accept joiners directly on host:port. The invite's addresses: `advertise` as
        given, else every candidate gathered for the port (engine/wire/candidates.py),
        among them a mapping on the home router (UPnP; upnp=None: unless POTLUCK_UPNP=0),
        kept until close()."""
        from engine.wire import candidates as cand

        self._server = await serve(lambda ws: self.accept(ws, "direct"), host, port, **WS_OPTIONS)
        bound = self._server.sockets[0].getsockname()[1]
        wildcard = host in ("0.0.0.0", "::", "")
        if advertise:
            found = [cand.Candidate("given", a if a.startswith("ws") else cand.url_for(a, bound)) for a in advertise]
        elif not wildcard and stage_auth.is_loopback(host):
            found = [cand.Candidate("given", cand.url_for(host, bound))]     # this machine only
        else:
            if upnp is None:
                upnp = os.environ.get("POTLUCK_UPNP", "1") != "0"
            self._mapper = cand.PortMapper() if upnp else None
            self.gathered, rendezvous = await asyncio.gather(
                cand.gather(bound, upnp=upnp, mapper=self._mapper, addresses=None if wildcard else []),
                self._open_rendezvous())
            found = ([] if wildcard else [cand.Candidate("given", cand.url_for(host, bound))]) + \
                self.gathered.candidates + rendezvous
            if self.gathered.mapping.external:
                self.on_event(f"the router maps {cand.url_for(*self.gathered.mapping.external)} to this computer")
            elif upnp:
                self.on_event(f"no port mapping: {self.gathered.mapping.why_not}")
        self.direct_addresses = [c.url for c in found]
        self.direct_kinds = [c.kind for c in found]
        self._watch_revocations()
        return bound

    async def _open_rendezvous(self) -> list:
        """A UDP socket kept open (and its NAT mapping fresh) while hosting; its public
        address, as STUN servers see it, goes in invites as kind "udp"."""
        from engine.wire import candidates as cand, stun

        servers = stun.servers_from_env()
        if not servers or os.environ.get("POTLUCK_PUNCH", "1") == "0":
            return []
        try:
            from engine.wire.punch import UdpEndpoint

            ep = await UdpEndpoint.open(exclusive=False)
        except (ImportError, OSError) as exc:
            log.info("no rendezvous socket: %s", exc)
            return []
        await ep.candidates(servers)
        if not ep.mapped or stun._is_own(ep.mapped[0][0]):
            ep.close()             # no STUN answer, or no NAT (then the TCP address works)
            return []
        ep.keep_mapping(servers[0])
        self._udp = ep
        return [cand.Candidate("udp", f"udp://{a}:{p}") for a, p in ep.mapped[:2]]

    async def use_relay(self, url: str):
        self.relay_url = url.rstrip("/")
        self._relay_task = asyncio.ensure_future(self._relay_loop())
        self._watch_revocations()

    def take_reply(self, code: str) -> Reply:
        """A joiner's reply code (InviteError if it is none of ours): dial its addresses
        now, and again whenever that joiner's tunnel drops, while this host runs."""
        r = self.state.add_reply(code)
        self._dial_replies()
        self._watch_revocations()
        return r

    def _dial_replies(self):
        for r in self.state.replies():
            if r.pipeline != self.pipeline:
                continue
            if r.key not in self._dialers and any(k != "udp" for k in r.kinds):
                self._dialers[r.key] = asyncio.ensure_future(self._dial(r))
            if r.key + "/udp" not in self._dialers and self._udp is not None and udp_addresses(r.direct, r.kinds):
                self._dialers[r.key + "/udp"] = asyncio.ensure_future(self._punch_reply(r))

    async def _punch_reply(self, r: Reply):
        """A joiner's reply code with UDP candidates: punch toward them from the socket our
        invites named (the joiner punches toward it meanwhile) and take its QUIC
        connection; the joiner's usual handshake then runs over it."""
        from engine.wire.punch import PunchError

        targets = udp_addresses(r.direct, r.kinds)
        backoff = 1.0
        while any(x.key == r.key for x in self.state.replies()) and self._udp is not None:
            try:
                key = punch_key(self.state.rendezvous_key(r.invite_id))
                peer = await self._udp.punch(key, targets, PUNCH_TIMEOUT * 2)
                channel = await self._udp.quic_accept(peer)
            except (PunchError, InviteError, OSError) as exc:
                self.on_event(f"reply {r.key}: no punched path to the joiner ({exc})")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            t0 = time.monotonic()
            try:
                await self.accept(channel, "direct (punched)")
            finally:
                await channel.close()
            backoff = 1.0 if time.monotonic() - t0 > 30 else min(backoff * 2, 30.0)
            await asyncio.sleep(backoff)

    async def _dial(self, r: Reply):
        """Connect to a joiner that cannot reach us (it listens: its reply code), and run
        the usual handshake on that connection, the joiner speaking first."""
        from engine.wire.candidates import KIND_ORDER

        routes = [("direct (reply)", url) for kind, url in
                  sorted(zip(r.kinds, r.direct), key=lambda ku: KIND_ORDER.get(ku[0], 9)) if kind != "udp"]
        backoff = 1.0
        while any(x.key == r.key for x in self.state.replies()):     # until revoked or expired
            errors: list[str] = []
            path, url, ws = await _first_to_connect(routes, errors, lambda text: None)
            if ws is None:
                self.on_event(f"reply {r.key}: no address of the joiner answers ({'; '.join(errors)[:300]})")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            t0 = time.monotonic()
            await self.accept(ws, path)          # until that session ends
            await ws.close()
            # a session that lasted is redialled at once; a refused or failed handshake
            # (revoked, used up, someone else listening there) ever more slowly
            backoff = 1.0 if time.monotonic() - t0 > 30 else min(backoff * 2, 30.0)
            await asyncio.sleep(backoff)

    def invite(self, ttl_s: float = 24 * 3600, uses: int = 1) -> str:
        _, code = self.state.create_invite(self.identity.public, self.relay_url, self.direct_addresses,
                                           ttl_s=ttl_s, max_uses=uses, kinds=self.direct_kinds)
        return code

    async def wait_peer(self) -> Peer:
        return await self._joined.get()

    async def close(self):
        if self._relay_task:
            self._relay_task.cancel()
        if self._revoke_watch:
            self._revoke_watch.cancel()
        for t in self._dialers.values():
            t.cancel()
        if self._server is not None:
            self._server.close()
        if self._mapper is not None:
            await self._mapper.close()      # the router forgets the mapping now, not at lease end
            self._mapper = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        for p in self.peers.values():
            if p.session:
                await p.session.close("host shutting down")
            if p.server:
                p.server.close()
        for t in list(self._tasks):
            t.cancel()

    # -- the relay
    async def _relay_loop(self):
        backoff = 1.0
        url = f"{self.relay_url}/v1/host/{self.pipeline.hex()}"
        while True:
            try:
                async with connect(url, open_timeout=CONNECT_TIMEOUT, max_size=4096, ping_interval=20) as ctl:
                    self.on_event(f"relay: registered at {self.relay_url}")
                    backoff = 1.0
                    async for text in ctl:
                        try:
                            msg = json.loads(text)
                            sid = str(msg["session"])
                            if msg.get("type") != "incoming" or not sid.isalnum() or len(sid) > 64:
                                continue
                        except (ValueError, KeyError, TypeError):
                            continue
                        self._spawn(self._relay_accept(sid))
                    self.on_event(f"relay: control connection closed ({ctl.close_reason or 'no reason'})")
            except asyncio.CancelledError:
                raise
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as exc:
                self.on_event(f"relay: cannot register at {self.relay_url}: {exc}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _relay_accept(self, sid: str):
        url = f"{self.relay_url}/v1/accept/{self.pipeline.hex()}/{sid}"
        try:
            ws = await connect(url, open_timeout=CONNECT_TIMEOUT, **WS_OPTIONS)
        except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
            log.warning("relay accept %s failed: %s", sid, exc)
            return
        await self.accept(ws, "relay")

    def _spawn(self, coro):
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- one joiner
    async def _reject(self, ws, reason: str):
        self.rejected[reason] += 1
        log.info("refused a joiner: %s", reason)
        try:
            await asyncio.wait_for(ws.send(b"\x00" + reason.encode()[:500]), 2)
        except Exception:   # noqa: BLE001
            pass
        await ws.close(1008, reason[:120])

    async def accept(self, ws, path: str):
        """Handles one channel (direct or relayed) until its session ends."""
        try:
            session = await self._handshake(ws, path)
            resumed = session.ws_in is not ws and session._next is not None
        except _Refused as exc:
            await self._reject(ws, str(exc))
            return
        except (ConnectionClosed, OSError):
            self.rejected["closed during the handshake"] += 1
            return
        except Exception as exc:   # noqa: BLE001  nothing a peer sends may take the host down
            log.exception("unexpected error in a handshake")
            await self._reject(ws, f"internal error: {type(exc).__name__}")
            return
        if resumed:
            # the joiner's MOVE should follow at once; if it does not (its wait ran out, the
            # new connection died), this channel is dropped and the session can try again
            before, deadline = session.moves, time.monotonic() + 2 * HANDSHAKE_TIMEOUT
            while session.moves == before and not session.closed.is_set() and time.monotonic() < deadline \
                    and session._next is not None and session._next[0] is ws:
                await asyncio.sleep(0.1)
            if session.moves == before and session._next is not None and session._next[0] is ws:
                session._next = None
                await ws.close(1008, "the move did not come")
                return
        await session.closed.wait()      # the channel's handler lives as long as the session
        if not resumed:
            self.on_event(f"peer {session.peer_id} ({session.name}) disconnected: {session.close_reason}")

    async def _handshake(self, ws, path: str) -> Session:
        try:
            first = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        except asyncio.TimeoutError:
            raise _Refused(f"no handshake within {HANDSHAKE_TIMEOUT:g} s") from None
        try:
            mode, pipeline, invite_id, prologue, msg1 = parse_hello(first)
        except NoiseError as exc:
            raise _Refused(str(exc)) from None
        if pipeline != self.pipeline:
            raise _Refused("this host serves another pipeline")
        if mode == MODE_RESUME:
            return await self._resume(ws, path, invite_id, msg1)
        psk = None
        if mode == MODE_JOIN:
            try:
                psk = self.state.invite_psk(invite_id)
            except InviteError as exc:
                raise _Refused(str(exc)) from None
        r = Responder(self.identity.private, prologue, psk=psk)
        try:
            payload = r.read_1(msg1)
        except NoiseError as exc:
            raise _Refused(str(exc)) from None
        if r.re in self._seen_ephemeral:
            raise _Refused("replayed handshake")
        self._seen_ephemeral[r.re] = True
        while len(self._seen_ephemeral) > 100_000:
            self._seen_ephemeral.popitem(last=False)
        key = r.remote_static
        if mode == MODE_MEMBER:
            try:
                self.state.check_member(key)
            except InviteError as exc:
                raise _Refused(str(exc)) from None
        try:
            hello = json.loads(payload or b"{}")
            name = str(hello.get("name", ""))[:64] if isinstance(hello, dict) else ""
            # which of the invite's addresses the joiner came in on (for the status only)
            kind = hello.get("kind") if isinstance(hello, dict) else None
        except ValueError:
            name, kind = "", None
        if path == "direct" and kind in ("lan", "mapped", "ipv6", "public"):
            path = f"direct ({kind})"
        await ws.send(b"\x01" + r.write_2(json.dumps({"pipeline": self.pipeline.hex()}).encode()))
        send_key, recv_key = r.keys()
        session = Session(ws, send_key, recv_key, role="host", peer_key=key, path=path, name=name)
        try:
            kind, _, _ = await session.recv_inner(HANDSHAKE_TIMEOUT)
        except asyncio.TimeoutError:
            raise _Refused("no confirmation within the handshake timeout") from None
        except NoiseError as exc:
            raise _Refused(str(exc)) from None
        if kind != CONFIRM:
            raise _Refused("expected a confirmation")
        if mode == MODE_JOIN:
            try:
                self.state.record_join(invite_id, key, name)
            except InviteError as exc:
                await session.send(BYE, 0, str(exc).encode())
                raise _Refused(str(exc)) from None
        await session.send(READY)
        self.accepted += 1
        await self._attach(session)
        return session

    async def _resume(self, ws, path: str, resume_id: bytes, joiner_nonce: bytes) -> Session:
        """A second channel for a session that exists (a joiner on the relay found a direct
        path): it must prove the session's keys, then the session moves onto it."""
        session = next((p.session for p in self.peers.values() if p.session is not None
                        and not p.session.closed.is_set() and hmac.compare_digest(p.session.resume_id, resume_id)),
                       None)
        if session is None:
            raise _Refused("no such session to resume")
        if len(joiner_nonce) != 16:
            raise _Refused("a resume carries a 16-byte nonce")
        nonce = os.urandom(16)
        await ws.send(b"\x02" + nonce)
        try:
            answer = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        except asyncio.TimeoutError:
            raise _Refused("no proof within the handshake timeout") from None
        if not isinstance(answer, bytes) or len(answer) < 32 or not hmac.compare_digest(
                answer[:32], hmac.new(session.resume_key, b"joiner" + nonce + joiner_nonce, hashlib.sha256).digest()):
            raise _Refused("not the session's keys")
        kind = answer[32:40].decode(errors="replace")
        here = f"direct ({kind})" if path == "direct" and kind in ("lan", "mapped", "ipv6", "public") else path
        try:
            session.expect_move(ws, here)
        except NoiseError as exc:
            raise _Refused(str(exc)) from None
        await ws.send(b"\x03" + hmac.new(session.resume_key, b"host" + nonce + joiner_nonce, hashlib.sha256).digest())
        self.on_event(f"peer {session.peer_id} ({session.name}) moving to {here}")
        return session

    async def _attach(self, session: Session):
        peer = self.peers.get(session.peer_key)
        if peer is None:
            peer = Peer(session.peer_key, session.name)
            self.peers[session.peer_key] = peer

            async def on_conn(reader, writer):
                s = peer.session
                if s is None or s.closed.is_set():
                    writer.close()
                    return
                await s.open_stream(reader, writer)

            peer.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
            peer.port = peer.server.sockets[0].getsockname()[1]
            fresh = True
        else:
            fresh = False
            if peer.session is not None:
                await peer.session.close("replaced by a new connection")
        session.on_punch_offer = self._punch_for
        peer.session = session.start()
        self.on_event(f"peer {peer.node_id} ({peer.name or 'unnamed'}) connected via {session.path}")
        if fresh:
            await self._joined.put(peer)
            if self.on_peer:
                self.on_peer(peer)

    async def _punch_for(self, session: Session, theirs: list):
        """A relayed joiner offers its UDP candidates: answer with ours, punch toward its
        (both at once), and take its QUIC connection on the punched socket; the session
        then moves there like any direct channel (accept -> _resume)."""
        try:
            from engine.wire import punch, stun

            ep = await punch.UdpEndpoint.open()
        except (ImportError, OSError) as exc:
            await session.send(PUNCH, 0, json.dumps({"udp": [], "why": f"cannot punch here: {exc}"}).encode())
            return
        try:
            mine = await ep.candidates(stun.servers_from_env())
            await session.send(PUNCH, 0, json.dumps({"udp": [list(c) for c in mine]}).encode())
            peer = await ep.punch(session.punch_key, theirs, PUNCH_TIMEOUT)
            channel = await ep.quic_accept(peer)
        except (punch.PunchError, OSError, ConnectionClosed) as exc:
            ep.close()
            self.on_event(f"peer {session.peer_id} ({session.name}): no punched path ({exc})")
            return
        try:
            await self.accept(channel, "direct (punched)")
        finally:
            await channel.close()

    async def open_hop(self, src: Peer, dst: Peer) -> str:
        """Stage on `src` -> stage on `dst`, both in other homes: `src` gets a loopback
        port whose connections travel src -> host -> dst inside the two tunnels.
        Returns the address the stage on `src` should use for its next stage."""
        self._hops += 1
        port = await src.session.request_listener(self._hops, ("127.0.0.1", dst.port))
        return f"ws://127.0.0.1:{port}"

    def _watch_revocations(self):
        if self._revoke_watch is None:
            self._revoke_watch = asyncio.ensure_future(self._revocations())

    async def _revocations(self):
        while True:
            await asyncio.sleep(2.0)
            for key, peer in list(self.peers.items()):
                if peer.session is not None and not peer.session.closed.is_set():
                    try:
                        self.state.check_member(key)
                    except InviteError as exc:
                        self.on_event(f"peer {peer.node_id}: {exc}; disconnecting")
                        await peer.session.close(str(exc))
            self._dial_replies()          # `potluck invites --reply CODE` from another terminal


class _Refused(Exception):
    pass


# ---- the joiner's side ----------------------------------------------------------------
def _hello_prefix(mode: int, pipeline: bytes, invite_id: bytes) -> bytes:
    return MAGIC + bytes([mode]) + pipeline + invite_id


async def open_session(invite: Invite, identity: Identity, target: tuple[str, int], *, name: str = "",
                       member: bool = False, prefer: str = "auto", log_event=None) -> Session:
    """Reach the host (its direct addresses first, raced, then the relay), authenticate,
    and return a started Session whose streams lead to `target` (our stage server).
    prefer: "auto", "direct" or "relay". Raises TunnelError with the reasons."""
    say = log_event or (lambda text: log.info(text))
    direct = direct_routes(invite)
    relay = ([("relay", f"{invite.relay.rstrip('/')}/v1/join/{invite.pipeline.hex()}")]
             if prefer in ("auto", "relay") and invite.relay else [])
    if prefer == "relay":
        direct = []
    if not direct and not relay:
        raise TunnelError(f"the code offers no {prefer} route")
    errors: list[str] = []
    refused: HostRefused | None = None
    # one race: the relay joins it RELAY_AFTER_S after the direct addresses started (or at
    # once when they have all failed), so another home's private address, which may hang
    # until its connect times out, holds a join up by that long at most; a relayed tunnel
    # then looks for a direct path at once (Joiner._seek_direct)
    routes = direct + relay
    delays = [i * STAGGER_S for i in range(len(direct))] + \
        [max(len(direct) * STAGGER_S, RELAY_AFTER_S) if direct else 0.0 for _ in relay]
    while routes:
        path, url, ws = await _first_to_connect(routes, errors, say, delays)
        if ws is None:
            break
        delays = [d for r, d in zip(routes, delays) if r[1] != url]
        routes = [r for r in routes if r[1] != url]      # the rest, should this one fail
        try:
            session = await _client_handshake(ws, invite, identity, target, name, member, path)
            if path == "relay" and direct:
                say(f"no direct route to the host answered within {delays[-1]:g} s "
                    f"({', '.join(u for _, u in direct)}): joined through the relay; looking for a direct path")
            return session
        except (TunnelError, ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
            await ws.close()
            reason = getattr(exc, "rcvd", None)
            reason = reason.reason if reason is not None and reason.reason else (str(exc) or type(exc).__name__)
            errors.append(f"{path} {url}: {reason}")
            say(f"{path} route {url} failed ({reason})")
            if isinstance(exc, HostRefused):
                refused = exc       # said by whoever answered there: try the others too
    if refused is not None:
        raise HostRefused(f"{refused}" + (f" (also: {'; '.join(errors)})" if len(errors) > 1 else ""))
    hint = ("" if invite.relay or prefer == "relay" else
            ". No direct path reaches the host, and this code names no relay: the host can turn on UPnP "
            "on their router (`potluck doctor` checks it), forward the port to their computer, or host "
            "with a relay (--relay)")
    raise TunnelError("cannot reach the host: " + "; ".join(errors) + hint)


_KIND_ORDER = {"lan": 0, "given": 1, "mapped": 2, "ipv6": 3, "public": 4}


def direct_routes(invite: Invite) -> list[tuple[str, str]]:
    """(path, url) of the invite's direct addresses, in the order a joiner tries them."""
    return [(f"direct ({k})" if k != "given" else "direct", a)
            for k, a in sorted(zip(invite.kinds, invite.direct), key=lambda ka: _KIND_ORDER.get(ka[0], 9))
            if k != "udp"]


async def resume_direct(session: Session, invite: Invite, say) -> bool:
    """A relayed session tries the invite's direct addresses; where one opens and the
    host there proves it holds this session (and we prove it to it), the session moves
    onto it mid-stream (Session.move_to). Returns whether it moved."""
    errors: list[str] = []
    path, url, ws = await _first_to_connect(direct_routes(invite), errors, lambda text: None)
    if ws is None:
        return False
    return await _prove_and_move(session, invite, ws, path, url, say)


async def punch_direct(session: Session, invite: Invite, say) -> bool:
    """A relayed session punches a UDP path through both home routers (engine/wire/punch.py),
    the candidates exchanged inside the session, and moves onto a QUIC channel there.
    Returns whether it moved."""
    try:
        from engine.wire import punch, stun

        ep = await punch.UdpEndpoint.open()
    except (ImportError, OSError) as exc:
        say(f"no hole punching here ({exc})")
        return False
    try:
        mine = await ep.candidates(stun.servers_from_env())
        theirs, why = await session.offer_punch(mine, HANDSHAKE_TIMEOUT)
        if not theirs:
            raise punch.PunchError(why or "the host has no UDP address to punch at")
        peer = await ep.punch(session.punch_key, theirs, PUNCH_TIMEOUT)
        channel = await ep.quic_connect(peer)
    except (punch.PunchError, OSError, ConnectionClosed, asyncio.TimeoutError) as exc:
        ep.close()
        say(f"no punched path to the host ({exc or type(exc).__name__})")
        return False
    return await _prove_and_move(session, invite, channel, "direct (punched)", f"udp://{peer[0]}:{peer[1]}", say)


async def _prove_and_move(session: Session, invite: Invite, ws, path: str, url: str, say) -> bool:
    """On a fresh channel to the host: prove we hold the session and check that the host
    there does too, then move the session onto it (Session.move_to)."""
    try:
        mine = os.urandom(16)      # so a confirm recorded from an earlier try proves nothing now
        await ws.send(_hello_prefix(MODE_RESUME, invite.pipeline, session.resume_id) + mine)
        challenge = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        if not isinstance(challenge, bytes) or len(challenge) != 17 or challenge[0] != 2:
            said = challenge[1:201] if isinstance(challenge, bytes) else str(challenge)[:200]
            raise TunnelError(f"the host there did not take the session: {said!r}")
        nonce = challenge[1:]
        kind = path[len("direct ("):-1] if path.startswith("direct (") else ""
        await ws.send(hmac.new(session.resume_key, b"joiner" + nonce + mine, hashlib.sha256).digest()
                      + kind.encode()[:8])
        confirm = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        if not (isinstance(confirm, bytes) and len(confirm) == 33 and confirm[0] == 3 and hmac.compare_digest(
                confirm[1:], hmac.new(session.resume_key, b"host" + nonce + mine, hashlib.sha256).digest())):
            raise TunnelError("the answer there is not from the host of this session")
        await session.move_to(ws, path)
        return True
    except (TunnelError, NoiseError, ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
        say(f"{path} {url} opened but the session could not move there ({exc or type(exc).__name__})")
        await ws.close()
        return False
STAGGER_S = 0.25    # happy eyeballs: the next address starts this long after the one before
RELAY_AFTER_S = 1.0  # ... and the relay this long after the first direct address


async def _first_to_connect(routes, errors: list, say, delays: list[float] | None = None):
    """Open WebSockets to the routes, each STAGGER_S after the one before (in the order
    given; or route i at delays[i]), and keep the first that opens; the rest are closed.
    An address that cannot work (another home's private address) costs no more than its
    stagger."""
    # attempt i starts STAGGER_S after attempt i-1, or at once when every attempt before it
    # has failed (another home's private address fails at once: no route)
    failed = 0
    turn = [asyncio.Event() for _ in routes]

    async def attempt(i, path, url):
        nonlocal failed
        try:
            await asyncio.wait_for(turn[i].wait(), i * STAGGER_S if delays is None else delays[i])
        except asyncio.TimeoutError:
            pass
        try:
            return path, url, await connect(url, open_timeout=CONNECT_TIMEOUT, **WS_OPTIONS)
        except BaseException:
            failed += 1
            if failed < len(turn):
                turn[failed].set()
            raise

    if turn:
        turn[0].set()
    tasks = [asyncio.ensure_future(attempt(i, p, u)) for i, (p, u) in enumerate(routes)]
    names = {t: (p, u) for t, (p, u) in zip(tasks, routes)}
    winner = None
    try:
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None and winner is None:
                    winner = t.result()
                elif exc is not None:
                    path, url = names[t]
                    errors.append(f"{path} {url}: {exc or type(exc).__name__}")
                    say(f"{path} route {url} unreachable ({exc or type(exc).__name__})")
                else:
                    await t.result()[2].close()
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            if not t.done() or t.cancelled():
                continue
            if t.exception() is None and (winner is None or t.result() is not winner):
                await t.result()[2].close()
    return winner if winner is not None else (None, None, None)


async def _client_handshake(ws, invite: Invite, identity: Identity, target, name, member, path) -> Session:
    mode = MODE_MEMBER if member else MODE_JOIN
    prologue = _hello_prefix(mode, invite.pipeline, b"\x00" * 8 if member else invite.invite_id)
    ini = Initiator(identity.private, invite.host_key, prologue, psk=None if member else invite.psk())
    said = {"name": name[:64], "t": int(time.time())}
    if path.startswith("direct ("):
        said["kind"] = path[len("direct ("):-1]
    await ws.send(prologue + ini.write_1(json.dumps(said).encode()))
    answer = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT * 2)
    if not isinstance(answer, (bytes, bytearray)) or not answer:
        raise TunnelError("the host answered something that is not a handshake")
    if answer[0] == 0:
        raise HostRefused(f"the host refused: {bytes(answer[1:]).decode(errors='replace')[:500]}")
    try:
        ini.read_2(answer[1:])
    except NoiseError as exc:
        raise TunnelError(str(exc)) from None
    send_key, recv_key = ini.keys()
    session = Session(ws, send_key, recv_key, role="joiner", peer_key=invite.host_key, path=path,
                      target=target, name=name)
    await session.send(CONFIRM)
    try:
        kind, _, payload = await session.recv_inner(HANDSHAKE_TIMEOUT * 2)
    except NoiseError as exc:
        raise TunnelError(str(exc)) from None
    if kind == BYE:
        raise HostRefused(f"the host refused: {payload.decode(errors='replace')[:500]}")
    if kind != READY:
        raise TunnelError("the host did not confirm the session")
    return session.start()


class Joiner:
    """Keeps this machine's stage connected to the host: the first session joins with
    the invite; after a drop it reconnects as a member (its key is allowlisted)."""

    def __init__(self, invite: Invite, identity: Identity, target: tuple[str, int], name: str = "",
                 prefer: str = "auto", on_event=None, direct_retry_s: float | None = None,
                 reply_listen: str | None = None, on_reply=None):
        self.invite, self.identity, self.target, self.name, self.prefer = invite, identity, target, name, prefer
        # while relayed, how often the direct addresses are tried again (a router's mapping
        # may come late, a firewall may open): the session then moves there mid-stream
        self.direct_retry_s = float(os.environ.get("POTLUCK_DIRECT_RETRY_S", DIRECT_RETRY_S)) \
            if direct_retry_s is None else direct_retry_s
        self.on_event = on_event or (lambda text: log.info(text))
        self.session: Session | None = None
        self.member = False
        # when nothing in the invite reaches the host: listen on this HOST:PORT, show a reply
        # code (on_reply(code)) and wait for the host to connect (None: fail instead)
        self.reply_listen, self.on_reply = reply_listen, on_reply
        self.reply_code: str | None = None
        self._incoming: asyncio.Queue | None = None
        self._reply_server = None
        self._mapper = None
        self._udp = None               # with no relay: the socket we punch toward the host from
        self._punch_task: asyncio.Task | None = None
        # while relayed, punch a direct UDP path (POTLUCK_PUNCH=0: never)
        self.punch = os.environ.get("POTLUCK_PUNCH", "1") != "0"

    GIVE_UP_AFTER = 5      # refusals in a row (a revoked member, a used-up code) before giving up

    async def connect(self) -> Session:
        try:
            self.session = await self._open()
        except TunnelError as exc:
            if self.reply_listen is None or isinstance(exc, HostRefused) or self.prefer == "relay":
                raise
            self.session = await self._by_reply(str(exc))
        self.member = True
        self.on_event(f"connected to the host via {self.session.path}")
        return self.session

    async def run(self):
        """Reconnects until the host refuses us (revoked) or is gone for good."""
        if self.session is None:
            await self.connect()
        delay = 1.0
        while True:
            seeker = asyncio.ensure_future(self._seek_direct(self.session))
            try:
                await self.session.closed.wait()
            finally:
                seeker.cancel()
            self.on_event(f"tunnel closed: {self.session.close_reason}")
            if "revoked" in self.session.close_reason:
                raise TunnelError(self.session.close_reason)
            refusals = 0
            while True:
                await asyncio.sleep(delay)
                try:
                    await self.connect()
                    delay = 1.0
                    break
                except TunnelError as exc:
                    refusals = refusals + 1 if isinstance(exc, HostRefused) else 0
                    if refusals >= self.GIVE_UP_AFTER:
                        raise
                    self.on_event(f"reconnect failed: {exc}")
                    delay = min(delay * 2, 30.0)


    async def _open(self) -> Session:
        return await open_session(self.invite, self.identity, self.target, name=self.name,
                                  member=self.member, prefer=self.prefer, log_event=self.on_event)

    async def _by_reply(self, why: str) -> Session:
        """Listen, gather this machine's candidates (its router's mapping among them), show
        a reply code, and take the host's connection when it comes -- or the invite's own
        routes, tried again meanwhile, when one of those answers first (a relay back up)."""
        if self._reply_server is None:
            try:
                await self._listen_for_replies(why)
            except BaseException:
                await self.close()          # set up again on the next try
                raise
        waiting = asyncio.ensure_future(self._next_reply_session())
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(waiting), self.direct_retry_s)
                except asyncio.TimeoutError:
                    pass
                try:
                    return await self._open()
                except HostRefused:
                    raise
                except TunnelError:
                    continue
        finally:
            waiting.cancel()

    async def _listen_for_replies(self, why: str):
        from engine.wire import candidates as cand

        self._incoming = asyncio.Queue()

        async def handler(ws):
            # anyone may connect here (the address is in a code): a few wait their
            # turn, more are turned away, so a flood costs bounded memory; and none
            # while this joiner is connected another way
            if self._incoming.qsize() >= REPLY_QUEUE or (self.session is not None
                                                         and not self.session.closed.is_set()):
                await ws.close(1013, "busy")
                return
            done = asyncio.Event()
            await self._incoming.put((ws, done, "direct (reply)"))
            await done.wait()          # the connection lives as long as its session

        host, _, port = self.reply_listen.rpartition(":")
        try:
            self._reply_server = await serve(handler, host or "0.0.0.0", int(port or 0), **WS_OPTIONS)
        except OSError as exc:
            raise TunnelError(f"{why}; and a reply code needs this computer to listen on "
                              f"{self.reply_listen}, which failed ({exc.strerror or exc}): "
                              "give another with --reply-listen") from None
        bound = self._reply_server.sockets[0].getsockname()[1]
        self._mapper = cand.PortMapper()
        g, udp = await asyncio.gather(
            cand.gather(bound, upnp=os.environ.get("POTLUCK_UPNP", "1") != "0", mapper=self._mapper),
            self._punch_toward_host())
        if not g.candidates and not udp:
            raise TunnelError(f"{why}; and this computer has no address the host could reach either")
        cands = (g.candidates + udp)[:16]
        self.reply_code = encode_reply(Reply(self.invite.pipeline, self.invite.invite_id,
                                             [c.url for c in cands], [c.kind for c in cands]))
        self.on_event("the host cannot be reached from here; it can reach this computer instead: "
                      f"send the host this reply code ({', '.join(c.kind for c in g.candidates)})")
        if self.on_reply is not None:
            self.on_reply(self.reply_code)

    async def _punch_toward_host(self) -> list:
        """With the host's punching address in the invite (kind "udp"): a socket of ours, its
        public address for the reply code, and punching toward the host from it, a round a
        second, until the host (given our code) punches back; then QUIC, and the join's
        handshake over it (_next_reply_session)."""
        from engine.wire import candidates as cand, stun

        targets = udp_addresses(self.invite.direct, self.invite.kinds)
        servers = stun.servers_from_env()
        if not targets or not servers or not self.punch:
            return []
        try:
            from engine.wire.punch import UdpEndpoint

            self._udp = await UdpEndpoint.open(exclusive=False)
        except (ImportError, OSError):
            return []
        await self._udp.candidates(servers)
        if not self._udp.mapped:
            return []
        self._punch_task = asyncio.ensure_future(self._punch_loop(targets))
        return [cand.Candidate("udp", f"udp://{a}:{p}") for a, p in self._udp.mapped[:2]]

    async def _punch_loop(self, targets):
        from engine.wire.punch import PunchError

        key = punch_key(rendezvous_key(self.invite.psk()))
        while True:
            try:
                peer = await self._udp.punch(key, targets, None, interval=1.0)
                channel = await self._udp.quic_connect(peer)
            except (PunchError, OSError) as exc:
                self.on_event(f"no punched path to the host ({exc})")
                await asyncio.sleep(1.0)
                continue
            done = asyncio.Event()
            await self._incoming.put((channel, done, "direct (punched)"))
            await done.wait()
            await channel.close()

    async def _next_reply_session(self) -> Session:
        while True:
            ws, done, path = await self._incoming.get()
            try:
                session = await _client_handshake(ws, self.invite, self.identity, self.target, self.name,
                                                  self.member, path)
            except (TunnelError, ConnectionClosed, OSError, asyncio.TimeoutError, NoiseError) as exc:
                # even a refusal: whoever connected here need not be the host (a refusal
                # is not authenticated), and the host redials; so wait for the next one
                self.on_event(f"a connection to the reply address failed ({exc or type(exc).__name__})")
                done.set()
                continue
            except asyncio.CancelledError:      # connected another way meanwhile
                done.set()
                raise
            asyncio.ensure_future(_release_when_closed(session, done))
            return session

    async def close(self):
        """Stop listening for the host (a reply code's listener) and remove its mapping."""
        if self._reply_server is not None:
            self._reply_server.close()
            self._reply_server = None
        if self._mapper is not None:
            await self._mapper.close()
            self._mapper = None
        if self._punch_task is not None:
            self._punch_task.cancel()
            self._punch_task = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None

    async def _seek_direct(self, session: Session):
        """While relayed: the invite's direct addresses again (a mapping may come late, a
        firewall open), then hole punching; the first try of punching right away."""
        first = True
        while session.path == "relay" and self.prefer != "relay":
            if not first:
                try:
                    await asyncio.wait_for(session.closed.wait(), self.direct_retry_s)
                    return
                except asyncio.TimeoutError:
                    pass
            moved = (not first and direct_routes(self.invite) and await resume_direct(session, self.invite, self.on_event)) \
                or (self.punch and await punch_direct(session, self.invite, self.on_event))
            first = False
            if moved:
                try:      # the host's MOVE ends the old channel (behind what it still carries)
                    await asyncio.wait_for(session.moved.wait(), DEAD_AFTER)
                except asyncio.TimeoutError:
                    await session.close("the host did not finish moving to the direct path")
                    return
                self.on_event(f"moved to {session.path}: no longer relayed")


async def _release_when_closed(session: Session, done: asyncio.Event):
    await session.closed.wait()
    done.set()


def default_name() -> str:
    return os.environ.get("POTLUCK_NAME") or socket.gethostname()[:64]
