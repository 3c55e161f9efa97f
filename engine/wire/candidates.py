"""The addresses a friend may reach this host on ("candidates"), and the router's mapping.

A host that listens for friends directly (TunnelHost.listen) gathers, for its port:

  * lan      its private IPv4 addresses: a friend in the same home;
  * mapped   a port mapping asked of the home router over UPnP-IGD (async-upnp-client,
             the maintained client Home Assistant uses), or where no router answers
             that, over NAT-PMP (engine/wire/natpmp.py): the router's public address
             and the mapped port, renewed while the host listens and removed when it
             stops. Most home routers grant one; it is how two homes connect with no
             server of their own;
  * ipv6     its global IPv6 addresses: routers seldom NAT IPv6, though many firewall it;
  * public   its public IPv4 address as a STUN server sees it (engine/wire/stun.py), on
             the same port: reachable when the owner forwarded that port by hand, or
             the machine has no NAT in front of it;
  * given    addresses the owner named (--advertise): tried as they are.
  * udp      not a route: the public address of a UDP socket kept open while the host
             listens (STUN), for hole punching when a friend's reply code comes back
             with theirs (engine/wire/punch.py, TunnelHost.take_reply).

The invite carries them (engine/wire/invite.py, version 2), and the joiner tries them
in KIND_ORDER, racing the connects (engine/wire/tunnel_routes.py). What is learnt along the
way -- whether the router granted a mapping and why not, the NAT's behaviour -- goes
to `potluck doctor` and the status.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from datetime import timedelta

log = logging.getLogger("potluck.candidates")

KINDS = ("lan", "given", "mapped", "ipv6", "public", "udp")
KIND_ORDER = {k: i for i, k in enumerate(KINDS)}
LEASE_S = 3600          # the router forgets a mapping this long after its last renewal
SEARCH_S = 2            # SSDP: how long routers get to answer
IGD = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"


@dataclass(frozen=True)
class Candidate:
    kind: str      # one of KINDS
    url: str       # ws://address:port

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown candidate kind {self.kind!r}")


def url_for(address: str, port: int) -> str:
    return f"ws://[{address}]:{port}" if ":" in address else f"ws://{address}:{port}"


def classify(address: str) -> str | None:
    """The kind of one of this machine's own addresses, or None (not for others)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return None
    if ip.version == 6:
        return "ipv6" if ip.is_global else None
    if ip.is_private or ipaddress.ip_address(address) in ipaddress.ip_network("100.64.0.0/10"):
        return "lan"
    return "public"


def local_candidates(port: int, addresses: list[str]) -> list[Candidate]:
    out = []
    for a in addresses:
        kind = classify(a)
        if kind is not None:
            out.append(Candidate(kind, url_for(a.split("%")[0], port)))
    return out


def interface_addresses() -> list[str]:
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)]


def on_our_networks(url: str) -> bool:
    """Whether a private address (in a ws:// URL) lies on one of this machine's own
    networks. Another home's LAN address almost never does, and a connect there is not
    refused but unanswered: a route to it gets a short timeout (tunnel_routes.py)."""
    import psutil

    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return True
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family != (socket.AF_INET if ip.version == 4 else socket.AF_INET6) or not a.netmask:
                continue
            try:
                if ip in ipaddress.ip_network(f"{a.address.split('%')[0]}/{a.netmask}", strict=False):
                    return True
            except ValueError:
                continue
    return False


def ordered(cands: list[Candidate]) -> list[Candidate]:
    """Deduplicated (by URL, first kind wins), in the order a joiner tries them."""
    seen, out = set(), []
    for c in sorted(cands, key=lambda c: KIND_ORDER[c.kind]):
        if c.url not in seen:
            seen.add(c.url)
            out.append(c)
    return out


@dataclass
class MappingResult:
    external: tuple[str, int] | None = None
    why_not: str = ""            # a sentence for the doctor when there is no mapping
    how: str = ""                # the protocol that granted it: "UPnP-IGD", "PCP" or "NAT-PMP"


class PortMapper:
    """One TCP port mapping on the home router, kept while the host listens: asked over
    UPnP-IGD, else PCP (RFC 6887), else NAT-PMP (RFC 6886), whichever the router speaks.

        m = PortMapper()
        result = await m.open(7870)          # external (ip, port), or why_not
        ...
        await m.close()                      # removes the mapping
    """

    def __init__(self, description: str = "Potluck", lease_s: int = LEASE_S, search_s: float = SEARCH_S,
                 natpmp: bool = True, upnp_igd: bool = True, pcp: bool = True):
        self.description, self.lease_s, self.search_s = description, lease_s, search_s
        self.natpmp, self.upnp_igd, self.pcp = natpmp, upnp_igd, pcp
        self._pmp_gateway: str | None = None     # set while a NAT-PMP mapping is held
        self._pcp: tuple[str, bytes, str] | None = None   # (gateway, nonce, client) while a PCP one is
        self.granted_s = lease_s                 # the lease the router granted
        self._igd = None
        self._session = None
        self._renew: asyncio.Task | None = None
        self.result = MappingResult()
        self._mapping: tuple[int, int, str] | None = None     # external port, internal port, client

    async def open(self, internal_port: int) -> MappingResult:
        # which of PCP and NAT-PMP the gateway speaks is found out while SSDP looks for a
        # UPnP router (its search is the slowest part, ~2 s): a gateway that speaks neither
        # then costs nothing more (asked one after the other, their silence cost ~5 s more)
        speaks = asyncio.ensure_future(self._speaks())
        try:
            self.result = (await self._open(internal_port) if self.upnp_igd
                           else MappingResult(None, "UPnP-IGD not asked"))
        except Exception as exc:  # noqa: BLE001 -- a router that answers oddly must not stop hosting
            log.info("port mapping failed: %r", exc)
            self.result = MappingResult(None, f"the router's UPnP answered with an error ({type(exc).__name__}: {exc})")
        else:
            if self.result.external is not None:
                self.result.how = "UPnP-IGD"
        if self.result.external is not None:
            speaks.cancel()
            return self.result
        pcp_ok, pmp_ok, why = await speaks
        for ok, open_ in ((pcp_ok, self._open_pcp), (pmp_ok, self._open_natpmp)):
            if self.result.external is None and ok:
                got = await open_(internal_port)
                self.result = got if got.external else MappingResult(None, f"{self.result.why_not}; {got.why_not}")
        if self.result.external is None and why:
            self.result = MappingResult(None, f"{self.result.why_not}; {why}")
        return self.result

    async def _speaks(self) -> tuple[bool, bool, str]:
        """(PCP answers, NAT-PMP answers, why neither) of the default gateway, at once."""
        from engine.wire import natpmp, pcp

        if not (self.pcp or self.natpmp):
            return False, False, ""
        gateway = natpmp.default_gateway()
        if gateway is None:
            return False, False, "PCP, NAT-PMP: no default gateway to ask"

        async def pmp() -> bool:
            try:
                return (await natpmp.ask(gateway, natpmp.external_address_request(), 0, tries=2))["result"] == 0
            except (natpmp.NatPmpError, OSError):
                return False

        async def pcp_() -> bool:
            try:
                return await pcp.speaks(gateway, pcp.client_address(gateway))
            except OSError:
                return False

        got_pcp, got_pmp = await asyncio.gather(pcp_() if self.pcp else _false(), pmp() if self.natpmp else _false())
        return got_pcp, got_pmp, "" if got_pcp or got_pmp else "the router speaks neither PCP nor NAT-PMP"

    async def _open_pcp(self, internal_port: int) -> MappingResult:
        from engine.wire import natpmp, pcp

        gateway = natpmp.default_gateway()
        if gateway is None:
            return MappingResult(None, "PCP: no default gateway to ask")
        try:
            client, nonce = pcp.client_address(gateway), pcp.new_nonce()
            got = await pcp.ask(gateway, pcp.map_request(nonce, pcp.TCP, internal_port, internal_port, self.lease_s,
                                                         client), nonce)
        except (pcp.PcpError, OSError) as exc:
            return MappingResult(None, f"PCP: {exc}")
        if got["result"] != 0:
            return MappingResult(None, f"PCP: the router says {got['meaning']}")
        self._pcp = (gateway, nonce, client)
        self.granted_s = got["lifetime"] or self.lease_s
        self._mapping = (got["external"][1], internal_port, client)
        self._renew = asyncio.ensure_future(self._renew_loop())
        return MappingResult(got["external"], how="PCP")

    async def _open_natpmp(self, internal_port: int) -> MappingResult:
        from engine.wire import natpmp

        gateway = natpmp.default_gateway()
        if gateway is None:
            return MappingResult(None, "NAT-PMP: no default gateway to ask")
        try:
            addr = await natpmp.ask(gateway, natpmp.external_address_request(), 0)
            if addr["result"] != 0:
                return MappingResult(None, f"NAT-PMP: the router says {addr['meaning']}")
            got = await natpmp.ask(gateway, natpmp.map_request(internal_port, internal_port, self.lease_s), natpmp.TCP)
        except (natpmp.NatPmpError, OSError) as exc:
            return MappingResult(None, f"NAT-PMP: {exc}")
        if got["result"] != 0:
            return MappingResult(None, f"NAT-PMP: the router refused a mapping ({got['meaning']})")
        self._pmp_gateway = gateway
        self.granted_s = got["lifetime"] or self.lease_s
        self._mapping = (got["external_port"], internal_port, "")
        self._renew = asyncio.ensure_future(self._renew_loop())
        return MappingResult((addr["external"], got["external_port"]), how="NAT-PMP")

    async def _open(self, internal_port: int) -> MappingResult:
        from async_upnp_client.aiohttp import AiohttpSessionRequester
        from async_upnp_client.client_factory import UpnpFactory
        from async_upnp_client.profiles.igd import IgdDevice
        from async_upnp_client.search import async_search
        import aiohttp

        found: list[str] = []

        async def on_answer(headers):
            location = headers.get("location")
            if location and location not in found:
                found.append(location)

        await async_search(on_answer, timeout=max(1, int(self.search_s)), search_target=IGD)
        if not found:
            return MappingResult(None, "no UPnP router answered on this network (UPnP off on the router, "
                                       "or no home router in front of this computer)")
        self._session = aiohttp.ClientSession()
        requester = AiohttpSessionRequester(self._session, with_sleep=True)
        device = await UpnpFactory(requester, non_strict=True).async_create_device(found[0])
        self._igd = IgdDevice(device, None)
        external_ip = await self._igd.async_get_external_ip_address()
        if not external_ip:
            return MappingResult(None, "the UPnP router does not say its public address")
        client = _source_toward(device.device_url)
        last = None
        for external_port in (internal_port, internal_port + 1, internal_port + 2):
            try:
                await self._add(external_port, internal_port, client)
            except Exception as exc:  # noqa: BLE001 -- taken by another device: try the next
                if "725" in str(exc) or "OnlyPermanentLeasesSupported" in str(exc):
                    # an IGDv1 router that takes only permanent mappings: one, removed on close
                    self.lease_s = 0
                    try:
                        await self._add(external_port, internal_port, client)
                    except Exception as again:  # noqa: BLE001
                        last = again
                        continue
                else:
                    last = exc
                    continue
            self._mapping = (external_port, internal_port, client)
            if self.lease_s:             # a permanent mapping needs no renewal
                self._renew = asyncio.ensure_future(self._renew_loop())
            return MappingResult((external_ip, external_port))
        return MappingResult(None, f"the UPnP router refused a mapping ({type(last).__name__}: {last})")

    async def _add(self, external_port: int, internal_port: int, client: str):
        if self._pcp is not None:
            from engine.wire import pcp

            gateway, nonce, me = self._pcp
            got = await pcp.ask(gateway, pcp.map_request(nonce, pcp.TCP, internal_port, external_port, self.lease_s,
                                                         me), nonce)
            if got["result"] != 0:
                raise pcp.PcpError(f"the router refused the renewal ({got['meaning']})")
            return
        if self._pmp_gateway is not None:
            from engine.wire import natpmp

            got = await natpmp.ask(self._pmp_gateway, natpmp.map_request(internal_port, external_port,
                                                                          self.lease_s), natpmp.TCP)
            if got["result"] != 0:
                raise natpmp.NatPmpError(f"the router refused the renewal ({got['meaning']})")
            return
        await self._igd.async_add_port_mapping(
            remote_host=ipaddress.IPv4Address("0.0.0.0"), external_port=external_port, protocol="TCP",
            internal_port=internal_port, internal_client=ipaddress.IPv4Address(client), enabled=True,
            description=self.description, lease_duration=timedelta(seconds=self.lease_s))

    async def _renew_loop(self):
        while True:
            # half the lease asked for (a router may grant less: NAT-PMP says how much,
            # and renewing at half of that keeps it; UPnP grants what it was asked or fails)
            await asyncio.sleep(max(30.0, min(self.lease_s, self.granted_s) / 2))
            try:
                await self._add(*self._mapping)
            except Exception as exc:  # noqa: BLE001 -- the next renewal tries again
                log.warning("renewing the port mapping failed: %r", exc)

    async def close(self):
        if self._renew is not None:
            self._renew.cancel()
        if self._pcp is not None and self._mapping is not None:
            from engine.wire import pcp

            gateway, nonce, me = self._pcp
            try:     # lifetime 0 deletes (RFC 6887 15)
                await pcp.ask(gateway, pcp.map_request(nonce, pcp.TCP, self._mapping[1], 0, 0, me), nonce, tries=2)
            except (pcp.PcpError, OSError) as exc:
                log.info("removing the PCP mapping failed: %r", exc)
            self._mapping = self._pcp = None
        if self._pmp_gateway is not None and self._mapping is not None:
            from engine.wire import natpmp

            try:     # lifetime 0 deletes (RFC 6886 3.4)
                await natpmp.ask(self._pmp_gateway, natpmp.map_request(self._mapping[1], 0, 0), natpmp.TCP, tries=2)
            except (natpmp.NatPmpError, OSError) as exc:
                log.info("removing the NAT-PMP mapping failed: %r", exc)
            self._mapping = self._pmp_gateway = None
        if self._igd is not None and self._mapping is not None:
            try:
                await asyncio.wait_for(self._igd.async_delete_port_mapping(
                    remote_host=ipaddress.IPv4Address("0.0.0.0"), external_port=self._mapping[0],
                    protocol="TCP"), 5)
            except Exception as exc:  # noqa: BLE001 -- the lease ends it anyway
                log.info("removing the port mapping failed: %r", exc)
            self._mapping = None
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _false() -> bool:
    return False


def _source_toward(url: str) -> str:
    """This machine's address toward the router (the mapping's internal client)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname or "192.0.2.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


@dataclass
class Gathered:
    candidates: list[Candidate] = field(default_factory=list)
    mapping: MappingResult = field(default_factory=MappingResult)
    nat: str = "unknown"          # stun.nat_behaviour
    public: str | None = None     # the public IPv4 address STUN servers saw


async def gather(port: int, *, upnp: bool = True, stun_servers: list[tuple[str, int]] | None = None,
                 mapper: PortMapper | None = None, addresses: list[str] | None = None) -> Gathered:
    """Every candidate for `port`, the router's mapping (kept open by `mapper`) and the NAT's
    behaviour, gathered at once: the slowest part (SSDP, STUN) takes about two seconds."""
    from engine.wire import stun

    g = Gathered(local_candidates(port, interface_addresses() if addresses is None else addresses))
    jobs = []
    if upnp and mapper is not None:
        jobs.append(mapper.open(port))
    servers = stun.servers_from_env() if stun_servers is None else stun_servers
    if servers:
        jobs.append(stun.query(servers))
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, MappingResult):
            g.mapping = r
            if r.external:
                g.candidates.append(Candidate("mapped", url_for(*r.external)))
        elif isinstance(r, tuple):
            local, seen = r
            g.nat = stun.nat_behaviour(local, seen)
            if seen:
                g.public = seen[0].address[0]
                if classify(g.public) == "public":
                    g.candidates.append(Candidate("public", url_for(g.public, port)))
        elif isinstance(r, BaseException):
            log.info("gathering candidates: %r", r)
    if upnp and mapper is None:
        g.mapping = MappingResult(None, "not asked (port mapping off)")
    g.candidates = ordered(g.candidates)
    return g
