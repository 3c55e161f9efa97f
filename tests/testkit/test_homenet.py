"""The emulated home internet is real (testkit.homenet): NAT rewrites sources, the home
firewall drops what nobody asked for, a UPnP mapping made with async-upnp-client opens a
port and deleting it closes it, and STUN tells an endpoint-independent NAT from a
symmetric one.

One network for the module: home 0 "eim" NAT with miniupnpd, home 1 "symmetric" NAT,
home 2 no NAT (a public PC); STUN on the public host's two addresses. Clients and
servers are sockets of this process made inside the namespaces (HomeNet.socket /
call_in), so no test starts a Python process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.homenet import (HomeSpec, home_internet, homenet_available,  # noqa: E402
                             stun_available, upnp_available)

ok, why = homenet_available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.timeout(120)]
UPNP, UPNP_WHY = upnp_available()
STUN, STUN_WHY = stun_available()

EIM, SYM, PUB = 0, 1, 2
PC_PORT = 8080            # the server on every PC and on the public host
MAPPED_PORT = 40123       # the external port of the UPnP mapping
IGD = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"


class Server:
    """A TCP server socket made inside `ns`: answers each connection with `name` and
    records the peers it saw."""

    def __init__(self, net, ns: str, name: bytes, port: int = PC_PORT):
        self.name, self.peers = name, []
        self.sock = net.socket(ns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer)
            with c:
                c.sendall(self.name)


def reach(net, ns: str, addr: str, port: int, timeout: float = 1.5) -> bytes:
    """Connect from namespace `ns` to addr:port and read the server's name; raises OSError
    (refused, unreachable, timed out) when it does not get through."""
    def go():
        with socket.create_connection((addr, port), timeout=timeout) as s:
            return s.recv(64)
    return net.call_in(ns, go)


def fails(net, ns: str, addr: str, port: int) -> str:
    try:
        got = reach(net, ns, addr, port, timeout=1.0)
    except OSError as e:
        return type(e).__name__
    pytest.fail(f"{ns} reached {addr}:{port} (answer {got!r})")


def stun_mapped(sock: socket.socket, server: tuple[str, int], timeout: float = 1.0) -> tuple[str, int]:
    """RFC 5389 Binding request from `sock` to `server`; the XOR-MAPPED-ADDRESS answered."""
    sock.settimeout(timeout)
    for _ in range(3):
        tid = os.urandom(12)
        sock.sendto(struct.pack("!HHI12s", 0x0001, 0, 0x2112A442, tid), server)
        try:
            data, _src = sock.recvfrom(2048)
        except socket.timeout:
            continue
        kind, length, cookie, rtid = struct.unpack("!HHI12s", data[:20])
        if kind != 0x0101 or cookie != 0x2112A442 or rtid != tid:
            continue
        pos = 20
        while pos + 4 <= 20 + length:
            atype, alen = struct.unpack("!HH", data[pos:pos + 4])
            val = data[pos + 4:pos + 4 + alen]
            if atype == 0x0020 and val[1] == 0x01:          # XOR-MAPPED-ADDRESS, IPv4
                port = struct.unpack("!H", val[2:4])[0] ^ 0x2112
                ip = struct.unpack("!I", val[4:8])[0] ^ 0x2112A442
                return socket.inet_ntoa(struct.pack("!I", ip)), port
            pos += 4 + alen + (-alen % 4)
        raise AssertionError(f"no XOR-MAPPED-ADDRESS in {data!r}")
    raise AssertionError(f"no STUN answer from {server}")


@pytest.fixture(scope="module")
def net():
    homes = [HomeSpec(nat="eim", upnp=UPNP), HomeSpec(nat="symmetric"), HomeSpec(nat=None)]
    with home_internet(homes, stun=STUN) as n:
        servers = [Server(n, n.public, b"public")] + [Server(n, n.host(i), f"pc{i}".encode())
                                                      for i in range(len(homes))]
        n.servers = servers
        try:
            yield n
        finally:
            for s in servers:
                s.sock.close()


def test_layout(net):
    assert net.wan_addr(EIM) == "11.77.0.10" and net.lan_addr(EIM) == "192.168.1.2"
    assert net.lan_addr(SYM) == "192.168.2.2" and net.lan_addr(PUB) == "11.77.3.2"
    assert net.public_addr == "11.77.0.1"
    for ns in (net.public, net.hub, *net.routers, *net.hosts):
        assert ns.startswith(net.prefix)
    # the PC's only way out is its router
    assert f"default via {net.gateway(EIM)}" in net.exec(net.host(EIM), ["ip", "route"]).stdout


def test_outbound_is_translated(net):
    """(1) Each PC reaches the public server; the server sees the router's WAN address
    (NAT homes) or the PC's own public address (no NAT)."""
    pub = net.servers[0]
    for i, seen in ((EIM, net.wan_addr(EIM)), (SYM, net.wan_addr(SYM)), (PUB, net.lan_addr(PUB))):
        pub.peers.clear()
        assert reach(net, net.host(i), net.public_addr, PC_PORT) == b"public"
        assert pub.peers[0][0] == seen, (i, pub.peers)
    # and the public PC is reachable from anywhere
    assert reach(net, net.host(EIM), net.lan_addr(PUB), PC_PORT) == b"pc2"
    assert reach(net, net.public, net.lan_addr(PUB), PC_PORT) == b"pc2"


def test_unsolicited_inbound_is_blocked(net):
    """(2) Home B's PC (and the public host) cannot reach home A's PC: its private address
    is unroutable, and A's router drops connections to an unmapped WAN port (silently:
    a timeout, not a refusal), although a server listens on the PC at that port."""
    for src in (net.host(SYM), net.host(PUB), net.public):
        fails(net, src, net.lan_addr(EIM), PC_PORT)
        assert fails(net, src, net.wan_addr(EIM), PC_PORT) in ("TimeoutError", "timeout")
        if src != net.host(SYM):     # (from inside, its own WAN address is the router itself)
            assert fails(net, src, net.wan_addr(SYM), PC_PORT) in ("TimeoutError", "timeout")
    assert net.servers[1 + EIM].peers == [] and net.servers[1 + SYM].peers == []


@pytest.mark.skipif(not UPNP, reason=UPNP_WHY)
def test_upnp_mapping_opens_and_closes(net):
    """(3) From home A's PC, async-upnp-client finds the router (SSDP), reads its external
    address, maps WAN:MAPPED_PORT -> PC:PC_PORT; home B then reaches the PC through the
    router; after DeletePortMapping it no longer does."""
    from async_upnp_client.aiohttp import AiohttpRequester
    from async_upnp_client.client_factory import UpnpFactory
    from async_upnp_client.profiles.igd import IgdDevice
    from async_upnp_client.search import async_search

    wan, pc = net.wan_addr(EIM), net.servers[1 + EIM]
    seen: dict = {}

    async def session():
        found = []

        async def on_answer(headers):
            found.append(headers["location"])

        await async_search(on_answer, timeout=1, search_target=IGD)
        assert found, "no IGD answered the SSDP search"
        device = await UpnpFactory(AiohttpRequester(), non_strict=True).async_create_device(found[0])
        igd = IgdDevice(device, None)
        seen["external"] = await igd.async_get_external_ip_address()
        await igd.async_add_port_mapping(
            remote_host=ipaddress.IPv4Address("0.0.0.0"), external_port=MAPPED_PORT, protocol="TCP",
            internal_port=PC_PORT, internal_client=ipaddress.IPv4Address(net.lan_addr(EIM)),
            enabled=True, description="homenet test", lease_duration=timedelta(minutes=10))
        seen["open"] = await asyncio.to_thread(reach, net, net.host(SYM), wan, MAPPED_PORT)
        seen["peer"] = pc.peers[-1][0]
        await igd.async_delete_port_mapping(remote_host=ipaddress.IPv4Address("0.0.0.0"),
                                            external_port=MAPPED_PORT, protocol="TCP")

    net.call_in(net.host(EIM), asyncio.run, session())
    assert seen["external"] == wan
    assert seen["open"] == b"pc0" and seen["peer"] == net.wan_addr(SYM)
    assert fails(net, net.host(SYM), wan, MAPPED_PORT) in ("TimeoutError", "timeout")
    assert "AddPortMapping" in net.log("miniupnpd0") and "DeletePortMapping" in net.log("miniupnpd0")


@pytest.mark.skipif(not STUN, reason=STUN_WHY)
def test_stun_tells_nat_kinds_apart(net):
    """(4) A STUN binding from each PC shows its public face: the router's WAN address;
    the "eim" NAT keeps one mapped port for both server addresses, the symmetric NAT
    shows each server a different port, the public PC its own address and port."""
    def faces(i):
        with net.socket(net.host(i), socket.SOCK_DGRAM) as s:
            s.bind(("0.0.0.0", 0))
            local = s.getsockname()[1]
            return local, stun_mapped(s, net.stun_addr), stun_mapped(s, net.stun_addr2)

    local, a, b = faces(EIM)
    assert a == b == (net.wan_addr(EIM), a[1])
    assert a[1] == local            # Linux MASQUERADE keeps a free source port
    local, a, b = faces(SYM)
    assert a[0] == b[0] == net.wan_addr(SYM)
    assert a[1] != b[1]
    local, a, b = faces(PUB)
    assert a == b == (net.lan_addr(PUB), local)


def test_homes_may_share_a_private_range():
    """Two homes both on 192.168.1.0/24 each reach the public host through their own
    router; the namespaces, daemons and temp dir are gone after the block."""
    homes = [HomeSpec(lan="192.168.1.0/24", upnp=UPNP), HomeSpec(nat="symmetric", lan="192.168.1.0/24")]
    with home_internet(homes, stun=STUN, subnet=78) as n:
        pub = Server(n, n.public, b"public")
        try:
            assert n.lan_addr(0) == n.lan_addr(1) == "192.168.1.2"
            for i in (0, 1):
                assert reach(n, n.host(i), n.public_addr, PC_PORT) == b"public"
                assert pub.peers[-1][0] == n.wan_addr(i)
        finally:
            pub.sock.close()
        names = list(n._created)
        daemons = [p for p in n._procs]
        assert len(daemons) == UPNP + STUN
    left = set(os.listdir("/run/netns")) & set(names)
    assert not left, f"namespaces left behind: {left}"
    assert all(p.poll() is not None for p in daemons)
    assert not os.path.exists(n.tmp)
