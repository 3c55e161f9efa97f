"""NAT-PMP (RFC 6886): a port mapping asked of routers that speak it instead of UPnP-IGD.

Sans-I/O: `external_address_request()`, `map_request()`, `parse_response()`; the thin
asyncio layer `ask()` sends one request to the gateway's UDP port 5351 with the RFC's
retransmissions (250 ms, doubling). The gateway is the default route's next hop
(`default_gateway()`: /proc/net/route on Linux, GetBestRoute on Windows).

Its whole protocol is a few fixed-size messages, so it is written here rather than
taken from a library; UPnP-IGD's SSDP and SOAP are not (engine/wire/candidates.py
uses async-upnp-client for those).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import sys

PORT = 5351
TCP = 2                 # opcode: map TCP (1 is UDP)
RESULTS = {0: "success", 1: "unsupported version", 2: "not authorized or refused", 3: "network failure",
           4: "out of resources", 5: "unsupported opcode"}


class NatPmpError(ValueError):
    pass


def external_address_request() -> bytes:
    return struct.pack("!BB", 0, 0)


def map_request(internal_port: int, external_port: int, lifetime_s: int, opcode: int = TCP) -> bytes:
    return struct.pack("!BBHHHI", 0, opcode, 0, internal_port, external_port, lifetime_s)


def parse_response(data: bytes, opcode: int) -> dict:
    """The answer to a request of `opcode`: {"result", "epoch", ...}; NatPmpError for
    anything else (a failure result is returned, with its meaning)."""
    if len(data) < 8:
        raise NatPmpError("NAT-PMP answer too short")
    version, op, result, epoch = struct.unpack_from("!BBHI", data)
    if version != 0 or op != 128 + opcode:
        raise NatPmpError(f"not an answer to NAT-PMP opcode {opcode}")
    out = {"result": result, "meaning": RESULTS.get(result, f"result {result}"), "epoch": epoch}
    if result != 0:
        return out
    if opcode == 0:
        if len(data) != 12:
            raise NatPmpError("NAT-PMP address answer of the wrong size")
        out["external"] = str(ipaddress.IPv4Address(data[8:12]))
    else:
        if len(data) != 16:
            raise NatPmpError("NAT-PMP mapping answer of the wrong size")
        out["internal_port"], out["external_port"], out["lifetime"] = struct.unpack_from("!HHI", data, 8)
    return out


class _Proto(asyncio.DatagramProtocol):
    def __init__(self):
        self.answers: asyncio.Queue = asyncio.Queue()

    def datagram_received(self, data, addr):
        self.answers.put_nowait(data)


async def exchange(gateway: str, request: bytes, read, tries: int):
    """Send `request` to the gateway's port 5351, retransmitted after 250, 500, 1000 ms...
    (RFC 6886 3.1, RFC 6887 8.1.1), until an answer `read(data)` accepts (it raises
    ValueError for what is not ours); None when nothing answered. PCP shares it (pcp.py)."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(_Proto, remote_addr=(gateway, PORT))
    try:
        wait = 0.25
        for _ in range(tries):
            transport.sendto(request)
            deadline = loop.time() + wait
            while loop.time() < deadline:
                try:
                    data = await asyncio.wait_for(proto.answers.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
                try:
                    return read(data)
                except ValueError:
                    continue
            wait *= 2
        return None
    finally:
        transport.close()


async def ask(gateway: str, request: bytes, opcode: int, tries: int = 4) -> dict:
    """One request, retransmitted; NatPmpError if unanswered."""
    got = await exchange(gateway, request, lambda data: parse_response(data, opcode), tries)
    if got is None:
        raise NatPmpError(f"no NAT-PMP answer from the gateway {gateway}")
    return got


def default_gateway() -> str | None:
    """The IPv4 next hop of the default route, or None where it cannot be read."""
    try:
        if sys.platform.startswith("linux"):
            # thread-self: this thread's network namespace (the same as the process's,
            # unless a thread entered another, as the tests' emulated homes do)
            table = "/proc/thread-self/net/route"
            with open(table if os.path.exists(table) else "/proc/net/route") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if len(fields) > 3 and fields[1] == "00000000" and int(fields[3], 16) & 2:
                        return socket.inet_ntoa(struct.pack("<I", int(fields[2], 16)))
        elif sys.platform == "win32":
            return _windows_gateway()
    except (OSError, ValueError):
        pass
    return None


def _windows_gateway() -> str | None:
    import ctypes
    from ctypes import wintypes

    class Row(ctypes.Structure):   # MIB_IPFORWARDROW
        _fields_ = [(n, wintypes.DWORD) for n in (
            "dest", "mask", "policy", "next_hop", "if_index", "type", "proto", "age", "next_hop_as", "metric1",
            "metric2", "metric3", "metric4", "metric5")]

    row = Row()
    dest = struct.unpack("<I", socket.inet_aton("8.8.8.8"))[0]     # any public address: the default route
    if ctypes.windll.iphlpapi.GetBestRoute(dest, 0, ctypes.byref(row)) != 0:
        return None
    hop = socket.inet_ntoa(struct.pack("<I", row.next_hop))
    return None if hop == "0.0.0.0" else hop
