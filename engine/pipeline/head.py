"""The head: owns the requests, runs stage 0, and keeps every stage busy.

A thin asyncio driver around two sans-I/O objects: the core scheduler
(engine/core/scheduler.py), which decides admission, micro-batches and prompt chunks,
and the recovery (engine/core/recovery.py), which decides what happens when a stage
leaves. The head connects the stages, computes stage 0's share of each step, hands
volumes to the link, streams tokens to each request's queue as they arrive, frees a
finished or cancelled sequence on every stage, and -- when a stage leaves -- lets the
old arrangement go, asks the machines the recovery names, loads the new split and
replays every live sequence.

Its parts, beside this driver (each a mixin of Head): engine/pipeline/requests.py (what
a request is, submit and cancel), ring_formation.py (connecting the stages, the split,
loading, reading each stage), speculation_driver.py (drafting), recovery_driver.py (the
failover, in the order it happens) and token_bookkeeping.py (a step's tokens back, a
sequence's end).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from websockets.exceptions import ConnectionClosed

from engine.wire import frames
from engine.core.product_choice import ProductChoice
from engine.model.cores import CoreLease
from engine.model.device import DTYPES, HostStaging, compute_dtype, device_name, pick_device, step_failure
from engine.model.sources import ModelError, ModelSource
from engine.core.compression import POLICIES as COMPRESS_POLICIES
from engine.core.compression import should_compress
from engine.pipeline.hop_trace import HopTrace
from engine.pipeline.kept_replies import KeptReplies
from engine.pipeline.launch_ahead import StepsAhead, wanted
from engine.pipeline.link import LinkSender
from engine.core import precision
# WATCH_S, REJOIN_GRACE_S: how often machines that left are asked whether they are back,
# and for how long; read when a head is made (a test may shorten them here)
from engine.core.recovery import REJOIN_GRACE_S, WATCH_S, Recovery
from engine.core.scheduler import Group, Scheduler, Seq
from engine.core.sampling import sampling_defaults
from engine.model.grammar import Grammars
from engine.model.sampler import Sampler
from engine.core.partition import check_partition
from engine.core.prompt_chunk import lane_chunk_tokens
from engine.model.stage import StageBatch, StageModel
from engine.core.step_gate import COMPUTE_ORDERS
from engine.core.speculation import SpecPolicy
from engine.model.draft import DraftModel
from engine.pipeline.recovery_driver import RecoveryDriver
# the request-facing names, re-exported: the API, the terminal and the tests import them from here
from engine.pipeline.requests import Delta, Done, PipelineError, RequestHandle, RequestIntake, Sequence, TokenLogprob
from engine.pipeline.ring_formation import RemoteStage, RingFormation
from engine.pipeline.spare_layers import SpareLayers
from engine.pipeline.speculation_driver import SPECULATE_CHOICES, SpeculationDriver, _yielding_thread
from engine.pipeline.token_bookkeeping import TokenBookkeeping
from engine.wire.stage_auth import new_route, split_address

__all__ = ["Head", "PipelineError", "TokenLogprob", "Delta", "Done", "Sequence", "RequestHandle", "RemoteStage",
           "SPECULATE_CHOICES"]

log = logging.getLogger("potluck.head")


class Head(RequestIntake, RingFormation, SpeculationDriver, RecoveryDriver, SpareLayers, TokenBookkeeping,
           KeptReplies):
    def __init__(self, source: ModelSource, stage_addresses: list[str] | None = None, *,
                 layers: list[tuple[int, int]] | None = None, micro_batches: int | None = None,
                 dtype: str = "auto", device: str = "auto", kv_budget_tokens: int | None = None,
                 max_batch: int = 32, pipeline: str = "local", progress=None,
                 prefill_chunk: int | str | None = "auto", link_mode: str = "jit", compress: str = "off",
                 compute: str = "in-order", weights: str = "auto", say=None, on_weights=None,
                 cores=None, cpu_homes: list[list[int]] | None = None, same_machine: bool = False,
                 solo_cores: bool = False,
                 hop=None, memory_cap: int | None = None,
                 wait_timeout: float = 300.0, speculate: str | None = None, spec_policy: SpecPolicy | None = None,
                 draft: str | None = None, keep_replies: int | None = None):
        self.source = source
        # ended replies' KV kept on the stages for their follow-ups (kept_replies.py;
        # None: core/kept_prefixes.py's MOST of them, 0: none)
        self._init_kept(keep_replies)
        # speculative decoding (issue 34): "auto" drafts (prompt lookup, or the draft model)
        # where the policy (engine/core/speculation.py) says it pays, "off" never (None:
        # POTLUCK_SPECULATE, else auto: replies are token-identical either way -- test_pipeline,
        # test_failover and test_api pass with it on -- and the policy measures a draft
        # with k = 1 and keeps it off where it does not pay)
        speculate = speculate or os.environ.get("POTLUCK_SPECULATE") or "auto"
        if speculate not in SPECULATE_CHOICES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_CHOICES)}, not {speculate!r}")
        self.speculate = speculate
        self.spec_policy = spec_policy or SpecPolicy()
        # a draft model beside stage 0 ('MODEL[@WEIGHTS]', engine/model/draft.py): it drafts
        # instead of prompt lookup; loaded at start, it never leaves this machine
        self.draft_spec = draft
        self.drafter: DraftModel | None = None
        # overlap (issue 34 item 4, PipeInfer-style): while a verification is in flight the
        # draft model drafts on after its guesses, on its own thread; where they all stand
        # the next round's draft is already made (POTLUCK_DRAFT_AHEAD=0: never)
        self.draft_ahead = os.environ.get("POTLUCK_DRAFT_AHEAD", "1") != "0"
        self._ahead_stop: dict[int, threading.Event] = {}   # micro-batch id -> its step came back
        # draft-thread jobs reading a context new to the draft model (a prompt's worth of
        # compute): rounds meanwhile go without drafts rather than wait for them
        self._draft_reading = 0
        # rounds waiting for the draft thread: drafting ahead yields to them at once
        self._drafts_waiting = 0
        self._drafts_lock = threading.Lock()
        # micro-batch id -> (launch time, tokens drafted, a decode step): its trip's measurements
        self._trips: dict[int, tuple[float, int, bool]] = {}
        self.cores = cores  # a CoreLease when local stage processes share this CPU
        # solo_cores: no local stage shares it, and no thread count was fixed: the head's
        # own stage still keeps its steps off the cores other programs use (cores.py solo)
        self.own_cores = CoreLease.solo() if solo_cores and cores is None else None
        # the head's stage's choice of CPU matrix products, kept across rearrangements
        self.products = ProductChoice()
        # when they do, each stage's share of it stands in for the speed probes (which
        # would measure one another's load): 3 stages on 2 cores get 0.5, 1, 0.5. Kept
        # by who holds the cores (the head, a stage's address), not by position: after a
        # stage left the shares are those of the processes left (core/partition.py)
        self.cpu_homes: dict[str, list[int]] = {}
        if cpu_homes:
            keys = ["head"] + [split_address(a)[0] for a in (stage_addresses or [])]
            self.cpu_homes = dict(zip(keys, cpu_homes))
        # all stages are processes on this machine: they report the same free memory,
        # which they share rather than each have
        self.same_machine = same_machine
        # bytes the host lets its own stage use (their VRAM cap), as a stage's owner can
        self.memory_cap = memory_cap
        # a friend's share address may carry its secret ('ws://host:port#secret'): kept
        # apart, so addresses in status, events and logs never show it
        self._secrets: dict[str, str] = {}
        self.remotes = [RemoteStage(self._remember(a)) for a in (stage_addresses or [])]
        # the token this pipeline's stages prove on their data links (engine/wire/stage_auth.py)
        self.route = new_route()
        self.n_stages = 1 + len(self.remotes)
        self.layers_override = layers
        # Data links acknowledge every piece so the sender can measure the link, except
        # between processes sharing this CPU: over loopback there is nothing to measure,
        # and each ack is a message handled on two ends while the cores compute a step.
        self.acks = cores is None
        self.device = pick_device(device)
        self.dtype_name = compute_dtype(self.device) if dtype == "auto" else dtype
        self.dtype = DTYPES[self.dtype_name]
        self.device_name = device_name(self.device)
        if weights not in precision.CHOICES:
            raise ModelError(f"unknown weights {weights!r}: choose one of {', '.join(precision.CHOICES)}")
        self.weights = weights              # auto until start() settles it against the pool's memory
        self.trace = HopTrace.from_env("head")   # where a round's time goes (POTLUCK_HOP_TRACE)
        self.say = say or (lambda text: None)
        # the settled precision as fields (core/precision.Chosen), beside say's table
        self.on_weights = on_weights or (lambda chosen: None)
        self.kv_budget_override = kv_budget_tokens
        self._to_host = HostStaging()   # stage 0's GPU output leaves through pinned memory
        self.link_mode = link_mode          # fifo | fixed | jit (see link_scheduler.py)
        if compress not in COMPRESS_POLICIES:
            raise ValueError(f"compression policy must be one of {COMPRESS_POLICIES}")
        self.compress = compress            # off | auto | prefill | all (see compression.py)
        # in-order: steps in arrival order, as vLLM computes; decode-first: decode steps cut
        # into prompt steps between layers (core/step_gate.py): lower time per token for
        # later first tokens (bench/weaklink.py's +cut-in measures the trade)
        if compute not in COMPUTE_ORDERS:
            raise ValueError(f"compute order must be one of {COMPUTE_ORDERS}")
        self.compute = compute
        self.link: LinkSender | None = None
        self.profiles: list[dict] = []
        # every machine's last profile by address (and the layers it was measured for),
        # kept after it leaves: one that comes back starts from it (recovery_driver.py)
        self.known_profiles: dict[str, tuple[dict, int]] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._prepared_waiters: dict[int, asyncio.Future] = {}   # stage index -> its "prepared"
        self._stats_lock = asyncio.Lock()
        self.pipeline = pipeline
        # await hop(a, b): how the stage at address a reaches the stage at b when that
        # differs from how the head reaches b (stages in other homes, behind tunnels:
        # engine/node/homes.py); asked at every arrangement, since neighbours change
        self.hop = hop
        self.progress = progress or (lambda stage, done, total, what: None)
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="head-compute")
        # decode steps' own thread, with compute="decode-first": they cut into prompt
        # steps between layers, as on the stages (engine/core/step_gate.py)
        self._decode_exec = ThreadPoolExecutor(1, thread_name_prefix="head-decode")
        # the draft model's own thread: drafting ahead runs beside stage 0's compute, at a
        # lower priority, so that guessing never slows what it guesses for (this
        # machine's stage processes, the event loop that moves activations)
        self._draft_exec = ThreadPoolExecutor(1, thread_name_prefix="head-draft", initializer=_yielding_thread)
        self._ids = itertools.count(1)
        self.seqs: dict[int, Sequence] = {}
        # the decisions: who runs, in which micro-batch, how prompts are cut (sans-I/O)
        # (kept: a rearrangement after a stage left starts a fresh one with the same settings)
        self._sched_args = dict(micro_batches=micro_batches, shared_cpu=cores is not None, max_batch=max_batch,
                                prompt_chunk=prefill_chunk, dtype_bytes=self.dtype.itemsize, compress=compress)
        self.sched = Scheduler(self.n_stages, **self._sched_args)
        self.sampler = Sampler()   # used when the head is also the last stage
        self.stage0: StageModel | None = None
        # one process: the next decode step queued behind this one's draw (core/ahead.py)
        self._launch_ahead = wanted(self.device)
        # on one machine: long prompts in pieces between the decode steps (_prompt_lane);
        # POTLUCK_PROMPT_LANE=0 turns it off, as before (bench/prompt_lane.py)
        self.prompt_lane = os.environ.get("POTLUCK_PROMPT_LANE", "1") != "0"
        self.lane_pieces = 0   # pieces computed in the prompt lane (tests, benchmarks)
        self._ahead: StepsAhead | None = None
        # the old stage 0's layers during a rearrangement, for the new one (model/handover.py)
        self._held = None
        self._extra0 = None   # layers stage 0's next share lacks, loaded ahead beside it (_prepare_all)
        self._data_ws = None
        self._readers: list[asyncio.Task] = []
        self.ranges: list[tuple[int, int]] = []
        self._kick_pending = False
        self.tokens_served = 0
        # failover: a stage that leaves (closed, silent, gone to sleep) is dropped, the
        # layers re-planned over the machines left, and every sequence replayed on them.
        # The decisions are the recovery's (engine/core/recovery.py); the head does the I/O.
        self.recovery = Recovery([r.address for r in self.remotes], wait_timeout, watch_s=WATCH_S,
                                 grace_s=REJOIN_GRACE_S)
        self._recovery: asyncio.Task | None = None   # the rearrangement under way
        self._watch: asyncio.Task | None = None      # asking machines that left whether they are back

    # ---- setup --------------------------------------------------------------
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def _step0(self, decode: bool, batch: StageBatch, x: torch.Tensor,
                     forks: dict[int, list[int]] | None = None, opening: dict | None = None) -> torch.Tensor:
        """Stage 0's share of a step: decode steps cut into prompt steps (compute
        "decode-first"), or everything in arrival order ("in-order"). Kept replies are let
        go or taken over first (`opening`: kept_replies.py), and after it the step's
        forks (a request's other choices) copy their parent's KV, as every stage does."""
        cut_in = decode and self.compute == "decode-first"

        def run():
            self.trace("compute")
            with self.stage0.gate.step(decode=cut_in):
                self._apply_opening(opening)
                out = self.stage0.forward(batch, x)
                self.trace("forwarded")   # on a GPU: launched, waited for below
                for parent, children in (forks or {}).items():
                    for c in children:
                        self.stage0.fork(parent, c)
            if out.is_cuda:
                # a GPU step returns before it is done: it is waited for here, on the
                # compute thread, not by the frame's copy to the host on the event loop
                # (every token, acknowledgement and heartbeat would wait with it)
                torch.cuda.current_stream(out.device).synchronize()
            self.trace("computed")
            return out

        return await asyncio.get_running_loop().run_in_executor(self._decode_exec if cut_in else self._exec, run)

    async def start(self) -> "Head":
        cfg = self.source.config()
        self.config = cfg
        self.tokenizer = await self._run(self.source.tokenizer)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        self.eos_ids = _eos_ids(cfg, self.tokenizer, self.source)
        # what a request that names no sampling field gets (the API and the terminal chat)
        self.sampling_defaults = sampling_defaults(_generation_config(self.source))
        n_layers = cfg.num_hidden_layers
        if self.layers_override:
            # A user's split is checked before any stage is contacted or any weight read:
            # a typo should cost a message, not a minute of loading.
            check_partition(self.layers_override, n_layers)
            if len(self.layers_override) != self.n_stages:
                n = len(self.layers_override)
                raise ModelError(f"--layers gives {n} layer range{'s' if n != 1 else ''} for {self.n_stages} "
                                 "stages: give one range per stage (or leave --stages out)")
        self.fingerprint = await self._run(self.source.fingerprint)
        for r in self.remotes:
            await self._hello(r)
        if self.draft_spec:
            await self._load_draft()
        await self._form()
        self._arm_spares()
        return self

    # the scheduler's state, as the rest of the engine and the tests read it
    @property
    def groups(self) -> list[Group]:
        return self.sched.groups

    @property
    def waiting(self) -> list[Seq]:
        return self.sched.waiting

    @property
    def micro_batches(self) -> int:
        return self.sched.micro_batches

    @property
    def dynamic_micro_batches(self) -> bool:
        return self.sched.dynamic

    @property
    def capacity(self) -> int:
        return self.sched.capacity

    @property
    def reserved(self) -> int:
        return self.sched.reserved

    # the recovery's state, as the API, the node and the tests read it
    @property
    def recovering(self) -> str | None:
        """Why the pipeline is rearranging (None: it serves)."""
        return self.recovery.status

    @property
    def events(self) -> list[dict]:
        """Who left, why, how long recovery took."""
        return self.recovery.events

    @property
    def error(self) -> str | None:
        """Why the pipeline cannot serve (None: it can)."""
        return self.recovery.failed

    async def close(self, why: str = "the pipeline was stopped"):
        """Stop: every request still running ends first, with `why` (an API client reads
        it in its stream), then the stages are let go."""
        self.recovery.close()
        self._disarm_spares()
        for s in list(self.seqs.values()):
            self._finish(s, "error", why, free=False)
        self._forget_kept()
        for task in (self._recovery, self._watch):
            if task is not None and not task.done():
                task.cancel()  # what it connected is closed below
                await asyncio.gather(task, return_exceptions=True)
        for t in self._readers:
            t.cancel()
        if self.link is not None:
            await self.link.close()
        self.trace.flush()
        for r in self.remotes:
            if r.ws is not None:
                await r.ws.close()
        if self._data_ws is not None:
            await self._data_ws.close()
        self._exec.shutdown(wait=False, cancel_futures=True)
        self._decode_exec.shutdown(wait=False, cancel_futures=True)
        self._stop_drafting_ahead()
        self._draft_exec.shutdown(wait=False, cancel_futures=True)
        if self.own_cores is not None:
            self.own_cores.close()
            self.own_cores = None

    def info(self) -> dict:
        stages = [{"address": "head (this process)", "layers": list(self.ranges[0]),
                   "device": self.device, "device_name": self.device_name}] \
            + [{"address": r.address, "layers": list(r.range),
                "device": (r.welcome or {}).get("device"), "device_name": (r.welcome or {}).get("device_name")}
               for r in self.remotes]
        for st, mem in zip(stages, self.stage_memory()):
            st["memory"] = mem
        return {
            "model": self.source.name,
            "stages": stages,
            "dtype": self.dtype_name,
            # unquantized weights are at the compute dtype: "full (float32)" on a CPU, not "bf16"
            # beside "dtype": "float32"
            "weights": precision.full_label(self.dtype_name) if self.weights == precision.FULL else self.weights,
            "micro_batches": self.micro_batches,
            "kv_capacity_tokens": self.capacity,
            "kv_reserved_tokens": self.reserved,
            # a long prompt computed a piece at a time (the prompt lane) is running too
            "running": self.sched.running() + (self.sched.lane is not None),
            "waiting": len(self.waiting),
            "tokens_served": self.tokens_served,
            "recovering": self.recovering,
            # a machine being taken in, loading its layers while the pipeline serves
            "joining": self.recovery.joining_status,
            "joining_progress": self.recovery.joining_progress,
            # a stage that said it is leaving, whose layers the others load while it serves
            "leaving": self.recovery.parting_status,
            # layers held beside the slices, so that a stage lost without notice costs no loading
            "spare_layers": self.spare_layers,
            "speculation": self.speculation(),
            # ended replies cached on every stage for their follow-ups (kept_replies.py)
            "kept": self.kept_info(),
            "events": self.events[-20:],
            "error": self.error,
        }

    # ---- scheduling ---------------------------------------------------------
    def _kick(self):
        if self.recovering or self.error:
            return  # the stages are being rearranged: steps go out once they are back
        now = time.monotonic()
        if self.sched.retune_due(now):
            self.refresh_own_profile()
            self.sched.retune(now, self.profiles, self.link.sched.link if self.link is not None else None)
        self._room_for_waiting()
        self.sched.lane_chunk = None
        # one stage, or stages sharing this machine's CPU (the default on a CPU): over a
        # link between machines, prompts travel in link-sized chunks instead (_stream_prompt)
        if (self.n_stages == 1 or self.sched.shared_cpu) and self.profiles and self.prompt_lane:
            self.sched.lane_chunk = lane_chunk_tokens(self.profiles[0]["prefill"])
            laned = self.sched.take_for_lane()
            if laned is not None:
                asyncio.ensure_future(self._prompt_lane(laned, self.recovery.epoch))
        for g in self.sched.schedule():
            asyncio.ensure_future(self._launch(g, self.recovery.epoch))

    async def _prompt_lane(self, s: Sequence, epoch: int):
        """A long prompt computed a piece at a time ahead of its micro-batch (core/
        prompt_chunk.py lane_chunk_tokens), on one stage or on stages sharing this CPU.
        Each piece is a step of its own on the head's compute thread (and, sent on as a
        prompt chunk, on each stage's), so the micro-batches' decode steps go between
        them, and a request cancelled meanwhile stops at the next piece. Its last piece
        goes in its micro-batch's step, which draws its first token, as any prompt's does."""
        c = self.sched.lane_chunk
        src = s.source_tokens
        failed = None
        while s.prompt_len - s.pos > c and not s.done and not s.cancelled:
            s.in_flight = c
            batch = StageBatch([s.id], [s.pos], [c])
            opening = self._opening([s])
            try:
                t0 = time.monotonic()
                out = await self._step0(False, batch, torch.tensor(src[s.pos:s.pos + c], dtype=torch.long),
                                        opening=opening)
            except (ValueError, RuntimeError) as exc:
                failed = step_failure(exc, self.device)
            s.in_flight = 0
            if epoch != self.recovery.epoch:
                return   # the stages were rearranged: the sequence is replayed from its history
            if failed is not None:
                break
            if self.remotes:
                # on as a prompt chunk (micro-batch 0, step 0: a chunk's failure comes back
                # as one, Head._on_tokens); the opening step follows it on every link
                frame = frames.encode(frames.FrameType.ACTIVATIONS, 0, 0,
                                      {"rows": [[s.id, s.pos, c]], "partial": True, **opening}, out,
                                      q8=self._q8("prefill", out, time.monotonic() - t0), to_host=self._to_host)
                try:
                    if self.link is None:
                        raise ConnectionClosed(None, None)   # let go mid-rearrangement
                    self.link.submit(frame, "prefill")
                except ConnectionClosed:
                    self._stage_lost(1, "the connection to stage 1 closed", epoch)
                    return
            s.pos += c
            self.lane_pieces += 1
        if s.done:   # ended while a piece computed (the pipeline closing): its KV goes now
            if s.needs_free:
                s.needs_free = False
                self._end_kv(s)
        elif failed is not None:
            self._finish(s, "error", failed)
        elif s.cancelled and not self.remotes:
            self._finish(s, "cancelled")
        else:
            if s.cancelled:
                # pieces are on their way to other stages, and a free sent now could overtake
                # them (a late piece would cache the sequence again): it joins a micro-batch
                # for one token of its prompt, whose step comes back behind them, and ends
                # there as cancelled
                s.prompt_len = s.pos + 1
            self.sched.lane_done(s)
        self._kick()

    async def _launch(self, g: Group, epoch: int):
        # the step belongs to the arrangement it was scheduled in: a rearrangement that began
        # before this task first ran has let that one's links go and replays its sequences
        if epoch != self.recovery.epoch:
            return
        self.trace("launch")
        try:
            for s in list(g.seqs):
                if not s.opened and not s.done:
                    s.in_flight = s.prompt_len - s.pos
                    await self._stream_prompt(g, s, epoch)
                    if epoch != self.recovery.epoch:
                        return  # a stage left meanwhile: this sequence is replayed from its history
        except ConnectionClosed:
            self._stage_lost(1, "the connection to stage 1 closed", epoch)
            return
        except (ValueError, RuntimeError) as exc:
            log.warning("prompt chunk failed on the head: %s", exc)
            for x in g.seqs:
                if x.done and x.needs_free:
                    x.needs_free = False
                    self._end_kv(x)
            g.seqs = [x for x in g.seqs if not x.done]
        # A sequence that finished (cancelled, failed) after it joined this micro-batch
        # but before the step was built -- at submit time, or while prompts streamed
        # above -- must not be sent: it was freed already (sending it would recreate its
        # KV behind that free, a leak) or it is waiting for its prompt chunks to drain
        # (needs_free: it rides along unsent and is freed when this step returns).
        g.seqs = [s for s in g.seqs if not s.done or s.needs_free]
        rows, inputs, new, forks, keep = [], [], {}, {}, []
        step_rows = self.sched.step_rows(g)
        # busy is every sequence the pipeline holds, in every micro-batch: a step of one
        # row among full micro-batches is a busy pipeline (core/speculation.py)
        in_flight = sum(1 for x in self.groups if any(not q.done for q in x.seqs))
        self.spec_policy.set_load(self._active(), full=self.n_stages > 1 and in_flight >= self.n_stages)
        drafts = await self._drafts([r.seq for r in step_rows if not r.new])
        if epoch != self.recovery.epoch:
            return  # a stage left while the draft model drafted: its sequences are replayed
        drafted, checked = 0, {}
        for r in step_rows:
            s = r.seq
            if r.new:
                src = s.source_tokens
                inputs.extend(src[s.pos:s.prompt_len])   # (a cancelled lane prompt: cut short)
                new[str(s.id)] = {"sampling": s.params.to_dict(), "prompt": src}
                if s.replay is not None and s.generated:
                    new[str(s.id)]["replayed"] = len(s.generated)
                if r.forks:
                    new[str(s.id)]["forks"] = [[f.id, f.params.seed] for f in r.forks]
                    forks[s.id] = [f.id for f in r.forks]
            else:
                inputs.append(s.generated[-1])
            n, s.draft = r.n, []
            if not r.new:
                s.draft = drafts.get(s.id) or []
                if s.draft:   # checked in this one step: the last token and the draft
                    inputs.extend(s.draft)
                    n = s.in_flight = 1 + len(s.draft)
                    drafted += len(s.draft)
                    checked[s.id] = list(s.draft)
            keep.append(n if s.draft else 1)
            rows.append([s.id, r.pos, n])
        if not rows:
            for s in g.seqs:  # no step to trail behind: free now
                if s.needs_free:
                    s.needs_free = False
                    self._end_kv(s)
            g.seqs = []
            g.in_flight = False
            self._kick()
            return
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           keep if drafted else None)
        x = torch.tensor(inputs, dtype=torch.long)
        opening = self._opening([r.seq for r in step_rows])
        self._trips[g.id] = (time.monotonic(), drafted, not new)
        try:
            if self.remotes:
                decode = not new
                t0 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_started(t0, len(rows))
                out = await self._step0(decode, batch, x, forks, opening)
                if epoch != self.recovery.epoch:
                    return  # computed for stages that are gone: its sequences are replayed
                t1 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_finished(t1)
                kind = "decode" if decode else "prefill"
                meta = {"rows": rows, "new": new, **opening}
                if checked:  # the last stage penalizes each position after the draft before it
                    meta["drafts"] = {str(k): v for k, v in checked.items()}
                frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step, meta, out,
                                    q8=self._q8(kind, out, t1 - t0), to_host=self._to_host)
                self.trace("framed")
                self.link.submit(frame, kind)
                self._draft_on(g, [r.seq for r in step_rows if not r.new], [r.seq for r in step_rows if r.new])
            else:
                # rows that will want a token after this step's: their next position may be
                # computed before this step's tokens are read (core/ahead.py)
                goes_on = [len(r.seq.generated) + 2 <= r.seq.params.max_tokens
                           and len(r.seq.prompt) + len(r.seq.generated) + 2 <= self.context_length
                           for r in step_rows] if self._launch_ahead else None
                entries = await self._run(self._local_last, batch, x, new, forks, checked, goes_on, epoch, opening)
                if epoch != self.recovery.epoch:
                    return
                self._on_tokens(g.id, g.step, entries, [])
        except ConnectionClosed:
            self._stage_lost(1, "the connection to stage 1 closed", epoch)
        except Exception as exc:
            if epoch != self.recovery.epoch:
                # the stages were rearranged while this step ran (its sequences may have been
                # freed under it: a KeyError in the sampler, found by the chaos run); the
                # rearrangement replays them, so this step's failure is moot
                log.info("a step of an earlier arrangement failed: %r", exc)
                return
            if not isinstance(exc, (ValueError, RuntimeError)):
                raise
            log.warning("step failed on the head: %s", exc)
            why = step_failure(exc, self.device)
            self._on_tokens(g.id, g.step, [], [[s, why] for s in batch.seq_ids])

    async def _stream_prompt(self, g: Group, s: Sequence, epoch: int):
        """Send all but the last chunk of a new prompt ahead of its micro-batch step."""
        c = self.sched.prompt_chunk(s, self.profiles[0]["prefill"], self._bandwidth())
        if not c:
            return
        src = s.source_tokens
        while s.prompt_len - s.pos > c and not s.done:
            batch = StageBatch([s.id], [s.pos], [c])
            x = torch.tensor(src[s.pos: s.pos + c], dtype=torch.long)
            opening = self._opening([s])
            try:
                t0 = time.monotonic()
                out = await self._step0(False, batch, x, opening=opening)
            except (ValueError, RuntimeError) as exc:
                self._finish(s, "error", step_failure(exc, self.device))
                raise
            if epoch != self.recovery.epoch:
                return
            frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step,
                                {"rows": [[s.id, s.pos, c]], "partial": True, **opening}, out,
                                q8=self._q8("prefill", out, time.monotonic() - t0), to_host=self._to_host)
            s.pos += c
            s.in_flight -= c
            self.link.submit(frame, "prefill")

    def prompt_chunk_tokens(self) -> int | None:
        """Tokens per prompt chunk for the next prompt (None: whole prompts)."""
        return self.sched.chunk_size(self.profiles[0]["prefill"] if self.profiles else None, self._bandwidth())

    def _bandwidth(self) -> float | None:
        """The first link's measured bandwidth (None: no link to another stage)."""
        return self.link.sched.link.bandwidth if self.link is not None else None

    def _q8(self, kind: str, out: torch.Tensor, compute_seconds: float) -> bool:
        return should_compress(self.compress, kind, out.numel() * out.element_size(),
                               self.link.sched.link.bandwidth, compute_seconds)

    def _active(self) -> int:
        """Sequences the pipeline holds now (admitted, not finished), all micro-batches."""
        return sum(1 for g in self.groups for s in g.seqs if not s.done)

    def _local_last(self, batch, x, new, forks, drafts, goes_on=None, epoch=None, opening=None):
        self._apply_opening(opening)
        if self.sampler.grammars is None:   # loads nothing until a request has a schema
            self.sampler.grammars = Grammars(lambda: self.tokenizer, self.stage0.vocab_size)
        self.sampler.open_new(new, self.stage0.vocab_size)
        ahead = None
        if self._launch_ahead:
            if self._ahead is None or self._ahead.stage is not self.stage0:
                self._ahead = StepsAhead(self.stage0)
            ahead = self._ahead
        logits = ahead.forward(batch, x, epoch) if ahead is not None else self.stage0.forward(batch, x)
        for parent, children in forks.items():
            for c in children:
                self.stage0.fork(parent, c)
        positions = [st + n - k + 1 for st, n, k in zip(batch.starts, batch.ns, batch.kept)]
        launch = ahead.launch(batch, goes_on, epoch) if ahead is not None and goes_on and not forks else None
        entries = self.sampler.step(batch.seq_ids, logits, forks, batch.keep, positions, drafts, ahead=launch)
        if ahead is not None:
            ahead.read(entries)
        return entries


def _eos_ids(cfg, tokenizer, source) -> set[int]:
    ids = set()
    for v in (getattr(cfg, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    if source.root is not None:
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(str(source.root))
            v = gen.eos_token_id
            ids.update([v] if isinstance(v, int) else (v or []))
        except (OSError, ValueError):
            pass
    return ids


def _generation_config(source) -> dict | None:
    """The model's generation_config.json, if it has one (its recommended sampling)."""
    if source.root is None:
        return None
    try:
        with open(Path(source.root) / "generation_config.json", encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return None
    return gen if isinstance(gen, dict) else None
