"""The head's decisions when a stage leaves, sans-I/O: who is gone, whom to ask back
and when, when to give up, and what the status says. The head (engine/pipeline/head.py)
does the I/O -- closing connections, saying hello, loading layers, replaying sequences
-- and feeds this object what happened; tests feed it plain events and a clock.

    rec = Recovery(["ws://a", "ws://b"], wait_timeout=300)
    rec.formed(["ws://a", "ws://b"])               # these hold layers now
    if rec.lost(1, "ws://a", "stage 1 left: switched off", rec.epoch):
        asks = rec.begin(["ws://a", "ws://b"], ranges, now, lost=1)   # a new arrangement
        for ask in asks:                           # hello each machine as ask says
            rec.answered(ask)  or  rec.unanswered(ask, why, now)
        rec.forming(now)                           # split the layers, load them ...
        rec.no_room(need, have, now)               # ... or the machines left cannot:
        rec.to_ask(now); rec.take(address)         #   ask who left every wait_s(now),
        rec.gave_up(now)                           #   until the host's timeout passes
        rec.recovered(now, stages, ranges, replayed)
    rec.watching / rec.may_ask / rec.to_ask(now) / rec.came(address, now)   # machines coming back:
    rec.ahead(layers) ... rec.begin(..., joined=address)   # it loads its layers while the pipeline
    rec.joined_gone(address, why, now)                     # serves, then a rearrangement takes it in
    rec.turned_away(address, why)                          # (or it cannot take the model)
    rec.leaving(index, address, why, epoch) ... rec.lost(...)   # a stage with notice: the others load
                                                           # its layers while it serves, then it is lost
    rec.too_slow(address, why, now)                # it answers, but its line cannot carry
                                                   # its take-in yet (core/line_check.py)
    rec.offer(address, now)                        # a machine offers itself
    rec.rank(address)                              # its place in the pipeline's order

Every rearrangement bumps `epoch`: what the head computed for an older arrangement is
void. `status` is what the pipeline is doing about it (None: serving), `events` the
record (left, waiting, recovered, back, joined, rejoined), `failed` why it cannot serve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core import line_check

# how often machines that left are asked whether they are back, and for how long
WATCH_S, REJOIN_GRACE_S = 2.0, 600.0
# how the stages left are asked to go on (they should answer: they are up), and how
# the one that left is (briefly: it may only have dropped its connection). A stage
# still letting its last head go refuses at once, so it is asked again; one that says
# nothing within SURVIVOR_WITHIN_S (asleep, its line cut at the same moment) is gone
# too: every request waits while it is asked, and the watch asks it back later
SURVIVOR_ATTEMPTS, SURVIVOR_TIMEOUT_S, SURVIVOR_WITHIN_S = 10, 5.0, 8.0
LOST_ATTEMPTS, LOST_TIMEOUT_S = 1, 2.0
# a machine that left or offered itself, asked whether it is (still) there
PROBE_TIMEOUT_S = 2.0
# a machine that keeps dropping out (a line that collapsed: each time it is taken back,
# replaying the conversations over it stalls them until it drops again) is asked back
# later each time: its second drop within DROPS_WINDOW_S waits HOLD_S[0], later ones
# HOLD_S[1]. Only while the pipeline serves without it; one it cannot do without is
# asked as ever
DROPS_WINDOW_S, HOLD_S = 600.0, (30.0, 120.0)


def missing_ranges(ranges: list[tuple[int, int]], kept: list[bool]) -> list[tuple[int, int]]:
    """The layers the old arrangement's stages held and nobody holds now: the ranges of
    the stages not kept (stage i held ranges[i]), neighbouring ones merged."""
    out: list[tuple[int, int]] = []
    for (a, b), k in zip(ranges, kept):
        if k:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def describe_layers(ranges: list[tuple[int, int]]) -> str:
    """'layer 5', 'layers 13–30', 'layers 4–6 and 21–30', 'layers 2, 4–6 and 21–30': counted
    from 1, as people count and the joiner's own line says ("layers 25–30 of 30"), from
    half-open [start, end) ranges counted from 0."""
    parts = [f"{a + 1}" if b - a == 1 else f"{a + 1}–{b}" for a, b in ranges]
    word = "layer" if len(ranges) == 1 and ranges[0][1] - ranges[0][0] == 1 else "layers"
    if len(parts) <= 1:
        return f"{word} {''.join(parts)}"
    return f"{word} {', '.join(parts[:-1])} and {parts[-1]}"


def waiting_status(missing: list[tuple[int, int]], need: int, have: int) -> tuple[str, str]:
    """What a pipeline that cannot hold the model says while it waits for a machine:
    (the status, what it waits for). missing: the layers nobody holds (empty when the
    shortfall is not one stage's, e.g. a machine that came back with less room)."""
    what = describe_layers(missing) if missing else f"{max(1, need - have)} more layers"
    room = (f"the machines left have room for {have} of the model's {need} layers" if have < need
            else "a machine left has no room for even one layer")
    return f"waiting for a computer to hold {what} ({room})", what


@dataclass(frozen=True)
class Ask:
    """Say hello to the machine that held stage `index` of the old arrangement."""
    address: str
    index: int
    attempts: int
    timeout: float
    lost: bool       # the one that left
    within: float | None = None   # no attempt starts after this many seconds


class Recovery:
    def __init__(self, addresses: list[str], wait_timeout: float = 300.0, *, watch_s: float = WATCH_S,
                 grace_s: float = REJOIN_GRACE_S, wall=time.time):
        self.wait_timeout = wait_timeout   # how long requests wait for room before they fail
        self.watch_s, self.grace_s = watch_s, grace_s
        self._wall = wall                  # the events' timestamps (decisions use `now`)
        self.epoch = 0                     # bumps at each rearrangement
        self.status: str | None = None     # why the pipeline is rearranging (None: it serves)
        self.events: list[dict] = []       # who left, why, how long recovery took
        self.failed: str | None = None     # why the pipeline cannot serve
        self.closed = False
        self.order = list(addresses)       # every machine in pipeline order: one coming back takes its place
        self.holders: list[str] = []       # the machines holding layers now (the head aside)
        self.away: dict[str, float] = {}   # machines that left or offered themselves -> since when
        self.served: set[str] = set()      # machines that held layers here (come back vs join)
        self.drops: dict[str, list[float]] = {}   # when each machine dropped out without notice
        # machines that answered but whose line could not carry their take-in (line_check.py):
        # not asked again before this time
        self.slow_until: dict[str, float] = {}
        self.slow_times: dict[str, int] = {}      # ... after how many tests in a row
        self._noticed: str | None = None   # the machine that said it is leaving
        # the rearrangement in progress
        self._t0 = self._t_plan = 0.0
        self._old_ranges: list[tuple[int, int]] = []
        self._kept: list[bool] = []
        self._joined = False
        self._deadline: float | None = None
        self._what = ""
        self._index: dict[str, int] = {}   # the old arrangement's machines -> their stage index
        self._need_have: tuple[int, int] | None = None   # the last no_room's
        # a machine that answered the watch, loading its layers ahead while the pipeline
        # serves (the rearrangement that takes it in follows): its address, since when
        self.joining: str | None = None
        self.joining_status: str | None = None
        self.joining_progress: float | None = None   # 0..1, as its loading reports it
        # a stage that said it is leaving, whose layers the others load while it still
        # serves (the rearrangement that lets it go follows): its address, the status
        self.parting: str | None = None
        self.parting_status: str | None = None
        self._t_came: float | None = None
        self._ahead_s: float | None = None
        self._loaded_ahead = False

    # ---- the machines ----------------------------------------------------------
    def formed(self, holders: list[str]) -> None:
        """These machines hold layers now (in pipeline order)."""
        self.holders = list(holders)
        self.served.update(holders)
        for a in holders:
            self.away.pop(a, None)
            self.slow_until.pop(a, None)
            self.slow_times.pop(a, None)

    def offer(self, address: str, now: float) -> bool:
        """A machine offers its stage: it is asked, as the machines that left are, until it
        answers. False when it already holds layers."""
        if address in self.holders:
            return False
        if address not in self.order:
            self.order.append(address)
        self.away.setdefault(address, now)
        return True

    def to_ask(self, now: float) -> list[str]:
        """The machines to ask now whether they are there, first left first: those that left
        (or offered themselves) within the grace period; the others are forgotten. While
        the pipeline serves, one that keeps dropping out waits out its hold first."""
        for address, since in list(self.away.items()):
            if now - since > self.grace_s:
                del self.away[address]
                self.slow_until.pop(address, None)
                self.slow_times.pop(address, None)
        if self.status is not None:   # waiting for room: whoever could give it
            return list(self.away)
        return [a for a, since in self.away.items()
                if now - since >= self.hold_s(a, now) and now >= self.slow_until.get(a, 0.0)]

    def too_slow(self, address: str, why: str, now: float) -> str:
        """A machine answered the watch, but its line cannot carry its take-in now (why):
        the pipeline serves on without it, and it is asked again later, later each time
        (line_check.hold_s). The first time in an absence is recorded (`back`: whether it
        held layers here before, or asks to join); what the log says."""
        times = self.slow_times.get(address, 0) + 1
        if times == 1:
            self._record("slow", address=address, why=why, back=address in self.served)
        self.slow_times[address] = times
        self.away[address] = now     # it is there: its grace counts from now
        wait = line_check.hold_s(times)
        self.slow_until[address] = now + wait
        return f"{address} answers, but {why}: asked again in {wait:g} s"

    def hold_s(self, address: str, now: float) -> float:
        """How long after its last drop a machine is asked back: 0, unless it dropped out
        more than once within DROPS_WINDOW_S."""
        recent = [t for t in self.drops.get(address, ()) if now - t <= DROPS_WINDOW_S]
        return 0.0 if len(recent) <= 1 else HOLD_S[min(len(recent) - 2, len(HOLD_S) - 1)]

    def _dropped(self, address: str, now: float) -> None:
        """A machine is gone (asked back later by the watch): without notice, one drop more."""
        self.away[address] = now
        if address == self._noticed:
            self._noticed = None
            return
        times = [t for t in self.drops.get(address, ()) if now - t <= DROPS_WINDOW_S]
        self.drops[address] = times + [now]

    def rank(self, address: str) -> int:
        """A machine's place in the pipeline (sort by it): one that came back takes its old
        place, a newcomer goes after those known."""
        return self.order.index(address) if address in self.order else len(self.order)

    def take(self, address: str) -> None:
        """A machine that answered is taken in: it is no longer asked."""
        self.away.pop(address, None)
        self.slow_until.pop(address, None)
        self.slow_times.pop(address, None)

    @property
    def watching(self) -> bool:
        """Whether anyone may come back (the head then asks them every watch_s)."""
        return bool(self.away) and not self.closed and not self.failed

    @property
    def may_ask(self) -> bool:
        """Whether the watch may ask now (a rearrangement in progress asks them itself)."""
        return self.watching and self.status is None and self.joining is None and self.parting is None

    def came(self, address: str, now: float, ahead: bool = True) -> str:
        """A machine answered the watch: it loads its layers ahead while the pipeline goes
        on serving (its first load would otherwise pause every conversation), then a
        rearrangement takes it in (begin(joined=...)); without `ahead`, at once. What the
        log says."""
        self.joining, self._t_came, self._loaded_ahead = address, now, False
        self.slow_until.pop(address, None)
        self.slow_times.pop(address, None)
        doing = "loading its layers while the pipeline serves" if ahead else "rearranging the pipeline"
        self.joining_status = f"{address} {self._verb(address)}: {doing}"
        self._record("back" if address in self.served else "joined", address=address, why=self.joining_status)
        return self.joining_status

    def ahead(self, layers: str, done: int = 0, total: int = 0) -> None:
        """The layers (describe_layers) the machine taking its turn loads ahead, and how far
        it is (tensors read of total, as its progress says)."""
        if self.joining is not None:
            self._loaded_ahead = True
            self.joining_progress = min(1.0, done / total) if total > 0 else None
            far = f" ({int(100 * self.joining_progress)}%)" if self.joining_progress is not None else ""
            self.joining_status = (f"{self.joining} {self._verb(self.joining)}: loading {layers}{far} "
                                   "while the pipeline serves")

    def joined_gone(self, address: str, why: str, now: float) -> str:
        """The machine loading ahead went before it was taken in: asked again later."""
        self._stop_joining()
        self._dropped(address, now)
        return f"{address} went before it was taken in ({why}): it is asked again later"

    def turned_away(self, address: str, why: str) -> str:
        """The machine loading ahead cannot take the model (its Potluck refuses it, a part
        it lacks): not taken in -- the rearrangement would fail the whole pipeline -- and
        not asked again (an offer brings it back)."""
        self._stop_joining()
        self.away.pop(address, None)
        self._record("refused", address=address, why=why)
        return f"{address} cannot take a share ({why}): it is not taken in"

    def _stop_joining(self) -> None:
        self.joining = self.joining_status = self.joining_progress = None
        self.parting = self.parting_status = None

    def leaving(self, index: int, address: str, why: str, epoch: int) -> bool:
        """Stage `index` said it is leaving: whether the others load its layers first, while
        it still serves (False: nothing else may be under way; it is lost at once instead).
        Its loss follows (lost()) once they have, or its notice runs out."""
        if epoch != self.epoch or self.failed or self.status or self.closed or self.joining or self.parting:
            return False
        self.parting = self._noticed = address
        self.parting_status = f"{why}: the others load its layers while the pipeline serves"
        self._record("leaving", stage=index, address=address, why=why)
        return True

    def _verb(self, address: str) -> str:
        return "is back" if address in self.served else "joined"

    # ---- a stage leaves ------------------------------------------------------------
    def lost(self, index: int, address: str | None, why: str, epoch: int) -> bool:
        """Stage `index` of arrangement `epoch` left: whether to rearrange (False: an older
        arrangement's stage, a rearrangement already under way, or the pipeline is done)."""
        if epoch != self.epoch or self.failed or self.status or self.closed:
            return False
        # a machine loading ahead is let go: the loss comes first (the watch asks it again);
        # a stage leaving is lost now (its layers loaded by the others or not)
        self._stop_joining()
        self.status = why
        self._record("left", stage=index, address=address, why=why)
        return True

    def begin(self, holders: list[str], ranges: list[tuple[int, int]], now: float, lost: int | None = None,
              ask_back: bool = True, joined: str | None = None) -> list[Ask]:
        """A new arrangement: who of the old one's machines to ask to go on, and how.
        holders: the old arrangement's machines (stage 1 on); ranges: its layers (the head
        first); lost: the stage that left, asked back briefly unless ask_back is False
        (it said it is leaving, or stopped answering: asking would wait out a timeout);
        joined: a machine the watch found, taken in."""
        self.epoch += 1
        self._t0 = self._t_plan = now
        self._old_ranges = list(ranges)
        self._kept = [True] + [False] * len(holders)
        self._joined = joined is not None
        self._ahead_s = None
        self._deadline = None
        self._need_have = None
        self._index = {address: i for i, address in enumerate(holders, start=1)}
        self.holders = []
        asks = []
        for i, address in enumerate(holders, start=1):
            if i == lost and not ask_back:
                self._dropped(address, now)   # it may come back: the watch asks it
            elif i == lost:
                asks.append(Ask(address, i, LOST_ATTEMPTS, LOST_TIMEOUT_S, True))
            else:
                asks.append(Ask(address, i, SURVIVOR_ATTEMPTS, SURVIVOR_TIMEOUT_S, False, SURVIVOR_WITHIN_S))
        if joined is not None:
            self.take(joined)
            self.status = self.status or f"{joined} {self._verb(joined)}: rearranging the pipeline"
            if self.joining == joined and self._loaded_ahead and self._t_came is not None:
                self._ahead_s = round(now - self._t_came, 3)
        self._stop_joining()
        return asks

    def answered(self, ask: Ask) -> None:
        self._kept[ask.index] = True

    def unanswered(self, ask: Ask, why: str, now: float) -> None:
        """A machine asked to go on did not answer: gone too (the watch asks it later)."""
        if not ask.lost:   # another one gone at the same time
            self._record("left", stage=None, address=ask.address, why=why)
        self._dropped(ask.address, now)

    def gone_meanwhile(self, address: str, why: str, now: float) -> str:
        """A machine of the new arrangement left while it was being formed or waited for
        room (a second loss): its layers are missing too, it is asked back like the
        others, and a wait's status names every missing range. The status."""
        i = self._index.get(address)
        if i is not None and i < len(self._kept):
            self._kept[i] = False
        self._dropped(address, now)
        self._record("left", stage=i, address=address, why=why)
        if self._need_have is not None and self.missing():
            # the room left is not known until the layers are split again: say who went
            self._what = describe_layers(self.missing())
            self.status = f"waiting for a computer to hold {self._what} (another machine left meanwhile: {why})"
        else:
            self.status = f"{address} left too ({why}): rearranging the pipeline"
        return self.status

    def missing(self) -> list[tuple[int, int]]:
        """Every range of layers the old arrangement held that nobody holds now."""
        return missing_ranges(self._old_ranges, self._kept)

    def forming(self, now: float) -> None:
        """The layers are being split and loaded (again: after waiting for room)."""
        self._t_plan = now

    def no_room(self, need: int, have: int, now: float) -> str:
        """The machines there are cannot hold the model: requests wait until one joins or
        comes back, or wait_timeout passes. The status, which names what is missing."""
        if self._deadline is None:
            self._deadline = now + self.wait_timeout
        self._need_have = (need, have)
        self.status, self._what = waiting_status(self.missing(), need, have)
        self._record("waiting", why=self.status)
        return self.status

    def wait_s(self, now: float) -> float:
        """How long to wait before asking the machines again."""
        return min(self.watch_s, max(0.0, (self._deadline or now) - now))

    def gave_up(self, now: float) -> str | None:
        """Why the pipeline fails, once nobody joined within wait_timeout (else None)."""
        if self._deadline is None or now < self._deadline:
            return None
        return self._because(f"no machine joined within {self.wait_timeout:g} s to hold {self._what}: "
                             "the machines left cannot hold the model")

    def cannot_go_on(self, exc: object) -> str:
        """Why the pipeline fails when the machines there are fail to take the layers."""
        return self._because(f"the stages left cannot go on: {exc}")

    def broke(self, exc: object) -> str:
        """Why the pipeline fails when the rearrangement itself broke (a bug: say so)."""
        return self._because(f"rearranging the pipeline failed: {exc}")

    def recovered(self, now: float, stages: int, ranges: list[tuple[int, int]], replayed: int,
                  kept: int = 0) -> dict:
        """Serving again: the record. seconds: from noticing to serving again; replan_s:
        letting go, reaching the machines and any wait for room; load_s: loading the new
        layers (bench/failover.py); kept_layers: how many of them stayed in memory where
        they were, not read again; ahead_s (a machine taken in): how long it loaded its
        layers ahead while the pipeline served, before this pause."""
        self.status = None
        extra = {"ahead_s": self._ahead_s} if self._joined else {}
        return self._record("rejoined" if self._joined else "recovered", stages=stages,
                            layers=[list(r) for r in ranges], seconds=round(now - self._t0, 3),
                            replan_s=round(self._t_plan - self._t0, 3), load_s=round(now - self._t_plan, 3),
                            replayed=replayed, kept_layers=kept, **extra)

    # ---- the end -----------------------------------------------------------------
    def fail(self, why: str) -> bool:
        """The pipeline cannot serve: False if it had failed already."""
        self.status = None
        self._stop_joining()
        if self.failed:
            return False
        self.failed = why
        return True

    def close(self) -> None:
        self.closed = True
        self.status = None
        self._stop_joining()

    def _because(self, what: str) -> str:
        left = [e["why"] for e in self.events if e["event"] == "left"]
        return f"{left[-1]}; {what}" if left else what

    def _record(self, event: str, **fields) -> dict:
        e = {"t": self._wall(), "event": event, **fields}
        self.events.append(e)
        return e
