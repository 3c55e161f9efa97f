"""The head: owns the requests, runs stage 0, and keeps every stage busy.

A thin asyncio driver around two sans-I/O objects: the core scheduler
(engine/core/scheduler.py), which decides admission, micro-batches and prompt chunks,
and the recovery (engine/core/recovery.py), which decides what happens when a stage
leaves. The head connects the stages, computes stage 0's share of each step, hands
volumes to the link, streams tokens to each request's queue as they arrive, frees a
finished or cancelled sequence on every stage, and -- when a stage leaves -- lets the
old arrangement go, asks the machines the recovery names, loads the new split and
replays every live sequence (the failover section, in the order it happens).
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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from websockets.exceptions import ConnectionClosed, WebSocketException

from engine.wire import frames
from engine.model.detok import Detokenizer
from engine.model.device import (DTYPES, compute_dtype, device_name, free_memory, kv_budget_tokens_for, memory_for_kv,
                                 pick_device, speed_score, step_failure)
from engine.model.sources import ModelError, ModelSource
from engine.core.compression import POLICIES as COMPRESS_POLICIES
from engine.core.compression import should_compress
from engine.pipeline.link import LinkSender, open_link
from engine.core import precision
from engine.core.partition import NoRoom, lm_head_layers_estimate, partition, shared_cpu_speeds
from engine.core.profile import interp, scaled
# WATCH_S, REJOIN_GRACE_S: how often machines that left are asked whether they are back,
# and for how long; read when a head is made (a test may shorten them here)
from engine.core.recovery import PROBE_TIMEOUT_S, REJOIN_GRACE_S, WATCH_S, Ask, Recovery
from engine.core.scheduler import Group, Scheduler, Seq
from engine.model.measure import load_and_measure
from engine.model.quant import bnb_missing, prequantized
from engine.core.sampling import MAX_CHOICES, SamplingParams, choice_seed, sampling_defaults
from engine.model.grammar import Grammars
from engine.model.sampler import Sampler
from engine.core.partition import check_partition
from engine.model.stage import StageBatch, StageModel
from engine.core.step_gate import COMPUTE_ORDERS
from engine.core.tool_calls import without_tool_messages
from engine.core.drafts import PromptLookup
from engine.core.spec_verify import verify_greedy
from engine.core.speculation import SpecPolicy
from engine.core.speculation import describe as describe_speculation
from engine.model.sampler import speculable
from engine.model import catalog
from engine.model.draft import DraftModel
from engine.pipeline.stage_server import connect_stage
from engine.wire.stage_auth import new_route, split_address

log = logging.getLogger("potluck.head")

SPECULATE_CHOICES = ("auto", "off")   # speculative decoding: the policy decides, or never


class PipelineError(RuntimeError):
    """The pipeline cannot serve (a stage refused, died, or holds another model)."""


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the likeliest tokens' at its position, as
    the last stage computed them (engine/model/sampler.py: from the raw logits)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None   # one per token, when the request asked


@dataclass
class Done:
    finish_reason: str          # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    ttft: float | None = None   # seconds from submit to first token
    seconds: float = 0.0


@dataclass(eq=False)
class Sequence(Seq):
    """A request: the scheduler's view of it (core Seq) and what the head streams."""
    prompt: list[int] = field(kw_only=True)
    params: SamplingParams = field(kw_only=True)
    queue: asyncio.Queue = field(kw_only=True)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    needs_free: bool = False     # finished while a step was in flight: free when it returns
    text: str = ""               # decoded so far (emitted)
    detok: Detokenizer | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    # after a stage left: prompt + tokens generated so far, prefilled on the new stages
    # so decoding goes on where it was (None: the prompt is what the stages are sent)
    replay: list[int] | None = None
    # speculative decoding (issue 34): whether its requests' settings allow it, its prompt
    # lookup (fed the prompt and every emitted token, never a rejected guess), and the
    # draft its step now in flight carries after its last token
    spec: bool = False
    lookup: PromptLookup | None = None
    draft: list[int] = field(default_factory=list)
    # the draft model has yet to read this sequence's context: read it while its step is
    # in flight (Head._draft_on), draft from the round after
    draft_unread: bool = False

    @property
    def source_tokens(self) -> list[int]:
        """What a step that opens this sequence sends: its prompt, or its replay."""
        return self.replay if self.replay is not None else self.prompt

    def rewind(self) -> None:
        """Back to the queue as a new prompt: its whole history, to be prefilled again."""
        self.replay = self.prompt + self.generated
        self.prompt_len = len(self.replay)
        self.max_tokens = self.params.max_tokens - len(self.generated)
        self.pos = self.in_flight = 0
        self.opened = self.needs_free = False
        self.draft = []   # a verification in flight on the old stages: its answer never comes
        # a choice still waiting for its parent's prompt replays as a prompt of its own
        self.forks, self.parent = [], None


class RequestHandle:
    def __init__(self, head: "Head", seq: Sequence):
        self._head, self.seq = head, seq

    def __aiter__(self):
        return self._events()

    async def _events(self):
        while True:
            ev = await self.seq.queue.get()
            yield ev
            if isinstance(ev, Done):
                return

    async def next_event(self, timeout: float | None = None):
        """The next Delta or Done, or None when `timeout` passes first (nothing is lost:
        a caller that keeps a stream alive while the pipeline rearranges asks again)."""
        try:
            return await asyncio.wait_for(self.seq.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def cancel(self):
        self._head.cancel(self.seq.id)

    async def text(self) -> tuple[str, Done]:
        parts = []
        async for ev in self:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            else:
                return "".join(parts), ev
        raise PipelineError("stream ended without a result")


@dataclass
class RemoteStage:
    address: str
    ws: object = None
    welcome: dict | None = None
    configured: dict | None = None
    range: tuple[int, int] = (0, 0)


def _yielding_thread(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task of its own),
    where the system allows it; elsewhere it runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


class Head:
    def __init__(self, source: ModelSource, stage_addresses: list[str] | None = None, *,
                 layers: list[tuple[int, int]] | None = None, micro_batches: int | None = None,
                 dtype: str = "auto", device: str = "auto", kv_budget_tokens: int | None = None,
                 max_batch: int = 32, pipeline: str = "local", progress=None,
                 prefill_chunk: int | str | None = "auto", link_mode: str = "jit", compress: str = "off",
                 compute: str = "in-order", weights: str = "auto", say=None,
                 cores=None, cpu_homes: list[list[int]] | None = None, same_machine: bool = False,
                 hop=None, memory_cap: int | None = None,
                 wait_timeout: float = 300.0, speculate: str | None = None, spec_policy: SpecPolicy | None = None,
                 draft: str | None = None):
        self.source = source
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
        self.say = say or (lambda text: None)
        self.kv_budget_override = kv_budget_tokens
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
        self._stats_waiters: dict[int, asyncio.Future] = {}
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
                     forks: dict[int, list[int]] | None = None) -> torch.Tensor:
        """Stage 0's share of a step: decode steps cut into prompt steps (compute
        "decode-first"), or everything in arrival order ("in-order"). Then the step's
        forks (a request's other choices) copy their parent's KV, as every stage does."""
        cut_in = decode and self.compute == "decode-first"

        def run():
            with self.stage0.gate.step(decode=cut_in):
                out = self.stage0.forward(batch, x)
                for parent, children in (forks or {}).items():
                    for c in children:
                        self.stage0.fork(parent, c)
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
                raise ModelError(f"{len(self.layers_override)} layer ranges for {self.n_stages} stages")
        self.fingerprint = await self._run(self.source.fingerprint)
        for r in self.remotes:
            await self._hello(r)
        if self.draft_spec:
            await self._load_draft()
        await self._form()
        return self

    async def _load_draft(self):
        """The draft model, on this machine's device before stage 0 loads (its memory is
        taken from what stage 0 may hold)."""
        spec = self.draft_spec
        if spec == "auto":   # the catalog's pairing for this model
            spec = catalog.draft_for(self.source.spec) or catalog.draft_for(self.source.name)
            if not spec:
                self.say(f"No draft model is paired with {self.source.name} in the catalog: prompt lookup drafts")
                return
        self.progress(0, 0, 1, "loading the draft model")
        self.drafter = await self._run(lambda: DraftModel.load(
            spec, dtype=self.dtype, device=self.device, target_tokenizer=self.tokenizer,
            target_name=self.source.name, target_vocab=self.config.vocab_size))
        self.progress(0, 1, 1, "loading the draft model")
        self.say(f"Draft model: {self.drafter.name} on {self.device_name}, "
                 f"{self.drafter.param_bytes / 2**20:.0f} MiB; it drafts where speculation pays"
                 + ("" if self.speculate != "off" else " (speculation is off: --speculate auto turns it on)"))

    def _remember(self, address: str) -> str:
        url, secret = split_address(address)
        if secret:
            self._secrets[url] = secret
        return url

    async def _hello(self, r: RemoteStage, attempts: int = 1, timeout: float = 30):
        """The control connection to a stage, and its welcome (free memory, speed, device)."""
        for attempt in range(attempts):
            try:
                r.ws = await connect_stage(r.address, "control", self.pipeline,
                                           key=self._secrets.get(r.address, ""), timeout=timeout)
                r.welcome = frames.parse_control(await asyncio.wait_for(r.ws.recv(), timeout))
            except (OSError, asyncio.TimeoutError, WebSocketException, frames.FrameError) as exc:
                # (a process killed mid-handshake answers with no HTTP at all: InvalidMessage)
                if r.ws is not None:  # connected but no welcome (a frozen machine): let it go
                    asyncio.ensure_future(r.ws.close())
                    r.ws = None
                if attempt + 1 < attempts:
                    await asyncio.sleep(0.5)  # a stage lets its last head go before it takes the next
                    continue
                raise PipelineError(f"cannot reach stage at {r.address}: {exc}") from None
            if r.welcome["type"] != "welcome":
                raise PipelineError(f"stage at {r.address} did not welcome us: {r.welcome}")
            return

    async def _form(self, hints: dict | None = None):
        """Split the layers over the stages there are, load each stage's share, open the links.

        hints: address (or "head") -> (profile, layers it was measured for): after a stage
        left, the stages left start from their last profile scaled to their new share."""
        cfg = self.config
        n_layers = cfg.num_hidden_layers
        fingerprint = self.fingerprint
        mine = free_memory(self.device) if self.memory_cap is None else min(free_memory(self.device), self.memory_cap)
        if self.drafter is not None and self.memory_cap is not None:
            mine = max(0, mine - self.drafter.param_bytes)   # the cap holds the draft model too
        mems = [mine] + [r.welcome["free_memory"] for r in self.remotes]
        if self.same_machine:
            mems = [min(mems) // self.n_stages] * self.n_stages
        self.weights = self._settle_weights(cfg, mems)
        if self.layers_override and len(self.layers_override) == self.n_stages:
            self.ranges = list(self.layers_override)
        else:
            homes = [self.cpu_homes.get(k) for k in ["head"] + [r.address for r in self.remotes]]
            if all(h is not None for h in homes):
                speeds = shared_cpu_speeds(homes)
            else:  # a machine of its own among them (or none shares this CPU): probe
                speeds = [await self._run(speed_score, self.device)] + [r.welcome["speed"] for r in self.remotes]
            caps = precision.layer_caps(cfg, self.weights, self.dtype.itemsize, mems)
            extra = [0.0] * self.n_stages
            extra[-1] = lm_head_layers_estimate(cfg)
            self.ranges = partition(n_layers, speeds, caps, extra)
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
                    r.configured = msg
                    return
                elif msg["type"] == "error":
                    raise PipelineError(f"stage {i + 1} ({r.address}): {msg['message']}")

        def load_local():
            weights = precision.slice_bytes(cfg, *self.ranges[0], self.weights, self.dtype.itemsize)
            budget = self.kv_budget_override or kv_budget_tokens_for(
                cfg, self.ranges[0], self.dtype, self.device, memory_for_kv(weights, self.device, self.memory_cap))
            return load_and_measure(lambda: StageModel(
                self.source, *self.ranges[0], dtype=self.dtype, device=self.device,
                kv_budget_tokens=budget, cores=self.cores, weights=self.weights,
                progress=lambda d, t, w: self.progress(0, d, t, w)), profile=hint("head", self.ranges[0]))

        try:
            results = await asyncio.gather(self._run(load_local),
                                           *(configure(i, r) for i, r in enumerate(self.remotes)))
        except ConnectionClosed as exc:
            raise PipelineError(f"a stage closed its connection during setup: {exc}") from None
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
            self.link = open_link(self._data_ws, self.link_mode, lambda n: interp(self.profiles[0]["decode"], n),
                                  on_failed=lambda why: self._stage_lost(1, f"the link to stage 1 failed: {why}",
                                                                         epoch),
                                  acked=self.acks)
            for i, r in enumerate(self.remotes):
                self._readers.append(asyncio.ensure_future(self._read_stage(i + 1, r, epoch)))

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

    async def close(self):
        self.recovery.close()
        for task in (self._recovery, self._watch):
            if task is not None and not task.done():
                task.cancel()  # what it connected is closed below
                await asyncio.gather(task, return_exceptions=True)
        for t in self._readers:
            t.cancel()
        if self.link is not None:
            await self.link.close()
        for r in self.remotes:
            if r.ws is not None:
                await r.ws.close()
        if self._data_ws is not None:
            await self._data_ws.close()
        for s in list(self.seqs.values()):
            self._finish(s, "error", "pipeline closed", free=False)
        self._exec.shutdown(wait=False, cancel_futures=True)
        self._decode_exec.shutdown(wait=False, cancel_futures=True)
        self._stop_drafting_ahead()
        self._draft_exec.shutdown(wait=False, cancel_futures=True)

    def info(self) -> dict:
        return {
            "model": self.source.name,
            "stages": [{"address": "head (this process)", "layers": list(self.ranges[0]),
                        "device": self.device, "device_name": self.device_name}]
            + [{"address": r.address, "layers": list(r.range),
                "device": (r.welcome or {}).get("device"), "device_name": (r.welcome or {}).get("device_name")}
               for r in self.remotes],
            "dtype": self.dtype_name,
            "weights": self.weights,
            "micro_batches": self.micro_batches,
            "kv_capacity_tokens": self.capacity,
            "kv_reserved_tokens": self.reserved,
            "running": self.sched.running(),
            "waiting": len(self.waiting),
            "tokens_served": self.tokens_served,
            "recovering": self.recovering,
            "speculation": self.speculation(),
            "events": self.events[-20:],
            "error": self.error,
        }

    def speculation(self) -> dict:
        """The switch, who drafts, and tokens per trip and acceptance so far (status, the
        chat window)."""
        st = self.spec_policy.stats()
        out = {"mode": self.speculate, "draft": self.drafter.name if self.drafter is not None else "prompt lookup",
                "tokens_per_trip": st["tokens_per_trip"], "acceptance": st["acceptance"], "rounds": st["rounds"]}
        out["summary"] = describe_speculation(out)
        return out

    def _settle_weights(self, cfg, mems: list[int]) -> str:
        """The precision every stage loads: the user's, the checkpoint's own if it was
        saved quantized, or (auto) the highest at which the model fits the pool."""
        saved = prequantized(cfg)
        quantized_ok = bnb_missing() is None and all(r.welcome.get("quantized") for r in self.remotes)
        devices = sorted({self.device_name} | {r.welcome["device_name"] for r in self.remotes})
        where = (f"this machine's {self.n_stages} stage(s) ({self.device_name})" if self.same_machine
                 else f"{self.n_stages} stage(s) ({', '.join(devices)})")
        chosen = saved or self.weights
        if chosen == "auto":
            chosen = precision.choose(cfg, self.dtype.itemsize, mems, quantized_ok)
        elif chosen in precision.QUANTIZED and not quantized_ok:
            raise ModelError(f"{chosen} weights need bitsandbytes on every machine of the pipeline, and "
                             "at least one lacks it: install it there (pip install bitsandbytes) or "
                             "choose --weights bf16")
        self.say(precision.table(cfg, self.dtype.itemsize, self.dtype_name, mems, chosen, quantized_ok, where))
        return chosen

    # ---- requests -----------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation as token ids, by the model's chat template. tools: OpenAI
        function specs ({name, description, parameters}); a template that knows tools
        renders them itself, for one that does not they are explained in the system
        message and the calls and results written as text (core/tool_calls.py)."""
        kwargs = {}
        template = self.tokenizer.chat_template or ""
        knows_tools = "tools" in (template if isinstance(template, str) else json.dumps(template))
        if knows_tools and tools:
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools]
        elif not knows_tools and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
            # calls and results are written as text, even when this turn offers no tools
            messages = without_tool_messages(messages, tools or [])
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        return self.submit_n(prompt, params, 1)[0]

    def submit_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[RequestHandle]:
        """n choices of one prompt (OpenAI's n): the prompt is computed once, and each
        stage copies its KV to the other choices at the step that completes it (a fork,
        core/scheduler.py); from there on they decode as sequences of their own. Choice
        i > 0 draws with a seed derived from the request's (core/sampling.py choice_seed)."""
        if isinstance(n, bool) or not isinstance(n, int) or not (1 <= n <= MAX_CHOICES):
            raise ValueError(f"n must be a whole number from 1 to {MAX_CHOICES}")
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context window is "
                             f"{self.context_length}")
        if self.error:
            raise PipelineError(self.error)
        # never reserve beyond the context window: generation stops there anyway
        params.max_tokens = min(params.max_tokens, self.context_length - len(prompt))
        choices = [params] + [replace(params, stop=list(params.stop),
                                      seed=None if params.seed is None else choice_seed(params.seed, i))
                              for i in range(1, n)]
        seqs = [Sequence(next(self._ids), len(prompt), p.max_tokens, prompt=list(prompt), params=p,
                         queue=asyncio.Queue()) for p in choices]
        seq, seq.forks = seqs[0], seqs[1:]
        if seq.need > self.capacity:
            raise ValueError(f"this request needs {seq.need} tokens of KV cache but the pipeline "
                             f"holds at most {self.capacity}; lower max_tokens or n, or shorten the prompt")
        for s in seqs:
            self.seqs[s.id] = s
            # n > 1 choices decode side by side already; logprobs and grammars need each
            # token's own step (engine/model/sampler.py speculable; penalties verify)
            s.spec = n == 1 and speculable(s.params)
        self.sched.add(seq)
        # kick on the loop's next turn, once: requests submitted together (a burst, a
        # client's batch) then start in one step instead of the first alone and the
        # rest prefilling a step later alongside its decode
        if not self._kick_pending:
            self._kick_pending = True
            asyncio.get_running_loop().call_soon(self._deferred_kick)
        return [RequestHandle(self, s) for s in seqs]

    def _deferred_kick(self):
        self._kick_pending = False
        self._kick()

    def cancel(self, seq_id: int):
        seq = self.seqs.get(seq_id)
        if seq is None or seq.done:
            return
        seq.cancelled = True
        if self.sched.withdraw(seq):
            self._finish(seq, "cancelled", free=False)
        elif not seq.in_flight:
            self._finish(seq, "cancelled")
        # else: finished when its step comes back

    # ---- scheduling ---------------------------------------------------------
    def _kick(self):
        if self.recovering or self.error:
            return  # the stages are being rearranged: steps go out once they are back
        now = time.monotonic()
        if self.sched.retune_due(now):
            self.refresh_own_profile()
            self.sched.retune(now, self.profiles, self.link.sched.link if self.link is not None else None)
        for g in self.sched.schedule():
            asyncio.ensure_future(self._launch(g))

    def refresh_own_profile(self):
        """Stage 0's profile as its steps in service time it (core/profile.py StepLog)."""
        step_log = self.stage0.step_log if self.stage0 is not None else None
        if step_log is not None and step_log.steps:
            self.profiles[0] = step_log.profile()

    async def _launch(self, g: Group):
        epoch = self.recovery.epoch
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
                    asyncio.ensure_future(self._free_everywhere([x.id]))
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
        drafted = 0
        for r in step_rows:
            s = r.seq
            if r.new:
                src = s.source_tokens
                inputs.extend(src[s.pos:])
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
            keep.append(n if s.draft else 1)
            rows.append([s.id, r.pos, n])
        if not rows:
            for s in g.seqs:  # no step to trail behind: free now
                if s.needs_free:
                    s.needs_free = False
                    asyncio.ensure_future(self._free_everywhere([s.id]))
            g.seqs = []
            g.in_flight = False
            self._kick()
            return
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           keep if drafted else None)
        x = torch.tensor(inputs, dtype=torch.long)
        self._trips[g.id] = (time.monotonic(), drafted, not new)
        try:
            if self.remotes:
                decode = not new
                t0 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_started(t0, len(rows))
                out = await self._step0(decode, batch, x, forks)
                if epoch != self.recovery.epoch:
                    return  # computed for stages that are gone: its sequences are replayed
                t1 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_finished(t1)
                kind = "decode" if decode else "prefill"
                frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step, {"rows": rows, "new": new}, out,
                                    q8=self._q8(kind, out, t1 - t0))
                self.link.submit(frame, kind)
                self._draft_on(g, [r.seq for r in step_rows if not r.new], [r.seq for r in step_rows if r.new])
            else:
                entries = await self._run(self._local_last, batch, x, new, forks)
                if epoch != self.recovery.epoch:
                    return
                self._on_tokens(g.id, g.step, entries, [])
        except ConnectionClosed:
            self._stage_lost(1, "the connection to stage 1 closed", epoch)
        except (ValueError, RuntimeError) as exc:
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
            try:
                t0 = time.monotonic()
                out = await self._step0(False, batch, x)
            except (ValueError, RuntimeError) as exc:
                self._finish(s, "error", step_failure(exc, self.device))
                raise
            if epoch != self.recovery.epoch:
                return
            frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step,
                                {"rows": [[s.id, s.pos, c]], "partial": True}, out,
                                q8=self._q8("prefill", out, time.monotonic() - t0))
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

    def _speculates(self, s: Sequence) -> bool:
        return self.speculate != "off" and s.spec and not s.cancelled

    def _k(self, s: Sequence, free: int = 0) -> int:
        """Tokens to draft after a decoding sequence this round, k from the policy (0: a
        plain step), `free` of them drafted ahead already. Never past its max_tokens: the
        KV its admission reserved holds the draft, and nothing past the window is drafted."""
        if not self._speculates(s):
            return 0
        return max(0, min(self.spec_policy.k_for(s.id, free), s.params.max_tokens - len(s.generated) - 1))

    async def _on_draft_thread(self, fn):
        """Run fn on the draft model's thread, ahead of any drafting-ahead: that yields to a
        waiting round at its next position (_draft_on's enough())."""
        def run():
            with self._drafts_lock:
                self._drafts_waiting -= 1
            return fn()

        with self._drafts_lock:
            self._drafts_waiting += 1
        return await asyncio.get_running_loop().run_in_executor(self._draft_exec, run)

    async def _drafts(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """This round's drafts for the decoding sequences of a step: seq id -> tokens."""
        if self.drafter is None:
            ks = {s.id: k for s in seqs if (k := self._k(s)) > 0}
            return {s.id: self._draft(s, ks[s.id]) for s in seqs if s.id in ks}
        if not any(self._speculates(s) for s in seqs):
            return {}
        if self._draft_reading:
            return {}   # the draft thread reads a new context (a prompt's compute): no waiting on it
        drafter = self.drafter
        # what the draft model guessed ahead during the last trip (its chains are settled
        # once this round has the draft thread: jobs run in order, ahead-drafting first),
        # and how much of each context it has yet to read
        ctxs = {s.id: s.prompt + s.generated for s in seqs}
        try:
            seen = await self._on_draft_thread(
                lambda: {sid: (drafter.ahead_of(sid, c), drafter.unread(sid, c)) for sid, c in ctxs.items()})
        except RuntimeError:   # the thread is shut down: the head is closing
            return {}
        ks = {}
        for s in seqs:
            free, unread = seen[s.id]
            k = self._k(s, free)
            if k <= 0:
                continue
            k_max = self.spec_policy.config.k_max
            if unread > k_max + 2 and self.draft_ahead:
                # more than a round's catch-up: a context new to the draft model. Reading it
                # is a prompt's compute, no round should wait on: it is read while this
                # step is in flight, and drafts start the round after -- where the sequence
                # has two whole rounds of guesses left to pay for it (a burst's last tokens
                # do not: there it would only take the host's cores from everyone's stage 0)
                s.draft_unread = s.params.max_tokens - len(s.generated) >= 2 * k_max
                continue
            ks[s.id] = k
        if not ks:
            return {}
        asks = [(sid, ctxs[sid], k) for sid, k in ks.items()]
        live = [sid for sid, x in self.seqs.items() if not x.done]

        def run():
            drafter.retain(live)   # sequences that finished since: their draft KV goes
            return drafter.draft(asks), drafter.seconds_per_token

        try:
            out, cost = await self._on_draft_thread(run)
        except (ValueError, RuntimeError) as exc:   # a guess is never worth a failed reply
            log.warning("the draft model failed: %s; plain steps this round", exc)
            return {}
        # the batch's drafting per computed guess (core/speculation.py's model), without the
        # prefill of a prompt new to the draft model, which is no guess's cost (guesses
        # drafted ahead the policy counts apart)
        if cost is not None:
            self.spec_policy.observe_draft(cost)
        return out

    def _draft_on(self, g: Group, seqs: list[Sequence], prompts: list[Sequence] = ()):
        """Overlap: the step checking these sequences' drafts (or a plain step) is on its
        way; the draft model drafts on after it, as if all of the draft stands, until the
        step comes back (_on_tokens stops it). If every guess stood and the target's own
        next token is the draft's next guess, the next round's guesses are ready
        (DraftModel.chain) and cost it only their verification (SpecPolicy's `free`); if
        not, they are dropped and it was the draft thread's idle time that paid.

        `prompts`, the sequences whose prompt this step carries: the prompt's trip is the
        time to read it into the draft model (one step, however long), which their first
        decode round would otherwise wait for -- where drafting ahead is known to pay at
        this load (a prompt is too dear a step to try it with). Not for a busy pipeline,
        where nobody drafts."""
        if self.drafter is None or not self.draft_ahead or self.spec_policy.busy:
            return
        ahead = self.spec_policy.config.k_max + 1   # the target's token, then a whole round
        policy = self.spec_policy
        asks, reading = [], False
        for s in seqs:
            if not self._speculates(s) or s.done:
                continue
            pays = policy.ahead_pays(s.id)
            if s.draft_unread:   # its context, read now (then guesses on, where that pays)
                s.draft_unread, reading = False, True
                asks.append((s.id, s.prompt + s.generated + s.draft, ahead if pays else 1))
            elif pays:
                asks.append((s.id, s.prompt + s.generated + s.draft, ahead))
        for s in prompts:
            if self._speculates(s) and not s.done and policy.ahead_pays(s.id, untried=False):
                asks.append((s.id, s.prompt + s.generated, ahead))
                reading = True
        if not asks:
            return
        stop = self._ahead_stop[g.id] = threading.Event()
        drafter = self.drafter

        def enough() -> bool:   # its step came back, or another micro-batch waits to draft
            return stop.is_set() or self._drafts_waiting > 0

        def run():   # queued behind other micro-batches' drafts, it may find its step back already
            drafter.draft(asks, stop=enough)
            return drafter.seconds_per_position

        def done(fut):
            if reading:
                self._draft_reading -= 1
            if fut.cancelled():
                return
            if fut.exception() is not None:
                log.warning("drafting ahead failed: %s", fut.exception())
            elif fut.result() is not None:   # how many guesses a trip has time for (ahead_pays)
                self.spec_policy.observe_ahead(fut.result())

        asyncio.get_running_loop().run_in_executor(self._draft_exec, run).add_done_callback(done)
        if reading:   # counted once it is queued: done() runs on this loop, after this
            self._draft_reading += 1

    def _stop_drafting_ahead(self, group_id: int | None = None):
        for gid in ([group_id] if group_id is not None else list(self._ahead_stop)):
            ev = self._ahead_stop.pop(gid, None)
            if ev is not None:
                ev.set()

    def _draft(self, s: Sequence, k: int) -> list[int]:
        """Prompt lookup's guess of up to k tokens after a decoding sequence."""
        t0 = time.perf_counter()
        if s.lookup is None:
            s.lookup = PromptLookup()
        known = len(s.lookup)
        if known < len(s.prompt):
            s.lookup.extend(s.prompt[known:])
            known = len(s.prompt)
        s.lookup.extend(s.generated[known - len(s.prompt):])
        draft = s.lookup.propose(k)
        self.spec_policy.observe_draft((time.perf_counter() - t0) / k)
        return draft

    def _local_last(self, batch, x, new, forks):
        if self.sampler.grammars is None:   # loads nothing until a request has a schema
            self.sampler.grammars = Grammars(lambda: self.tokenizer, self.stage0.vocab_size)
        self.sampler.open_new(new, self.stage0.vocab_size)
        logits = self.stage0.forward(batch, x)
        for parent, children in forks.items():
            for c in children:
                self.stage0.fork(parent, c)
        positions = [st + n - k + 1 for st, n, k in zip(batch.starts, batch.ns, batch.kept)]
        return self.sampler.step(batch.seq_ids, logits, forks, batch.keep, positions)

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
                        self._stage_lost(index, f"stage {index} ({r.address}) is leaving: {msg['reason']}", epoch,
                                         ask_back=False)
                        return
                    elif msg["type"] == "profile":   # checked point by point by parse_control
                        self.profiles[index] = msg["profile"]
                    elif msg["type"] == "stats":
                        fut = self._stats_waiters.pop(index, None)
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                    continue
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

    # ---- failover: the I/O, in the order it happens; the decisions (who is gone, whom to
    # ask back and when, when to give up, what the status says) are engine/core/recovery.py's
    def offer(self, address: str):
        """A machine offers its stage (ws://...): the head takes it in as soon as it
        answers -- a pipeline waiting for room at once, a running one by a rearrangement
        (every sequence replays, nothing is lost)."""
        if self.recovery.offer(self._remember(address), time.monotonic()):
            self._ensure_watch()

    def _stage_lost(self, index: int, why: str, epoch: int, ask_back: bool = True):
        """A stage left (its connection closed or went silent, it sent garbage, its
        owner took it back): rearrange the pipeline over the stages left and go on."""
        address = self.remotes[index - 1].address if 0 < index <= len(self.remotes) else None
        if not self.recovery.lost(index, address, why, epoch):
            return  # already being dealt with, or a stage of an arrangement that is gone
        log.warning("stage %d left (%s): rearranging the pipeline over the others", index, why)
        self._stop_drafting_ahead()   # the steps in flight never come back
        self._recovery = asyncio.ensure_future(self._recover_or_fail(self._rearrange(index, ask_back)))

    async def _recover_or_fail(self, rearrangement):
        try:
            await rearrangement
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a rearrangement that breaks must say so, not leave requests hanging
            log.exception("rearranging the pipeline failed")
            self._pipeline_failed(self.recovery.broke(exc))
        finally:
            self._ensure_watch()

    async def _rearrange(self, lost: int | None = None, ask_back: bool = True, joined: RemoteStage | None = None):
        """Drop stage `lost` (or take in `joined`, a machine that came back), split the
        layers over who is there, and replay every live sequence on the new arrangement."""
        asks = self.recovery.begin([r.address for r in self.remotes], self.ranges, time.monotonic(), lost,
                                   ask_back, joined.address if joined is not None else None)
        hints = self._profile_hints(lost)
        await self._let_go()
        live = self._rewind()
        self.remotes = await self._ask(asks) + ([joined] if joined is not None else [])
        capacity = self.sched.capacity
        self.stage0 = None  # its layers change: the old slice goes before the new one loads
        while True:
            self.remotes.sort(key=lambda r: self.recovery.rank(r.address))
            self._fresh_scheduler(capacity)
            self.recovery.forming(time.monotonic())
            try:
                await self._form(hints)
                break
            except NoRoom as exc:
                log.warning("%s", self.recovery.no_room(exc.need, exc.have, time.monotonic()))
                r = await self._wait_for_machine()
                if r is None:
                    self._pipeline_failed(self.recovery.gave_up(time.monotonic()))
                    return
                self.remotes.append(r)
            except (PipelineError, ModelError, ConnectionClosed, OSError) as exc:
                self._pipeline_failed(self.recovery.cannot_go_on(exc))
                return
        done = self.recovery.recovered(time.monotonic(), self.n_stages, self.ranges, len(live))
        log.warning("pipeline rearranged over %d stage(s) in %.1f s; %d sequence(s) replayed",
                    self.n_stages, done["seconds"], len(live))
        self._kick()

    def _profile_hints(self, lost: int | None) -> dict:
        """Each machine's last profile, for the layers it held: the stages left start from
        it scaled to their new share instead of profiling again while everyone waits."""
        hints = {"head": (self.profiles[0], self.ranges[0][1] - self.ranges[0][0])} if self.profiles else {}
        for i, r in enumerate(self.remotes, start=1):
            if i != lost and i < len(self.profiles):
                hints[r.address] = (self.profiles[i], r.range[1] - r.range[0])
        return hints

    async def _let_go(self):
        """Let the old arrangement's connections go, all at once: a dead peer's each waits
        out its close timeout; a live stage frees what it held for this head when its head
        goes."""
        for t in self._readers:
            t.cancel()
        self._readers = []
        closing = [ws.close() for ws in [self._data_ws] + [r.ws for r in self.remotes] if ws is not None]
        if self.link is not None:
            closing.append(self.link.close())
        self.link = self._data_ws = None
        await asyncio.gather(*closing, return_exceptions=True)

    def _rewind(self) -> list[Sequence]:
        """Every live sequence back to the queue with its history, in arrival order."""
        live = sorted((s for s in self.seqs.values() if not s.done), key=lambda s: s.id)
        for s in live:
            s.rewind()
        return live

    async def _ask(self, asks: list[Ask]) -> list[RemoteStage]:
        """The old arrangement's machines, asked to go on as the recovery says: those that answer."""
        answered = []
        for ask in asks:
            r = RemoteStage(ask.address)
            try:
                await self._hello(r, attempts=ask.attempts, timeout=ask.timeout)
            except PipelineError as exc:
                self.recovery.unanswered(ask, str(exc), time.monotonic())
                continue
            self.recovery.answered(ask)
            answered.append(r)
        return answered

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
            r = await self._probe()
            if r is not None:
                self.recovery.take(r.address)
                return r
            await asyncio.sleep(self.recovery.wait_s(time.monotonic()))
        return None

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
            log.warning("%s", self.recovery.came(r.address))
            self._recovery = asyncio.ensure_future(self._recover_or_fail(self._rearrange(joined=r)))
            return  # _recover_or_fail starts a new watch if others are still away

    def _pipeline_failed(self, why: str):
        if not self.recovery.fail(why):
            return
        log.error("pipeline failed: %s", why)
        for s in list(self.seqs.values()):
            self._finish(s, "error", why, free=False)

    def _on_tokens(self, group_id: int, step: int, tokens: list, errors: list):
        if not (0 <= group_id < len(self.groups)):
            log.warning("tokens for unknown micro-batch %d ignored", group_id)
            return
        g = self.groups[group_id]
        if step == 0:  # a prompt chunk failed on some stage
            for sid, msg in errors:
                s = self.seqs.get(sid)
                if s is not None:
                    self._finish(s, "error", msg)
            return
        if not g.in_flight or step != g.step:
            log.warning("stale tokens for micro-batch %d step %d ignored", group_id, step)
            return
        self._stop_drafting_ahead(group_id)   # its answer is here: no more guessing past it
        self._measure_trip(group_id, errors)
        members = {s.id: s for s in g.seqs}
        for sid, msg in errors:
            s = members.get(sid)
            if s is not None and not s.done:
                s.in_flight = 0
                self._finish(s, "error", msg)
        by_seq: dict[int, list] = {}   # a verification step answers one entry per position
        for entry in tokens:
            by_seq.setdefault(entry[0], []).append(entry)
        for sid, entries in by_seq.items():
            s = members.get(sid)
            if s is None or s.done or not s.in_flight:
                continue
            draft, s.draft = s.draft, []
            if draft:
                if len(entries) != len(draft) + 1:
                    s.in_flight = 0
                    self._finish(s, "error", f"a verification of {len(draft)} drafted tokens came back with "
                                             f"{len(entries)} tokens")
                    continue
                # the last stage drew what plain decoding would after each prefix of the
                # draft: the draft stands while it agrees (engine/core/spec_verify.py)
                verdict = verify_greedy(draft, [e[1] for e in entries])
                s.in_flight = verdict.n_accepted + 1   # what stays in every stage's KV
                self.spec_policy.observe_round(sid, len(draft), verdict.n_accepted)
                emitted = [(t, None) for t in draft[:verdict.n_accepted]] + [(verdict.next_token, None)]
            else:
                if s.spec and s.generated and self.speculate != "off":   # a plain decode round
                    self.spec_policy.observe_round(sid, 0, 0)
                entry = entries[0]
                lp = None
                if len(entry) == 4 and s.params.logprobs:
                    lp = TokenLogprob(entry[1], entry[2], [(t, v) for t, v in entry[3][:s.params.top_logprobs]])
                emitted = [(entry[1], lp)]
            self.sched.advance(s)
            if s.cancelled:
                self._finish(s, "cancelled")
                continue
            for tok, lp in emitted:
                if s.done:
                    break   # a stop, the end or max_tokens: what the draft guessed after it is not said
                self._append(s, tok, lp)
        for s in g.seqs:
            if s.in_flight and not s.done:
                # the step came back without it: a fork whose parent's step failed (every
                # row of a step gets a token or an error; forks ride on their parent's)
                s.in_flight = 0
                self._finish(s, "error", "the step that was to start this choice failed")
        for s in g.seqs:
            if s.needs_free:
                s.needs_free = False
                asyncio.ensure_future(self._free_everywhere([s.id]))
        self.sched.on_result(g)
        self._kick()

    def _measure_trip(self, group_id: int, errors: list) -> None:
        """A decode step's trip, head to head, for the speculation policy: a plain one
        times the ring, one with drafts the extra tokens' cost (over the plain trip)."""
        t0, drafted, decode = self._trips.pop(group_id, (None, 0, False))
        if t0 is None or not decode or errors:
            return
        seconds = time.monotonic() - t0
        if self.spec_policy.busy:
            return   # a busy pipeline's steps queue behind each other: no trip one person would see
        if not drafted:
            self.spec_policy.observe_trip(seconds)
        elif self.spec_policy.trip is not None:
            self.spec_policy.observe_verify_extra((seconds - self.spec_policy.trip) / drafted, drafted)

    def _append(self, s: Sequence, tok: int, lp: TokenLogprob | None = None):
        if s.t_first is None:
            s.t_first = time.perf_counter()
        self.tokens_served += 1
        if tok in self.eos_ids:
            self._finish(s, "stop")
            return
        s.generated.append(tok)
        if s.detok is None:
            s.detok = Detokenizer(self.tokenizer)
        # "" while the token ends inside a UTF-8 character: it comes with the next one
        text = s.text + s.detok.add(tok)
        reason = None
        for stop in s.params.stop:
            at = text.find(stop, max(0, len(s.text) - len(stop)))
            if at != -1:
                text, reason = text[:at], "stop"
                break
        delta = text[len(s.text):]
        s.text = text
        if delta or reason is None:
            s.queue.put_nowait(Delta(delta, [tok], None if lp is None else [lp]))
        if reason is None and (len(s.generated) >= s.params.max_tokens
                               or len(s.prompt) + len(s.generated) >= self.context_length):
            reason = "length"
        if reason:
            self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str, error: str | None = None, free: bool = True):
        if s.done:
            return
        s.done = True
        self.seqs.pop(s.id, None)
        self.spec_policy.drop(s.id)
        in_group = self.sched.release(s)
        if free and in_group:
            if s.in_flight:
                s.needs_free = True  # its step is still on some stage
            else:
                asyncio.ensure_future(self._free_everywhere([s.id]))
        now = time.perf_counter()
        s.queue.put_nowait(Done(reason, len(s.prompt), len(s.generated), error,
                                None if s.t_first is None else s.t_first - s.t_submit, now - s.t_submit))
        self._kick()

    async def stage_stats(self) -> list[dict]:
        """Every stage (head first): sequences held, tokens cached, frames refused,
        decode steps that cut into prompt steps."""
        # one query at a time: answers carry no id, so two callers would take each other's
        async with self._stats_lock:
            kv = self.stage0.kv
            out = [{"seqs": len(kv.seqs), "kv_tokens": kv.used_tokens, "rejected": 0,
                    "cut_ins": self.stage0.gate.cut_ins}]
            for i, r in enumerate(self.remotes, start=1):
                fut = asyncio.get_running_loop().create_future()
                self._stats_waiters[i] = fut
                await r.ws.send(frames.control("get_stats"))
                msg = await asyncio.wait_for(fut, 30)
                out.append({k: msg[k] for k in ("seqs", "kv_tokens", "rejected", "cut_ins")})
            return out

    async def _free_everywhere(self, ids: list[int]):
        if self.stage0 is None or self.recovery.closed:
            return  # mid-rearrangement (every stage starts afresh anyway), or closed

        def local():
            with self.stage0.gate.step(decode=False):  # never under a parked step's feet
                for i in ids:
                    self.stage0.free(i)
                    self.sampler.close(i)

        await self._run(local)
        for r in self.remotes:
            try:
                await r.ws.send(frames.control("free", seq_ids=ids))
            except ConnectionClosed:
                pass


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
