"""Friend-to-friend hops (issue 43): stage i in one friend's home reaches stage i+1 in
another's directly, not through the host's machine.

The host introduces the two, in INTRO frames inside the tunnels it has with each (sealed
end to end with it); B is the home of the next stage, A the one that connects to it:

    host -> B   {"op": "accept", "hop", "id", "psk", "key": A's node key}
    B -> host   {"op": "door", "hop", "addresses", "kinds", "udp"}   or {"op": "door", "hop", "why"}
    host -> A   {"op": "dial", "hop", "id", "psk", "key": B's node key, "addresses", "kinds", "udp"}
    A -> host   {"op": "punch", "hop", "udp"}        (only when no address answered; the host
    host -> B   {"op": "punch", "hop", "udp"}         passes A's UDP candidates on to B)
    A -> host   {"op": "dialed", "hop", "port", "path", "rtt_ms"}    or {"op": "dialed", "hop", "why"}
    A -> host   {"op": "hop_link", "hop", "rtt_ms", "mbit_s"}   every HOP_REPORT_S while the hop is up:
                what its tunnel's pings and traffic measure now, for the host's status
    host -> A|B {"op": "end", "hop"}      the hop is over (a new arrangement, a friend revoked)

B opens a door: a WebSocket listener on all its addresses, with the candidates a host
gathers for its own (the LAN, a mapping on the router, a public address). A races them
and runs a Noise IK handshake over the first that opens: the prologue names the pipeline
and the introduction, the pre-shared key is the introduction's (fresh and random, from
the host), and each side's static key must be the one the host named. A stranger who
learns the door's address opens nothing; B trusts A for this pipeline and this hop only:
the door's sessions reach B's own stage server and nothing else (no LISTEN, no MOVE, no
PUNCH, no INTRO inside them), and they end when the host ends the introduction or B's
own tunnel to the host closes (the trust came from there).

Where no address of B's answers A within DIAL_TIMEOUT_S and both have UDP candidates
(their STUN-mapped and LAN addresses, engine/wire/punch.py), the two punch a hole at once,
A's candidates passed to B through the host, and the same handshake runs over QUIC on
the punched socket ("direct (punched)"). Where that fails too, A says why and the host
sets the hop up through itself, as before (TunnelHost.open_hop).

Inside: `check_intro` validates a frame's fields (pure), `FriendHops` is one joiner's
side (opened with its session to the host), `introduce` the host's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field

from websockets.exceptions import ConnectionClosed

from engine.core.ws_address import address_problem
from engine.wire.noise import Initiator, NoiseError, Responder
from engine.wire.tunnel_routes import _KIND_ORDER, _first_to_connect, open_timeouts
from engine.wire.tunnel_session import (BYE, CONFIRM, HANDSHAKE_TIMEOUT, INTRO, MODE_FRIEND, READY, STAGE, WS_OPTIONS,
                                        Session, TunnelError, _hello_prefix, parse_hello)
from engine.wire.ws_server import serve

log = logging.getLogger("potluck.friends")

DIAL_TIMEOUT_S = 4.0       # A's try of B's addresses, before punching or going through the host
PUNCH_S = 5.0              # seconds of hole punching before the hop goes through the host
ANSWER_TIMEOUT_S = 20.0    # the host's wait for a friend's answer (a door gathers ~2 s, a dial
                           # tries for DIAL_TIMEOUT_S and punches for PUNCH_S)
MAX_INTROS = 8             # introductions one friend holds at once
# how long the way two homes' hop went is remembered (hop_plan): a friend coming back
# within it is introduced the way that worked, not by trying every way again first
REMEMBER_S = 600.0
MAX_ADDRESSES = 12
# how often A tells the host its hop's round trip and goodput as the hop's own pings and
# traffic measure them: the status shows the hop as it is, not as its handshake found it
HOP_REPORT_S = 5.0
_HEX = re.compile(r"^[0-9a-f]*$")


class HopError(TunnelError):
    """No direct hop between two friends; str() says why."""


class NoPath(HopError):
    """Both friends answered, and neither dialing nor punching found a way between them
    (not a friend gone quiet mid-introduction): worth remembering (hop_plan)."""


def check_intro(msg, frm: str) -> dict:
    """An INTRO frame's fields, checked (NoiseError when anything is off). frm: "host"
    (what a joiner may be told) or "friend" (what the host may be answered)."""
    if not isinstance(msg, dict):
        raise NoiseError("an INTRO frame is a JSON object")
    op = msg.get("op")
    allowed = ("accept", "dial", "end", "punch") if frm == "host" else ("door", "dialed", "punch", "hop_link")
    if op not in allowed:
        raise NoiseError(f"INTRO op {op!r} is not for this end")
    hop = msg.get("hop")
    if not isinstance(hop, int) or isinstance(hop, bool) or not 0 < hop < 2**31:
        raise NoiseError("INTRO without a hop number")
    out = {"op": op, "hop": hop}

    def hexfield(name: str, n: int) -> bytes:
        v = msg.get(name)
        if not isinstance(v, str) or len(v) != 2 * n or not _HEX.match(v):
            raise NoiseError(f"INTRO {op}: {name} must be {n} bytes in hex")
        return bytes.fromhex(v)

    if op in ("accept", "dial"):
        out["id"], out["psk"], out["key"] = hexfield("id", 8), hexfield("psk", 32), hexfield("key", 32)
    if op == "dial" or (op == "door" and "why" not in msg):
        addrs, kinds = msg.get("addresses"), msg.get("kinds")
        if not (isinstance(addrs, list) and isinstance(kinds, list) and len(addrs) == len(kinds) <= MAX_ADDRESSES
                # a door is ws://host:port and no more: not a path or query for the other
                # friend's machine to request of whatever listens there
                and all(isinstance(a, str) and len(a) <= 200 and "#" not in a and address_problem(a) is None
                        for a in addrs)
                and all(isinstance(k, str) and len(k) <= 16 for k in kinds)):
            raise NoiseError(f"INTRO {op}: malformed addresses")
        out["addresses"], out["kinds"] = addrs, kinds
    if op in ("door", "dial", "punch") and "why" not in msg:
        from engine.wire.punch import parse_candidates

        try:
            out["udp"] = parse_candidates(msg.get("udp", []))
        except ValueError as exc:
            raise NoiseError(f"INTRO {op}: {exc}") from None
        out["symmetric"] = msg.get("symmetric") is True     # its router maps each destination anew
    if op in ("door", "dialed") and "why" in msg:
        out["why"] = str(msg["why"])[:300]
    if op == "dialed" and "why" not in msg:
        port, path, rtt = msg.get("port"), msg.get("path"), msg.get("rtt_ms")
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(path, str) and len(path) <= 40
                and isinstance(rtt, (int, float)) and 0 <= rtt < 1e6):
            raise NoiseError("INTRO dialed: malformed answer")
        out.update(port=port, path=path, rtt_ms=float(rtt))
    if op == "hop_link":
        for name in ("rtt_ms", "mbit_s"):
            v = msg.get(name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6):
                raise NoiseError(f"INTRO hop_link: malformed {name}")
            out[name] = None if v is None else float(v)
    return out


def hop_plan(last_path: str | None, age_s: float) -> str:
    """How to set up a hop between two homes, from how their last one went: "full" (dial
    the door's addresses, then punch, then through the host), "punch" (it was punched:
    dialing would cost DIAL_TIMEOUT_S of waiting on addresses that do not answer) or
    "host" (no direct path was found: trying again would hold the pipeline ~10 s for the
    same answer). Forgotten after REMEMBER_S: a router may have changed."""
    if last_path is None or age_s > REMEMBER_S:
        return "full"
    if last_path == "via the host":
        return "host"
    if last_path == "direct (punched)":
        return "punch"
    return "full"


def pack(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


@dataclass
class _Intro:
    hop: int
    id: bytes
    psk: bytes
    key: bytes                                  # the other friend's node key
    door: bool                                  # we accept (B), not dial (A)
    sessions: list = field(default_factory=list)
    listener: asyncio.AbstractServer | None = None
    udp: object = None                          # punch.UdpEndpoint for this hop, if any
    punching: asyncio.Task | None = None


class FriendHops:
    """One joiner's side of its introductions, for as long as its session with the host:
    a door others' stages come in by, and dials out to others' doors."""

    def __init__(self, identity, pipeline: bytes, target: tuple[str, int] | None, host: Session):
        self.identity, self.pipeline, self.target, self.host = identity, pipeline, target, host
        self.intros: dict[int, _Intro] = {}     # hop -> introduction
        self._door = None
        self._door_cands: list = []
        self._mapper = None
        self._tasks: set = set()
        self._reporter: asyncio.Task | None = None
        self.closed = False

    # -- what the host says
    async def on_intro(self, msg: dict) -> None:
        op, hop = msg["op"], msg["hop"]
        if op == "end":
            await self._end(hop)
            return
        if op == "punch":
            intro = self.intros.get(hop)
            if intro is None or not intro.door or intro.udp is None or intro.punching is not None:
                raise NoiseError("a punch for no introduction of ours")
            intro.punching = asyncio.ensure_future(self._punch_in(intro, msg["udp"], msg["symmetric"]))
            return
        if hop in self.intros or len(self.intros) >= MAX_INTROS:
            raise NoiseError("an introduction the host already made, or too many")
        intro = self.intros[hop] = _Intro(hop, msg["id"], msg["psk"], msg["key"], door=op == "accept")
        if op == "accept":
            answer = {"op": "door", "hop": hop}
            try:
                if self.target is None:
                    raise HopError("this computer holds no stage to reach")
                cands = await self._open_door()
                if not cands:
                    raise HopError("this computer has no address another home could reach")
                answer.update(addresses=[c.url for c in cands], kinds=[c.kind for c in cands],
                              udp=[list(c) for c in await self._udp_for(intro)],
                              symmetric=bool(intro.udp is not None and intro.udp.symmetric))
            except Exception as exc:  # noqa: BLE001 -- whatever broke, the host hears why and goes via itself
                await self._end(hop)
                answer = {"op": "door", "hop": hop, "why": str(exc) or type(exc).__name__}
            await self.host.send(INTRO, 0, pack(answer))
        else:
            try:
                port, path, rtt = await self._dial(intro, msg["addresses"], msg["kinds"], msg.get("udp", []),
                                                   msg.get("symmetric", False))
                answer = {"op": "dialed", "hop": hop, "port": port, "path": path, "rtt_ms": round(rtt * 1000, 1)}
                self._report_links()
            except Exception as exc:  # noqa: BLE001 -- as above: the hop goes through the host
                await self._end(hop)
                answer = {"op": "dialed", "hop": hop, "why": str(exc) or type(exc).__name__}
            await self.host.send(INTRO, 0, pack(answer))

    async def _end(self, hop: int) -> None:
        intro = self.intros.pop(hop, None)
        if intro is None:
            return
        if intro.listener is not None:
            intro.listener.close()
        if intro.punching is not None:
            intro.punching.cancel()
        for s in intro.sessions:
            await s.close("the host ended this hop")
        if intro.udp is not None:
            intro.udp.close()

    async def _udp_for(self, intro: _Intro) -> list:
        """A UDP socket for this hop and where the other friend may punch at it (empty
        where punching is off or the socket cannot be opened)."""
        if os.environ.get("POTLUCK_PUNCH", "1") == "0":
            return []
        try:
            from engine.wire import punch, stun

            intro.udp = await punch.UdpEndpoint.open()
            return await intro.udp.candidates(stun.servers_from_env())
        except (ImportError, OSError) as exc:
            log.info("hop %d: no hole punching here (%s)", intro.hop, exc)
            return []

    async def _punch_in(self, intro: _Intro, theirs: list, theirs_symmetric: bool) -> None:
        """B: punch toward A's candidates while A punches toward ours (predicting ports
        where one router maps each destination anew), take A's QUIC connection on the
        punched socket, and run the door's handshake over it."""
        from engine.wire import punch

        try:
            peer = await self._punch(intro, theirs, theirs_symmetric)
            channel = await intro.udp.quic_accept(peer)
        except (punch.PunchError, OSError) as exc:
            log.info("hop %d: no punched path in (%s)", intro.hop, exc)
            return
        try:
            await self._accept(channel)
        finally:
            await channel.close()

    # -- B: the door
    async def _open_door(self) -> list:
        from engine.wire import candidates as cand

        if self._door is None:
            self._door = await serve(self._accept, "0.0.0.0", 0, **WS_OPTIONS)
            port = self._door.sockets[0].getsockname()[1]
            upnp = os.environ.get("POTLUCK_UPNP", "1") != "0"
            self._mapper = cand.PortMapper() if upnp else None
            g = await cand.gather(port, upnp=upnp, mapper=self._mapper)
            self._door_cands = [c for c in g.candidates if c.kind != "udp"][:MAX_ADDRESSES]
        return self._door_cands

    async def _accept(self, ws) -> None:
        """Someone at the door: a friend the host introduced, or nobody we let in."""
        try:
            session = await asyncio.wait_for(self._door_handshake(ws), HANDSHAKE_TIMEOUT)
        except (NoiseError, TunnelError, ConnectionClosed, OSError, asyncio.TimeoutError, ValueError) as exc:
            log.info("refused at the door: %s", exc or type(exc).__name__)
            await ws.close(1008, "refused")
            return
        await session.closed.wait()

    async def _door_handshake(self, ws) -> Session:
        first = await ws.recv()
        mode, pipeline, intro_id, prologue, msg1 = parse_hello(first)
        intro = next((i for i in self.intros.values() if i.id == intro_id and i.door), None)
        if mode != MODE_FRIEND or pipeline != self.pipeline or intro is None:
            raise NoiseError("no such introduction here")
        intro.sessions = [s for s in intro.sessions if not s.closed.is_set()]
        if len(intro.sessions) >= 4:
            raise NoiseError("enough connections for this hop")
        r = Responder(self.identity.private, prologue, psk=intro.psk)
        r.read_1(msg1)
        if r.remote_static != intro.key:
            raise NoiseError("not the friend the host introduced")
        await ws.send(b"\x01" + r.write_2(b"{}"))
        send_key, recv_key = r.keys()
        session = Session(ws, send_key, recv_key, role="joiner", peer_key=intro.key, path="friend",
                          target=self.target, friend=True)
        kind, _, _ = await session.recv_inner(HANDSHAKE_TIMEOUT)
        if kind != CONFIRM or intro.hop not in self.intros:
            raise NoiseError("expected a confirmation")
        await session.send(READY)
        intro.sessions.append(session)
        return session.start()

    # -- A: the dial
    async def _punch(self, intro: _Intro, theirs: list, theirs_symmetric: bool) -> tuple[str, int]:
        """Punch at the other friend (both at once); with one symmetric NAT between them,
        by port prediction (punch.py). The socket that got through becomes the hop's."""
        from engine.wire import punch

        # prediction meets by chance (98 in 100): a second try, both sides at once again
        tries = 2 if intro.udp.symmetric != theirs_symmetric else 1
        for attempt in range(tries):
            try:
                intro.udp, peer = await intro.udp.punch_either(punch.punch_key(intro.psk), theirs, PUNCH_S,
                                                               theirs_symmetric)
                return peer
            except punch.PunchError:
                if attempt + 1 == tries:
                    raise

    async def _dial(self, intro: _Intro, addresses: list[str], kinds: list[str],
                    udp: list, theirs_symmetric: bool = False) -> tuple[int, str, float]:
        routes = [(f"direct ({k})", a) for k, a in sorted(zip(kinds, addresses),
                                                          key=lambda ka: _KIND_ORDER.get(ka[0], 9))]
        errors: list[str] = []
        t0 = time.monotonic()
        try:
            path, url, ws = await asyncio.wait_for(
                _first_to_connect(routes, errors, lambda text: None, timeouts=open_timeouts(routes)), DIAL_TIMEOUT_S)
            if ws is None:
                raise HopError("no address of the other home answers: " + "; ".join(errors)[:300])
        except (asyncio.TimeoutError, HopError) as exc:
            why = str(exc) if isinstance(exc, HopError) else \
                f"no address of the other home answered within {DIAL_TIMEOUT_S:g} s"
            if not udp:
                raise HopError(why) from None
            path, ws = "direct (punched)", await self._punch_out(intro, udp, theirs_symmetric, why)
        connected = time.monotonic()
        try:
            prologue = _hello_prefix(MODE_FRIEND, self.pipeline, intro.id)
            ini = Initiator(self.identity.private, intro.key, prologue, psk=intro.psk)
            await ws.send(prologue + ini.write_1(b"{}"))
            answer = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
            rtt = time.monotonic() - connected
            if not isinstance(answer, (bytes, bytearray)) or not answer or answer[0] != 1:
                raise HopError("the other home's door refused")
            ini.read_2(bytes(answer[1:]))
            send_key, recv_key = ini.keys()
            session = Session(ws, send_key, recv_key, role="host", peer_key=intro.key, path=path, friend=True)
            await session.send(CONFIRM)
            kind, _, payload = await session.recv_inner(HANDSHAKE_TIMEOUT)
            if kind != READY:
                raise HopError(f"the other home did not confirm: {payload.decode(errors='replace')[:200]}"
                               if kind == BYE else "the other home did not confirm")
        except BaseException:
            await ws.close()
            raise
        session.start()
        intro.sessions.append(session)

        async def on_conn(reader, writer):
            if session.closed.is_set():
                writer.close()
                return
            await session.open_stream(reader, writer, target=STAGE)

        intro.listener = await asyncio.start_server(on_conn, "127.0.0.1", 0)

        async def close_with_session(listener=intro.listener):
            await session.closed.wait()        # B's door went (it left, or the host ended the hop):
            listener.close()                   # A's stage reconnecting here fails at once

        task = asyncio.ensure_future(close_with_session())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("hop %d: direct to the next stage via %s in %.0f ms", intro.hop, path,
                 (time.monotonic() - t0) * 1000)
        return intro.listener.sockets[0].getsockname()[1], path, rtt

    async def _punch_out(self, intro: _Intro, theirs: list, theirs_symmetric: bool, why: str):
        """A: no address of B's answered; punch a hole toward B's UDP candidates, ours
        passed to B through the host so that B punches back at once, and open QUIC."""
        from engine.wire import punch

        mine = await self._udp_for(intro)
        if not mine:
            raise HopError(f"{why}; and no hole punching here")
        await self.host.send(INTRO, 0, pack({"op": "punch", "hop": intro.hop, "udp": [list(c) for c in mine],
                                             "symmetric": intro.udp.symmetric}))
        try:
            peer = await self._punch(intro, theirs, theirs_symmetric)
            return await intro.udp.quic_connect(peer)
        except (punch.PunchError, OSError) as exc:
            raise HopError(f"{why}; and no hole could be punched ({exc})") from None

    def _report_links(self) -> None:
        """Tell the host how the hops this end dialed are doing, every HOP_REPORT_S, for
        as long as any is up (started by the first dial that found a direct path)."""
        if self._reporter is not None and not self._reporter.done():
            return

        async def report():
            while not self.closed:
                await asyncio.sleep(HOP_REPORT_S)
                for hop, link in self.links().items():
                    rtt, goodput = link.get("rtt_ms"), link.get("mbit_s")
                    try:
                        await self.host.send(INTRO, 0, pack({
                            "op": "hop_link", "hop": hop, "rtt_ms": None if rtt is None else round(rtt, 1),
                            "mbit_s": None if goodput is None else round(goodput, 3)}))
                    except (ConnectionClosed, OSError):
                        return              # the host's tunnel is gone: so are the hops

        self._reporter = asyncio.ensure_future(report())
        self._tasks.add(self._reporter)
        self._reporter.add_done_callback(self._tasks.discard)

    def links(self) -> dict[int, dict]:
        """Per hop this end dialed: its path and round trip (for the host's status)."""
        return {hop: s.link() for hop, i in self.intros.items() for s in i.sessions[:1] if i.listener is not None}

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        for hop in list(self.intros):
            await self._end(hop)
        if self._door is not None:
            self._door.close()
        if self._mapper is not None:
            await self._mapper.close()


async def introduce(src: Session, dst: Session, hop: int, dst_target_port: int | None = None,
                    punch_only: bool = False) -> dict:
    """The host's side: introduce `src` (it connects) to `dst` (its stage is connected
    to), both sessions with friends. Returns {"port": src's loopback port, "path",
    "rtt_ms"}; HopError with the reason when they found no direct path. punch_only: the
    door's addresses are not passed on (hop_plan: the two homes' last hop was punched), so
    `src` punches at once."""
    intro_id, psk = os.urandom(8), os.urandom(32)
    door = await dst.ask(INTRO, pack({"op": "accept", "hop": hop, "id": intro_id.hex(), "psk": psk.hex(),
                                      "key": src.peer_key.hex()}), "door", hop, ANSWER_TIMEOUT_S)
    if "why" in door:
        raise HopError(f"the next stage's home opened no door: {door['why']}")
    src.punch_relay[hop] = dst          # A's punch candidates, passed on to B (Session._on_intro)
    try:
        dialed = await src.ask(INTRO, pack({"op": "dial", "hop": hop, "id": intro_id.hex(), "psk": psk.hex(),
                                            "key": dst.peer_key.hex(),
                                            "addresses": [] if punch_only else door["addresses"],
                                            "kinds": [] if punch_only else door["kinds"], "udp": [list(c) for c in door.get("udp", [])],
                                            "symmetric": door.get("symmetric", False)}),
                               "dialed", hop, ANSWER_TIMEOUT_S)
    finally:
        src.punch_relay.pop(hop, None)
    if "why" in dialed:
        await end(dst, hop)
        raise NoPath(dialed["why"])
    return dialed


async def end(session: Session, hop: int) -> None:
    """Tell a friend that a hop is over (quietly: its tunnel may be gone already)."""
    try:
        await session.send(INTRO, 0, pack({"op": "end", "hop": hop}))
    except (ConnectionClosed, OSError):
        pass
