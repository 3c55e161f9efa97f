"""STUN (RFC 8489) Binding: what address a NAT shows the internet, and how it maps.

Sans-I/O: `request()` builds a Binding request, `parse_response()` reads the answer
(XOR-MAPPED-ADDRESS, or MAPPED-ADDRESS from old servers), `nat_behaviour()` classifies
a NAT from the mapped addresses two servers saw for one local socket. `query()` is the
thin asyncio layer: one UDP socket, one request per server, retransmitted.

Only the Binding method, without authentication or FINGERPRINT: the answer tells where
our packets appear to come from, which is all a candidate needs, and a forged answer
can only make us advertise an address that does not work (the tunnel's Noise handshake
authenticates whoever answers there).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

MAGIC = 0x2112A442
BINDING_REQUEST = 0x0001
BINDING_SUCCESS = 0x0101
MAPPED_ADDRESS = 0x0001
XOR_MAPPED_ADDRESS = 0x0020
HEADER = struct.Struct("!HHI12s")
MAX_MESSAGE = 1280
# public STUN servers answering Binding on UDP 3478 (configurable: POTLUCK_STUN, comma-separated)
DEFAULT_SERVERS = ("stun.l.google.com:19302", "stun.cloudflare.com:3478", "stun.nextcloud.com:3478")


class StunError(ValueError):
    pass


@dataclass(frozen=True)
class Mapped:
    server: tuple[str, int]       # whom we asked
    address: tuple[str, int]      # where our packets came from, as it saw them


def request(txid: bytes | None = None) -> tuple[bytes, bytes]:
    """(a Binding request, its transaction id)."""
    txid = txid or os.urandom(12)
    return HEADER.pack(BINDING_REQUEST, 0, MAGIC, txid), txid


def parse_response(data: bytes, txid: bytes) -> tuple[str, int]:
    """The mapped (address, port) in a Binding success answering `txid`, or StunError."""
    if len(data) < HEADER.size or len(data) > MAX_MESSAGE:
        raise StunError("not a STUN message (size)")
    mtype, length, magic, got = HEADER.unpack_from(data)
    if magic != MAGIC or got != txid:
        raise StunError("not an answer to our request")
    if mtype != BINDING_SUCCESS:
        raise StunError(f"the server answered message type {mtype:#06x}, not a Binding success")
    if HEADER.size + length != len(data) or length % 4:
        raise StunError("STUN message length does not match")
    pos, plain = HEADER.size, None
    while pos + 4 <= len(data):
        atype, alen = struct.unpack_from("!HH", data, pos)
        value = data[pos + 4: pos + 4 + alen]
        if len(value) != alen:
            raise StunError("STUN attribute runs past the message")
        if atype == XOR_MAPPED_ADDRESS:
            return _address(value, xor=txid)
        if atype == MAPPED_ADDRESS and plain is None:
            plain = _address(value, xor=None)
        pos += 4 + alen + (-alen % 4)
    if plain is None:
        raise StunError("the answer carries no mapped address")
    return plain


def _address(value: bytes, xor: bytes | None) -> tuple[str, int]:
    if len(value) < 4:
        raise StunError("mapped address too short")
    family, port = value[1], struct.unpack_from("!H", value, 2)[0]
    raw = value[4:]
    if family == 1 and len(raw) == 4:
        pass
    elif family == 2 and len(raw) == 16:
        pass
    else:
        raise StunError(f"mapped address of unknown family {family} or size {len(raw)}")
    if xor is not None:
        port ^= MAGIC >> 16
        key = struct.pack("!I", MAGIC) + xor
        raw = bytes(b ^ k for b, k in zip(raw, key))
    return str(ipaddress.ip_address(raw)), port


def nat_behaviour(local: tuple[str, int], seen: list[Mapped]) -> str:
    """How this socket's NAT maps, from what several servers saw:
    "open" (the address is our own: no NAT), "endpoint-independent" (every server saw the
    same address and port: a peer may reach that mapping too, so hole punching works),
    "symmetric" (another port per destination: punching cannot guess it), "unknown"
    (fewer than two answers)."""
    if not seen:
        return "unknown"
    addrs = {m.address for m in seen}
    if any(m.address == local or (m.address[1] == local[1] and _is_own(m.address[0])) for m in seen):
        return "open"
    if len(seen) < 2:
        return "unknown"
    return "endpoint-independent" if len(addrs) == 1 else "symmetric"


def _is_own(address: str) -> bool:
    try:
        import psutil

        return any(a.address.split("%")[0] == address for addrs in psutil.net_if_addrs().values() for a in addrs)
    except Exception:   # noqa: BLE001 -- a best guess; no psutil means no claim
        return False


def servers_from_env() -> list[tuple[str, int]]:
    text = os.environ.get("POTLUCK_STUN")
    names = [s.strip() for s in text.split(",")] if text is not None else list(DEFAULT_SERVERS)
    out = []
    for name in names:
        if not name:
            continue
        host, _, port = name.rpartition(":")
        out.append((host.strip("[]"), int(port)) if host and port.isdigit() else (name, 3478))
    return out


class _Proto(asyncio.DatagramProtocol):
    def __init__(self):
        self.answers: asyncio.Queue = asyncio.Queue()

    def datagram_received(self, data, addr):
        self.answers.put_nowait((data, addr))


async def query(servers: list[tuple[str, int]], *, local_port: int = 0, timeout: float = 2.0,
                tries: int = 3, transport=None, answers: asyncio.Queue | None = None
                ) -> tuple[tuple[str, int], list[Mapped]]:
    """Ask each server (from one UDP socket) where we appear to come from. Returns (our
    local address, the answers that came), never raises for servers that do not answer.
    With `transport` and `answers` (the (data, addr) that socket receives), asks from a
    socket the caller owns and keeps open: hole punching needs the mapping of the very
    socket it punches from (engine/wire/punch.py)."""
    loop = asyncio.get_running_loop()
    own = transport is None
    if own:
        transport, proto = await loop.create_datagram_endpoint(_Proto, local_addr=("0.0.0.0", local_port),
                                                               family=socket.AF_INET)
        answers = proto.answers
    try:
        local = transport.get_extra_info("sockname")[:2]
        pending: dict[bytes, tuple[str, int]] = {}
        targets: dict[bytes, tuple[str, int]] = {}
        async def resolve(host, port):
            try:
                return await asyncio.wait_for(loop.getaddrinfo(host, port, family=socket.AF_INET,
                                                               type=socket.SOCK_DGRAM), timeout)
            except (OSError, asyncio.TimeoutError):
                return None

        # names resolved at once, not one after another: a dead resolver costs one timeout
        for (host, port), infos in zip(servers, await asyncio.gather(*(resolve(h, p) for h, p in servers))):
            if not infos:
                continue
            msg, txid = request()
            pending[txid] = (host, port)
            targets[txid] = infos[0][4][:2]
        seen: list[Mapped] = []
        start = loop.time()
        for attempt in range(tries):
            for txid in pending:
                transport.sendto(HEADER.pack(BINDING_REQUEST, 0, MAGIC, txid), targets[txid])
            deadline = start + timeout / tries * (attempt + 1)     # all of it within `timeout`
            while pending and loop.time() < deadline:
                try:
                    data, _ = await asyncio.wait_for(answers.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                for txid in list(pending):
                    try:
                        seen.append(Mapped(pending[txid], parse_response(data, txid)))
                    except StunError:
                        continue
                    del pending[txid]
                    break
            if not pending:
                break
        if local[0] == "0.0.0.0":
            local = (_route_source(), local[1])
        return local, seen
    finally:
        if own:
            transport.close()


def _route_source() -> str:
    """The address this machine sends from toward the internet (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return "0.0.0.0"
