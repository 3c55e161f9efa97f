"""A small emulated internet for NAT-traversal tests: homes behind NAT routers, and a
public server host, all in Linux network namespaces on this machine.

    from testkit.homenet import HomeSpec, home_internet, homenet_available

    ok, why = homenet_available()          # root, `ip netns`, iptables in a namespace?
    homes = [HomeSpec(nat="eim", upnp=True), HomeSpec(nat="symmetric"), HomeSpec(nat=None)]
    with home_internet(homes, stun=True) as net:
        srv = net.popen(net.host(0), [sys.executable, "server.py"])        # the PC in home 0
        net.exec(net.host(1), ["curl", f"http://{net.wan_addr(0)}:8080"])  # from home 1
        sock = net.socket(net.public, socket.SOCK_STREAM)   # a socket of this process, made inside
        out = net.call_in(net.host(0), fn, *args)           # fn runs in a thread inside host(0)
    # every namespace and daemon is gone here, even after an exception

Topology (S = `subnet`, default 77; every address lives only inside our namespaces,
which have no link to the host's network, so nothing here can leave the machine):

    public host ─┐                          ┌─ router 0 ── PC 0      (home 0)
                 ├── "internet" (a bridge) ─┼─ router 1 ── PC 1      (home 1)
                 │    11.S.0.0/24           └─ ...

  * the internet: a bridge "br0" in a hub namespace, one L2 segment 11.S.0.0/24 (as
    netns's "star"). 11.0.0.0/8 is ordinary unicast space, not a private, shared
    (100.64/10) or documentation range: miniupnpd 2.3.1 refuses every mapping while its
    WAN address is in a reserved range and has no option to allow it, and it accepts 11/8.
  * the public host `net.public`: 11.S.0.1 (`public_addr`) and 11.S.0.2 (`public_addr2`),
    both on "eth0" (two addresses so that a STUN client can ask two server addresses).
  * home i's router `net.router(i)`: "wan" 11.S.0.(10+i) (`wan_addr(i)`) on the internet,
    "lan" toward the PC; it forwards.
  * home i's PC `net.host(i)`: "eth0", default route via the router's LAN address.
      - NAT homes: the LAN is 192.168.(i+1).0/24 (router .1, PC .2 = `lan_addr(i)`), or
        HomeSpec(lan="192.168.1.0/24") to give several homes the same private range (a
        PC then cannot even name another home's PC). No router has a route to any
        private range but its own: another home's private address is unreachable.
      - nat=None: a routed public subnet 11.S.(i+1).0/24 (router .1, PC .2); the public
        host and every router route it via the router's WAN address.
  * `net.links[i]` is home i's access link (router wan <-> hub port; "up" = the home's
    upload) and `net.links[len(homes)]` the public host's, so `net.shape(i, rate_bps)`
    (testkit.netns.Network.shape, tbf) gives a home a bottleneck.

NAT kinds (iptables in the router's namespace, whichever backend `iptables` is; on
Debian 12 that is iptables-nft, i.e. nf_tables rules in tables "ip nat"/"ip filter"):

  * "eim" endpoint-independent mapping: `-t nat -A POSTROUTING -o wan -j MASQUERADE`.
    Linux keeps the PC's source port when it is free and reuses one mapping for every
    destination. Filtering is address-and-port dependent (only replies from the exact
    remote that the PC sent to get in: conntrack), i.e. a "port-restricted cone".
  * "symmetric": `MASQUERADE --random-fully`: a new random port for every new
    (destination address, port), so two STUN servers see two different mapped ports.
  * None: no NAT and no firewall; the PC has a public address (see above).

Every NAT router also has a firewall: FORWARD policy DROP except ESTABLISHED,RELATED,
LAN->WAN, and ctstate DNAT (connections that a port mapping redirected: only
miniupnpd adds DNAT rules); INPUT policy DROP except loopback, the LAN side and
ESTABLISHED,RELATED, so the router silently drops anything unsolicited from the
internet (a connection to an unmapped WAN port times out, no RST). No hairpinning.

UPnP (HomeSpec(upnp=True)): Debian's miniupnpd (package miniupnpd-nftables, 2.3.1, the
nftables flavour) runs in the foreground (-d) in the router namespace with a config in
a temp dir: ext_ifname=wan, listening_ip=lan, UPnP-IGD and NAT-PMP/PCP on, secure_mode
(a client maps only to itself), external and internal ports 1024-65535 allowed for the
home's LAN, everything else denied. miniupnpd does not create its nftables table, so we
create `table inet miniupnpd` first (what Debian's /etc/miniupnpd/nft_init.sh would,
with our names and forward policy accept: the iptables FORWARD chain is the gate);
its log is `net.log("miniupnpd<i>")`.

STUN (home_internet(..., stun=True)): coturn's turnserver in the public host, STUN only
(--stun-only, no TURN relay, no auth, no TLS/DTLS, no CLI, no config file), on UDP and
TCP port 3478 of both public addresses: `net.stun_addr` and `net.stun_addr2`
((host, port) tuples); coturn also answers on 3479 (its RFC 5780 alternate port). Its
log is `net.log("turnserver")`.

Packages (Debian): `python -m testkit.homenet --install` runs
`apt-get install -y iptables nftables miniupnpd-nftables coturn conntrack` (APT_PACKAGES;
conntrack flushes a router's NAT table for the chaos run, testkit/chaos.py). Not the
"miniupnpd" package: that one adds debconf questions and a system service; the -nftables
package alone is just the daemon. coturn's own service stays off (its /etc/default/coturn
leaves it disabled).
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import re
import secrets
import shutil
import socket
import subprocess
from pathlib import Path
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from testkit.netns import Link, NetnsError, Network, netns_available, sh

__all__ = ["APT_PACKAGES", "HomeSpec", "HomeNet", "home_internet", "homenet_available",
           "upnp_available", "stun_available", "install_packages", "NetnsError"]

APT_PACKAGES = ("iptables", "nftables", "miniupnpd-nftables", "coturn", "conntrack")
STUN_PORT = 3478
NAT_KINDS = ("eim", "symmetric", None)
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class HomeSpec:
    """One home: its router's NAT kind ("eim", "symmetric" or None: a public address and
    no firewall), whether the router runs miniupnpd, and (NAT homes) the LAN range."""
    nat: str | None = "eim"
    upnp: bool = False
    lan: str | None = None          # a /24 or wider, e.g. "192.168.1.0/24"; default 192.168.(i+1).0/24
    igd: bool = True                # with upnp: UPnP-IGD too (False: the router speaks PCP and NAT-PMP only)

    def __post_init__(self):
        if self.nat not in NAT_KINDS:
            raise ValueError(f"nat must be one of {NAT_KINDS}, not {self.nat!r}")
        if self.upnp and self.nat is None:
            raise ValueError("upnp needs a NAT home (nat='eim' or 'symmetric')")


# -- what is installed --------------------------------------------------------------------
def _version_line(argv: Sequence[str]) -> str:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (p.stdout + p.stderr).strip()


@functools.lru_cache(maxsize=1)
def homenet_available() -> tuple[bool, str]:
    """(True, summary) when NAT homes can be built here: root, `ip netns`, veth, and
    iptables NAT (MASQUERADE, --random-fully, conntrack) inside a namespace. The summary
    names the iptables backend and whether UPnP and STUN are available (see
    upnp_available / stun_available). Otherwise (False, why). Cached."""
    ok, why = netns_available()
    if not ok:
        return False, why
    if shutil.which("iptables") is None:
        return False, "`iptables` not found (apt-get install -y iptables)"
    ns = f"hnprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        sh(["ip", "netns", "add", ns])
    except NetnsError as e:
        return False, f"ip netns unavailable: {e}"
    try:
        ipt = ["ip", "netns", "exec", ns, "iptables"]
        sh([*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE", "--random-fully"])
        sh([*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"])
        sh([*ipt, "-P", "FORWARD", "DROP"])
    except NetnsError as e:
        return False, f"iptables NAT does not work in a namespace: {e}"
    finally:
        sh(["ip", "netns", "del", ns], check=False)
    m = re.search(r"\((\w+)\)", _version_line(["iptables", "--version"]))
    backend = m.group(1) if m else "?"
    u_ok, u_why = upnp_available()
    s_ok, s_why = stun_available()
    return True, (f"iptables backend {backend}; upnp: {'yes' if u_ok else 'no'} ({u_why}); "
                  f"stun: {'yes' if s_ok else 'no'} ({s_why})")


@functools.lru_cache(maxsize=1)
def upnp_available() -> tuple[bool, str]:
    """(True, version) when miniupnpd (nftables flavour) and `nft` are installed."""
    if shutil.which("miniupnpd") is None:
        return False, "miniupnpd not found (apt-get install -y miniupnpd-nftables)"
    if shutil.which("nft") is None:
        return False, "nft not found (apt-get install -y nftables)"
    v = _version_line(["miniupnpd", "--version"])
    if "nftables" not in v:
        return False, f"miniupnpd is not the nftables flavour ({v!r}): apt-get install -y miniupnpd-nftables"
    return True, v.splitlines()[0]


@functools.lru_cache(maxsize=1)
def stun_available() -> tuple[bool, str]:
    """(True, version) when coturn's turnserver is installed."""
    if shutil.which("turnserver") is None:
        return False, "turnserver not found (apt-get install -y coturn)"
    m = re.search(r"Coturn-[\w.]+", _version_line(["turnserver", "--version"]) or "")
    return True, m.group(0) if m else "coturn"


def install_packages() -> None:
    """apt-get install APT_PACKAGES (as root), without starting any system service."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # a policy-rc.d that says "no" keeps the packages' postinst from starting coturn or
    # miniupnpd as services on the machine itself (Debian's documented switch)
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", *APT_PACKAGES], check=True, env=env)
    finally:
        if ours:
            policy.unlink()
    upnp_available.cache_clear()
    stun_available.cache_clear()
    homenet_available.cache_clear()


# -- entering a namespace from this process -----------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def _enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (sockets it makes from now on
    live there; other threads are unaffected)."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class HomeNet(Network):
    """A built home internet (see home_internet). Namespaces are named by string
    (`public`, `router(i)`, `host(i)`, `hub`); popen/exec/argv take such a name (or an
    index into `namespaces`). Inherits testkit.netns.Network's popen, exec, shape,
    qdisc and teardown."""

    def __init__(self, prefix: str, homes: Sequence[HomeSpec], subnet: int):
        super().__init__(prefix, 0, "star", subnet)
        self.homes = list(homes)
        S = subnet
        self.public = f"{prefix}pub"
        self.hub = f"{prefix}hub"
        self.routers = [f"{prefix}r{i}" for i in range(len(homes))]
        self.hosts = [f"{prefix}h{i}" for i in range(len(homes))]
        self.namespaces = [self.public, *self.routers, *self.hosts]
        self.public_addr, self.public_addr2 = f"11.{S}.0.1", f"11.{S}.0.2"
        self.stun_addr: tuple[str, int] | None = None
        self.stun_addr2: tuple[str, int] | None = None
        self._wan = [f"11.{S}.0.{10 + i}" for i in range(len(homes))]
        self._lan_net: list[ipaddress.IPv4Network] = []
        for i, h in enumerate(homes):
            if h.nat is None:
                self._lan_net.append(ipaddress.IPv4Network(f"11.{S}.{i + 1}.0/24"))
            else:
                self._lan_net.append(ipaddress.IPv4Network(h.lan or f"192.168.{i + 1}.0/24"))
        self.tmp = tempfile.mkdtemp(prefix=f"{prefix}-")
        self._logs: dict[str, Any] = {}

    # -- addresses ---------------------------------------------------------------------
    def router(self, i: int) -> str:
        return self.routers[i]

    def host(self, i: int) -> str:
        return self.hosts[i]

    def wan_addr(self, i: int) -> str:
        """Router i's public address (on the internet segment)."""
        return self._wan[i]

    def lan_addr(self, i: int) -> str:
        """The PC's address in home i (private in NAT homes, public with nat=None)."""
        return str(self._lan_net[i].network_address + 2)

    def gateway(self, i: int) -> str:
        """Router i's LAN address (the PC's default gateway)."""
        return str(self._lan_net[i].network_address + 1)

    def lan_net(self, i: int) -> str:
        return str(self._lan_net[i])

    # -- running things ----------------------------------------------------------------
    def argv(self, ns: str | int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside namespace `ns` (a name, or an index into namespaces)."""
        if isinstance(ns, int):
            ns = self.namespaces[ns]
        return ["ip", "netns", "exec", ns, *map(str, argv)]

    def call_in(self, ns: str, fn: Callable[..., Any], *args, timeout: float | None = 60.0, **kw) -> Any:
        """Run fn(*args, **kw) in a new thread of this process that has entered namespace
        `ns`: every socket it makes (asyncio, aiohttp and async_upnp_client included,
        with asyncio.run inside fn) lives there. Returns fn's result or raises its error."""
        out: dict[str, Any] = {}

        def body():
            try:
                _enter(ns)
                out["r"] = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                out["e"] = e

        t = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call_in({ns}, {getattr(fn, '__name__', fn)}) still running after {timeout}s")
        if "e" in out:
            raise out["e"]
        return out.get("r")

    def socket(self, ns: str, type: int = socket.SOCK_STREAM, family: int = socket.AF_INET) -> socket.socket:
        """A socket of this process made inside namespace `ns` (it stays there)."""
        return self.call_in(ns, socket.socket, family, type)

    def log(self, name: str) -> str:
        """What daemon `name` ("miniupnpd<i>", "turnserver") has written so far."""
        path = os.path.join(self.tmp, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def _daemon(self, name: str, ns: str, argv: Sequence[str]) -> subprocess.Popen:
        # a log file, not a pipe: a chatty daemon must never block on a full pipe
        f = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        self._logs[name] = f
        return self.popen(ns, argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_listening(self, name: str, ns: str, p: subprocess.Popen, want: Sequence[str],
                        timeout: float = 15.0) -> None:
        """Wait until `ss -Hlnu` / `-Hlnt` in ns shows every "PROTO ADDR:PORT" of want."""
        deadline = time.monotonic() + timeout
        while True:
            out = {"udp": sh(self.argv(ns, ["ss", "-Hlnu"])).stdout,
                   "tcp": sh(self.argv(ns, ["ss", "-Hlnt"])).stdout}
            if all(re.search(rf"\s{re.escape(w.split()[1])}\s", out[w.split()[0]]) for w in want):
                return
            if p.poll() is not None:
                raise NetnsError(f"{name} in {ns} exited ({p.returncode}):\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise NetnsError(f"{name} in {ns} not listening on {want} after {timeout}s:\n"
                                 f"{self.log(name)[-3000:]}")
            time.sleep(0.1)

    # -- building ----------------------------------------------------------------------
    def _sysctl(self, ns: str, *settings: str) -> None:
        sh(self.argv(ns, ["sysctl", "-qw", *settings]))

    def _build(self) -> None:
        S = self.subnet
        self._add_ns(self.hub)
        self._ip(self.hub, "link", "add", "br0", "type", "bridge")
        self._ip(self.hub, "link", "set", "br0", "up")

        def attach(ns: str, dev: str, port: str) -> Link:
            sh(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub])
            self._ip(self.hub, "link", "set", port, "master", "br0")
            self._ip(self.hub, "link", "set", port, "up")
            self._ip(ns, "link", "set", dev, "up")
            return Link(len(self.links), ns, dev, self.hub, port)

        self._add_ns(self.public)
        pub_link = attach(self.public, "eth0", "pub")
        for a in (self.public_addr, self.public_addr2):
            self._ip(self.public, "addr", "add", f"{a}/24", "dev", "eth0")

        for i, h in enumerate(self.homes):
            r, pc = self.routers[i], self.hosts[i]
            self._add_ns(r)
            self._add_ns(pc)
            self.links.append(attach(r, "wan", f"r{i}"))
            self._ip(r, "addr", "add", f"{self._wan[i]}/24", "dev", "wan")
            sh(["ip", "link", "add", "lan", "netns", r, "type", "veth", "peer", "name", "eth0", "netns", pc])
            plen = self._lan_net[i].prefixlen
            self._ip(r, "addr", "add", f"{self.gateway(i)}/{plen}", "dev", "lan")
            self._ip(pc, "addr", "add", f"{self.lan_addr(i)}/{plen}", "dev", "eth0")
            self._ip(r, "link", "set", "lan", "up")
            self._ip(pc, "link", "set", "eth0", "up")
            self._ip(pc, "route", "add", "default", "via", self.gateway(i))
            self._sysctl(r, "net.ipv4.ip_forward=1")
            if h.nat is not None:
                self._firewall(i, h)
        self.links.append(Link(len(self.links), pub_link.a_ns, pub_link.a_dev, pub_link.b_ns, pub_link.b_dev))

        # public homes' subnets are routed via their router's WAN address
        for j, h in enumerate(self.homes):
            if h.nat is None:
                for ns in [self.public] + [r for k, r in enumerate(self.routers) if k != j]:
                    self._ip(ns, "route", "add", self.lan_net(j), "via", self._wan[j])

    def _firewall(self, i: int, h: HomeSpec) -> None:
        masq = "-j MASQUERADE --random-fully" if h.nat == "symmetric" else "-j MASQUERADE"
        rules = f"""*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A POSTROUTING -o wan {masq}
COMMIT
*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -i lan -j ACCEPT
-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -i lan -o wan -j ACCEPT
-A FORWARD -i wan -o lan -m conntrack --ctstate DNAT -j ACCEPT
COMMIT
"""
        path = os.path.join(self.tmp, f"iptables-r{i}.rules")
        with open(path, "w") as f:
            f.write(rules)
        sh(self.argv(self.routers[i], ["iptables-restore", path]))

    def _start_miniupnpd(self, i: int) -> None:
        r = self.routers[i]
        nft = os.path.join(self.tmp, f"miniupnpd{i}.nft")
        with open(nft, "w") as f:
            f.write("""table inet miniupnpd {
    chain forward { type filter hook forward priority 0; policy accept; jump miniupnpd; }
    chain miniupnpd { }
    chain prerouting { type nat hook prerouting priority -100; policy accept; jump prerouting_miniupnpd; }
    chain postrouting { type nat hook postrouting priority 100; policy accept; jump postrouting_miniupnpd; }
    chain prerouting_miniupnpd { }
    chain postrouting_miniupnpd { }
}
""")
        sh(self.argv(r, ["nft", "-f", nft]))
        conf = os.path.join(self.tmp, f"miniupnpd{i}.conf")
        with open(conf, "w") as f:
            f.write(f"""ext_ifname=wan
listening_ip=lan
enable_natpmp=yes
enable_upnp={"yes" if self.homes[i].igd else "no"}
secure_mode=yes
system_uptime=no
uuid={uuid.uuid4()}
lease_file={self.tmp}/miniupnpd{i}.leases
upnp_table_name=miniupnpd
upnp_nat_table_name=miniupnpd
upnp_forward_chain=miniupnpd
upnp_nat_chain=prerouting_miniupnpd
upnp_nat_postrouting_chain=postrouting_miniupnpd
allow 1024-65535 {self.lan_net(i)} 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
""")
        name = f"miniupnpd{i}"
        p = self._daemon(name, r, ["miniupnpd", "-d", "-f", conf, "-P", os.path.join(self.tmp, f"{name}.pid")])
        self._wait_listening(name, r, p, [f"udp {self.gateway(i)}:5351"] +
                             (["udp 0.0.0.0%lan:1900"] if self.homes[i].igd else []))

    def _start_stun(self) -> None:
        p = self._daemon("turnserver", self.public, [
            "turnserver", "-n", "--stun-only", "--no-auth", "-L", self.public_addr, "-L", self.public_addr2,
            "-p", STUN_PORT, "--no-cli", "--no-tls", "--no-dtls", "--log-file", "stdout", "--simple-log",
            "--pidfile", os.path.join(self.tmp, "turnserver.pid"),
            "--userdb", os.path.join(self.tmp, "turndb")])
        self._wait_listening("turnserver", self.public, p,
                             [f"udp {a}:{STUN_PORT}" for a in (self.public_addr, self.public_addr2)])
        self.stun_addr = (self.public_addr, STUN_PORT)
        self.stun_addr2 = (self.public_addr2, STUN_PORT)

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> list[str]:
        errors = super().close()        # kills our processes, deletes the namespaces
        for f in self._logs.values():
            f.close()
        self._logs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return errors


@contextmanager
def home_internet(homes: Sequence[HomeSpec] = (HomeSpec(),), *, stun: bool = False, subnet: int = 77,
                  prefix: str | None = None) -> Iterator[HomeNet]:
    """Build the public host, one router and one PC per HomeSpec, the internet bridge,
    the NAT and firewall rules, miniupnpd where upnp=True and (stun=True) a STUN server;
    yield the HomeNet; always tear everything down (see the module docstring). Raises
    NetnsError if a command fails, or if UPnP or STUN is asked for and not installed."""
    homes = list(homes)
    if not 1 <= len(homes) <= 200:
        raise ValueError("1 to 200 homes")
    if not 0 <= subnet <= 255:
        raise ValueError("subnet is the second octet of 11.x.y.z")
    if any(h.upnp for h in homes):
        ok, why = upnp_available()
        if not ok:
            raise NetnsError(f"upnp=True but {why}")
    if stun:
        ok, why = stun_available()
        if not ok:
            raise NetnsError(f"stun=True but {why}")
    prefix = prefix or f"hn{os.getpid()}{secrets.token_hex(2)}"
    net = HomeNet(prefix, homes, subnet)
    try:
        net._build()
        for i, h in enumerate(homes):
            if h.upnp:
                net._start_miniupnpd(i)
        if stun:
            net._start_stun()
        yield net
    finally:
        errors = net.close()
        if errors:
            print("testkit.homenet: cleanup problems:\n  " + "\n  ".join(errors), file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] == ["--install"]:
        install_packages()
    elif sys.argv[1:] == ["--packages"]:
        print(" ".join(APT_PACKAGES))
    else:
        print(f"usage: python -m testkit.homenet [--install | --packages]\n"
              f"  --install   apt-get install -y {' '.join(APT_PACKAGES)}\n"
              f"  --packages  print that list\n{homenet_available()}", file=sys.stderr)
        sys.exit(0 if sys.argv[1:] == [] else 2)
