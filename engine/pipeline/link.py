"""The asyncio layer of one outbound data link: the LinkScheduler decides, this sends.

Whatever has been handed to the socket can no longer be overtaken, so this layer keeps
the bytes in flight (sent, not yet acknowledged by the receiver) near the link's
bandwidth-delay product, cuts every decision into pieces of at most `piece` bytes, and
keeps the kernel's send buffer small. Then a decode volume that arrives behind a large
prefill waits for at most one piece plus what is in flight — not the whole prefill.

The receiver acknowledges each piece (an `ack` control message); acknowledged bytes over
time give the goodput, pings give the RTT: the scheduler's link figures are measured,
continuously, not assumed. A receiver that stops acknowledging stalls the sender at the
in-flight cap; after `stall_timeout` the link is declared failed (back-pressure, then a
clear error — never unbounded buffering).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections import deque

from websockets.exceptions import ConnectionClosed

from engine.core.heartbeat import Silence
from engine.wire import frames
from engine.core.link_scheduler import GoodputMeter, LinkScheduler, next_rtt_min
from engine.wire.volumes import encode_chunk

log = logging.getLogger("potluck.link")

SNDBUF = 64 << 10
# Pieces and the in-flight floor follow the measured bandwidth (what a decode volume
# may wait behind is link *time*); these are 256 KiB at 100 Mbit/s.
PIECE_TIME = 0.020
MIN_IN_FLIGHT_TIME = 0.020
MIN_PIECE = 4 << 10
MAX_PIECE = 256 << 10


class LinkStalled(RuntimeError):
    pass


PONG_TICK = 0.05   # s: how often a ping's waiter wakes to count the silence in running time


async def pong_rtt(waiter, timeout: float, tick: float = PONG_TICK) -> float | None:
    """The RTT a ping measured, or None when it is unanswered within `timeout` of this
    process's running time (core/heartbeat.py Silence: our own loop held is not the
    peer's silence). None is one figure missing, not a verdict: the heartbeat judges the
    peer, and the next ping measures again.

    The figure keeps whatever our own loop was held meanwhile, on purpose: the acks that
    pace this link come back through the same loop, so the in-flight cap sized by this
    RTT must cover that time too, or a loaded machine's cap undercuts its own ack clock
    and the measured goodput spirals down."""
    silence = Silence(timeout, tick, time.monotonic())
    while not waiter.done():
        await asyncio.wait({waiter}, timeout=tick)
        if silence.advance(time.monotonic()) and not waiter.done():
            return None
    latency = waiter.result()
    return latency if isinstance(latency, float) and latency >= 0 else None


def shrink_socket_buffers(ws, sndbuf: int = SNDBUF) -> None:
    """Keep the kernel from becoming a second, FIFO scheduler below ours."""
    sock = ws.transport.get_extra_info("socket") if ws.transport else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    try:
        ws.transport.set_write_buffer_limits(high=16 << 10)
    except (AttributeError, RuntimeError):
        pass


class LinkSender:
    def __init__(self, ws, scheduler: LinkScheduler | None = None, *, piece: int | None = None,
                 min_in_flight: int | None = None, max_in_flight: int = 16 << 20,
                 stall_timeout: float = 60.0, ping_interval: float = 1.0, clock=time.monotonic,
                 on_failed=None, acked: bool = True, trace=None):
        self.ws = ws
        self.trace = trace or (lambda tag: None)   # engine/pipeline/hop_trace.py
        self.sched = scheduler or LinkScheduler()
        self.piece = piece
        self.min_in_flight = min_in_flight
        self.max_in_flight = max_in_flight
        self.stall_timeout = stall_timeout
        self.ping_interval = ping_interval
        self.clock = clock
        self.on_failed = on_failed or (lambda reason: None)
        # acked=False: the receiver sends no acks (processes sharing one CPU over
        # loopback, engine/model/cores.py): nothing to measure there, and each ack is a
        # message handled on both ends while the cores compute. Then nothing counts as
        # in flight: TCP back-pressure and the receiver's bounded queue hold the sender.
        self.acked = acked
        self._ids = itertools.count(1)
        self._data: dict[int, bytes] = {}
        self._committed: deque = deque()      # pieces decided but not yet written
        self._sent: deque = deque()           # (volume id, bytes) awaiting ack, in order
        self.in_flight = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.failed: str | None = None
        self.peer_gone = False   # the socket closed under us (see open_link's reader)
        # the receiver stopped answering (our heartbeat went unanswered, or it stopped
        # reading): frozen or unreachable, so asking it back would only wait out a timeout
        self.unanswered = False
        self.rtt_min: float | None = None
        self.goodput = GoodputMeter(self.sched.link)   # from acks, while there is a backlog
        self.bytes_sent = 0
        shrink_socket_buffers(ws)

    def start(self) -> "LinkSender":
        self._tasks = [asyncio.ensure_future(self._run())]
        if self.ping_interval:
            self._tasks.append(asyncio.ensure_future(self._pinger()))
        return self

    async def close(self):
        for t in self._tasks:
            t.cancel()

    @property
    def piece_bytes(self) -> int:
        """Largest piece per write: `piece` if given, else PIECE_TIME of measured link time."""
        if self.piece:
            return self.piece
        return max(MIN_PIECE, min(MAX_PIECE, int(self.sched.link.bandwidth * PIECE_TIME)))

    def piece_for(self, kind: str) -> int:
        """Pieces let decode overtake a prefill; a decode volume itself goes whole (up
        to MAX_PIECE): cut in two, 8 rows of the default model paid a second frame and
        acknowledgement on every hop."""
        return MAX_PIECE if kind == "decode" else self.piece_bytes

    @property
    def cap(self) -> int:
        """Bytes allowed in flight: about one bandwidth-delay product, plus a piece.

        The floor is in link time too (unless `min_in_flight` is given): 256 KiB is
        21 ms at 100 Mbit/s but 5 s at 0.4 Mbit/s, and a decode volume queued behind
        what is in flight waits for all of it."""
        bw = self.sched.link.bandwidth
        rtt = self.rtt_min if self.rtt_min is not None else self.sched.link.rtt
        piece = self.piece_bytes
        floor = self.min_in_flight if self.min_in_flight is not None else \
            min(MAX_PIECE, max(2 * piece, int(bw * MIN_IN_FLIGHT_TIME)))
        bdp = int(bw * rtt) + piece
        return max(floor, min(self.max_in_flight, bdp))

    def submit(self, data: bytes, kind: str) -> int:
        if self.failed:
            raise LinkStalled(self.failed)
        vid = next(self._ids) & 0xFFFFFFFF
        self._data[vid] = data
        self.sched.enqueue(vid, kind, len(data), self.clock())
        self._wake.set()
        return vid

    def on_ack(self, volume_id: int, nbytes: int) -> None:
        """The receiver got `nbytes` of a piece of `volume_id` (pieces ack in order)."""
        if not self._sent or self._sent[0] != (volume_id, nbytes):
            raise frames.FrameError(f"acknowledgement for something never sent (volume {volume_id}, {nbytes} B)")
        self._sent.popleft()
        self.in_flight -= nbytes
        backlog = bool(self.sched.pending or self._committed or self.in_flight >= self.cap // 2)
        self.goodput.on_ack(self.clock(), nbytes, backlog)
        self._wake.set()

    async def _pinger(self):
        try:
            while True:
                await asyncio.sleep(self.ping_interval)
                ahead = self.in_flight / max(1.0, self.sched.link.bandwidth)
                waiter = await self.ws.ping()
                rtt = await pong_rtt(waiter, self.stall_timeout)
                if rtt is None:
                    continue
                self.sched.link.observe_rtt(rtt)
                self.rtt_min = next_rtt_min(self.rtt_min, rtt, ahead)
        except (ConnectionClosed, asyncio.CancelledError):
            pass

    async def _run(self):
        try:
            while True:
                sent_any = False
                while self.in_flight < self.cap:
                    if not self._committed:
                        s = self.sched.next_send(self.clock())
                        if s is None:
                            break
                        data = self._data[s.volume_id]
                        piece = self.piece_for(s.kind)
                        for off in range(s.offset, s.offset + s.length, piece):
                            end = min(off + piece, s.offset + s.length)
                            self._committed.append((s.volume_id, s.kind, off, end, len(data)))
                        if s.last:
                            self._committed.append((s.volume_id, None, 0, 0, 0))  # release marker
                    vid, kind, off, end, total = self._committed.popleft()
                    if kind is None:
                        self._data.pop(vid, None)
                        continue
                    piece = memoryview(self._data[vid])[off:end]
                    if self.acked:
                        self._sent.append((vid, end - off))
                        self.in_flight += end - off
                    self.bytes_sent += end - off
                    # a peer that stops reading blocks this write (TCP back-pressure)
                    self.trace("link.sent")
                    send = asyncio.ensure_future(self.ws.send(encode_chunk(vid, kind, off, total, piece)))
                    # a send that fails as this task is cancelled (the link closing) has its
                    # error taken here, not logged as "never retrieved"
                    send.add_done_callback(_taken)
                    await asyncio.wait_for(send, self.stall_timeout)
                    sent_any = True
                if not sent_any:
                    if self.peer_gone:
                        # an idle link never writes, so it would never learn: without
                        # this its task (and whatever made it) lived as long as the process,
                        # and its owner would find out only when the next request failed on it
                        if self.in_flight:
                            raise ConnectionClosed(None, None)   # and took something with it
                        self.failed = self.failed or "connection closed"
                        self.on_failed(self.failed)
                        return
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.stall_timeout)
                    except asyncio.TimeoutError:
                        if self.in_flight:  # nothing acknowledged for a whole timeout
                            raise
        except asyncio.TimeoutError:
            self.unanswered = True
            self.failed = (f"the receiver stopped reading: {self.in_flight} bytes unacknowledged "
                           f"for {self.stall_timeout:.0f} s")
            log.error(self.failed)
            self.on_failed(self.failed)
            await self.ws.close(1011, "peer stopped reading")
        except ConnectionClosed:
            self.failed = self.failed or "connection closed"
            self.on_failed(self.failed)
        except asyncio.CancelledError:
            pass


def _taken(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def open_link(ws, mode: str, decode_time, on_failed=None, **kw) -> LinkSender:
    """A started LinkSender on `ws`, plus the task that reads the receiver's acks (with
    acked=False, one that refuses any: the receiver was told to send none)."""
    link = LinkSender(ws, LinkScheduler(mode=mode, decode_time=decode_time), on_failed=on_failed, **kw).start()

    async def read_acks():
        try:
            async for msg in ws:
                m = frames.parse_control(msg)
                if m["type"] != "ack":
                    raise frames.FrameError(f"unexpected {m['type']} on a data link")
                link.on_ack(m["v"], m["bytes"])
        except frames.FrameError as exc:
            link.failed = f"the receiver sent a bad message: {exc}"
            link.on_failed(link.failed)
            await ws.close(1008, str(exc)[:120])
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == 1011 and exc.rcvd is None:
                link.unanswered = True       # our heartbeat went unanswered
                link.failed = link.failed or "the receiver stopped answering"
        link.peer_gone = True   # (not when cancelled: the link is being closed anyway)
        link._wake.set()

    link._tasks.append(asyncio.ensure_future(read_acks()))
    return link
