"""Direct paths through two home routers: UDP hole punching, then QUIC on the punched socket.

Two homes behind NATs that map endpoint-independently (most home routers; plain Linux
MASQUERADE) can reach each other with no port mapping and no server of their own, if
both send first: each side's outgoing packet opens its own router for the other's
answer. The exchange of addresses needs a channel the two already share: a relayed
tunnel session (engine/wire/tunnel.py, inner frame PUNCH), end-to-end encrypted, so the
relay learns nothing it did not know.

    ep = await UdpEndpoint.open()
    mine = await ep.candidates(stun_servers)      # LAN addresses + the STUN-mapped one
    ... exchange candidates over the session ...
    peer = await ep.punch(key, theirs, timeout)   # both sides at once
    channel = await (ep.quic_connect(peer) if joiner else ep.quic_accept(peer))
    await channel.send(b"..."); await channel.recv()

What goes over the punched path is QUIC (aioquic, sans-I/O: this module owns the socket
and the timers): reliable, ordered, congestion-controlled, which the tunnel's frames
need, on the one UDP socket whose mapping was punched. QUIC's own TLS is keyed by a
throwaway certificate and authenticates nobody; the tunnel proves the session's keys
over the channel before anything moves onto it (TunnelHost._resume), and every frame
on it is sealed with the session's ciphers anyway.

Punch packets are MAC'd with a key derived from the session (PunchCodec): a stranger
who guesses the port cannot make either side pick its address.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import struct
from collections import deque

PUNCH_MAGIC = b"PLPU"
_PUNCH = struct.Struct("<4sB8s16s")      # magic | flags (1: answer) | nonce | mac
PUNCH_INTERVAL = 0.05                    # seconds between rounds of punch packets
PUNCH_ROUNDS_AFTER = 20                  # rounds still sent once the peer is heard (its NAT may lag)
CHOICE_COPIES = 3                        # answers sent to the path chosen, at once
MAX_TARGETS = 8                          # candidates of the peer punched at, at most
ALPN = "potluck-tunnel/1"
# one message on the channel: a tunnel frame (engine/wire/tunnel.py MAX_MESSAGE) and its
# cipher overhead; anything longer is a protocol error and closes the connection
MAX_MESSAGE = (64 << 10) + 1024
SEND_BUFFER = 1 << 20        # bytes sent but not acknowledged before send() waits
RECV_BUFFER = 4 << 20        # bytes received but not read before incoming packets are dropped
_LEN = struct.Struct("<I")


class PunchError(ConnectionError):
    """No direct UDP path opened (or the QUIC connection on it failed); str() says why."""


def punch_key(session_secret: bytes) -> bytes:
    return hmac.new(session_secret, b"potluck punch", hashlib.sha256).digest()


class PunchCodec:
    """Punch packets under a key both sides derive from their session."""

    def __init__(self, key: bytes):
        self.key = key

    def make(self, answer: bool) -> bytes:
        nonce = os.urandom(8)
        flags = 1 if answer else 0
        return _PUNCH.pack(PUNCH_MAGIC, flags, nonce, self._mac(flags, nonce))

    def check(self, data: bytes) -> bool | None:
        """Whether a valid packet is an answer; None for anything that is not ours."""
        if len(data) != _PUNCH.size or data[:4] != PUNCH_MAGIC:
            return None
        _, flags, nonce, mac = _PUNCH.unpack(data)
        if flags > 1 or not hmac.compare_digest(mac, self._mac(flags, nonce)):
            return None
        return bool(flags)

    def _mac(self, flags: int, nonce: bytes) -> bytes:
        return hmac.new(self.key, bytes([flags]) + nonce, hashlib.sha256).digest()[:16]


# Port prediction (the "birthday" punch) toward a NAT that maps every destination anew
# (symmetric): its side opens HARD_SOCKETS sockets, each punching at the other side's
# one mapped address, so its router holds that many mappings on random ports; the other
# side (its mapping endpoint-independent) sprays the symmetric side's public address at
# random ports. A probe that lands on one of those mappings is a reply to it for the
# symmetric router, and the path opens both ways. With 256 mappings and 1024 probes over
# the ~64k ports a router picks from, 98 tries in 100 meet (512 probes: 87 in 100); a
# pair of symmetric NATs is given up at once (their odds are nil).
HARD_SOCKETS = 256
SPRAY_PROBES = 1024
SPRAY_PER_ROUND = 32
PREDICT_S = 4.0
EPHEMERAL = (1024, 65535)


def spray_ports(rng, count: int, avoid: set[int] = frozenset()) -> list[int]:
    """`count` distinct random ports a NAT might map to, none of `avoid`."""
    out: set[int] = set()
    while len(out) < count:
        p = rng.randint(*EPHEMERAL)
        if p not in avoid:
            out.add(p)
    return list(out)


def symmetric_pair(cands: list[tuple[str, int]]) -> bool:
    """Whether a peer's candidates show a symmetric NAT: the two STUN-mapped addresses it
    lists first (UdpEndpoint.candidates) share a public address at different ports."""
    public = [(a, p) for a, p in cands if ipaddress.ip_address(a).is_global]
    return len(public) >= 2 and public[0][0] == public[1][0] and public[0][1] != public[1][1]


def predict_roles(mine_symmetric: bool, theirs_symmetric: bool) -> str | None:
    """'hard' (open many sockets), 'easy' (spray), None (plain punching), or raise
    PunchError when both sides map per destination."""
    if mine_symmetric and theirs_symmetric:
        raise PunchError("both homes' routers map every destination anew (symmetric NATs): no hole can be "
                         "punched between them; a port mapping (UPnP or PCP) on either router, or the "
                         "host's machine, carries the hop")
    if mine_symmetric:
        return "hard"
    if theirs_symmetric:
        return "easy"
    return None


class Puncher:
    """Sans-I/O: which packets to send when, and which of the peer's addresses works.

    Every PUNCH_INTERVAL a packet goes to each candidate of the peer. The first valid
    packet from the peer (from whatever address: its NAT may show another port than it
    thinks) names the path; since it crossed our router, ours have crossed its router
    (both NATs filter on the exact remote), so the path works both ways. We answer on it,
    and go on sending there for a few rounds for the peer's sake.

    The answers to that first packet also say which path we chose: port prediction's
    hard side punches from many sockets, and several of their mappings may be met, so a
    socket there (`chosen_only`) is done only once the peer answered it, never after
    rounds alone; else the two sides could pick different paths and QUIC would knock on
    a closed socket."""

    def __init__(self, key: bytes, targets: list[tuple[str, int]], spray: list[tuple[str, int]] = (),
                 chosen_only: bool = False):
        self.codec = PunchCodec(key)
        self.chosen_only = chosen_only
        self.targets = list(dict.fromkeys(targets))[:MAX_TARGETS]
        # port prediction's probes (the easy side toward a symmetric NAT): a few a round,
        # each address once, beside the targets
        self.spray = list(spray)[:SPRAY_PROBES]
        self.peer: tuple[str, int] | None = None
        self.answered = False           # the peer has heard us (it answered)
        self._rounds_left = PUNCH_ROUNDS_AFTER

    def round(self) -> list[tuple[bytes, tuple[str, int]]]:
        """The packets of one round (call every PUNCH_INTERVAL until done)."""
        if self.peer is not None:
            self._rounds_left -= 1
            return [(self.codec.make(answer=True), self.peer)]
        probes, self.spray = self.spray[:SPRAY_PER_ROUND], self.spray[SPRAY_PER_ROUND:]
        return [(self.codec.make(answer=False), t) for t in self.targets + probes]

    @property
    def done(self) -> bool:
        return self.peer is not None and (self.answered or (not self.chosen_only and self._rounds_left <= 0))

    def receive(self, data: bytes, addr: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]] | None:
        """None when `data` is no punch packet of this session; else the packets to send
        in reply (an answer to the first one heard)."""
        kind = self.codec.check(data)
        if kind is None:
            return None
        addr = tuple(addr[:2])
        if self.peer is None:
            # the choice: answered whatever this packet was, a few times (UDP may lose one)
            self.peer, self.answered = addr, kind
            return [(self.codec.make(answer=True), addr)] * CHOICE_COPIES
        if addr != self.peer:
            return []                    # another of its candidates got through too: one path is enough
        self.answered = self.answered or kind
        return [] if kind else [(self.codec.make(answer=True), addr)]


def udp_candidates(port: int, addresses: list[str], mapped: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Where the peer should punch at: the STUN-mapped addresses first (across homes), then
    this machine's own IPv4 addresses (the same home), never loopback or link-local."""
    out = [tuple(m) for m in mapped]
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a.split("%")[0])
        except ValueError:
            continue
        if ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            out.append((str(ip), port))
    return list(dict.fromkeys(out))[:MAX_TARGETS]


def parse_candidates(value) -> list[tuple[str, int]]:
    """A peer's candidate list off the wire (JSON): [[address, port], ...], checked."""
    if not isinstance(value, list):
        raise ValueError("candidates must be a list")
    out = []
    for item in value[:MAX_TARGETS]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and 0 < item[1] < 65536):
            raise ValueError("a candidate is [address, port]")
        ip = ipaddress.ip_address(item[0])        # ValueError for names: never resolved
        if ip.version != 4 or ip.is_multicast or ip.is_unspecified or ip.is_loopback:
            raise ValueError(f"not a candidate address: {item[0]}")
        out.append((str(ip), item[1]))
    return out


def _throwaway_certificate():
    """QUIC's TLS needs a server certificate; nobody checks this one (see the docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "potluck")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=7))
            .sign(key, hashes.SHA256()))
    return cert, key


def _configuration(is_client: bool):
    from aioquic.quic.configuration import QuicConfiguration

    cfg = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN], idle_timeout=60.0,
                            congestion_control_algorithm="cubic", max_datagram_size=1350,
                            max_data=8 << 20, max_stream_data=4 << 20)
    if is_client:
        cfg.verify_mode = ssl.CERT_NONE
        cfg.server_name = "potluck"
    else:
        cfg.certificate, cfg.private_key = _throwaway_certificate()
    return cfg


def _unacked(conn, stream_id: int) -> int:
    """Bytes of a stream written but not yet acknowledged by the peer: aioquic keeps them in
    the stream's send buffer (a private field; aioquic is pinned below 2)."""
    stream = conn._streams.get(stream_id)
    return len(stream.sender._buffer) if stream is not None else 0


class UdpEndpoint(asyncio.DatagramProtocol):
    """One UDP socket: STUN queries, hole punching, QUIC connections (one per peer address).

    exclusive: the socket serves one connection and closes with it (a relayed session's
    punch); else it lives on for more peers (a host's rendezvous socket, whose mapped
    address is in its invites) and keeps its NAT mapping open (keepalive)."""

    def __init__(self, exclusive: bool = True):
        self.exclusive = exclusive
        self.transport = None
        self._stun: asyncio.Queue | None = None
        self._punchers: list[Puncher] = []
        self._heard = asyncio.Event()
        self._channels: dict[tuple[str, int], QuicChannel] = {}
        self._accepting: dict[tuple[str, int], asyncio.Future] = {}
        self._keepalive: asyncio.Task | None = None
        self.mapped: list[tuple[str, int]] = []

    @classmethod
    async def open(cls, host: str = "0.0.0.0", port: int = 0, exclusive: bool = True) -> "UdpEndpoint":
        loop = asyncio.get_running_loop()
        _, ep = await loop.create_datagram_endpoint(lambda: cls(exclusive), local_addr=(host, port),
                                                    family=socket.AF_INET)
        return ep

    def keep_mapping(self, server: tuple[str, int], interval: float = 20.0):
        """Refresh this socket's NAT mapping by asking `server` (STUN) every `interval`
        seconds: home routers forget an idle UDP mapping after 30 s to a few minutes."""
        async def loop():
            from engine.wire import stun

            infos = await asyncio.get_running_loop().getaddrinfo(*server, family=socket.AF_INET,
                                                                 type=socket.SOCK_DGRAM)
            while True:
                self.sendto(stun.request()[0], infos[0][4][:2])
                await asyncio.sleep(interval)

        if self._keepalive is None:
            self._keepalive = asyncio.ensure_future(loop())

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1]

    def connection_made(self, transport):
        self.transport = transport

    def error_received(self, exc):
        pass          # ICMP for one candidate (another home's private address): others go on

    def close(self):
        if self._keepalive is not None:
            self._keepalive.cancel()
        for ch in list(self._channels.values()):
            ch._terminate("endpoint closed")
        for fut in self._accepting.values():
            if not fut.done():
                fut.cancel()
        if self.transport is not None:
            self.transport.close()

    def _forget(self, channel: "QuicChannel"):
        if self._channels.get(channel.peer) is channel:
            del self._channels[channel.peer]
        if self.exclusive and self.transport is not None:
            # the CONNECTION_CLOSE is on its way; the socket closes a moment later
            asyncio.get_running_loop().call_later(0.2, self.transport.close)

    def sendto(self, data: bytes, addr):
        try:
            self.transport.sendto(data, addr)
        except OSError:
            pass

    def datagram_received(self, data: bytes, addr):
        peer = tuple(addr[:2])
        if data[:4] == PUNCH_MAGIC:
            # the peer's last punch rounds may still come after QUIC began: never QUIC's
            for p in self._punchers:
                out = p.receive(data, peer)
                if out is not None:
                    for packet, to in out:
                        self.sendto(packet, to)
                    self._heard.set()
                    break
            return
        ch = self._channels.get(peer)
        if ch is not None:
            ch._datagram(data, addr)
            return
        if self._stun is not None and len(data) >= 20 and data[4:8] == b"\x21\x12\xa4\x42":
            self._stun.put_nowait((data, addr))
            return
        fut = self._accepting.get(peer)
        if fut is not None and not fut.done():
            self._start_server(data, peer, fut)

    # -- STUN
    async def candidates(self, servers: list[tuple[str, int]], timeout: float = 2.0) -> list[tuple[str, int]]:
        """Where the peer may reach this socket: its STUN-mapped address(es), its LAN ones."""
        from engine.wire import stun
        from engine.wire.candidates import interface_addresses

        mapped = []
        if servers:
            self._stun = asyncio.Queue()
            try:
                _, seen = await stun.query(servers, timeout=timeout, transport=self.transport, answers=self._stun)
            finally:
                self._stun = None
            mapped = [m.address for m in seen]
        self.mapped = list(dict.fromkeys(tuple(m) for m in mapped))     # what the internet sees
        return udp_candidates(self.port, interface_addresses(), mapped)

    # -- punching
    async def punch(self, key: bytes, targets: list[tuple[str, int]], timeout: float | None,
                    interval: float = PUNCH_INTERVAL, chosen_only: bool = False) -> tuple[str, int]:
        """Punch at the peer's candidates until a packet of its comes back (PunchError after
        `timeout`; None: until cancelled); returns the address it came from. `interval`:
        between rounds until then (a side that waits for its peer to start keeps its own
        router open with a round a second). chosen_only: see Puncher."""
        if not targets:
            raise PunchError("the peer has no address to punch at")
        p = Puncher(key, targets, chosen_only=chosen_only)
        self._punchers.append(p)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while not p.done:
                for packet, to in p.round():
                    self.sendto(packet, to)
                if deadline is not None and loop.time() > deadline:
                    if p.peer is None:
                        raise PunchError(f"no answer from any of {len(p.targets)} address(es) within {timeout:g} s "
                                         "(a symmetric NAT, or a firewall that drops them)")
                    if p.chosen_only:
                        raise PunchError(f"heard, but the peer chose another path within {timeout:g} s")
                self._heard.clear()
                try:
                    await asyncio.wait_for(self._heard.wait(), interval if p.peer is None else PUNCH_INTERVAL)
                except asyncio.TimeoutError:
                    pass
            return p.peer
        finally:
            self._punchers.remove(p)

    @property
    def symmetric(self) -> bool:
        """Whether two STUN servers saw this socket at different ports: a router that maps
        every destination anew (candidates() asked them)."""
        return len({p for _, p in self.mapped}) > 1

    async def punch_either(self, key: bytes, theirs: list[tuple[str, int]], timeout: float,
                           theirs_symmetric: bool | None = None) -> tuple["UdpEndpoint", tuple[str, int]]:
        """Plain punching, or port prediction where one side's NAT is symmetric (ours from
        STUN, theirs said or read off its candidates; both: PunchError at once). Returns the
        endpoint that got through (this one, or one of prediction's, and then this one is
        closed: an exclusive socket's job is done) and the peer's address."""
        if theirs_symmetric is None:
            theirs_symmetric = symmetric_pair(theirs)
        role = predict_roles(self.symmetric, theirs_symmetric)
        if role is None:
            return self, await self.punch(key, theirs, timeout)
        used, peer = await self.punch_predicting(key, theirs, role)
        if used is not self:
            self.close()
        return used, peer

    async def punch_predicting(self, key: bytes, targets: list[tuple[str, int]], role: str,
                               timeout: float | None = PREDICT_S,
                               interval: float = 0.5) -> tuple["UdpEndpoint", tuple[str, int]]:
        """Port prediction, `role` from predict_roles: "easy" punches the targets from this
        socket and sprays the symmetric side's public address at random ports; "hard"
        punches the targets from HARD_SOCKETS fresh sockets, keeps the one the peer's
        probe reaches and closes the rest. Returns (the endpoint that got through, the
        peer's address); PunchError within `timeout` when none did."""
        import random

        if role == "easy":
            publics = sorted({a for a, _ in targets if ipaddress.ip_address(a).is_global})
            if not publics:
                raise PunchError("port prediction needs the other side's public address")
            rng = random.Random(os.urandom(8))
            spray = [(publics[0], p) for p in spray_ports(rng, SPRAY_PROBES, {p for _, p in targets})]
            p = Puncher(key, targets, spray)
            return self, await self._punch_with(p, timeout)
        extra: list[UdpEndpoint] = []
        try:
            for _ in range(HARD_SOCKETS):
                extra.append(await UdpEndpoint.open())
        except OSError:
            pass                   # fewer sockets (a descriptor limit): worse odds, same way
        # each socket punches every `interval` (a side that waits long for the other keeps
        # its many mappings open with a packet each every few seconds)
        tasks = {asyncio.ensure_future(ep.punch(key, targets, timeout, interval=interval, chosen_only=True)): ep
                 for ep in [self] + extra}
        winner = None
        try:
            pending = set(tasks)
            while pending and winner is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if not t.cancelled() and t.exception() is None and winner is None:
                        winner = (tasks[t], t.result())
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t, ep in tasks.items():
                if ep is not self and (winner is None or ep is not winner[0]):
                    ep.close()
        if winner is None:
            raise PunchError(f"port prediction: none of {len(tasks)} mappings was met"
                             + (f" within {timeout:g} s" if timeout else ""))
        return winner

    async def _punch_with(self, p: "Puncher", timeout: float) -> tuple[str, int]:
        self._punchers.append(p)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while not p.done:
                for packet, to in p.round():
                    self.sendto(packet, to)
                if p.peer is None and loop.time() > deadline:
                    raise PunchError(f"port prediction: no probe met a mapping within {timeout:g} s")
                self._heard.clear()
                try:
                    await asyncio.wait_for(self._heard.wait(), PUNCH_INTERVAL)
                except asyncio.TimeoutError:
                    pass
            return p.peer
        finally:
            self._punchers.remove(p)

    # -- QUIC
    async def quic_connect(self, peer: tuple[str, int], timeout: float = 10.0) -> "QuicChannel":
        from aioquic.quic.connection import QuicConnection

        peer = tuple(peer)
        old = self._channels.get(peer)
        if old is not None:
            old._terminate("replaced by a new connection")
        conn = QuicConnection(configuration=_configuration(is_client=True))
        channel = self._channels[peer] = QuicChannel(self, conn, peer, stream_id=0)
        conn.connect(peer, now=asyncio.get_running_loop().time())
        channel._transmit()
        await channel._established(timeout)
        return channel

    async def quic_accept(self, peer: tuple[str, int], timeout: float = 10.0) -> "QuicChannel":
        """Wait for the peer's QUIC connection (only from the punched address)."""
        peer = tuple(peer)
        old = self._channels.get(peer)
        if old is not None:
            old._terminate("replaced by a new connection")
        fut = self._accepting[peer] = asyncio.get_running_loop().create_future()
        try:
            channel = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise PunchError(f"no QUIC connection came from {peer[0]}:{peer[1]} within {timeout:g} s") from None
        finally:
            if self._accepting.get(peer) is fut:
                del self._accepting[peer]
        await channel._established(timeout)
        return channel

    def _start_server(self, data: bytes, addr, fut: asyncio.Future):
        from aioquic.buffer import Buffer
        from aioquic.quic.connection import QuicConnection
        from aioquic.quic.packet import pull_quic_header

        cfg = _configuration(is_client=False)
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=cfg.connection_id_length)
        except ValueError:
            return
        if header.packet_type is None or getattr(header.packet_type, "name", "") != "INITIAL":
            return
        conn = QuicConnection(configuration=cfg, original_destination_connection_id=header.destination_cid)
        channel = self._channels[addr] = QuicChannel(self, conn, addr, stream_id=0)
        channel._datagram(data, addr)
        fut.set_result(channel)


class QuicChannel:
    """A message channel on one QUIC stream, with a WebSocket's send/recv/close, so a tunnel
    Session can move onto it: each message is a u32 length and its bytes."""

    def __init__(self, endpoint: UdpEndpoint, conn, peer: tuple[str, int], stream_id: int):
        self.endpoint, self.conn, self.peer, self.stream_id = endpoint, conn, peer, stream_id
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._handshake = asyncio.Event()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._rx = bytearray()
        self._messages: deque = deque()
        self._queued = 0
        self.closed = False
        self.close_reason = ""

    # -- the WebSocket-like face
    async def send(self, data: bytes):
        if len(data) > MAX_MESSAGE:
            raise ValueError("message too long for the channel")
        while not self.closed and _unacked(self.conn, self.stream_id) > SEND_BUFFER:
            self._writable.clear()
            await self._writable.wait()
        if self.closed:
            raise ConnectionError(f"channel closed ({self.close_reason})")
        self.conn.send_stream_data(self.stream_id, _LEN.pack(len(data)) + bytes(data))
        self._transmit()

    async def recv(self) -> bytes:
        while not self._messages:
            if self.closed:
                raise ConnectionError(f"channel closed ({self.close_reason})")
            self._readable.clear()
            await self._readable.wait()
        data = self._messages.popleft()
        self._queued -= len(data)
        return data

    async def close(self, code: int = 1000, reason: str = ""):
        if not self.closed:
            self.conn.close(error_code=0 if code == 1000 else 0x100, reason_phrase=reason[:100])
            self._transmit()
            self._terminate(reason or "closed")

    # -- the engine underneath
    async def _established(self, timeout: float):
        try:
            await asyncio.wait_for(self._handshake.wait(), timeout)
        except asyncio.TimeoutError:
            self._terminate("handshake timed out")
            raise PunchError(f"the QUIC handshake with {self.peer[0]}:{self.peer[1]} timed out") from None
        if self.closed:
            raise PunchError(f"the QUIC handshake failed ({self.close_reason})")

    def _datagram(self, data: bytes, addr):
        if self.closed:
            return
        if self._queued > RECV_BUFFER:
            # the reader is behind: drop, as a full router queue would; QUIC's congestion
            # control slows the sender and resends (aioquic's flow-control windows grow
            # with what arrives, not with what we read, so they cannot bound this)
            return
        self.conn.receive_datagram(data, addr, now=self._loop.time())
        self._events()
        self._transmit()

    def _events(self):
        from aioquic.quic import events

        while (ev := self.conn.next_event()) is not None:
            if isinstance(ev, events.HandshakeCompleted):
                self._handshake.set()
            elif isinstance(ev, events.StreamDataReceived) and ev.stream_id == self.stream_id:
                self._rx += ev.data
                self._split()
                if ev.end_stream:
                    self._terminate("the peer ended the stream")
            elif isinstance(ev, events.ConnectionTerminated):
                self._terminate(ev.reason_phrase or f"terminated (error {ev.error_code})")
        self._writable.set()         # acknowledgements may have come: senders look again

    def _split(self):
        while len(self._rx) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._rx)
            if n > MAX_MESSAGE:
                self.conn.close(error_code=0x101, reason_phrase="message too long")
                self._terminate("the peer sent a message over the limit")
                return
            if len(self._rx) < _LEN.size + n:
                return
            msg = bytes(self._rx[_LEN.size:_LEN.size + n])
            del self._rx[:_LEN.size + n]
            self._messages.append(msg)
            self._queued += len(msg)
            self._readable.set()

    def _transmit(self):
        now = self._loop.time()
        for data, addr in self.conn.datagrams_to_send(now=now):
            self.endpoint.sendto(data, addr)
        at = self.conn.get_timer()
        if self._timer is not None and self._timer_at != at:
            self._timer.cancel()
            self._timer = None
        if at is not None and self._timer is None and not self.closed:
            self._timer_at = at
            self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self):
        self._timer = None
        self.conn.handle_timer(now=self._loop.time())
        self._events()
        self._transmit()

    def _terminate(self, reason: str):
        if self.closed:
            return
        self.closed, self.close_reason = True, reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for ev in (self._handshake, self._readable, self._writable):
            ev.set()
        self.endpoint._forget(self)
