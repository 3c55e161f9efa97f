"""How the head forms its ring of stages: RingFormation (a mixin of Head) and RemoteStage.
Connecting each stage, settling the weights, splitting and loading the layers, profiles, reading stages.

The head (engine/pipeline/head.py) forms the ring at start and again after every
rearrangement (engine/pipeline/recovery_driver.py); each stage's control connection is
read here for tokens, step errors, a stage leaving, new profiles and stats.
"""

from __future__ import annotations

import asyncio
import time
import logging
import weakref
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed, WebSocketException

from engine.wire import frames
from engine.model.static_decode import decode_counts
from engine.model.device import free_memory, kv_budget_tokens_for, kv_bytes_per_token, memory_for_kv, speed_score
from engine.model.sources import ModelError
from engine.pipeline.link import open_link
from engine.core import precision
from engine.core.partition import lm_head_layers_estimate, partition, shared_cpu_speeds
from engine.core.profile import interp, scaled
from engine.model.measure import load_and_measure
from engine.model.quant import bnb_missing, prequantized
from engine.model.stage import StageModel
from engine.pipeline.requests import PipelineError
from engine.pipeline.stage_protocol import connect_stage
from engine.wire.stage_auth import split_address
from engine.core.sizes import counted

log = logging.getLogger("potluck.head")


@dataclass
class RemoteStage:
    address: str
    ws: object = None
    welcome: dict | None = None
    configured: dict | None = None
    range: tuple[int, int] = (0, 0)


class RingFormation:
    """Head's stages: hello, the split and the loading, the weights, profiles, each stage's
    connection read (a mixin of Head)."""

    def _remember(self, address: str) -> str:
        url, secret = split_address(address)
        if secret:
            self._secrets[url] = secret
        return url

    async def _hello(self, r: RemoteStage, attempts: int = 1, timeout: float = 30, within: float | None = None):
        """The control connection to a stage, and its welcome (free memory, speed, device).
        within: seconds after which no further attempt starts (each gets what is left)."""
        end = None if within is None else time.monotonic() + within
        for attempt in range(attempts):
            if end is not None:
                timeout = max(0.5, min(timeout, end - time.monotonic()))
            try:
                r.ws = await connect_stage(r.address, "control", self.pipeline,
                                           key=self._secrets.get(r.address, ""), timeout=timeout)
                r.welcome = frames.parse_control(await asyncio.wait_for(r.ws.recv(), timeout))
            except (OSError, asyncio.TimeoutError, WebSocketException, frames.FrameError) as exc:
                # (a process killed mid-handshake answers with no HTTP at all: InvalidMessage)
                if r.ws is not None:  # connected but no welcome (a frozen machine): let it go
                    asyncio.ensure_future(r.ws.close())
                    r.ws = None
                if attempt + 1 < attempts and (end is None or time.monotonic() + 0.5 < end):
                    await asyncio.sleep(0.5)  # a stage lets its last head go before it takes the next
                    continue
                if isinstance(exc, ConnectionRefusedError):     # "[Errno 111] Connect call failed (…)"
                    why = "nothing listens at that port (is `potluck stage` running there?)"
                else:
                    why = str(exc) or (f"no answer within {timeout:.0f} s" if isinstance(exc, asyncio.TimeoutError)
                                       else type(exc).__name__)
                raise PipelineError(f"cannot reach stage at {r.address}: {why}") from None
            if r.welcome["type"] != "welcome":
                raise PipelineError(f"stage at {r.address} did not welcome us: {r.welcome}")
            return

    async def _plan(self, remotes: list[RemoteStage], held: int,
                    quiet: bool = False) -> tuple[list[int], str, list[tuple[int, int]]]:
        """How the layers split over this machine and `remotes` (in pipeline order): what
        each machine offers, the weights every stage loads, each stage's layers. held: the
        bytes this machine's layers hold now (room for its new slice too). quiet: a plan
        for a loss that may never come (spare layers) says nothing to the user."""
        cfg = self.config
        n_stages = 1 + len(remotes)
        free = free_memory(self.device) + held
        mine = free if self.memory_cap is None else min(free, self.memory_cap)
        if self.drafter is not None and self.memory_cap is not None:
            mine = max(0, mine - self.drafter.param_bytes)   # the cap holds the draft model too
        mems = [mine] + [r.welcome["free_memory"] for r in remotes]
        if self.same_machine:
            mems = [min(mems) // n_stages] * n_stages
        weights = self._settle_weights(cfg, mems, remotes, quiet)
        if self.layers_override and len(self.layers_override) == n_stages:
            return mems, weights, list(self.layers_override)
        homes = [self.cpu_homes.get(k) for k in ["head"] + [r.address for r in remotes]]
        if all(h is not None for h in homes):
            speeds = shared_cpu_speeds(homes)
        else:  # a machine of its own among them (or none shares this CPU): probe
            # (while it serves -- a plan made ahead -- its last probe: one now would read
            # the steps' load, and hold them up)
            if self.stage0 is None or getattr(self, "_speed0", None) is None:
                self._speed0 = await self._run(speed_score, self.device)
            speeds = [self._speed0] + [r.welcome["speed"] for r in remotes]
        caps = precision.layer_caps(cfg, weights, self.dtype.itemsize, mems)
        extra = [0.0] * n_stages
        extra[-1] = lm_head_layers_estimate(cfg)
        return mems, weights, partition(cfg.num_hidden_layers, speeds, caps, extra)

    async def _form(self, hints: dict | None = None, planned: tuple | None = None):
        """Split the layers over the stages there are, load each stage's share, open the links.

        hints: address (or "head") -> (profile, layers it was measured for): after a stage
        left, the stages left start from their last profile scaled to their new share.
        planned: (addresses, the split _plan gave for them), taken as it is when the
        machines are still those: a machine taken in has loaded its share ahead by it."""
        cfg = self.config
        fingerprint = self.fingerprint
        if planned is not None and planned[0] == [r.address for r in self.remotes]:
            self.offered, self.weights, self.ranges = planned[1]
        else:
            # the old stage 0's layers in hand (a rearrangement) are room for the new one too
            held = self._held.nbytes() if self._held is not None else 0
            self.offered, self.weights, self.ranges = await self._plan(self.remotes, held)
        for r, rng in zip(self.remotes, self.ranges[1:]):
            r.range = rng

        def hint(key, rng):
            if not hints or key not in hints:
                return None
            prof, n = hints[key]
            return scaled(prof, (rng[1] - rng[0]) / max(1, n))

        async def configure(i, r):
            nxt = self.remotes[i + 1].address if i + 1 < len(self.remotes) else None
            if nxt is not None and self.hop is not None:
                nxt = await self.hop(r.address, nxt)
            await r.ws.send(frames.control(
                "configure", model=self.source.spec, start=r.range[0], end=r.range[1],
                fingerprint=fingerprint, next=nxt, dtype=self.dtype_name,
                kv_budget_tokens=self.kv_budget_override, threads=None, link=self.link_mode,
                compress=self.compress, compute=self.compute, acks=self.acks, weights=self.weights,
                profile=hint(r.address, r.range), route=self.route))
            while True:
                msg = frames.parse_control(await r.ws.recv())
                if msg["type"] == "progress":
                    self.progress(i + 1, msg["done"], msg["total"], msg["what"])
                elif msg["type"] == "configured":
                    if msg["n_layers"] != r.range[1] - r.range[0]:
                        continue   # the answer to an earlier try's configure (cancelled): not ours
                    r.configured = msg
                    return
                elif msg["type"] == "error":
                    raise PipelineError(f"stage {i + 1} ({r.address}): {msg['message']}")

        def load_local():
            held, self._held = self._held, None   # one try takes them; a later one reads its own
            if held is not None:
                held.narrow(*self.ranges[0])
            # what stays in memory of the old slice is part of the new one's weights
            weights = precision.slice_bytes(cfg, *self.ranges[0], self.weights, self.dtype.itemsize) \
                - (held.nbytes() if held is not None else 0)
            budget = self.kv_budget_override or kv_budget_tokens_for(
                cfg, self.ranges[0], self.dtype, self.device, memory_for_kv(weights, self.device, self.memory_cap))
            return load_and_measure(lambda: StageModel(
                self.source, *self.ranges[0], dtype=self.dtype, device=self.device,
                kv_budget_tokens=budget, cores=self.cores or self.own_cores, weights=self.weights, reuse=held,
                products=self.products,
                progress=lambda d, t, w: self.progress(0, d, t, w)), profile=hint("head", self.ranges[0]))

        local = asyncio.ensure_future(self._run(load_local))
        remote = [asyncio.ensure_future(configure(i, r)) for i, r in enumerate(self.remotes)]
        try:
            results = await asyncio.gather(local, *remote)
        except BaseException as exc:
            # one stage failed (a machine gone while the layers load): the others' configures
            # stop waiting on their connections, else the next try's would find each
            # connection still being read ("cannot call recv while another coroutine is
            # already running recv", found by the chaos run); our own slice finishes loading
            for t in remote:
                t.cancel()
            await asyncio.gather(local, *remote, return_exceptions=True)
            if isinstance(exc, ConnectionClosed):
                raise PipelineError(f"a stage closed its connection during setup: {exc}") from None
            raise
        self.stage0, profile0 = results[0]
        self.profiles = [profile0] + [r.configured["profile"] for r in self.remotes]
        budgets = [self.stage0.kv.budget_tokens] + [r.configured["kv_budget_tokens"] for r in self.remotes]
        self.sched.capacity = min(budgets)
        if self.drafter is not None:   # every admitted sequence's reservation, drafts included, fits
            self.drafter.model.kv.budget_tokens = self.sched.capacity
        self.recovery.formed([r.address for r in self.remotes])
        self.sched.hop_bytes = cfg.hidden_size * self.dtype.itemsize

        if self.remotes:
            self._data_ws = await connect_stage(self.remotes[0].address, "data", self.pipeline, key=self.route)
            epoch = self.recovery.epoch
            link = self.link = open_link(self._data_ws, self.link_mode,
                                         lambda n: interp(self.profiles[0]["decode"], n), acked=self.acks,
                                         trace=self.trace)
            # a stage that stopped answering is not asked back: that would wait out a timeout
            link.on_failed = lambda why: self._stage_lost(1, f"the link to stage 1 failed: {why}", epoch,
                                                          ask_back=not link.unanswered)
            for i, r in enumerate(self.remotes):
                self._readers.append(asyncio.ensure_future(self._read_stage(i + 1, r, epoch)))

    def stage_memory(self) -> list[dict | None]:
        """Each stage's memory (head first), in bytes: its slice of the weights, the room its
        KV cache may grow to for replies, and what the machine offered when the ring formed
        (the cache's bytes now come with stage_stats)."""
        if self.stage0 is None:
            return []
        offered = getattr(self, "offered", None) or []
        out = []
        # by a weak reference: a strong one kept the old arrangement's slice in memory while
        # a rearrangement loaded the new one (found by the chaos run's memory samples)
        param0 = getattr(self, "_param0", None)
        if param0 is None or param0[0]() is not self.stage0:
            self._param0 = param0 = (weakref.ref(self.stage0), self.stage0.param_bytes())
        rows = [(self.ranges[0], param0[1], self.stage0.kv.budget_tokens)]
        for r in self.remotes:
            c = r.configured or {}
            rows.append((r.range, c.get("param_bytes"), c.get("kv_budget_tokens")))
        for i, (rng, weights, budget) in enumerate(rows):
            if weights is None or budget is None:
                out.append(None)
                continue
            cache = budget * kv_bytes_per_token(self.config, rng, self.dtype)
            out.append({"weights": int(weights), "cache_room": int(cache),
                        "offered": int(offered[i]) if i < len(offered) else None})
        return out

    def _settle_weights(self, cfg, mems: list[int], remotes: list[RemoteStage], quiet: bool = False) -> str:
        """The precision every stage loads: the user's, the checkpoint's own if it was
        saved quantized, or (auto) the highest at which the model fits the pool."""
        saved = prequantized(cfg)
        quantized_ok = bnb_missing() is None and all(r.welcome.get("quantized") for r in remotes)
        devices = sorted({self.device_name} | {r.welcome["device_name"] for r in remotes})
        where = (f"this machine's {counted(len(mems), 'stage')} ({self.device_name})" if self.same_machine
                 else f"{counted(len(mems), 'stage')} ({', '.join(devices)})")
        chosen = saved or self.weights
        if chosen == "auto":
            chosen = precision.choose(cfg, self.dtype.itemsize, mems, quantized_ok)
        elif chosen in precision.QUANTIZED and not quantized_ok:
            raise ModelError(f"{chosen} weights need bitsandbytes on every machine of the pipeline, and "
                             "at least one lacks it: install it there (pip install bitsandbytes) or "
                             "choose --weights bf16")
        if not quiet:
            self.say(precision.table(cfg, self.dtype.itemsize, self.dtype_name, mems, chosen, quantized_ok, where))
            self.on_weights(precision.chosen(cfg, self.dtype.itemsize, self.dtype_name, chosen, where))
        return chosen

    def refresh_own_profile(self):
        """Stage 0's profile as its steps in service time it (core/profile.py StepLog)."""
        step_log = self.stage0.step_log if self.stage0 is not None else None
        if step_log is not None and step_log.steps:
            self.profiles[0] = step_log.profile()

    async def _read_stage(self, index: int, r: RemoteStage, epoch: int):
        """Tokens (from the last stage) and step errors (from any stage)."""
        try:
            async for data in r.ws:
                if isinstance(data, str):
                    msg = frames.parse_control(data)
                    if msg["type"] == "error":
                        log.warning("stage %d: %s", index, msg["message"])
                    elif msg["type"] == "leaving":
                        # its owner is taking it back (sharing off, a game, sleep): move its
                        # layers now, while it waits for us to let it go
                        log.warning("stage %d is leaving in %.0f s: %s", index, msg["seconds"], msg["reason"])
                        why = f"stage {index} ({r.address}) is leaving: {msg['reason']}"
                        if self._part(index, why, msg["seconds"], epoch):
                            continue   # it serves on while the others load its layers
                        self._stage_lost(index, why, epoch, ask_back=False)
                        return
                    elif msg["type"] == "profile":   # checked point by point by parse_control
                        self.profiles[index] = msg["profile"]
                    elif msg["type"] == "prepared":   # it loaded its next slice's layers ahead
                        fut = self._prepared_waiters.pop(index, None)
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                    elif msg["type"] == "stats":
                        fut = self._stats_waiters.pop(index, None)
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                    continue
                self.trace("tokens")
                frame = frames.decode(data)
                if frame.type != frames.FrameType.TOKENS:
                    raise frames.FrameError("stages send the head token frames only")
                self._on_tokens(frame.micro_batch, frame.step, frame.meta.get("tokens", []),
                                frame.meta.get("errors", []))
        except frames.FrameError as exc:
            await r.ws.close(1008, str(exc)[:120])
            self._stage_lost(index, f"stage {index} sent a bad frame: {exc}", epoch)
            return
        except ConnectionClosed as exc:
            reason = exc.rcvd.reason if exc.rcvd is not None else ""
            if exc.sent is not None and exc.sent.code == 1011 and exc.rcvd is None:
                # our heartbeat went unanswered: the stage is frozen or unreachable, and
                # asking it back would only wait out another timeout
                self._stage_lost(index, f"stage {index} ({r.address}) stopped answering", epoch, ask_back=False)
                return
            if reason:
                self._stage_lost(index, f"stage {index} ({r.address}) left: {reason}", epoch)
                return
        # (a clean close ends the loop without an exception: its reason is on the connection)
        reason = getattr(r.ws, "close_reason", None)
        self._stage_lost(index, f"stage {index} ({r.address}) " + (f"left: {reason}" if reason else "disconnected"),
                         epoch)

    async def stage_stats(self) -> list[dict]:
        """Every stage (head first): sequences held, tokens cached, frames refused,
        decode steps that cut into prompt steps, decode steps run over fixed buffers and
        of those replayed as CUDA graphs, graphs captured."""
        # one query at a time: answers carry no id, so two callers would take each other's
        async with self._stats_lock:
            kv = self.stage0.kv
            out = [{"seqs": len(kv.seqs), "kv_tokens": kv.used_tokens, "kv_bytes": kv.allocated_bytes(), "rejected": 0,
                    "cut_ins": self.stage0.gate.cut_ins, **decode_counts(self.stage0)}]
            for i, r in enumerate(self.remotes, start=1):
                fut = asyncio.get_running_loop().create_future()
                self._stats_waiters[i] = fut
                await r.ws.send(frames.control("get_stats"))
                msg = await asyncio.wait_for(fut, 30)
                out.append({k: msg[k] for k in ("seqs", "kv_tokens", "kv_bytes", "rejected", "cut_ins", "fixed_steps",
                                                 "graph_replays", "graph_captures")})
            return out
