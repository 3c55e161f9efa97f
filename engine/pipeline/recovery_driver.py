"""The head's failover I/O: RecoveryDriver (a mixin of Head), in the order it happens.
A stage lost or a machine offered: let go, rewind, ask, re-form, replay; the watch for those that left.

The decisions (who is gone, whom to ask back and when, when to give up, what the status
says) are engine/core/recovery.py's; forming the new ring is engine/pipeline/ring_formation.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from websockets.exceptions import ConnectionClosed, WebSocketException

from engine.model.device import release_memory
from engine.model.sources import ModelError
from engine.core.partition import NoRoom
from engine.core import line_check
from engine.core.recovery import PROBE_TIMEOUT_S, Ask, describe_layers
from engine.wire import frames
from engine.model.handover import HeldLayers
from engine.pipeline.configure_check import Checked
from engine.pipeline.load_ahead import build_beside
from engine.core.scheduler import Scheduler
from engine.model.sampler import Sampler
from engine.pipeline.requests import PipelineError, Sequence
from engine.pipeline.ring_formation import RemoteStage

log = logging.getLogger("potluck.head")


# how much of a leaving stage's notice the others may spend loading its layers while it
# serves: the rest is for letting it go before it goes anyway
PART_SHARE = 0.6


def loading_ahead() -> bool:
    """Whether a machine taken in, and the stages that take a leaving one's layers, load
    them before the rearrangement, while the pipeline serves (POTLUCK_LOAD_AHEAD=0: during
    it, as before; bench/join.py --ahead)."""
    return os.environ.get("POTLUCK_LOAD_AHEAD", "1") != "0"


class RecoveryDriver:
    """Head's failover: a stage lost, a machine offered or back, the rearrangement and the
    watch (a mixin of Head)."""

    def offer(self, address: str):
        """A machine offers its stage (ws://...): the head takes it in as soon as it
        answers -- a pipeline waiting for room at once, a running one by a rearrangement
        (every sequence replays, nothing is lost)."""
        if self.recovery.offer(self._remember(address), time.monotonic()):
            self._ensure_watch()

    def _stage_lost(self, index: int, why: str, epoch: int, ask_back: bool = True, planned: tuple | None = None):
        """A stage left (its connection closed or went silent, it sent garbage, its
        owner took it back): rearrange the pipeline over the stages left and go on."""
        address = self.remotes[index - 1].address if 0 < index <= len(self.remotes) else None
        if not self.recovery.lost(index, address, why, epoch):
            return  # already being dealt with, or a stage of an arrangement that is gone
        log.warning("stage %d left (%s): rearranging the pipeline over the others", index, why)
        if planned is None and self._spares is not None:
            # the split made for this loss, whose layers the survivors hold spare already
            planned = self._spares.for_loss(address, [r.address for r in self.remotes if r.address != address])
        self._disarm_spares()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()   # a machine loading ahead (_take_in): the loss comes first
        self._stop_drafting_ahead()   # the steps in flight never come back
        self._recovery = self._start_recovery(self._rearrange(index, ask_back, planned=planned))

    def _start_recovery(self, rearrangement) -> asyncio.Task:
        """Run a rearrangement (a coroutine) under _recover_or_fail. One cancelled before it
        began (the pipeline closing in the same turn) is closed, not left never awaited."""
        task = asyncio.ensure_future(self._recover_or_fail(rearrangement))
        task.add_done_callback(lambda t: t.cancelled() and rearrangement.close())
        return task

    async def _recover_or_fail(self, rearrangement):
        try:
            try:
                await rearrangement
            except asyncio.CancelledError as exc:
                if asyncio.current_task().cancelling():
                    raise
                # a future cancelled under the rearrangement, not this task: a failure like
                # any other (left alone, the pipeline would wait for ever, quietly)
                raise RuntimeError(f"a wait was cancelled under the rearrangement ({exc!r})") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a rearrangement that breaks must say so, not leave requests hanging
            log.exception("rearranging the pipeline failed")
            self._pipeline_failed(self.recovery.broke(exc))
        else:
            if self._recovery is asyncio.current_task():   # (not a take-out that handed on to a loss)
                self._arm_spares()
        finally:
            self._ensure_watch()

    async def _take_in(self, r: RemoteStage, ahead: bool):
        """A machine the watch found (back, or offered): it loads its share of the layers
        while the pipeline goes on serving, then a rearrangement takes it in, keeping those
        layers as every machine keeps its own. Loaded during the rearrangement instead,
        they would pause every conversation for as long as the machine reads them."""
        planned = None
        try:
            if ahead:
                planned = await self._load_ahead(r)
        except asyncio.CancelledError:
            asyncio.ensure_future(r.ws.close())   # a stage lost meanwhile: that comes first
            raise
        except (PipelineError, ModelError) as exc:
            # it refused its share, or lacks what the weights need: taken in, it would fail
            # the whole pipeline's rearrangement
            asyncio.ensure_future(r.ws.close())
            log.warning("%s", self.recovery.turned_away(r.address, str(exc)))
            return
        except (NoRoom, ConnectionClosed, OSError, asyncio.TimeoutError, frames.FrameError) as exc:
            if isinstance(exc, ConnectionClosed) or getattr(r.ws, "close_code", None) is not None:
                log.warning("%s", self.recovery.joined_gone(r.address, str(exc) or "its connection closed",
                                                             time.monotonic()))
                return
            log.warning("%s could not load its layers ahead (%s): the rearrangement loads them", r.address, exc)
        await self._rearrange(joined=r, planned=planned)

    async def _load_ahead(self, r: RemoteStage) -> tuple:
        """Ask `r` to load the share it would get, and every stage serving now the layers its
        next share lacks (the split shifts), and wait until they have: the plan for _form,
        (addresses, split)."""
        order = sorted(self.remotes + [r], key=lambda x: self.recovery.rank(x.address))
        planned = await self._plan_without_pause(order)
        start, end = planned[1][2][order.index(r) + 1]
        layers = describe_layers([(start, end)])
        self.recovery.ahead(layers)
        log.warning("%s", self.recovery.joining_status)
        await self._prepare_all(planned, r, lambda done, total: self.recovery.ahead(layers, done, total))
        return planned

    async def _plan_without_pause(self, order: list[RemoteStage], quiet: bool = False) -> tuple:
        """The split over this machine and `order` (the stages of the next arrangement), made
        while this one serves: (their addresses, _plan's split)."""
        held = self.stage0.held_bytes() if self.stage0 is not None else 0
        return [x.address for x in order], await self._plan(order, held, quiet)

    async def _prepare_all(self, planned: tuple, newcomer: RemoteStage | None = None, progress=None):
        """Each stage of the planned arrangement loads ahead what its share lacks (see
        _prepare_ranges)."""
        addresses, split = planned
        await self._prepare_ranges(dict(zip(addresses, split[2][1:])), split[2][0], split[1], newcomer, progress)

    async def _prepare_ranges(self, new: dict[str, tuple[int, int]], head: tuple[int, int], weights: str,
                              newcomer: RemoteStage | None = None, progress=None, spare: bool = False) -> int:
        """Each machine loads ahead what the range `new` gives it (by address; `head`, this
        machine's) lacks: a stage serving now, beside its slice (engine/pipeline/load_ahead.py);
        `newcomer`, its whole share. One that cannot (no room beside the slice it serves)
        loads it during the rearrangement; the newcomer's failure is raised once the others
        are done. Returns how many layers the serving stages hold beside their slices. spare:
        they are held against a loss (engine/core/spares.py), for as long as the arrangement
        lasts, so they leave each cache the room it was promised."""
        fields = dict(model=self.source.spec, fingerprint=self.fingerprint, dtype=self.dtype_name, weights=weights,
                      spare=spare)
        beside: dict[int, int] = {}
        mine: dict[int, asyncio.Future] = {}

        async def joining(r: RemoteStage):
            await r.ws.send(frames.control("prepare", start=new[r.address][0], end=new[r.address][1], **fields))
            while True:
                msg = frames.parse_control(await r.ws.recv())
                if msg["type"] == "prepared":
                    if msg["error"]:
                        raise PipelineError(msg["error"])
                    return
                if msg["type"] == "error":
                    raise PipelineError(msg["message"])
                if msg["type"] != "progress":
                    raise frames.FrameError(f"unexpected {msg['type']} while loading ahead")
                if progress is not None:
                    progress(msg["done"], msg["total"])

        async def serving(index: int, x: RemoteStage):
            (a, b), (s, e) = new[x.address], x.range
            if s <= a and b <= e:
                return   # it holds them all
            fut = mine[index] = self._prepared_waiters[index] = asyncio.get_running_loop().create_future()
            await x.ws.send(frames.control("prepare", start=a, end=b, **fields))
            msg = await fut   # (its connection read by _read_stage; if it closes, the loss cancels this)
            if msg["error"]:
                log.warning("stage %d loads layers %d-%d when it needs them: %s", index, a, b - 1, msg["error"])
            else:
                beside[index] = msg["n_layers"]

        async def own():   # this machine's stage 0, beside the slice it serves
            (a, b), stage = head, self.stage0
            if stage is None or (stage.start <= a and b <= stage.end):
                return
            checked = Checked(self.source, self.dtype, self.fingerprint, self.config, 0)
            msg = dict(start=a, end=b, weights=weights)
            try:
                extra = await asyncio.to_thread(build_beside, checked, msg, stage, self.device, self.memory_cap,
                                                None, self._extra0, spare)
            except Exception as exc:   # (ModelError: no room beside its slice)
                log.warning("layers %d-%d load when they are needed: %s", a, b - 1, exc)
                return
            self._extra0 = HeldLayers.merged(self._extra0, extra)
            beside[0] = len(self._extra0) if self._extra0 is not None else 0

        tasks = [own()] + ([joining(newcomer)] if newcomer is not None else [])
        tasks += [serving(i, x) for i, x in enumerate(self.remotes, start=1) if x.address in new]
        try:
            # each to its end (what the others loaded is kept either way), the newcomer's
            # failure after: a cancel (a stage lost) cancels them all
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for index, fut in mine.items():   # (only ours: a later load ahead may wait already)
                if self._prepared_waiters.get(index) is fut:
                    del self._prepared_waiters[index]
        for exc in results:
            if isinstance(exc, BaseException):
                raise exc
        return sum(beside.values())

    def _part(self, index: int, why: str, seconds: float, epoch: int) -> bool:
        """Stage `index` said it is leaving within `seconds`: the others load its layers while
        it still serves, then it is let go (_take_out). False: that cannot be now (something
        else under way); the caller loses it at once."""
        if not loading_ahead() or not 0 < index <= len(self.remotes) or \
                not self.recovery.leaving(index, self.remotes[index - 1].address, why, epoch):
            return False
        log.warning("%s", self.recovery.parting_status)
        self._disarm_spares()
        self._recovery = self._start_recovery(self._take_out(index, why, seconds, epoch))
        return True

    async def _take_out(self, index: int, why: str, seconds: float, epoch: int):
        """The stages left load the leaving stage's layers (each the part its new share
        lacks) while it still serves, for at most PART_SHARE of its notice; then it is lost
        as any stage is, and the rearrangement keeps what they loaded (a load not done by
        then finishes within it)."""
        leaver = self.remotes[index - 1]
        planned = None
        try:
            planned = await self._plan_without_pause([x for x in self.remotes if x is not leaver])
            await asyncio.wait_for(self._prepare_all(planned), PART_SHARE * seconds)
        except asyncio.TimeoutError:
            log.warning("the stages left are still loading stage %d's layers: they finish in the rearrangement", index)
        except (PipelineError, ModelError, NoRoom, ConnectionClosed, OSError, frames.FrameError) as exc:
            log.warning("the stages left could not load stage %d's layers ahead (%s)", index, exc)
        self._recovery = None   # (this task, which ends here): the loss starts the rearrangement
        self._stage_lost(index, why, epoch, ask_back=False, planned=planned)

    async def _rearrange(self, lost: int | None = None, ask_back: bool = True, joined: RemoteStage | None = None,
                         planned: tuple | None = None):
        """Drop stage `lost` (or take in `joined`, a machine that came back or offered
        itself, by the split `planned` it loaded ahead), split the layers over who is
        there, and replay every live sequence on the new arrangement."""
        asks = self.recovery.begin([r.address for r in self.remotes], self.ranges, time.monotonic(), lost,
                                   ask_back, joined.address if joined is not None else None)
        hints = self._profile_hints()
        await self._let_go(lost)
        live = self._rewind()
        self.remotes = await self._ask(asks) + ([joined] if joined is not None else [])
        capacity = self.sched.capacity
        # its layers change: the old slice goes before the new one loads, but for the layers
        # both hold (kept, not read again: engine/model/handover.py)
        old, self.stage0 = self.stage0, None
        if old is not None:
            self._held = await self._hand_over(old)
        del old
        release_memory(self.device)
        while True:
            self.remotes.sort(key=lambda r: self.recovery.rank(r.address))
            self._fresh_scheduler(capacity)
            self.recovery.forming(time.monotonic())
            try:
                try:
                    await self._form(hints, planned)
                except asyncio.CancelledError as exc:
                    if asyncio.current_task().cancelling():
                        raise
                    # a future cancelled under the formation (a friend's tunnel closed while
                    # its hop was asked), not this task: a machine gone, like the others
                    raise ConnectionError(f"a wait was cancelled under the formation ({exc!r})") from None
                break
            except NoRoom as exc:
                log.warning("%s", self.recovery.no_room(exc.need, exc.have, time.monotonic()))
                r = await self._wait_for_machine()
                if r is None:
                    self._held = None   # the old slice's layers: nobody will take them now
                    self._pipeline_failed(self.recovery.gave_up(time.monotonic()))
                    return
                self.remotes.append(r)
            except (PipelineError, ModelError, ConnectionClosed, OSError) as exc:
                if self._drop_gone():
                    continue       # a machine left while the layers loaded: split again over the rest
                if planned is not None:
                    # a split made ahead that no longer fits (a machine's memory went
                    # elsewhere meanwhile): one made now, from what the machines say now
                    log.warning("the split made ahead did not fit (%s): splitting again", exc)
                    planned = None
                    continue
                self._held = None
                self._pipeline_failed(self.recovery.cannot_go_on(exc))
                return
        kept = self.stage0.kept_layers + sum(r.configured["kept_layers"] for r in self.remotes)
        done = self.recovery.recovered(time.monotonic(), self.n_stages, self.ranges, len(live), kept)
        log.warning("pipeline rearranged over %d stage(s) in %.1f s (%d of %d layers kept in memory); "
                    "%d sequence(s) replayed", self.n_stages, done["seconds"], kept, self.ranges[-1][1], len(live))
        self._kick()

    async def _hand_over(self, stage):
        # on the compute thread, once a decode step that cut in is done: no step of the old
        # stage runs while its layers change hands
        await asyncio.get_running_loop().run_in_executor(self._decode_exec, lambda: None)
        extra, self._extra0 = self._extra0, None   # and what was loaded ahead beside it
        return (await self._run(stage.hand_over)).merge(extra)

    def _profile_hints(self) -> dict:
        """Each machine's last profile, for the layers it held: the stages left start from
        it scaled to their new share instead of profiling again while everyone waits, and
        so does a machine that comes back (a laptop that slept, a node started again: the
        same address through its tunnel), whose measuring would pause every request for
        seconds. Steps in service correct a profile that no longer fits."""
        known = self.known_profiles
        if self.profiles:
            known["head"] = (self.profiles[0], self.ranges[0][1] - self.ranges[0][0])
        for i, r in enumerate(self.remotes, start=1):
            if i < len(self.profiles):
                known[r.address] = (self.profiles[i], r.range[1] - r.range[0])
        return dict(known)

    async def _let_go(self, lost: int | None = None):
        """Let the old arrangement's connections go, all at once: a live stage frees what it
        held for this head when its head goes. Stage `lost`'s are cut, not closed: a stage
        that stopped answering (asleep, frozen) would have each graceful close wait out its
        close timeout while every reply waits (a second, measured by bench/failover.py's
        silent rows), and one that is gone answers nothing anyway."""
        for t in self._readers:
            t.cancel()
        self._readers = []
        gone = [self.remotes[lost - 1].ws] if lost is not None and 0 < lost <= len(self.remotes) else []
        if lost == 1:
            gone.append(self._data_ws)
        closing = []
        for ws in [self._data_ws] + [r.ws for r in self.remotes]:
            transport = getattr(ws, "transport", None)
            if ws is None:
                continue
            if any(ws is g for g in gone) and transport is not None:
                transport.abort()
            else:
                closing.append(ws.close())
        if self.link is not None:
            closing.append(self.link.close())
        self.link = self._data_ws = None
        await asyncio.gather(*closing, return_exceptions=True)

    def _rewind(self) -> list[Sequence]:
        """Every live sequence back to the queue with its history, in arrival order."""
        live = sorted((s for s in self.seqs.values() if not s.done), key=lambda s: s.id)
        for s in live:
            s.rewind()
        self._forget_kept()
        return live

    async def _ask(self, asks: list[Ask]) -> list[RemoteStage]:
        """The old arrangement's machines, asked to go on as the recovery says, all at once
        (one that says nothing costs its wait once, not once per machine after it): those
        that answer, in the old order."""
        async def one(ask: Ask) -> RemoteStage | None:
            r = RemoteStage(ask.address)
            try:
                await self._hello(r, attempts=ask.attempts, timeout=ask.timeout, within=ask.within)
            except PipelineError as exc:
                self.recovery.unanswered(ask, str(exc), time.monotonic())
                return None
            # the one that left answers (its connection may only have dropped), but a line
            # that collapsed answers a hello too: timed as the watch times one, or it would
            # be kept, and the replay over its line would lose it again
            slow = await self._line_too_slow(r, ask.timeout) if ask.lost else None
            if slow is not None:
                await r.ws.close()
                self.recovery.unanswered(ask, slow, time.monotonic())
                log.warning("%s", self.recovery.too_slow(ask.address, slow, time.monotonic()))
                return None
            self.recovery.answered(ask)
            return r

        return [r for r in await asyncio.gather(*(one(a) for a in asks)) if r is not None]

    def _fresh_scheduler(self, capacity: int):
        """A scheduler for the new arrangement, holding the rewound sequences and any
        request that arrived meanwhile, in arrival order."""
        self.n_stages = 1 + len(self.remotes)
        self.sched = Scheduler(self.n_stages, **self._sched_args)
        # until the new arrangement says what it holds, a request arriving meanwhile is
        # judged by the old one's (it waits in the queue either way)
        self.sched.capacity = capacity
        self.sampler = Sampler()
        for s in sorted((s for s in self.seqs.values() if not s.done), key=lambda s: s.id):
            self.sched.add(s)

    async def _wait_for_machine(self) -> RemoteStage | None:
        """The machines there are cannot hold the model: requests wait until a machine that
        left comes back or another offers itself (None: the host's timeout passed first)."""
        while self.recovery.gave_up(time.monotonic()) is None:
            self._drop_gone()      # a survivor that leaves meanwhile: its layers are missing too
            r = await self._probe()
            if r is not None:
                self.recovery.take(r.address)
                return r
            await asyncio.sleep(self.recovery.wait_s(time.monotonic()))
        return None

    def _drop_gone(self) -> bool:
        """The machines of the arrangement being formed whose control connection closed
        (a second machine gone during a recovery): dropped, recorded, asked back later.
        Whether there were any."""
        gone = [r for r in self.remotes if r.ws is None or getattr(r.ws, "close_code", None) is not None]
        for r in gone:
            self.remotes.remove(r)
            why = f"its connection closed ({getattr(r.ws, 'close_reason', '') or 'no reason'})"
            log.warning("%s", self.recovery.gone_meanwhile(r.address, why, time.monotonic()))
        if gone:
            self._ensure_watch()
        return bool(gone)

    async def _probe(self) -> RemoteStage | None:
        """The first machine the recovery says to ask that answers, with its control
        connection open."""
        for address in self.recovery.to_ask(time.monotonic()):
            r = RemoteStage(address)
            try:
                await self._hello(r, attempts=1, timeout=PROBE_TIMEOUT_S)
                return r
            except PipelineError:
                continue
        return None

    async def _line_too_slow(self, r: RemoteStage, within: float = line_check.ROUND_TRIP_S) -> str | None:
        """Why the line of a machine that answered cannot carry its take-in now (the replay
        of every conversation crosses it), or None (engine/core/line_check.py). within: how
        long the first byte may take."""
        tokens = sum(len(s.prompt) + len(s.generated) for s in self.seqs.values() if not s.done)
        check = line_check.LineCheck.for_replay(tokens, self.config.hidden_size, self.dtype.itemsize)
        try:
            round_trip = await self._line_fill(r, 1, within)
            try:
                elapsed = await self._line_fill(r, line_check.TEST_BYTES, check.deadline_s(round_trip))
            except asyncio.TimeoutError:
                elapsed = None
        except asyncio.TimeoutError:
            return f"its line carried nothing within {within:g} s"
        except (OSError, WebSocketException, frames.FrameError) as exc:
            return f"its connection broke while its line was timed ({str(exc) or type(exc).__name__})"
        except BaseException:   # cancelled (the head closing, a rearrangement given up): the
            asyncio.ensure_future(r.ws.close())   # stage's one head slot is let go
            raise
        return check.verdict(round_trip, elapsed)

    @staticmethod
    async def _line_fill(r: RemoteStage, n: int, timeout: float) -> float:
        """Asks the stage for n bytes of filler; the seconds they took."""
        t0 = time.monotonic()
        await r.ws.send(frames.control("line_test", bytes=n))
        msg = frames.parse_control(await asyncio.wait_for(r.ws.recv(), timeout))
        if msg["type"] != "line_fill" or len(msg["fill"]) != n:
            raise frames.FrameError(f"a {msg['type']} instead of {n} bytes of filler")
        return time.monotonic() - t0

    def _ensure_watch(self):
        if self.recovery.watching and (self._watch is None or self._watch.done()):
            self._watch = asyncio.ensure_future(self._watch_loop())

    async def _watch_loop(self):
        """While machines that left may come back, ask them now and then; one that answers
        gets a slice again (a rearrangement: every sequence replays, nothing is lost)."""
        while self.recovery.watching:
            await asyncio.sleep(self.recovery.watch_s)
            if not self.recovery.may_ask:
                continue  # a rearrangement in progress asks them itself
            r = await self._probe()
            if r is None:
                continue
            if not self.recovery.may_ask:  # a stage left meanwhile
                await r.ws.close()
                continue
            slow = await self._line_too_slow(r)
            if slow is not None or not self.recovery.may_ask:   # or a stage left meanwhile
                await r.ws.close()
                if slow is not None:   # the pipeline serves on without it: asked again later
                    log.warning("%s", self.recovery.too_slow(r.address, slow, time.monotonic()))
                continue
            ahead = loading_ahead()
            log.warning("%s", self.recovery.came(r.address, time.monotonic(), ahead))
            self._disarm_spares()
            self._recovery = self._start_take_in(r, ahead)
            return  # _recover_or_fail starts a new watch if others are still away

    def _start_take_in(self, r: RemoteStage, ahead: bool) -> asyncio.Task:
        task = self._start_recovery(self._take_in(r, ahead))

        def cancelled(t: asyncio.Task):
            # a loss in the same turn cancels the take-in before it began, so its own
            # except never ran: the machine's connection, left open, would hold its one
            # head slot (the watch's next ask then waits out the machine's patience)
            if t.cancelled():
                if r.ws is not None and getattr(r.ws, "close_code", None) is None:
                    asyncio.ensure_future(r.ws.close())
        task.add_done_callback(cancelled)
        return task

    def _pipeline_failed(self, why: str):
        if not self.recovery.fail(why):
            return
        log.error("pipeline failed: %s", why)
        for s in list(self.seqs.values()):
            self._finish(s, "error", why, free=False)
