"""Weak-link emulation on one machine: a shaping TCP proxy (pure asyncio, no deps).

    link = ShapedLink("127.0.0.1", 0, "127.0.0.1", server_port,
                      rate_bps=20e6, delay_s=0.040, queue_bytes=256 * 1024)
    port = await link.start()          # connect to 127.0.0.1:port instead of the server
    ...
    link.set_rate(5e6); link.set_delay(0.080)     # fluctuate at runtime
    await link.close()

Each direction ("up" = client -> target, "down" = target -> client) is its own
emulated link (the two are independent; their rate is shared by all connections
through the proxy) and behaves like a bottleneck router port followed by a wire:

    sender --TCP--> [reader] -> queue (<= queue_bytes) -> [serializer @ rate_bps]
                 -> wire (one-way delay_s) -> [deliverer] --TCP--> receiver

  * queue: bytes read from the sender wait here for the link. It holds at most
    `queue_bytes` (per connection, so that one connection whose receiver stops
    reading cannot block another's); when it is full the reader stops reading the
    sender's socket, the kernel buffers fill and the sender's TCP stalls:
    back-pressure, never a drop.
  * serializer: a token bucket kept as a virtual clock. A piece of n bytes starts
    when the link is free and the piece has arrived, and leaves the link
    n * 8 / rate_bps seconds later. Times are computed exactly on that clock, so
    timer jitter and late wake-ups shift *when* bytes are handed on, not the rate.
    Pieces are at most ~2 ms of link time (>= 1500 B), so a big read is not released
    as one late burst at low rates.
  * wire: a piece is delivered at (end of its serialization + delay_s), in order.
    Bytes on the wire are bounded by about rate * delay + slack (the link's
    bandwidth-delay product): if the receiver stops reading, the wire fills, then the
    queue, then the sender blocks.

The proxy reads in small pieces (16 KiB) with loop.sock_recv/sock_sendall (no
StreamReader/transport buffers in between) and its sockets have small kernel
buffers (SO_RCVBUF/SO_SNDBUF 64 KiB, TCP_NODELAY), so the emulated queue, not hidden
buffers, decides how much data sits in the path.

What it is not: a packet-level emulator. The proxy terminates TCP on both sides
(split TCP), so there is no end-to-end congestion control, slow start or loss
across the emulated link, and the sender's TCP window need not cover the emulated
bandwidth-delay product; the link behaves like an ideal, lossless, FIFO pipe of the
given rate, delay and buffer. Timers have ~1 ms granularity: delays come out at or
slightly above nominal, never below.

Run standalone (e.g. inside a network namespace):
    python -m testkit.linkemu 127.0.0.1:9000 10.0.0.2:8000 --rate-mbit 20 --delay-ms 40
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque

__all__ = ["ShapedLink", "LinkDirection"]

SOCK_BUF = 64 * 1024        # SO_RCVBUF / SO_SNDBUF on the proxy's sockets
READ_SIZE = 16 * 1024       # largest read from a sender's socket
GRANULARITY = 0.001         # run up to this far ahead of the virtual clock instead of sleeping
PIECE_TIME = 0.002          # serialize in pieces of about this much link time ...
MIN_PIECE = 1500            # ... but at least one MTU-sized packet
WIRE_SLACK = 64 * 1024      # extra bytes allowed on the wire beyond rate * delay


def _tune(sock: socket.socket, bufsize: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)


def _nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LinkDirection:
    """One direction of the emulated link: rate, delay, queue size, the serialization
    clock (shared by every connection's pipe in this direction) and the counters."""

    def __init__(self, name: str, rate_bps: float, delay_s: float, queue_bytes: int):
        self.name = name
        self.rate_bps = float(rate_bps)
        self.delay_s = float(delay_s)
        self.queue_bytes = int(queue_bytes)
        self.t_free = 0.0            # virtual time at which the link finishes its last piece
        self.queued = 0              # bytes waiting for the link (all connections)
        self.on_wire = 0             # bytes serialized, not yet handed to a receiver
        self.bytes_received = 0      # read from senders
        self.bytes_forwarded = 0     # handed to receivers' sockets
        self.max_queued = 0
        self.max_on_wire = 0
        self.pipes: set[_Pipe] = set()

    def piece_size(self) -> int:
        return max(MIN_PIECE, min(READ_SIZE, int(self.rate_bps / 8 * PIECE_TIME)))

    def wire_cap(self) -> int:
        """Most bytes one connection may have on the wire: the bandwidth-delay product
        plus slack (only reached when its receiver stops reading)."""
        return int(self.rate_bps / 8 * (self.delay_s + 0.005)) + 2 * READ_SIZE + WIRE_SLACK

    def wake(self) -> None:
        """Make every pipe re-check its limits (after a runtime change)."""
        for p in self.pipes:
            p.space.set()
            p.wire_space.set()

    def stats(self) -> dict:
        return dict(rate_bps=self.rate_bps, delay_s=self.delay_s, queue_bytes=self.queue_bytes,
                    queued=self.queued, on_wire=self.on_wire, max_queued=self.max_queued,
                    max_on_wire=self.max_on_wire, bytes_received=self.bytes_received,
                    bytes_forwarded=self.bytes_forwarded)


class _Pipe:
    """One connection's traffic in one direction: reader -> queue -> serializer -> wire
    -> deliverer. The queue limit and the wire cap are per connection (so a receiver
    that stops reading blocks only its own sender); the rate clock is the direction's."""

    def __init__(self, d: LinkDirection, src: socket.socket, dst: socket.socket):
        self.d, self.src, self.dst = d, src, dst
        self.loop = asyncio.get_running_loop()
        self.queue: deque[tuple[float, memoryview]] = deque()   # (arrival time, bytes)
        self.wire: deque[tuple[float, memoryview]] = deque()    # (delivery time, bytes)
        self.queued = 0
        self.on_wire = 0
        self.src_eof = False
        self.ser_done = False
        self.last_deliver = 0.0
        self.space = asyncio.Event()          # bytes left the queue
        self.queue_event = asyncio.Event()    # bytes entered the queue (or EOF)
        self.wire_event = asyncio.Event()     # bytes entered the wire (or done)
        self.wire_space = asyncio.Event()     # bytes left the wire

    async def run(self) -> None:
        self.d.pipes.add(self)
        tasks = [asyncio.create_task(c) for c in (self._reader(), self._serializer(), self._deliverer())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.d.pipes.discard(self)
            self.d.queued -= self.queued
            self.d.on_wire -= self.on_wire
            self.queue.clear()
            self.wire.clear()

    async def _reader(self) -> None:
        d, loop = self.d, self.loop
        while True:
            # room for a full read (or for the whole queue when it is smaller than one)?
            while d.queue_bytes - self.queued < min(READ_SIZE, d.queue_bytes):
                self.space.clear()
                await self.space.wait()
            n = min(READ_SIZE, d.queue_bytes - self.queued)
            data = await loop.sock_recv(self.src, n)
            if not data:
                self.src_eof = True
                self.queue_event.set()
                return
            k = len(data)
            self.queued += k
            d.queued += k
            d.bytes_received += k
            d.max_queued = max(d.max_queued, d.queued)
            self.queue.append((loop.time(), memoryview(data)))
            self.queue_event.set()

    async def _serializer(self) -> None:
        d, loop = self.d, self.loop
        resume = 0.0
        spins = 0
        while True:
            while not self.queue:
                if self.src_eof:
                    self.ser_done = True
                    self.wire_event.set()
                    return
                self.queue_event.clear()
                await self.queue_event.wait()
            # the wire is full (the receiver is not reading): wait, restart the clock then
            if self.on_wire + d.piece_size() > d.wire_cap():
                while self.on_wire + d.piece_size() > d.wire_cap():
                    self.wire_space.clear()
                    await self.wire_space.wait()
                resume = loop.time()
            arrival, data = self.queue[0]
            size = d.piece_size()
            if len(data) > size:
                piece = data[:size]
                self.queue[0] = (arrival, data[size:])
            else:
                piece = data
                self.queue.popleft()
            n = len(piece)
            # exact virtual time: the piece starts when the link is free and it is there
            start = max(d.t_free, arrival, resume)
            end = start + n * 8 / d.rate_bps
            d.t_free = end
            self.queued -= n
            d.queued -= n
            self.space.set()
            deliver = max(end + d.delay_s, self.last_deliver)   # in order, even if delay shrinks
            self.last_deliver = deliver
            self.wire.append((deliver, piece))
            self.on_wire += n
            d.on_wire += n
            d.max_on_wire = max(d.max_on_wire, d.on_wire)
            self.wire_event.set()
            # the link is busy until `end`: take the next piece then
            ahead = end - loop.time()
            if ahead > GRANULARITY:
                spins = 0
                await asyncio.sleep(ahead)
            else:
                spins += 1
                if spins >= 16:          # behind the clock (CPU-bound): let others run
                    spins = 0
                    await asyncio.sleep(0)

    async def _deliverer(self) -> None:
        d, loop = self.d, self.loop
        while True:
            while not self.wire:
                if self.ser_done:
                    try:
                        self.dst.shutdown(socket.SHUT_WR)     # pass the sender's EOF on
                    except OSError:
                        pass
                    return
                self.wire_event.clear()
                await self.wire_event.wait()
            wait = self.wire[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now = loop.time()          # never early: everything due by now, in one write
            chunks = []
            while self.wire and self.wire[0][0] <= now:
                chunks.append(self.wire.popleft()[1])
            if not chunks:
                continue
            buf = b"".join(chunks)
            await loop.sock_sendall(self.dst, buf)
            k = len(buf)
            self.on_wire -= k
            d.on_wire -= k
            d.bytes_forwarded += k
            self.wire_space.set()


class ShapedLink:
    """A TCP proxy listen_host:listen_port -> target_host:target_port that shapes each
    direction to `rate_bps` (bits/s), a one-way `delay_s` and a `queue_bytes` queue.

    `rate_down_bps` / `delay_down_s` / `queue_down_bytes` make the target -> client
    direction differ (home links are asymmetric); by default both are the same.
    Counters: `bytes_up` / `bytes_down` (forwarded), `stats()` for everything.
    """

    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int,
                 rate_bps: float, delay_s: float = 0.0, queue_bytes: int = 256 * 1024, *,
                 rate_down_bps: float | None = None, delay_down_s: float | None = None,
                 queue_down_bytes: int | None = None, sock_buf: int = SOCK_BUF):
        if rate_bps <= 0 or (rate_down_bps is not None and rate_down_bps <= 0):
            raise ValueError("rate must be > 0")
        if delay_s < 0 or (delay_down_s is not None and delay_down_s < 0):
            raise ValueError("delay must be >= 0")
        if queue_bytes < 1:
            raise ValueError("queue_bytes must be >= 1")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.sock_buf = sock_buf
        self.up = LinkDirection("up", rate_bps, delay_s, queue_bytes)
        self.down = LinkDirection(
            "down", rate_bps if rate_down_bps is None else rate_down_bps,
            delay_s if delay_down_s is None else delay_down_s,
            queue_bytes if queue_down_bytes is None else queue_down_bytes)
        self.port: int | None = None
        self.connections = 0          # accepted so far
        self._lsock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self._socks: set[socket.socket] = set()

    # -- runtime control -------------------------------------------------------------
    def _dirs(self, direction: str) -> list[LinkDirection]:
        if direction == "both":
            return [self.up, self.down]
        if direction in ("up", "down"):
            return [getattr(self, direction)]
        raise ValueError(f"direction must be 'up', 'down' or 'both', not {direction!r}")

    def set_rate(self, bps: float, direction: str = "both") -> None:
        """Change the rate for pieces not yet serialized (the one on the link finishes at
        the old rate)."""
        if bps <= 0:
            raise ValueError("rate must be > 0")
        for d in self._dirs(direction):
            d.rate_bps = float(bps)
            d.wake()           # the wire cap follows the rate

    def set_delay(self, s: float, direction: str = "both") -> None:
        """Change the one-way delay for pieces serialized from now on (bytes already on
        the wire keep theirs; order is kept, so a shorter delay takes effect once the
        wire has drained)."""
        if s < 0:
            raise ValueError("delay must be >= 0")
        for d in self._dirs(direction):
            d.delay_s = float(s)
            d.wake()

    def set_queue(self, nbytes: int, direction: str = "both") -> None:
        if nbytes < 1:
            raise ValueError("queue_bytes must be >= 1")
        for d in self._dirs(direction):
            d.queue_bytes = int(nbytes)
            d.wake()

    @property
    def bytes_up(self) -> int:
        return self.up.bytes_forwarded

    @property
    def bytes_down(self) -> int:
        return self.down.bytes_forwarded

    def stats(self) -> dict:
        return dict(up=self.up.stats(), down=self.down.stats(), connections=self.connections,
                    open_connections=len(self._conns))

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> int:
        """Listen; return the bound port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.listen_host, self.listen_port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _, addr = infos[0]
        ls = socket.socket(family, type_, proto)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(ls, self.sock_buf)       # accepted sockets inherit (set before listen)
            ls.bind(addr)
            ls.listen(128)
            ls.setblocking(False)
        except BaseException:
            ls.close()
            raise
        self._lsock = ls
        self.port = ls.getsockname()[1]
        self._accept_task = loop.create_task(self._accept_loop())
        return self.port

    async def __aenter__(self) -> "ShapedLink":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._accept_task = None
        if self._lsock:
            self._lsock.close()
            self._lsock = None
        conns = list(self._conns)
        for t in conns:
            t.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        for s in list(self._socks):
            s.close()
        self._socks.clear()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            csock, _ = await loop.sock_accept(self._lsock)
            csock.setblocking(False)
            _nodelay(csock)
            self.connections += 1
            t = loop.create_task(self._handle(csock))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _connect_target(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.target_host, self.target_port, type=socket.SOCK_STREAM)
        err: Exception | None = None
        for family, type_, proto, _, addr in infos:
            s = socket.socket(family, type_, proto)
            try:
                _tune(s, self.sock_buf)
                _nodelay(s)
                s.setblocking(False)
                await loop.sock_connect(s, addr)
                return s
            except BaseException as e:
                s.close()
                if not isinstance(e, OSError):
                    raise
                err = e
        raise err or OSError(f"cannot resolve {self.target_host}:{self.target_port}")

    async def _handle(self, csock: socket.socket) -> None:
        self._socks.add(csock)
        tsock = None
        try:
            try:
                tsock = await self._connect_target()
            except OSError:
                return
            self._socks.add(tsock)
            pipes = [_Pipe(self.up, csock, tsock), _Pipe(self.down, tsock, csock)]
            tasks = [asyncio.create_task(p.run()) for p in pipes]
            try:
                # a clean EOF in one direction half-closes it; the other goes on. An
                # error (reset, broken pipe) anywhere tears the connection down.
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for s in (csock, tsock):
                if s is not None:
                    self._socks.discard(s)
                    s.close()


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m testkit.linkemu", description=__doc__.split("\n")[0])
    ap.add_argument("listen", help="HOST:PORT to listen on (port 0: any; printed)")
    ap.add_argument("target", help="HOST:PORT to forward to")
    ap.add_argument("--rate-mbit", type=float, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--queue-kib", type=float, default=256)
    ap.add_argument("--down-rate-mbit", type=float, default=None)
    ap.add_argument("--down-delay-ms", type=float, default=None)
    a = ap.parse_args(argv)

    async def run():
        lh, lp = _hostport(a.listen)
        th, tp = _hostport(a.target)
        link = ShapedLink(lh, lp, th, tp, a.rate_mbit * 1e6, a.delay_ms / 1e3, int(a.queue_kib * 1024),
                          rate_down_bps=None if a.down_rate_mbit is None else a.down_rate_mbit * 1e6,
                          delay_down_s=None if a.down_delay_ms is None else a.down_delay_ms / 1e3)
        port = await link.start()
        print(f"listening {lh}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await link.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
