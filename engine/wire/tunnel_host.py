"""The host's side of the tunnels: TunnelHost accepts joiners (direct, relayed, punched), and
dials those that sent a reply code; Peer is one joiner as the host sees it, on a loopback port.

It also answers a relayed joiner's punch offer, moves sessions onto proven direct channels,
sets up hops between two joiners (three or more homes), and drops revoked members.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from engine.wire import stage_auth
from engine.wire.identity import Identity, node_id
from engine.wire.relay_auth import prove, relay_refusal
from engine.wire.invite import HostState, InviteError, Reply, udp_addresses
from engine.wire.keepalive import HeartbeatConnection
from engine.wire.noise import NoiseError, Responder
from engine.wire.punch import punch_key
from engine.wire.tunnel_routes import _first_to_connect
from engine.wire.tunnel_session import (BYE, CONFIRM, CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, HOST_STOPPED,
                                        MODE_FRIEND, MODE_JOIN, MODE_MEMBER, MODE_RESUME, PUNCH, PUNCH_TIMEOUT, READY,
                                        WS_OPTIONS, Session, parse_hello)
from engine.wire.ws_server import serve

log = logging.getLogger("potluck.tunnel")

# a reply code's joiner waits this long for the host to dial it (tunnel_join.REPLY_WAIT_S):
# one that never answered in that time is no longer dialled (a member that did is, while
# its invite lasts: its tunnel may drop and come back)
UNANSWERED_REPLY_S = 900.0

# a host behind a symmetric NAT predicting ports toward a joiner's reply code: how long its
# mappings stay open for the joiner's bursts of probes (tunnel_join.py: one every 8 s)
PREDICT_REPLY_S = 12.0
# channels through the relay at once: the relay pairs at most 8 a pipeline (relay.py
# max_channels), and a session moving to a direct path holds its old one a moment
MAX_RELAYED = 16


@dataclass
class Peer:
    key: bytes
    name: str
    session: Session | None = None
    server: asyncio.AbstractServer | None = None
    port: int = 0
    joined: float = field(default_factory=time.time)
    # what the joiner said it gives: {"device": "NVIDIA GeForce RTX 4090", "memory": bytes}
    about: dict = field(default_factory=dict)
    # the secret its stage takes control connections with (stage_auth.tunnel_stage_secret)
    secret: str = ""

    @property
    def node_id(self) -> str:
        return node_id(self.key)

    @property
    def address(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def control_address(self) -> str:
        """The address a head drives its stage at: `address` and its secret (a head keeps
        the secret apart, so status and logs show `address`)."""
        return f"{self.address}#{self.secret}"

    @property
    def path(self) -> str:
        return self.session.path if self.session else "offline"


def joiner_about(said) -> dict:
    """The joiner's word on its computer, kept only as far as it is well formed (a device
    name of at most 64 characters, a memory size in bytes): it is shown, never trusted."""
    if not isinstance(said, dict):
        return {}
    out = {}
    if isinstance(said.get("device"), str):
        out["device"] = said["device"][:64]
    mem = said.get("memory")
    if isinstance(mem, int) and not isinstance(mem, bool) and 0 <= mem < 2**53:
        out["memory"] = mem
    return out


@dataclass
class HopLink:
    """A hop between two friends' stages, as the host set it up."""
    src: bytes
    dst: bytes
    names: str
    path: str                 # "direct (lan)", "direct (mapped)", ... or "via the host"
    rtt_ms: float | None      # the handshake's, then as the dialing friend reports it
    mbit_s: float | None = None
    reported_at: float | None = None   # when the dialing friend last said how it goes


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
        # a member connected again (its session replaced): the head that follows the friends
        # offers it its stage back, however long it was away (homes.Friends.follow)
        self.on_back = None
        self.on_event = on_event or (lambda text: log.info(text))
        self._joined: asyncio.Queue = asyncio.Queue()
        self.rejected: Counter = Counter()
        self._relayed = 0     # channels through the relay, being set up or in use
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
        self.hops: dict[int, HopLink] = {}          # hop number -> the two friends and its path
        # (src key, dst key) -> how their last hop went and when (friend_hop.hop_plan)
        self._hop_paths: dict[tuple[bytes, bytes], tuple[str, float]] = {}
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
        from engine.wire.punch import PunchError, predict_roles, symmetric_pair

        targets = udp_addresses(r.direct, r.kinds)
        backoff = 1.0
        while any(x.key == r.key for x in self.state.replies()) and self._udp is not None:
            try:
                key = punch_key(self.state.rendezvous_key(r.invite_id))
                # a symmetric NAT on either side: port prediction (punch.py); ours symmetric,
                # our mappings stay open long enough for the joiner's next burst of probes
                role = predict_roles(self._udp.symmetric, symmetric_pair(targets))
                if role is None:
                    ep, peer = self._udp, await self._udp.punch(key, targets, PUNCH_TIMEOUT * 2)
                else:
                    ep, peer = await self._udp.punch_predicting(key, targets, role,
                                                                timeout=PREDICT_REPLY_S if role == "hard"
                                                                else PUNCH_TIMEOUT * 2)
                channel = await ep.quic_accept(peer)
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
        answered, told, since = False, False, time.monotonic()
        while any(x.key == r.key for x in self.state.replies()):     # until revoked or expired
            errors: list[str] = []
            path, url, ws = await _first_to_connect(routes, errors, lambda text: None)
            if ws is None:
                if not answered and time.monotonic() - since > UNANSWERED_REPLY_S:
                    # the joiner has stopped waiting by now (it waits as long): nobody listens there
                    self.on_event(f"reply {r.key}: the joiner never answered in {UNANSWERED_REPLY_S / 60:.0f} "
                                  "minutes: no longer dialled")
                    return
                # said once until it answers again: a joiner gone kept the log a line every few seconds
                (log.debug if told else self.on_event)(
                    f"reply {r.key}: no address of the joiner answers ({'; '.join(errors)[:300]}); "
                    "dialled again now and then")
                told = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            answered, told = True, False
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
                await p.session.close(HOST_STOPPED)
            if p.server:
                p.server.close()
        for t in list(self._tasks):
            t.cancel()

    # -- the relay
    async def _relay_loop(self):
        backoff = 1.0
        url = f"{self.relay_url}/v1/host/{self._relay_listing()}"
        while True:
            try:
                # (a host whose own loop was held keeps its listing: keepalive.py)
                async with connect(url, open_timeout=CONNECT_TIMEOUT, max_size=4096, ping_interval=20,
                                   create_connection=HeartbeatConnection) as ctl:
                    # listed once we prove we hold the key our invites name (relay_auth.py)
                    challenge = json.loads(await asyncio.wait_for(ctl.recv(), CONNECT_TIMEOUT))
                    await ctl.send(json.dumps(prove(self.identity.private, self.pipeline.hex(), challenge)))
                    if json.loads(await asyncio.wait_for(ctl.recv(), CONNECT_TIMEOUT)).get("type") != "registered":
                        raise ValueError("the relay did not list us")
                    self.on_event(f"relay: registered at {self.relay_url}")
                    backoff = 1.0
                    async for text in ctl:
                        try:
                            msg = json.loads(text)
                            sid = str(msg["session"])
                            if msg.get("type") != "incoming" or not sid.isalnum() or len(sid) > 64:
                                continue
                        except (ValueError, KeyError, TypeError, RecursionError):
                            continue
                        if self._relayed >= MAX_RELAYED:
                            # each "incoming" dials the relay back: a hostile relay's flood
                            # would take every file descriptor (stage links, the API) with it
                            self.rejected["too many relayed channels"] += 1
                            continue
                        self._relayed += 1    # counted as it is asked for: a flood comes in one read
                        self._spawn(self._relay_accept(sid))
                    self.on_event(f"relay: control connection closed ({ctl.close_reason or 'no reason'})")
            except asyncio.CancelledError:
                raise
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, asyncio.TimeoutError, ValueError,
                    AttributeError, RecursionError) as exc:   # (a relay's answer that is not a JSON object: AttributeError)
                self.on_event(f"relay: cannot register at {self.relay_url}: {relay_refusal(exc)}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    def _relay_listing(self) -> str:
        """How the relay lists us: the pipeline id and our public key, as invites name them."""
        return f"{self.pipeline.hex()}/{self.identity.public.hex()}"

    async def _relay_accept(self, sid: str):
        url = f"{self.relay_url}/v1/accept/{self._relay_listing()}/{sid}"
        try:
            try:
                ws = await connect(url, open_timeout=CONNECT_TIMEOUT, **WS_OPTIONS)
            except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
                log.warning("relay accept %s failed: %s", sid, exc)
                return
            await self.accept(ws, "relay")
        finally:
            self._relayed -= 1

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
        if mode == MODE_FRIEND:
            raise _Refused("a friend's hop goes to a friend's door, not to the host")
        psk, used_up = None, None
        if mode == MODE_JOIN:
            try:
                psk = self.state.invite_psk(invite_id)
            except InviteError as exc:
                if "used up" not in str(exc):
                    raise _Refused(str(exc)) from None
                # perhaps a member joining with the code again: known once its key is read
                psk, used_up = self.state.invite_psk(invite_id, used_up_ok=True), str(exc)
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
        if mode == MODE_MEMBER or used_up:
            try:
                rec = self.state.check_member(key)
            except InviteError as exc:
                # a stranger with a used-up code hears that; a revoked member, why it is refused
                raise _Refused(str(exc) if "revoked" in str(exc) else (used_up or str(exc))) from None
            if used_up and rec.get("invite") != invite_id.hex():
                raise _Refused(used_up)
        try:
            hello = json.loads(payload or b"{}")
            name = str(hello.get("name", ""))[:64] if isinstance(hello, dict) else ""
            # which of the invite's addresses the joiner came in on (for the status only)
            kind = hello.get("kind") if isinstance(hello, dict) else None
            about = joiner_about(hello.get("about") if isinstance(hello, dict) else None)
        except (ValueError, RecursionError):
            name, kind, about = "", None, {}
        if path == "direct" and kind in ("lan", "mapped", "ipv6", "public"):
            path = f"direct ({kind})"
        await ws.send(b"\x01" + r.write_2(json.dumps({"pipeline": self.pipeline.hex()}).encode()))
        send_key, recv_key = r.keys()
        session = Session(ws, send_key, recv_key, role="host", peer_key=key, path=path, name=name)
        session.about = about
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
            peer = Peer(session.peer_key, session.name,
                        secret=stage_auth.tunnel_stage_secret(self.identity.private, session.peer_key,
                                                                  self.pipeline.hex()))
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
        peer.about = getattr(session, "about", None) or peer.about
        session.on_punch_offer = self._punch_for
        session.on_hop_link = self._hop_reported
        peer.session = session.start()
        self.on_event(f"peer {peer.node_id} ({peer.name or 'unnamed'}) connected via {session.path}")
        if fresh:
            await self._joined.put(peer)
            if self.on_peer:
                self.on_peer(peer)
        elif self.on_back is not None:
            self.on_back(peer)

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
            # a symmetric NAT on one side: port prediction (punch.py); the joiner decides alike
            ep, peer = await ep.punch_either(session.punch_key, theirs, PUNCH_TIMEOUT)
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
        """Stage on `src` -> stage on `dst`, both in other homes. Returns the address the
        stage on `src` should use for its next stage: a loopback port on src's machine
        whose connections go straight to dst's home (the two friends introduced,
        friend_hop.py), or where they find no direct path, through this host inside the
        two tunnels (POTLUCK_FRIEND_HOPS=0: always through the host)."""
        from engine.wire.friend_hop import HopError, NoPath, hop_plan, introduce

        self._hops += 1
        hop = self._hops
        names = f"{src.name or src.node_id} → {dst.name or dst.node_id}"
        await self._end_hops_from(src.key)     # a stage has one next stage: the old hop is over
        t0 = time.monotonic()
        last, when = self._hop_paths.get((src.key, dst.key), (None, 0.0))
        plan = hop_plan(last, t0 - when)
        if os.environ.get("POTLUCK_FRIEND_HOPS", "1") != "0" and plan != "host":
            try:
                got = await introduce(src.session, dst.session, hop, punch_only=plan == "punch")
                self.hops[hop] = HopLink(src.key, dst.key, names, got["path"], got["rtt_ms"])
                self._hop_paths[(src.key, dst.key)] = (got["path"], time.monotonic())
                self.on_event(f"{names}: {got['path']}, {got['rtt_ms']:.0f} ms "
                              f"(set up in {time.monotonic() - t0:.1f} s{', punched at once' if plan == 'punch' else ''})")
                return f"ws://127.0.0.1:{got['port']}"
            except (HopError, asyncio.TimeoutError, ConnectionClosed, OSError) as exc:
                self.on_event(f"{names}: no direct path ({exc or type(exc).__name__}) after "
                              f"{time.monotonic() - t0:.1f} s; through this computer")
                if isinstance(exc, NoPath) and plan == "full":
                    self._hop_paths[(src.key, dst.key)] = ("via the host", time.monotonic())
                else:   # a friend gone quiet mid-introduction, or punching alone failed: next time, every way
                    self._hop_paths.pop((src.key, dst.key), None)
        elif plan == "host":
            self.on_event(f"{names}: through this computer, as the last time (no direct path then)")
        port = await src.session.request_listener(hop, ("127.0.0.1", dst.port))
        self.hops[hop] = HopLink(src.key, dst.key, names, "via the host", None)
        return f"ws://127.0.0.1:{port}"

    def _hop_reported(self, session: Session, msg: dict) -> None:
        """A friend says how a hop it dialed is doing. Only the friend at the hop's start
        speaks for it; a report for a hop already over (it crossed the end) is dropped."""
        h = self.hops.get(msg["hop"])
        if h is None or h.src != session.peer_key or h.path == "via the host":
            return
        if msg["rtt_ms"] is not None:
            h.rtt_ms = msg["rtt_ms"]
        h.mbit_s, h.reported_at = msg["mbit_s"], time.monotonic()

    def hop_links(self) -> list[dict]:
        """Each hop between two friends: who, its path, round trip and goodput, and
        whether those are live (reported within the last few HOP_REPORT_S) or still the
        handshake's (for the status)."""
        from engine.wire.friend_hop import HOP_REPORT_S

        def live(key: bytes) -> bool:
            p = self.peers.get(key)
            return p is not None and p.session is not None and not p.session.closed.is_set()

        now = time.monotonic()
        return [{"hop": f"{h.names}", "path": h.path, "rtt_ms": h.rtt_ms, "mbit_s": h.mbit_s,
                 "live": h.reported_at is not None and now - h.reported_at <= 3 * HOP_REPORT_S}
                for h in self.hops.values() if live(h.src) and live(h.dst)]

    async def _end_hops_from(self, key: bytes):
        from engine.wire.friend_hop import end

        for hop, h in list(self.hops.items()):
            if h.src == key:
                del self.hops[hop]
                src = self.peers.get(h.src)
                if h.path == "via the host" and src is not None and src.session is not None:
                    src.session.targets.pop(hop, None)     # its streams through here are over
                for k in (h.src, h.dst):
                    p = self.peers.get(k)
                    if h.path != "via the host" and p is not None and p.session is not None \
                            and not p.session.closed.is_set():
                        await end(p.session, hop)

    async def _end_hops_of(self, key: bytes):
        """A friend revoked: the friends it was introduced to hear that those hops are over."""
        from engine.wire.friend_hop import end

        for hop, h in list(self.hops.items()):
            if key in (h.src, h.dst):
                del self.hops[hop]
                other = self.peers.get(h.dst if key == h.src else h.src)
                if other is not None and other.session is not None and not other.session.closed.is_set():
                    await end(other.session, hop)

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
                        await self._end_hops_of(key)
            self._dial_replies()          # `potluck invites --reply CODE` from another terminal


class _Refused(Exception):
    pass
