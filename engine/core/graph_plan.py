"""Which decode steps replay a captured CUDA graph, and which graphs a stage keeps (issue 42).

On a GPU a decode step is a few milliseconds of kernels, and launching them one by one
from Python costs more than running them: the GPU idles most of every step. A captured
graph replays the step's whole kernel sequence with one launch, but only for the shape it
was captured at and over the same buffers. So a step is rounded up to a bucket:

* rows to the next of `row_buckets` (the padding rows repeat the last real row: they
  compute and write exactly what it does, and their outputs are dropped);
* tokens per row: 1 for decoding; for a speculative verification step of 1 + k, every
  row alike (a step whose rows differ runs eagerly), up to the next of
  `verify_tokens` (the padding positions repeat the row's last token, write KV past
  the row's length that its next step overwrites, and their outputs are dropped): the
  speculation policy picks any k from 1 to 8 as acceptance moves, and each k met for
  the first time was a capture in the middle of a reply;
* keys attended over to the next power of two from `min_kv` (each row's mask hides the
  keys past its own length), so a graph serves a whole range of context lengths; and
  from more for few rows (`floors`, from `row_floors`): a step reads every weight, and
  one user's keys are a small share beside them even at 2,048, so a chat's context
  crosses no bucket -- each crossing a capture in the middle of a reply, on a GPU a
  fifth of a second of an 8B model's -- until it is that long;
* where the rows sit in the KV store: in the first slots, 0 on (a graph attends over a
  slice of the store, no copy), or anywhere else (a graph gathers its rows' keys). Not a
  graph per first slot: a conversation lands in whichever slot is free (one freed a
  moment late sends the next reply to slot 1), and each new slot would be a capture in
  the middle of a reply (an H200 window's one-user figure lost a tenth to one).

Pure: the stage asks `shape_for`, the runner (engine/model/cuda_graphs.py) captures, and
`GraphBook` remembers what was captured, what failed and why, and evicts the least
recently used graph past `max_graphs` (each holds its buffers, and the capture pool
grows with the largest).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_KV = 256
# 1 + k tokens a row: a verification step of up to 8 drafted tokens (engine/core/speculation.py)
MAX_TOKENS_PER_ROW = 9
# the buckets a verification step's tokens are padded up to: on a GPU a step of one row
# reads every weight whatever its few tokens, so a padded position costs little; four
# graphs per row count and context serve every k
VERIFY_TOKENS = (2, 3, 5, 9)
MAX_GRAPHS = 48
# the most a step's keys read past its context may add to the bytes it reads anyway, its
# weights', where row_floors sets a bucket's floor above `min_kv`
KEY_SHARE = 0.03
# captures that fail (for any shape) before a stage stops trying: a family whose step
# cannot be captured fails the same way at every shape
MAX_FAILURES = 3


@dataclass(frozen=True)
class StepShape:
    rows: int              # a row bucket
    tokens: int            # per row
    kv_len: int            # keys attended over
    lo: int | None = None  # first slot when the rows sit in adjacent slots, else None (gathered)

    def label(self) -> str:
        where = "gathered" if self.lo is None else f"slots {self.lo}+"
        return f"{self.rows}x{self.tokens} over {self.kv_len} keys ({where})"


@dataclass(frozen=True)
class GraphPlan:
    row_buckets: tuple[int, ...] = ROW_BUCKETS
    min_kv: int = MIN_KV
    max_kv: int | None = None            # longest context a graph attends over (None: any)
    max_tokens: int = MAX_TOKENS_PER_ROW
    verify_tokens: tuple[int, ...] = VERIFY_TOKENS
    floors: tuple[tuple[int, int], ...] = ()   # (rows, fewest keys) above min_kv: row_floors
    # key counts whose one-user decode graph (slot 0) is captured at load beside its floor's:
    # where the floor came down for time (ahead_keys), a chat's context grows into them
    ahead: tuple[int, ...] = ()

    def kv_bucket(self, need: int, rows: int = 1) -> int:
        b = next((keys for r, keys in self.floors if r == rows), self.min_kv)   # per step: no dict
        while b < need:
            b *= 2
        return b

    def shape_for(self, ns: list[int], starts: list[int], slots: list[int],
                  keep: list[int] | None = None) -> StepShape | str:
        """The bucket a step's rows run in, or why they run eagerly (a short reason)."""
        if not ns:
            return "no rows"
        n = ns[0]
        if any(x != n for x in ns):
            return "rows of different lengths"
        if n > self.max_tokens:
            return f"rows of {n} tokens (a prompt)"
        if n > 1 and keep != ns:
            return "rows of several tokens that are no verification"
        if n == 1 and keep is not None and any(k != 1 for k in keep):
            return "a row keeps more positions than it has"
        rows = next((b for b in self.row_buckets if b >= len(ns)), None)
        if rows is None:
            return f"{len(ns)} rows, more than {self.row_buckets[-1]}"
        tokens = n if n == 1 else next((t for t in self.verify_tokens if t >= n), n)
        if self.max_kv is not None and max(starts) + tokens > self.max_kv:
            tokens = n        # near the context's end the padding would not fit: as it is
        need = max(s + tokens for s in starts)
        kv_len = self.kv_bucket(need, rows)
        if self.max_kv is not None and kv_len > self.max_kv:
            if need > self.max_kv:
                return f"a context of {need} tokens, past {self.max_kv}"
            kv_len = self.max_kv
        lo = 0 if slots == list(range(len(slots))) else None
        return StepShape(rows, tokens, kv_len, lo)

    def warm_shapes(self, up_to_rows: int = 16) -> list[StepShape]:
        """What a stage captures at load: decode steps of every row bucket up to
        `up_to_rows` in the first slots, one user's in any slot, and one user's
        verification steps in either (speculation drafts for one user, whose
        conversation sits in slot 0 or, beside another's kept reply, anywhere:
        engine/core/speculation.py, kept_prefixes.py), at the shortest context (a chat's
        first replies). Each shape met later is a capture in the middle of a reply."""
        first = [StepShape(r, 1, self.kv_bucket(1, r), 0) for r in self.row_buckets if r <= up_to_rows]
        one = self.kv_bucket(1, 1)
        verify = [StepShape(1, t, one, lo) for lo in (0, None) for t in self.verify_tokens if t <= self.max_tokens]
        return first + [StepShape(1, 1, one, None)] + verify + [StepShape(1, 1, k, 0) for k in self.ahead]


def row_floors(weight_bytes: int, kv_bytes_per_token: int, cap: int, row_buckets=ROW_BUCKETS,
               min_kv: int = MIN_KV, share: float = KEY_SHARE) -> tuple[tuple[int, int], ...]:
    """The fewest keys each row bucket's graphs attend over: the longest power of two from
    `min_kv` up to `cap` (what the KV store holds a slot at once) whose keys, read for
    every row, add at most `share` to the weights' bytes. An 8B model's one user: 2,048;
    its 16 rows: 256, as before; a model of 135M parameters: 256 for every bucket."""
    out = []
    for rows in row_buckets:
        keys = min_kv
        while keys * 2 <= cap and rows * keys * 2 * kv_bytes_per_token <= share * weight_bytes:
            keys *= 2
        if keys > min_kv:
            out.append((rows, keys))
    return tuple(out)


def ahead_keys(byte_floors: tuple[tuple[int, int], ...], timed: tuple[tuple[int, int], ...],
               min_kv: int = MIN_KV) -> tuple[int, ...]:
    """The key buckets one user's floor gave up for time (timed_floors), up to where the
    byte rule had it: their decode graphs are captured at load instead of in the middle
    of a reply as the chat's context reaches each."""
    most = dict(byte_floors).get(1, min_kv)
    keys = dict(timed).get(1, min_kv) * 2
    out = []
    while keys <= most:
        out.append(keys)
        keys *= 2
    return tuple(out)


def timed_floors(byte_floors: tuple[tuple[int, int], ...], attention, weight_seconds: float, layers: int,
                 min_kv: int = MIN_KV, share: float = KEY_SHARE) -> tuple[tuple[int, int], ...]:
    """row_floors' floors lowered where the keys cost more time than their bytes say:
    the longest power of two, up to the byte rule's floor, whose attention (timed on the
    device: `attention(rows, keys)`, seconds a layer) adds at most `share` of the time the
    step's weights take to read (`weight_seconds`) over `layers` layers, beside attending
    over `min_kv` keys. On a GPU one row's attention walks its keys a block per key/value
    head, far below the bandwidth its bytes would take (engine/model/key_clock.py)."""
    out = []
    for rows, most in byte_floors:
        base = attention(rows, min_kv)
        keys = min_kv
        while keys * 2 <= most and layers * (attention(rows, keys * 2) - base) <= share * weight_seconds:
            keys *= 2
        if keys > min_kv:
            out.append((rows, keys))
    return tuple(out)


@dataclass
class GraphBook:
    """What a stage's runner captured, how long it took, and what it gave up on."""

    max_graphs: int = MAX_GRAPHS
    max_failures: int = MAX_FAILURES
    failed: dict[StepShape, str] = field(default_factory=dict)
    disabled: str | None = None          # why nothing is captured any more
    # why no verification step is captured any more: its several tokens a row may take a
    # path a decode step does not (a product that reads the host), and its shapes, tried
    # at load, must not cost every decode step its graphs
    verify_disabled: str | None = None
    captures: int = 0
    capture_seconds: float = 0.0
    capture_bytes: int = 0               # growth of the device's reserved memory over captures
    replays: int = 0
    eager: dict[str, int] = field(default_factory=dict)   # reason -> steps that ran eagerly
    _live: OrderedDict = field(default_factory=OrderedDict)

    def may_capture(self, shape: StepShape) -> bool:
        if self.disabled is not None or shape in self.failed:
            return False
        return shape.tokens == 1 or self.verify_disabled is None

    def captured(self, shape: StepShape, seconds: float, grew_bytes: int) -> list[StepShape]:
        """Record a capture; returns the shapes to drop (least recently used first)."""
        self.captures += 1
        self.capture_seconds += seconds
        self.capture_bytes += max(0, grew_bytes)
        self._live[shape] = True
        self._live.move_to_end(shape)
        drop = []
        while len(self._live) > self.max_graphs:
            old, _ = self._live.popitem(last=False)
            drop.append(old)
        return drop

    def used(self, shape: StepShape) -> None:
        self.replays += 1
        if shape in self._live:
            self._live.move_to_end(shape)

    def forget(self, shape: StepShape | None = None) -> None:
        """A graph dropped (its buffers moved: the KV store grew), or all of them."""
        if shape is None:
            self._live.clear()
        else:
            self._live.pop(shape, None)

    def capture_failed(self, shape: StepShape, reason: str) -> None:
        self.failed[shape] = reason
        verify = shape.tokens > 1
        n = sum(1 for s in self.failed if (s.tokens > 1) == verify)
        if n < self.max_failures:
            return
        if verify and self.verify_disabled is None:
            self.verify_disabled = f"{n} captures of verification steps failed, the last: {reason}"
        elif not verify and self.disabled is None:
            self.disabled = f"{n} captures failed, the last: {reason}"

    def ran_eagerly(self, reason: str) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1

    @property
    def live(self) -> list[StepShape]:
        return list(self._live)

    def summary(self) -> dict:
        """For the stage's status and the GPU benchmark."""
        return {"graphs": len(self._live), "captures": self.captures, "replays": self.replays,
                "capture_s": round(self.capture_seconds, 3), "capture_mib": round(self.capture_bytes / 2**20, 1),
                "disabled": self.disabled, "verify_disabled": self.verify_disabled,
                "failed": {s.label(): r for s, r in self.failed.items()},
                "eager": dict(self.eager)}
