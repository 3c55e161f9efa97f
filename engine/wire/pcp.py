"""PCP (RFC 6887): a port mapping asked of routers (and some carrier-grade NATs) that speak
the Port Control Protocol, NAT-PMP's successor, where UPnP-IGD is off or absent.

Sans-I/O: `map_request()` and `parse_map_response()`; the thin asyncio layer `ask()`
sends one MAP request to the gateway's UDP port 5351 (the port NAT-PMP uses: a router
that speaks only NAT-PMP answers a PCP request with "unsupported version", which
`ask` reports as such) with the RFC's retransmissions.

A MAP request names the client's own address (the one the gateway sees it from:
`client_address()`), the protocol and internal port, and a random 12-byte nonce that
every renewal and the deletion (lifetime 0) repeat: the router ties the mapping to it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

PORT = 5351
VERSION = 2
MAP = 1
TCP, UDP = 6, 17
RESULTS = {0: "success", 1: "unsupported version", 2: "not authorized", 3: "malformed request",
           4: "unsupported opcode", 5: "unsupported option", 6: "malformed option", 7: "network failure",
           8: "no resources", 9: "unsupported protocol", 10: "user exceeded quota",
           11: "cannot provide the external address", 12: "address mismatch", 13: "excessive remote peers"}
_HEADER = struct.Struct("!BBHI16s")          # version, R|opcode, reserved, lifetime, client address
_MAP = struct.Struct("!12sB3xHH16s")         # nonce, protocol, internal port, external port, external address
_ANSWER = struct.Struct("!BBBBII12x")        # version, R|opcode, reserved, result, lifetime, epoch


class PcpError(ValueError):
    pass


def _v6(address: str) -> bytes:
    ip = ipaddress.ip_address(address)
    return (ipaddress.IPv6Address(f"::ffff:{ip}") if ip.version == 4 else ip).packed


def new_nonce() -> bytes:
    return os.urandom(12)


def map_request(nonce: bytes, protocol: int, internal_port: int, suggested_port: int, lifetime_s: int,
                client: str) -> bytes:
    """A MAP request (RFC 6887 section 11.1), no options; lifetime 0 deletes."""
    if len(nonce) != 12:
        raise PcpError("a PCP nonce is 12 bytes")
    return _HEADER.pack(VERSION, MAP, 0, lifetime_s, _v6(client)) + \
        _MAP.pack(nonce, protocol, internal_port, suggested_port, _v6("0.0.0.0"))


ANNOUNCE = 0


def announce_request(client: str) -> bytes:
    """An ANNOUNCE request (RFC 6887 section 14.1): asks nothing, but a PCP server answers
    it: whether the gateway speaks PCP at all, found out without making a mapping."""
    return _HEADER.pack(VERSION, ANNOUNCE, 0, 0, _v6(client))


def parse_announce_response(data: bytes) -> bool:
    """Whether `data` is a PCP server's answer to ANNOUNCE (any result: it speaks PCP)."""
    return len(data) >= _ANSWER.size and data[0] == VERSION and data[1] == 0x80 | ANNOUNCE


def parse_map_response(data: bytes, nonce: bytes) -> dict:
    """{"result", "meaning", "lifetime", "epoch"} and on success "external": (address, port);
    PcpError for what is no answer to our request (another nonce, not a MAP answer)."""
    if len(data) >= 4 and data[0] == 0:
        # a NAT-PMP-only router: it answers with its own version, result 1 (unsupported version)
        return {"result": 1, "meaning": "the router speaks NAT-PMP, not PCP", "lifetime": 0, "epoch": 0}
    if len(data) < _ANSWER.size + _MAP.size:
        raise PcpError("PCP answer too short")
    version, op, _, result, lifetime, epoch = _ANSWER.unpack_from(data)
    if version != VERSION or op != 0x80 | MAP:
        raise PcpError("not an answer to a PCP MAP request")
    got_nonce, _protocol, _internal, external_port, external = _MAP.unpack_from(data, _ANSWER.size)
    if got_nonce != nonce:
        raise PcpError("a PCP answer to another request")
    out = {"result": result, "meaning": RESULTS.get(result, f"result {result}"), "lifetime": lifetime,
           "epoch": epoch}
    if result == 0:
        ip = ipaddress.IPv6Address(external)
        out["external"] = (str(ip.ipv4_mapped or ip), external_port)
    return out


def client_address(gateway: str) -> str:
    """This machine's address toward the gateway (what PCP's client field must say)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((gateway, PORT))
        return s.getsockname()[0]


async def speaks(gateway: str, client: str, tries: int = 2) -> bool:
    """Whether the gateway answers PCP (ANNOUNCE), within ~0.75 s: a router on the LAN
    answers in milliseconds, and one that does not speak PCP never does."""
    from engine.wire.natpmp import exchange

    def read(data: bytes) -> bool:
        if not parse_announce_response(data):
            raise PcpError("not an answer to ANNOUNCE")
        return True

    return bool(await exchange(gateway, announce_request(client), read, tries))


async def ask(gateway: str, request: bytes, nonce: bytes, tries: int = 3) -> dict:
    """One MAP request, retransmitted after 250, 500 ms...; PcpError if unanswered."""
    from engine.wire.natpmp import exchange

    got = await exchange(gateway, request, lambda data: parse_map_response(data, nonce), tries)
    if got is None:
        raise PcpError(f"no PCP answer from the gateway {gateway}")
    return got
