"""A real emulated network on one machine: Linux network namespaces, veth pairs, tbf.

    from testkit.netns import emulated_network, netns_available

    ok, why = netns_available()            # root, `ip netns`, veth and tbf all work?
    with emulated_network(2, rate_bps=50e6) as net:      # line: n0 <-> n1, 50 Mbit/s each way
        srv = net.popen(1, [sys.executable, "server.py", "--host", net.addr(1)])
        net.run(0, [sys.executable, "client.py", net.addr(1)])
    # namespaces (and everything in them) are gone here, even after an exception

Topologies (addresses are 10.<subnet>.x.y and live only inside our namespaces):

  * "line": n0 - n1 - ... - n(N-1). Link k joins node k ("right" interface,
    10.S.k.1/24) and node k+1 ("left" interface, 10.S.k.2/24). Every namespace
    forwards and has routes to every subnet, so any node reaches any other.
    addr(i) is node i's first address.
  * "star": each node has "eth0" (10.S.0.(i+1)/24) joined by a veth to port "p<i>"
    of a bridge in a separate hub namespace: one L2 segment, like homes on the
    internet with their access link as the only bottleneck.

Shaping is `tc qdisc ... root tbf rate R burst B latency L` on the egress of both
ends of each link: "up" is the egress of node k (line: toward node k+1; star: the
node's upload), "down" the other end's (line: node k+1 toward k; star: the hub's
port toward the node, i.e. the node's download). tbf shapes rate and bounds the
queue (`latency` = the longest a packet may wait, i.e. a queue of about
rate * latency + burst bytes; beyond that tbf drops and TCP backs off, as a real
bottleneck does).

Delay: netem is not available on this kernel, so tbf gives rate only (plus its
queueing delay). For propagation delay put an testkit.linkemu.ShapedLink in the path:
`net.start_proxy(i, ...)` runs one inside namespace i (python -m testkit.linkemu), or
run a ShapedLink in the test process in front of a server.
"""

from __future__ import annotations

import functools
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["NetnsError", "Network", "Link", "emulated_network", "netns_available", "sh"]

REPO = Path(__file__).resolve().parent.parent


class NetnsError(RuntimeError):
    pass


def sh(argv: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run a command, capture its output; on failure raise NetnsError naming the
    command, its exit status and its stderr."""
    argv = [str(a) for a in argv]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetnsError(f"{argv[0]}: not found ({' '.join(argv)})") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"timed out after {timeout}s: {' '.join(argv)}") from e
    if check and p.returncode != 0:
        raise NetnsError(f"command failed (exit {p.returncode}): {' '.join(argv)}\n"
                         f"{(p.stderr or p.stdout).strip()}")
    return p


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """(True, "") when this process can build emulated networks: root, `ip` and `tc`
    present, and a probe namespace with a veth pair and a tbf qdisc can be made.
    Otherwise (False, why). Cached."""
    if sys.platform != "linux":
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found"
    ns = f"plprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        sh(["ip", "netns", "add", ns])
    except NetnsError as e:
        return False, f"ip netns unavailable: {e}"
    try:
        sh(["ip", "-n", ns, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        sh(["ip", "-n", ns, "link", "set", "pa", "up"])
        sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "pa", "root",
            "tbf", "rate", "10mbit", "burst", "32kb", "latency", "50ms"])
        return True, ""
    except NetnsError as e:
        return False, f"veth/tbf unavailable: {e}"
    finally:
        sh(["ip", "netns", "del", ns], check=False)


@dataclass
class Link:
    """One veth pair: end a (node side: "up" egress) and end b ("down" egress)."""
    index: int
    a_ns: str
    a_dev: str
    b_ns: str
    b_dev: str


def _tbf_args(rate_bps: float, burst_bytes: int | None, latency_s: float) -> list[str]:
    rate_bps = float(rate_bps)
    if burst_bytes is None:
        # ~4 ms worth of bytes, at least 32 KiB: large enough for tbf to run smoothly
        # without being a noticeable unshaped burst
        burst_bytes = max(32 * 1024, int(rate_bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(int(burst_bytes)),
            "latency", f"{latency_s * 1e3:.3f}ms"]


class Network:
    """A built network (see emulated_network). Nodes are 0..n-1."""

    def __init__(self, prefix: str, n: int, topology: str, subnet: int):
        self.prefix, self.n, self.topology, self.subnet = prefix, n, topology, subnet
        self.namespaces = [f"{prefix}n{i}" for i in range(n)]
        self.hub = f"{prefix}hub" if topology == "star" else None
        self.links: list[Link] = []
        self.addrs: list[list[str]] = [[] for _ in range(n)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # -- building ----------------------------------------------------------------------
    def _add_ns(self, ns: str) -> None:
        sh(["ip", "netns", "add", ns])
        self._created.append(ns)
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _ip(self, ns: str, *args) -> None:
        sh(["ip", "-n", ns, *args])

    def _build(self) -> None:
        for ns in self.namespaces:
            self._add_ns(ns)
        S = self.subnet
        if self.topology == "line":
            for k in range(self.n - 1):
                a, b = self.namespaces[k], self.namespaces[k + 1]
                # create both ends directly inside their namespaces: nothing touches the
                # host's namespace, and names only need to be unique per namespace
                sh(["ip", "link", "add", "right", "netns", a, "type", "veth",
                    "peer", "name", "left", "netns", b])
                self._ip(a, "addr", "add", f"10.{S}.{k}.1/24", "dev", "right")
                self._ip(b, "addr", "add", f"10.{S}.{k}.2/24", "dev", "left")
                self._ip(a, "link", "set", "right", "up")
                self._ip(b, "link", "set", "left", "up")
                self.addrs[k].append(f"10.{S}.{k}.1")
                self.addrs[k + 1].append(f"10.{S}.{k}.2")
                self.links.append(Link(k, a, "right", b, "left"))
            # forwarding and routes so that every node reaches every other
            for i, ns in enumerate(self.namespaces):
                if self.n > 2:
                    self.exec(i, ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
                for k in range(self.n - 1):
                    if k > i:        # to the right: via node i+1's address on link i
                        self._ip(ns, "route", "add", f"10.{S}.{k}.0/24", "via", f"10.{S}.{i}.2")
                    elif k < i - 1:  # to the left: via node i-1's address on link i-1
                        self._ip(ns, "route", "add", f"10.{S}.{k}.0/24", "via", f"10.{S}.{i - 1}.1")
            # addr(i): node i's first address (node 0 has only "right")
        elif self.topology == "star":
            self._add_ns(self.hub)
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                sh(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                    "peer", "name", f"p{i}", "netns", self.hub])
                self._ip(self.hub, "link", "set", f"p{i}", "master", "br0")
                self._ip(self.hub, "link", "set", f"p{i}", "up")
                self._ip(ns, "addr", "add", f"10.{S}.0.{i + 1}/24", "dev", "eth0")
                self._ip(ns, "link", "set", "eth0", "up")
                self.addrs[i].append(f"10.{S}.0.{i + 1}")
                self.links.append(Link(i, ns, "eth0", self.hub, f"p{i}"))
        else:
            raise ValueError(f"topology must be 'line' or 'star', not {self.topology!r}")

    # -- shaping -----------------------------------------------------------------------
    def shape(self, link: int, rate_bps: float | None, direction: str = "both", *,
              burst_bytes: int | None = None, latency_s: float = 0.05) -> None:
        """Set (or with rate_bps=None remove) tbf on link `link`'s egress in
        `direction` ("up", "down" or "both"). Can be called again at runtime."""
        lk = self.links[link]
        ends = {"up": [(lk.a_ns, lk.a_dev)], "down": [(lk.b_ns, lk.b_dev)],
                "both": [(lk.a_ns, lk.a_dev), (lk.b_ns, lk.b_dev)]}
        if direction not in ends:
            raise ValueError(f"direction must be 'up', 'down' or 'both', not {direction!r}")
        for ns, dev in ends[direction]:
            if rate_bps is None:
                sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                    *_tbf_args(rate_bps, burst_bytes, latency_s)])

    def qdisc(self, link: int) -> str:
        """`tc -s qdisc show` for both ends of a link (rates, drops, backlog)."""
        lk = self.links[link]
        return "\n".join(
            sh(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev]).stdout
            for ns, dev in ((lk.a_ns, lk.a_dev), (lk.b_ns, lk.b_dev)))

    # -- running things inside ---------------------------------------------------------
    def addr(self, i: int) -> str:
        return self.addrs[i][0]

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *map(str, argv)]

    def exec(self, i: int, argv: Sequence[str], *, check: bool = True,
             timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run to completion inside node i; NetnsError (with stderr) on failure."""
        return sh(self.argv(i, argv), check=check, timeout=timeout)

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process inside node i; it is killed when the network is torn down.
        Environment: PYTHONPATH gets the repository root (so `engine` imports)."""
        env = dict(kw.pop("env", None) or os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(self.argv(i, argv), env=env, **kw)
        self._procs.append(p)
        return p

    def start_proxy(self, i: int, listen: str, target: str, rate_bps: float, delay_s: float = 0.0,
                    queue_bytes: int = 256 * 1024, timeout: float = 10.0) -> tuple[subprocess.Popen, int]:
        """Run a ShapedLink (python -m testkit.linkemu) inside node i, listening on
        `listen` ("HOST:PORT", port 0 = any) and forwarding to `target`; the way to add
        propagation delay here. Returns (process, bound port)."""
        p = self.popen(i, [sys.executable, "-u", "-m", "testkit.linkemu", listen, target,
                           "--rate-mbit", rate_bps / 1e6, "--delay-ms", delay_s * 1e3,
                           "--queue-kib", queue_bytes / 1024], text=True)
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""     # "listening HOST:PORT"
        if not line.startswith("listening"):
            p.kill()
            raise NetnsError(f"proxy in {self.namespaces[i]} failed to start: {line!r} "
                             f"{p.stderr.read() if p.poll() is not None else ''}")
        return p, int(line.rsplit(":", 1)[1])

    # -- teardown ----------------------------------------------------------------------
    def _kill_procs(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 3
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdout, p.stderr, p.stdin):
                if f:
                    f.close()
        # anything else still running inside our own namespaces (children of ours):
        # a live process would keep its namespace alive after `ip netns del`
        for ns in self._created:
            pids = sh(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def close(self) -> list[str]:
        """Kill what we started inside, delete the namespaces (their veths go with
        them). Returns the errors met (never raises)."""
        errors = []
        try:
            self._kill_procs()
        except Exception as e:        # noqa: BLE001
            errors.append(f"killing processes: {e}")
        for ns in reversed(self._created):
            p = sh(["ip", "netns", "del", ns], check=False)
            if p.returncode != 0:
                errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self._created.clear()
        return errors


@contextmanager
def emulated_network(n: int = 2, topology: str = "line",
                     rate_bps: float | Sequence[float | None] | None = None,
                     rate_down_bps: float | Sequence[float | None] | None = None, *,
                     burst_bytes: int | None = None, latency_s: float = 0.05,
                     subnet: int = 99, prefix: str | None = None) -> Iterator[Network]:
    """Build n namespaces joined as a "line" or a "star" (see the module docstring),
    shape every link with tbf at `rate_bps` "up" and `rate_down_bps` (default: the
    same) "down" (a number for all links, a sequence per link, None: unshaped), yield
    the Network, and always tear it down. Raises NetnsError if a command fails."""
    if n < 2:
        raise ValueError("need at least 2 nodes")
    if not 0 <= subnet <= 255:
        raise ValueError("subnet is the second octet of 10.x.y.z")
    prefix = prefix or f"pl{os.getpid()}{secrets.token_hex(2)}"
    net = Network(prefix, n, topology, subnet)
    nlinks = n - 1 if topology == "line" else n

    def per_link(v):
        if v is None or isinstance(v, (int, float)):
            return [v] * nlinks
        v = list(v)
        if len(v) != nlinks:
            raise ValueError(f"{topology} of {n} nodes has {nlinks} links, got {len(v)} rates")
        return v

    ups = per_link(rate_bps)
    downs = ups if rate_down_bps is None else per_link(rate_down_bps)
    try:
        net._build()
        for k in range(nlinks):
            for direction, r in (("up", ups[k]), ("down", downs[k])):
                if r is not None:
                    net.shape(k, r, direction, burst_bytes=burst_bytes, latency_s=latency_s)
        yield net
    finally:
        errors = net.close()
        if errors:
            print("testkit.netns: cleanup problems:\n  " + "\n  ".join(errors), file=sys.stderr)
