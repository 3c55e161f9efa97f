"""Does the link emulation deliver what it promises? Nominal rate/delay vs measured.

For a few settings (Mbit/s / one-way ms) it measures, on loopback:

  * ShapedLink (testkit.linkemu): bulk goodput of a one-way transfer of ~2 s worth of
    bytes (up direction; with --bidir both directions at once, each reported), and the
    median round-trip time of 64-byte messages through a tiny echo server (expected:
    2 x delay);
  * tbf in network namespaces (testkit.netns; root only, skipped where unavailable):
    goodput between two namespaces over a veth shaped by tbf (rate only: netem is
    not available, so the RTT is the bare veth's), and the same with an
    testkit.linkemu proxy inside the sending namespace adding the delay (its own rate
    set far above the tbf rate, so tbf shapes and the proxy delays).

Goodput = payload bytes * 8 / (time from the first byte sent to the last byte
received, minus the one-way delay). TCP/IP headers are not payload: over tbf the
payload rate is ~3-4 % under the nominal wire rate (1448 of 1500+ bytes per packet).

    .venv/bin/python bench/linkcheck.py
    .venv/bin/python bench/linkcheck.py --settings 10/30 200/10 --seconds 3 --bidir

The helpers (bulk_goodput, echo_rtt, netns_goodput, netns_rtt) are used by
tests/test_linkemu.py too.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.linkemu import ShapedLink  # noqa: E402

QUEUE = 256 * 1024


# --- ShapedLink on loopback ---------------------------------------------------------------
async def bulk_goodput(rate_bps: float, delay_s: float, nbytes: int, *, bidir: bool = False,
                       queue_bytes: int = QUEUE) -> dict:
    """Send nbytes client -> server through a ShapedLink (and server -> client at the
    same time when bidir). Returns goodputs in bit/s and the link's stats."""
    payload = b"\x5a" * nbytes
    done_up = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter):
        async def recv():
            n = 0
            while chunk := await r.read(1 << 16):
                n += len(chunk)
            done_up.set_result((n, time.perf_counter()))

        async def send():
            if bidir:
                w.write(payload)
                await w.drain()
            w.write_eof()

        await asyncio.gather(recv(), send())
        w.close()

    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    link = ShapedLink("127.0.0.1", 0, "127.0.0.1", srv.sockets[0].getsockname()[1],
                      rate_bps, delay_s, queue_bytes)
    port = await link.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.perf_counter()

        async def send():
            w.write(payload)
            await w.drain()
            w.write_eof()

        async def recv():
            n = 0
            while chunk := await r.read(1 << 16):
                n += len(chunk)
            return n, time.perf_counter()

        _, (n_down, t_down) = await asyncio.gather(send(), recv())
        n_up, t_up = await done_up
        w.close()
        out = dict(up_bps=n_up * 8 / (t_up - t0 - delay_s), up_bytes=n_up, up_s=t_up - t0,
                   stats=link.stats())
        if bidir:
            out.update(down_bps=n_down * 8 / (t_down - t0 - delay_s), down_bytes=n_down,
                       down_s=t_down - t0)
        return out
    finally:
        await link.close()
        srv.close()
        await srv.wait_closed()


async def echo_rtt(link_or_port, n: int = 10, size: int = 64) -> list[float]:
    """Round-trip times of n sequential size-byte messages to an echo server at the
    given port (or through the given ShapedLink)."""
    port = link_or_port.port if isinstance(link_or_port, ShapedLink) else link_or_port
    r, w = await asyncio.open_connection("127.0.0.1", port)
    msg = b"p" * size
    rtts = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            w.write(msg)
            await w.drain()
            await r.readexactly(size)
            rtts.append(time.perf_counter() - t)
    finally:
        w.close()
    return rtts


async def start_echo() -> asyncio.Server:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter):
        try:
            while chunk := await r.read(1 << 16):
                w.write(chunk)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()
    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def shaped_rtt(rate_bps: float, delay_s: float, n: int = 10) -> list[float]:
    echo = await start_echo()
    link = ShapedLink("127.0.0.1", 0, "127.0.0.1", echo.sockets[0].getsockname()[1],
                      rate_bps, delay_s, QUEUE)
    await link.start()
    try:
        return await echo_rtt(link, n)
    finally:
        await link.close()
        echo.close()
        await echo.wait_closed()


# --- tbf in network namespaces ------------------------------------------------------------
SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while d := c.recv(1 << 16):
    n += len(d)
t = time.time()
c.sendall(b"k"); c.close()
print(n, repr(t), flush=True)
"""

SEND = r"""
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((host, port)); buf = b"x" * nbytes
t0 = time.time(); c.sendall(buf); c.shutdown(socket.SHUT_WR); c.recv(1)
print(repr(t0), flush=True)
"""

ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while d := c.recv(1 << 16):
    c.sendall(d)
"""

PING = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"p" * 64); got = 0
    while got < 64:
        got += len(c.recv(64 - got))
    out.append(time.perf_counter() - t)
print(" ".join(map(repr, out)), flush=True)
"""


def _ready(proc) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"helper failed to start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")


def netns_goodput(net, nbytes: int, *, src: int = 0, dst: int = 1, delay_s: float = 0.0,
                  port: int = 5001) -> float:
    """Payload goodput (bit/s) of one TCP transfer from node src to node dst of a
    built testkit.netns Network. With delay_s, the sender goes through an
    testkit.linkemu proxy in its own namespace that adds that one-way delay (rate far
    above any tbf rate). Times come from time.time() in both namespaces (one clock)."""
    py = sys.executable
    sink = net.popen(dst, [py, "-c", SINK, net.addr(dst), port], text=True)
    _ready(sink)
    host, tport = net.addr(dst), port
    proxy = None
    if delay_s:
        proxy, tport = net.start_proxy(src, "127.0.0.1:0", f"{net.addr(dst)}:{port}",
                                       rate_bps=100e9, delay_s=delay_s, queue_bytes=QUEUE)
        host = "127.0.0.1"
    try:
        t0 = float(net.exec(src, [py, "-c", SEND, host, tport, nbytes], timeout=120).stdout)
        n, t_end = sink.stdout.readline().split()
        sink.wait(10)
    finally:
        if proxy:
            proxy.terminate()
            proxy.wait(5)
    return int(n) * 8 / (float(t_end) - t0 - delay_s)


def netns_rtt(net, n: int = 10, *, src: int = 0, dst: int = 1, delay_s: float = 0.0,
              port: int = 5002) -> list[float]:
    """RTTs of 64-byte messages from node src to an echo server in node dst (through
    a delaying testkit.linkemu proxy in src's namespace when delay_s)."""
    py = sys.executable
    echo = net.popen(dst, [py, "-c", ECHO, net.addr(dst), port], text=True)
    _ready(echo)
    host, tport = net.addr(dst), port
    proxy = None
    if delay_s:
        proxy, tport = net.start_proxy(src, "127.0.0.1:0", f"{net.addr(dst)}:{port}",
                                       rate_bps=100e9, delay_s=delay_s, queue_bytes=QUEUE)
        host = "127.0.0.1"
    try:
        out = net.exec(src, [py, "-c", PING, host, tport, n], timeout=60).stdout
    finally:
        if proxy:
            proxy.terminate()
            proxy.wait(5)
        echo.terminate()
        echo.wait(5)
    return [float(x) for x in out.split()]


# --- the table ------------------------------------------------------------------------------
def _row(kind, rate, delay, gp, rtt, exp_rtt):
    gp_s = f"{gp / 1e6:8.1f} ({(gp / rate - 1) * 100:+5.1f}%)"
    return (f"{kind:<16} {rate / 1e6:>7.0f} {delay * 1e3:>6.0f}   {gp_s:<18} "
            f"{exp_rtt * 1e3:>8.1f} {rtt * 1e3:>8.2f}")


async def run_shaped(settings, seconds, bidir):
    rows = []
    for rate_mbit, delay_ms in settings:
        rate, delay = rate_mbit * 1e6, delay_ms / 1e3
        nbytes = max(2_000_000, int(rate / 8 * seconds))
        g = await bulk_goodput(rate, delay, nbytes, bidir=bidir)
        rtt = statistics.median(await shaped_rtt(rate, delay, 10))
        rows.append(_row("ShapedLink up", rate, delay, g["up_bps"], rtt, 2 * delay))
        if bidir:
            rows.append(_row("ShapedLink down", rate, delay, g["down_bps"], rtt, 2 * delay))
    return rows


def run_netns(settings, seconds):
    from testkit.netns import emulated_network, netns_available

    ok, why = netns_available()
    if not ok:
        return [f"(tbf in netns skipped: {why})"]
    rows, seen = [], set()
    for rate_mbit, delay_ms in settings:
        rate, delay = rate_mbit * 1e6, delay_ms / 1e3
        nbytes = max(2_000_000, int(rate / 8 * seconds))
        with emulated_network(2, "line", rate_bps=rate) as net:
            if rate not in seen:           # tbf alone: once per rate
                seen.add(rate)
                gp = netns_goodput(net, nbytes)
                rtt = statistics.median(netns_rtt(net, 10))
                rows.append(_row("tbf", rate, 0.0, gp, rtt, 0.0))
            if delay:
                gp = netns_goodput(net, nbytes, delay_s=delay)
                rtt = statistics.median(netns_rtt(net, 10, delay_s=delay))
                rows.append(_row("tbf+proxy delay", rate, delay, gp, rtt, 2 * delay))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="+", default=["10/30", "50/30", "100/30", "100/5"],
                    help="RATE_MBIT/DELAY_MS pairs")
    ap.add_argument("--seconds", type=float, default=2.0, help="transfer length at nominal rate")
    ap.add_argument("--bidir", action="store_true", help="ShapedLink: both directions at once")
    ap.add_argument("--no-netns", action="store_true")
    a = ap.parse_args(argv)
    settings = [tuple(float(x) for x in s.split("/")) for s in a.settings]
    t = time.perf_counter()
    print(f"{'link':<16} {'Mbit/s':>7} {'ms':>6}   {'goodput Mbit/s':<18} {'RTT exp':>8} {'RTT med':>8}")
    print("-" * 72)
    for row in asyncio.run(run_shaped(settings, a.seconds, a.bidir)):
        print(row, flush=True)
    if not a.no_netns:
        for row in run_netns(settings, a.seconds):
            print(row, flush=True)
    print(f"({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
