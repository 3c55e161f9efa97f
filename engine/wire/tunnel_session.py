"""The tunnel's session: its constants, inner frames and hello, and Session, the streams
over one authenticated channel (which may move to another mid-stream).

The protocol as a whole, and where each side of it lives: engine/wire/tunnel.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
import struct
import time
from collections import deque

from websockets.exceptions import ConnectionClosed

from engine.core.heartbeat import Silence
from engine.wire.identity import node_id
from engine.wire.noise import NoiseError, TransportCipher
from engine.wire.punch import punch_key

log = logging.getLogger("potluck.tunnel")

MAGIC = b"PLT1"
MODE_JOIN, MODE_MEMBER = 1, 2
PROLOGUE_LEN = 4 + 1 + 8 + 8
CHUNK = 32 << 10                 # bytes of a stream per DATA frame
MAX_MESSAGE = 64 << 10           # channel messages beyond this are refused
HANDSHAKE_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
# a tunnel silent this long is given up and the joiner dials again on a fresh connection:
# after a line cut the old TCP connection can sit in its retransmission back-off for half
# a minute after the line is back (the host's side, seen in a three-homes run), while a
# new one connects at once
PING_INTERVAL = 10.0
DEAD_AFTER = 30.0
# the reason a host's tunnels close with when it stops on purpose: a joiner waits for it
# quietly instead of advising router settings at every retry
HOST_STOPPED = "host shutting down"
MAX_STREAMS = 32
WS_OPTIONS = dict(max_size=MAX_MESSAGE + 1024, compression=None, ping_interval=None, max_queue=32)

CONFIRM, READY, OPEN, DATA, CLOSE, PING, PONG, BYE, LISTEN, LISTENING, MOVE, PUNCH, INTRO = range(1, 14)
MAX_HOP_LISTENERS = 4      # a joiner's loopback listeners for hops through the host, at most
PUNCH_TIMEOUT = 5.0              # seconds of hole punching before a try gives up
MODE_RESUME = 3                  # a second channel for a session that exists: see Session.move_to
MODE_FRIEND = 4                  # a friend's stage to the next friend's, introduced by the host (friend_hop.py)
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
    if not CONFIRM <= kind <= INTRO:
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
    if mode not in (MODE_JOIN, MODE_MEMBER, MODE_RESUME, MODE_FRIEND):
        raise NoiseError(f"unknown handshake mode {mode}")
    return mode, msg[5:13], msg[13:21], msg[:PROLOGUE_LEN], msg[PROLOGUE_LEN:]



def _hello_prefix(mode: int, pipeline: bytes, invite_id: bytes) -> bytes:
    return MAGIC + bytes([mode]) + pipeline + invite_id


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
                 target: tuple[str, int] | None = None, name: str = "", friend: bool = False):
        self.ws_in = self.ws_out = ws
        # a hop between two friends (friend_hop.py): streams to the one target only
        self.friend = friend
        # introductions (friend_hop.py): a joiner's FriendHops handles what the host says;
        # the host waits here for the answers, by (op, hop)
        self.friends = None
        self.on_intro = None
        self.on_hop_link = None   # host side: (session, msg) for a friend's report on a hop it dialed
        self._asks: dict[tuple[str, int], asyncio.Future] = {}
        self.punch_relay: dict[int, "Session"] = {}     # host: hop -> the friend A's punch goes to
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
        if self.friends is not None:
            await self.friends.close()     # a friend's trust in another came from this session
        for fut in self._asks.values():
            if not fut.done():
                fut.cancel()
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
        # the peer's silence counts only in time this process ran (engine/core/heartbeat.py):
        # a loop held past DEAD_AFTER wakes to the peer's frames still unread, not to a
        # tunnel it closes
        heard = self.last_rx
        silence = Silence(DEAD_AFTER, PING_INTERVAL, heard)
        first = True
        while not self.closed.is_set():
            await asyncio.sleep(0.0 if first else PING_INTERVAL)   # a round trip to show at once
            first = False
            if self.last_rx != heard:
                heard = self.last_rx
                silence = Silence(DEAD_AFTER, PING_INTERVAL, heard)
            if silence.advance(time.monotonic()):
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
                if self.friend and kind in (LISTEN, LISTENING, MOVE, PUNCH, INTRO):
                    raise NoiseError("a frame a friend's hop does not carry")
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
                elif kind == INTRO:
                    self._on_intro(payload)
                elif kind in (CONFIRM, READY):
                    raise NoiseError("handshake frame after the handshake")
        except NoiseError as exc:
            log.warning("tunnel from %s: %s", self.peer_id, exc)
            self.close_reason = str(exc)
        except (ConnectionClosed, OSError, ConnectionError) as exc:
            self.close_reason = self.close_reason or f"channel closed ({exc})"
        except Exception as exc:  # noqa: BLE001 -- a frame no check foresaw: the session ends, said why
            log.exception("tunnel from %s: a frame failed", self.peer_id)
            self.close_reason = f"a frame failed: {type(exc).__name__}"
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
        except (ValueError, AttributeError, RecursionError):   # (JSON nested thousands deep)
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

    def _on_intro(self, payload: bytes):
        """An introduction (friend_hop.py): the host's to a joiner, or a joiner's answer."""
        from engine.wire.friend_hop import check_intro

        try:
            raw = json.loads(payload) if len(payload) <= 8192 else None
        except (ValueError, RecursionError):
            raw = None
        msg = check_intro(raw, "host" if self.role == "joiner" else "friend")
        if self.role == "host" and msg["op"] == "punch":
            other = self.punch_relay.get(msg["hop"])
            if other is None:
                raise NoiseError("a punch for no hop this friend is dialing")
            from engine.wire.friend_hop import pack

            async def pass_on():
                try:
                    await other.send(INTRO, 0, pack({"op": "punch", "hop": msg["hop"],
                                                     "udp": [list(c) for c in msg["udp"]],
                                                     "symmetric": msg["symmetric"]}))
                except (ConnectionClosed, OSError):
                    pass                        # B is gone: A's punch runs out, the hop goes via us

            task = asyncio.ensure_future(pass_on())
            self._tasks.append(task)
            task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))
            return
        if self.role == "host" and msg["op"] == "hop_link":
            if self.on_hop_link is not None:     # how a hop this friend dialed is doing now
                self.on_hop_link(self, msg)
            return
        if self.role == "host":
            fut = self._asks.pop((msg["op"], msg["hop"]), None)
            if fut is None:
                raise NoiseError("an INTRO answer nobody asked for")
            if not fut.done():
                fut.set_result(msg)
            return
        if self.on_intro is None:
            raise NoiseError("this end takes no introductions")

        async def run():
            try:
                await self.on_intro(msg)
            except NoiseError as exc:
                await self.close(str(exc))
            except (ConnectionClosed, OSError):
                pass

        task = asyncio.ensure_future(run())
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def ask(self, kind: int, payload: bytes, op: str, hop: int, timeout: float) -> dict:
        """Host side: send a frame and wait for the peer's INTRO answer `op` for `hop`."""
        fut = self._asks[(op, hop)] = asyncio.get_running_loop().create_future()
        try:
            return await self._send_and_wait(fut, kind, 0, payload, timeout)
        finally:
            self._asks.pop((op, hop), None)

    async def _send_and_wait(self, fut: asyncio.Future, kind: int, stream: int, payload: bytes, timeout: float):
        """Send a frame and wait for the peer's answer in `fut`. The session closing under
        the wait (close() cancels what is awaited) is a lost friend, a ConnectionError, not
        a cancelled caller: a CancelledError out of here once ended a rearrangement
        silently, the pipeline waiting for ever (found by the chaos run)."""
        try:
            await self.send(kind, stream, payload)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.CancelledError:
            if fut.cancelled() and not asyncio.current_task().cancelling():
                raise ConnectionError(f"the tunnel closed: {self.close_reason or 'closed'}") from None
            raise

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
        if self.role != "joiner" or hop in self._hop_listeners:
            raise NoiseError("unexpected LISTEN frame")
        # a stage has one next stage at a time: the host asks anew at each arrangement and
        # says nothing when one through it ends, so the oldest listeners go (their streams
        # stay) -- refusing the fifth closed the tunnel after four rearrangements
        while len(self._hop_listeners) >= MAX_HOP_LISTENERS:
            self._hop_listeners.pop(next(iter(self._hop_listeners))).close()

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
        try:
            return await self._send_and_wait(fut, LISTEN, hop, b"", timeout)
        finally:
            self._listening.pop(hop, None)

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
