"""What an outbound link sends next: decode first, prefill in just-in-time chunks.

Sans-I/O: a pure object fed events (volumes queued, compute started/finished, link
measurements) and the current time; `next_send(now)` answers with the next piece to
hand to the socket, or None. The transport and the simulator run this same code.

Policy (MoLink, DESIGN.md "Weak links"):
  * two queues, decode and prefill; decode goes first while the waiting weight W (decode
    sends made while a prefill waited) is below N;
  * when the decode queue is empty, or W >= N, the head-of-line prefill is served: its
    whole remainder if W >= N (no starvation), else one chunk; every prefill send
    resets W;
  * the chunk is sized to finish before the next decode volume needs the link:
    window x bandwidth, where the window is
      - T_d(n) when a decode execution starts with the chunk,
      - t_s + T_d(n) - now while a decode execution started at t_s is running,
      - t_p + T_loop - now when none runs (the next decode is a pipeline loop away:
        T_loop = sum of stage decode times + link times, measured or given).
Modes: "fifo" (whole volumes in arrival order: what vLLM and Helix do), "fixed"
(decode-first, fixed chunk size) and "jit" (decode-first, just-in-time chunks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

MODES = ("fifo", "fixed", "jit")
FIXED_CHUNK_TIME = 0.020     # s of link time: 256 KiB at 100 Mbit/s
MIN_CHUNK_TIME = 0.0013      # s of link time: 16 KiB at 100 Mbit/s ...
MIN_CHUNK_FLOOR = 2 << 10    # ... but never below 2 KiB


@dataclass
class Volume:
    id: int
    kind: str            # "decode" | "prefill"
    nbytes: int
    queued_at: float
    sent: int = 0

    @property
    def remaining(self) -> int:
        return self.nbytes - self.sent


@dataclass(frozen=True)
class Send:
    volume_id: int
    kind: str
    offset: int
    length: int
    last: bool           # this piece completes the volume


@dataclass
class LinkEstimate:
    """Measured link: goodput in bytes/s and round-trip time in seconds (EWMA)."""

    bandwidth: float = 12.5e6     # 100 Mbit/s until measured
    rtt: float = 0.0
    alpha: float = 0.25
    samples: int = 0
    # the smallest RTT seen: the path's own delay, without the queueing a busy link
    # adds to pings (which the EWMA includes)
    rtt_min: float = float("inf")

    def observe_goodput(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            return
        self.bandwidth = bytes_per_s if self.samples == 0 else (
            (1 - self.alpha) * self.bandwidth + self.alpha * bytes_per_s)
        self.samples += 1

    def observe_rtt(self, rtt: float) -> None:
        if rtt >= 0:
            self.rtt = rtt if self.rtt == 0 else (1 - self.alpha) * self.rtt + self.alpha * rtt
            self.rtt_min = min(self.rtt_min, rtt)


RTT_MIN_RISE = 1.01   # how far one ping over a busy link lets the sender's RTT floor rise


def next_rtt_min(current: float | None, rtt: float, ahead: float) -> float:
    """The round trip a sender sizes its bytes in flight by, after one more ping.

    `ahead`: seconds of link time our own unacknowledged bytes took when the ping was
    sent (bytes in flight / the goodput estimate), at most what the ping waited behind.
    A cap sized by the round trips of pings that queued behind our own bytes would grow
    its own queue, so over a busy link the floor only falls, or rises by RTT_MIN_RISE a
    ping. But the round trip less `ahead` is the path's and the receiver's own at the
    least, a busy receiver's late answers included: where that is above the floor, the
    floor was wrong and rises to it at once. Without that, a friend whose machine got
    busy mid-evening took minutes to be allowed for, the goodput measured falling with
    the cap meanwhile (bench/ack_hold.py --late)."""
    if current is None:
        return rtt
    return max(min(current * RTT_MIN_RISE, rtt), rtt - ahead)


GOODPUT_SPAN = 0.05   # s: acknowledged bytes are summed over at least this long per sample


class GoodputMeter:
    """Goodput from acknowledgements, fed to a LinkEstimate: bytes acknowledged over a
    span of at least GOODPUT_SPAN, counted only while the link has a backlog (an idle
    link says nothing about its rate). The sender and the simulator share it."""

    def __init__(self, estimate: LinkEstimate):
        self.estimate = estimate
        self._start: float | None = None
        self._bytes = 0

    def on_ack(self, now: float, nbytes: int, backlog: bool) -> None:
        if self._start is None:
            self._start, self._bytes = now, 0
        else:
            self._bytes += nbytes
            span = now - self._start
            if span >= GOODPUT_SPAN:
                self.estimate.observe_goodput(self._bytes / span)
                self._start, self._bytes = now, 0
        if not backlog:
            self._start = None


@dataclass
class LinkScheduler:
    mode: str = "jit"
    n_wait: int = 30                        # N: decode sends before a waiting prefill goes whole
    # Byte sizes given here are used as such; left None they follow the measured
    # bandwidth (a fixed byte count is 21 ms at 100 Mbit/s but seconds on a slow home
    # uplink, where a decode would wait behind it for all that time).
    fixed_chunk: int | None = None          # bytes, "fixed" mode (None: FIXED_CHUNK_TIME of link)
    min_chunk: int | None = None            # never smaller: per-send overhead dominates below
    decode_time: Callable[[int], float] = lambda n: 0.02   # T_d(n): profiled decode execution time
    loop_time: float | None = None          # T_loop: given by the head, else learned
    link: LinkEstimate = field(default_factory=LinkEstimate)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.n_wait < 1:
            raise ValueError("n_wait must be at least 1")
        self.decode_q: deque[Volume] = deque()
        self.prefill_q: deque[Volume] = deque()
        self.fifo_q: deque[Volume] = deque()
        self.w = 0
        self._ids: set[int] = set()
        # compute state of the stage that feeds this link
        self._decode_started: float | None = None
        self._decode_tokens = 1
        self._last_decode_end: float | None = None
        self._loop_ewma: float | None = None

    # ---- events -------------------------------------------------------------
    def enqueue(self, volume_id: int, kind: str, nbytes: int, now: float) -> None:
        if kind not in ("decode", "prefill"):
            raise ValueError(f"unknown volume kind {kind!r}")
        if nbytes <= 0:
            raise ValueError("a volume has at least one byte")
        if volume_id in self._ids:
            raise ValueError(f"volume {volume_id} is already queued")
        self._ids.add(volume_id)
        v = Volume(volume_id, kind, nbytes, now)
        if self.mode == "fifo":
            self.fifo_q.append(v)
        elif kind == "decode":
            self.decode_q.append(v)
        else:
            self.prefill_q.append(v)

    def decode_compute_started(self, now: float, n_tokens: int) -> None:
        """The stage feeding this link began a decode execution of n_tokens rows."""
        self._decode_started = now
        self._decode_tokens = max(1, n_tokens)

    def decode_compute_finished(self, now: float) -> None:
        if self._last_decode_end is not None and self._decode_started is not None:
            # the gap between decode executions is what the next prediction needs
            period = now - self._last_decode_end
            if self._loop_ewma is not None:
                # an idle pipeline or a stretch of prefill-only steps is not the decode
                # cadence: one such gap (seconds) would size the next chunks to seconds
                period = min(period, 2 * self._loop_ewma)
            if period > 0:
                self._loop_ewma = period if self._loop_ewma is None else 0.75 * self._loop_ewma + 0.25 * period
        self._last_decode_end = now
        self._decode_started = None

    @property
    def pending(self) -> int:
        return len(self.decode_q) + len(self.prefill_q) + len(self.fifo_q)

    @property
    def pending_bytes(self) -> int:
        return sum(v.remaining for q in (self.decode_q, self.prefill_q, self.fifo_q) for v in q)

    # ---- decisions ----------------------------------------------------------
    def window(self, now: float) -> float:
        """Seconds until the next decode volume needs the link (DESIGN.md's three cases)."""
        td = self.decode_time(self._decode_tokens)
        if self._decode_started is not None:
            return max(0.0, self._decode_started + td - now)
        if self._last_decode_end is None:
            return td  # nothing measured yet: assume a decode starts with the chunk
        loop = self.loop_time if self.loop_time is not None else self._loop_ewma
        if loop is None:
            return td
        t_f = self._last_decode_end + loop
        return t_f - now if t_f > now else td

    def chunk_size(self, now: float) -> int:
        bw = self.link.bandwidth
        if self.mode == "fixed":
            return self.fixed_chunk or max(MIN_CHUNK_FLOOR, int(bw * FIXED_CHUNK_TIME))
        floor = self.min_chunk if self.min_chunk is not None else max(MIN_CHUNK_FLOOR, int(bw * MIN_CHUNK_TIME))
        return max(floor, int(self.window(now) * bw))

    def next_send(self, now: float) -> Send | None:
        if self.mode == "fifo":
            if not self.fifo_q:
                return None
            return self._take(self.fifo_q, self.fifo_q[0].remaining)
        if self.decode_q and (not self.prefill_q or self.w < self.n_wait):
            if self.prefill_q:
                self.w += 1
            return self._take(self.decode_q, self.decode_q[0].remaining)
        if self.prefill_q:
            v = self.prefill_q[0]
            length = v.remaining if self.w >= self.n_wait else min(v.remaining, self.chunk_size(now))
            self.w = 0
            return self._take(self.prefill_q, length)
        return None

    def _take(self, q: deque, length: int) -> Send:
        v = q[0]
        s = Send(v.id, v.kind, v.sent, length, v.sent + length == v.nbytes)
        v.sent += length
        if s.last:
            q.popleft()
            self._ids.discard(v.id)
        return s
