"""The head: owns the requests, runs stage 0, and keeps every stage busy.

Requests wait in a queue until the pipeline's KV budget can hold them (prompt +
max_tokens on every stage), then join one of K micro-batches at an iteration
boundary (continuous batching). Each micro-batch cycles head -> stage 1 -> ... ->
last stage -> head; with K >= number of stages every stage has work while the others
compute. Tokens stream to each request's queue as they arrive; a finished or
cancelled sequence is freed on every stage.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from engine.wire import frames
from engine.model.detok import Detokenizer
from engine.model.device import DTYPES, free_memory, kv_budget_tokens_for, speed_score
from engine.model.sources import ModelError, ModelSource
from engine.core import microbatch
from engine.core.compression import POLICIES as COMPRESS_POLICIES
from engine.core.compression import should_compress
from engine.pipeline.link import LinkSender, open_link
from engine.core.partition import layer_bytes_estimate, lm_head_layers_estimate, partition
from engine.core.profile import interp
from engine.model.measure import load_and_measure
from engine.core import prompt_chunk
from engine.core.sampling import SamplingParams
from engine.model.sampler import Sampler
from engine.core.partition import check_partition
from engine.model.stage import StageBatch, StageModel
from engine.core.step_gate import COMPUTE_ORDERS
from engine.pipeline.stage_server import PROTOCOL_VERSION, WS_OPTIONS

log = logging.getLogger("potluck.head")


class PipelineError(RuntimeError):
    """The pipeline cannot serve (a stage refused, died, or holds another model)."""


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Done:
    finish_reason: str          # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    ttft: float | None = None   # seconds from submit to first token
    seconds: float = 0.0


@dataclass
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    generated: list[int] = field(default_factory=list)
    pos: int = 0                 # tokens cached on the stages
    in_flight: int = 0           # tokens of the step now in the pipeline (0: none)
    opened: bool = False         # the last stage has its sampling parameters
    cancelled: bool = False
    done: bool = False
    needs_free: bool = False     # finished while a step was in flight: free when it returns
    text: str = ""               # decoded so far (emitted)
    detok: Detokenizer | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    @property
    def reservation(self) -> int:
        return len(self.prompt) + self.params.max_tokens


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
class Group:
    id: int
    seqs: list[Sequence] = field(default_factory=list)
    in_flight: bool = False
    step: int = 0
    retiring: bool = False       # the controller wants fewer micro-batches: admit nobody


@dataclass
class RemoteStage:
    address: str
    ws: object = None
    welcome: dict | None = None
    configured: dict | None = None
    range: tuple[int, int] = (0, 0)


class Head:
    def __init__(self, source: ModelSource, stage_addresses: list[str] | None = None, *,
                 layers: list[tuple[int, int]] | None = None, micro_batches: int | None = None,
                 dtype: str = "float32", device: str = "cpu", kv_budget_tokens: int | None = None,
                 max_batch: int = 32, pipeline: str = "local", progress=None,
                 prefill_chunk: int | str | None = "auto", link_mode: str = "jit", compress: str = "off",
                 compute: str = "in-order",
                 cores=None, cpu_shares: list[float] | None = None,
                 next_addresses: list[str | None] | None = None):
        self.source = source
        self.cores = cores  # a CoreLease when local stage processes share this CPU
        # when they do, each stage's share of it stands in for the speed probes (which
        # would measure one another's load): 3 stages on 2 cores get 0.5, 1, 0.5
        self.cpu_shares = cpu_shares
        self.remotes = [RemoteStage(a) for a in (stage_addresses or [])]
        self.n_stages = 1 + len(self.remotes)
        self.layers_override = layers
        # Stage processes that lease this CPU's cores (cores.py) are one compute
        # resource: every step runs on all the idle cores, so one micro-batch
        # keeps the whole CPU busy, stage after stage, and every extra micro-batch only
        # re-reads the weights (8 requests on 2 local stages: 2 micro-batches of one
        # core each decoded at 0.75x the single process, one on both cores 0.86-0.95x). On
        # separate machines each stage is its own resource: as many as there are stages.
        self.micro_batches = micro_batches or (1 if cores is not None else self.n_stages)
        # with no fixed count, the controller (microbatch.py) picks M..2M from the
        # measured compute and link figures, and re-picks as they change
        # Not for stages sharing this CPU: they talk over loopback, so there are no
        # transmission bubbles to fill, and each extra micro-batch re-reads the weights
        # (measured: the controller went to 3 on 2 local stages, decode 0.48x single).
        self.dynamic_micro_batches = micro_batches is None and self.n_stages > 1 and cores is None
        # Data links acknowledge every piece so the sender can measure the link, except
        # between processes sharing this CPU: over loopback there is nothing to measure,
        # and each ack is a message handled on two ends while the cores compute a step
        # (bench/overhead.py, 3 stages, 8 requests: see README).
        self.acks = cores is None
        self._retuned_at = 0.0
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.device = device
        self.kv_budget_override = kv_budget_tokens
        self.max_batch = max_batch
        # Long prompts travel in chunks so stage 1 computes chunk k while the head
        # computes chunk k+1 (None: whole prompts). Pointless without remote stages.
        # "auto" (the default): sized to the measured link, prompt by prompt
        # (prompt_chunk.py); 64 tokens where there is no link to measure.
        if not (prefill_chunk is None or prefill_chunk == "auto"
                or (type(prefill_chunk) is int and prefill_chunk > 0)):
            raise ValueError("prefill_chunk must be a positive number of tokens, 'auto' or None")
        self.prefill_chunk = prefill_chunk if stage_addresses else None
        self.link_mode = link_mode          # fifo | fixed | jit (see link_scheduler.py)
        if compress not in COMPRESS_POLICIES:
            raise ValueError(f"compression policy must be one of {COMPRESS_POLICIES}")
        self.compress = compress            # off | auto | prefill | all (see compression.py)
        # in-order: steps in arrival order, as vLLM computes; decode-first: decode steps cut
        # into prompt steps between layers (step_gate.py). bench/weaklink.py at the paper's
        # reference point: time per token 0.135 -> 0.127 s, first token 1.13 -> 1.24 s.
        if compute not in COMPUTE_ORDERS:
            raise ValueError(f"compute order must be one of {COMPUTE_ORDERS}")
        self.compute = compute
        self.link: LinkSender | None = None
        self.profiles: list[dict] = []
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._stats_lock = asyncio.Lock()
        self.pipeline = pipeline
        # how remote stage i reaches stage i+1 when that differs from how the head
        # reaches it (stages in other homes, behind tunnels: engine/wire/tunnel.py)
        self.next_addresses = next_addresses
        self.progress = progress or (lambda stage, done, total, what: None)
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="head-compute")
        # decode steps' own thread, with compute="decode-first": they cut into prompt
        # steps between layers, as on the stages (engine/core/step_gate.py)
        self._decode_exec = ThreadPoolExecutor(1, thread_name_prefix="head-decode")
        self._ids = itertools.count(1)
        self.seqs: dict[int, Sequence] = {}
        self.waiting: list[Sequence] = []
        self.groups: list[Group] = []
        self.sampler = Sampler()   # used when the head is also the last stage
        self.stage0: StageModel | None = None
        self._data_ws = None
        self._readers: list[asyncio.Task] = []
        self.reserved = 0
        self.capacity = 0
        self.ranges: list[tuple[int, int]] = []
        self.error: str | None = None
        self.pausing: str | None = None  # a stage said it is going (wire "pausing")
        self._kick_pending = False
        self._last_steps: dict[int, int] = {}  # step counters of removed micro-batches (stale frames)
        self.tokens_served = 0

    # ---- setup --------------------------------------------------------------
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def _step0(self, decode: bool, batch: StageBatch, x: torch.Tensor) -> torch.Tensor:
        """Stage 0's share of a step: decode steps cut into prompt steps (compute
        "decode-first"), or everything in arrival order ("in-order")."""
        cut_in = decode and self.compute == "decode-first"

        def run():
            with self.stage0.gate.step(decode=cut_in):
                return self.stage0.forward(batch, x)

        return await asyncio.get_running_loop().run_in_executor(self._decode_exec if cut_in else self._exec, run)

    async def start(self) -> "Head":
        cfg = self.source.config()
        self.config = cfg
        self.tokenizer = await self._run(self.source.tokenizer)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        self.eos_ids = _eos_ids(cfg, self.tokenizer, self.source)
        n_layers = cfg.num_hidden_layers
        if self.layers_override:
            # A user's split is checked before any stage is contacted or any weight read:
            # a typo should cost a message, not a minute of loading.
            check_partition(self.layers_override, n_layers)
            if len(self.layers_override) != self.n_stages:
                raise ModelError(f"{len(self.layers_override)} layer ranges for {self.n_stages} stages")
        fingerprint = await self._run(self.source.fingerprint)

        for r in self.remotes:
            try:
                r.ws = await connect(r.address, **WS_OPTIONS)
                await r.ws.send(frames.control("hello", role="control", version=PROTOCOL_VERSION,
                                             pipeline=self.pipeline))
                r.welcome = frames.parse_control(await asyncio.wait_for(r.ws.recv(), 30))
            except (OSError, asyncio.TimeoutError, ConnectionClosed, frames.FrameError) as exc:
                raise PipelineError(f"cannot reach stage at {r.address}: {exc}") from None
            if r.welcome["type"] != "welcome":
                raise PipelineError(f"stage at {r.address} did not welcome us: {r.welcome}")

        if self.layers_override:
            self.ranges = list(self.layers_override)
        else:
            if self.cpu_shares:
                speeds = list(self.cpu_shares)
            else:
                speeds = [await self._run(speed_score, self.device)] + [r.welcome["speed"] for r in self.remotes]
            mems = [free_memory(self.device)] + [r.welcome["free_memory"] for r in self.remotes]
            per_layer = layer_bytes_estimate(cfg, self.dtype.itemsize)
            caps = [max(1, int(m * 0.6 // per_layer)) for m in mems]
            extra = [0.0] * self.n_stages
            extra[-1] = lm_head_layers_estimate(cfg)
            self.ranges = partition(n_layers, speeds, caps, extra)
        for r, rng in zip(self.remotes, self.ranges[1:]):
            r.range = rng

        async def configure(i, r):
            nxt = (self.next_addresses[i] if self.next_addresses else self.remotes[i + 1].address) \
                if i + 1 < len(self.remotes) else None
            await r.ws.send(frames.control(
                "configure", model=self.source.spec, start=r.range[0], end=r.range[1],
                fingerprint=fingerprint, next=nxt, dtype=self.dtype_name,
                kv_budget_tokens=self.kv_budget_override, threads=None, link=self.link_mode,
                compress=self.compress, compute=self.compute, acks=self.acks))
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
            budget = self.kv_budget_override or kv_budget_tokens_for(cfg, self.ranges[0], self.dtype, self.device)
            return load_and_measure(lambda: StageModel(
                self.source, *self.ranges[0], dtype=self.dtype, device=self.device,
                kv_budget_tokens=budget, cores=self.cores,
                progress=lambda d, t, w: self.progress(0, d, t, w)))

        try:
            results = await asyncio.gather(self._run(load_local),
                                           *(configure(i, r) for i, r in enumerate(self.remotes)))
        except ConnectionClosed as exc:
            raise PipelineError(f"a stage closed its connection during setup: {exc}") from None
        self.stage0, profile0 = results[0]
        self.profiles = [profile0] + [r.configured["profile"] for r in self.remotes]
        budgets = [self.stage0.kv.budget_tokens] + [r.configured["kv_budget_tokens"] for r in self.remotes]
        self.capacity = min(budgets)

        if self.remotes:
            self._data_ws = await connect(self.remotes[0].address, **WS_OPTIONS)
            await self._data_ws.send(frames.control("hello", role="data", version=PROTOCOL_VERSION,
                                                  pipeline=self.pipeline))
            self.link = open_link(self._data_ws, self.link_mode, lambda n: interp(self.profiles[0]["decode"], n),
                                  on_failed=lambda why: self._pipeline_failed(f"link to stage 1: {why}"),
                                  acked=self.acks)
            for i, r in enumerate(self.remotes):
                self._readers.append(asyncio.ensure_future(self._read_stage(i + 1, r)))
        self.groups = [Group(i) for i in range(self.micro_batches)]
        return self

    async def close(self):
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

    def info(self) -> dict:
        return {
            "model": self.source.name,
            "stages": [{"address": "head (this process)", "layers": list(self.ranges[0])}]
            + [{"address": r.address, "layers": list(r.range)} for r in self.remotes],
            "micro_batches": self.micro_batches,
            "kv_capacity_tokens": self.capacity,
            "kv_reserved_tokens": self.reserved,
            "running": sum(len(g.seqs) for g in self.groups),
            "waiting": len(self.waiting),
            "tokens_served": self.tokens_served,
            "pausing": self.pausing,
            "error": self.error,
        }

    # ---- requests -----------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
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
        seq = Sequence(next(self._ids), list(prompt), params, asyncio.Queue())
        if seq.reservation > self.capacity:
            raise ValueError(f"this request needs {seq.reservation} tokens of KV cache but the pipeline "
                             f"holds at most {self.capacity}; lower max_tokens or shorten the prompt")
        self.seqs[seq.id] = seq
        self.waiting.append(seq)
        # kick on the loop's next turn, once: requests submitted together (a burst, a
        # client's batch) then start in one step instead of the first alone and the
        # rest prefilling a step later alongside its decode
        if not self._kick_pending:
            self._kick_pending = True
            asyncio.get_running_loop().call_soon(self._deferred_kick)
        return RequestHandle(self, seq)

    def _deferred_kick(self):
        self._kick_pending = False
        self._kick()

    def cancel(self, seq_id: int):
        seq = self.seqs.get(seq_id)
        if seq is None or seq.done:
            return
        seq.cancelled = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled", free=False)
        elif not seq.in_flight:
            self._finish(seq, "cancelled")
        # else: finished when its step comes back

    # ---- scheduling ---------------------------------------------------------
    def _retune(self):
        """Re-pick the micro-batch count at most twice a second."""
        now = time.monotonic()
        if now - self._retuned_at < 0.5:
            return
        self._retuned_at = now
        log = self.stage0.step_log if self.stage0 is not None else None
        if log is not None and log.steps:   # the head's own stage, as its steps time it
            self.profiles[0] = log.profile()
        if not self.dynamic_micro_batches or self.link is None:
            return
        n_seqs = sum(len(g.seqs) for g in self.groups) + len(self.waiting)
        est = self.link.sched.link
        hop_bytes = self.config.hidden_size * self.dtype.itemsize
        stage_curves = [(lambda b, p=p: interp(p["decode"], b)) for p in self.profiles]
        busy = [(lambda b: b * hop_bytes / est.bandwidth)] * (self.n_stages - 1)
        # path delay only: queueing behind our own volumes is what `busy` models
        one_way = (est.rtt_min if est.rtt_min != float("inf") else est.rtt) / 2
        latency = [one_way] * self.n_stages  # the last hop carries tokens: a few bytes
        k = microbatch.choose(self.n_stages, n_seqs, stage_curves, busy, latency)
        for g in self.groups:
            g.retiring = g.id >= k
        while len(self.groups) < k:
            self.groups.append(Group(len(self.groups)))
        while len(self.groups) > k and not self.groups[-1].seqs and not self.groups[-1].in_flight:
            self.groups.pop()  # only trailing ones: ids of groups in flight stay valid
        self.micro_batches = len([g for g in self.groups if not g.retiring])

    def _kick(self):
        self._retune()
        # Trailing micro-batches beyond the count, empty and idle, go (ids stay valid).
        while len(self.groups) > max(1, self.micro_batches) and not self.groups[-1].seqs \
                and not self.groups[-1].in_flight:
            self._last_steps[self.groups[-1].id] = self.groups[-1].step
            self.groups.pop()
        idle = [g for g in self.groups if not g.in_flight]
        # A newcomer that joins a decoding micro-batch holds its members' next token
        # until its whole prompt has crossed every link and stage (on a weak link,
        # most of a second, once per newcomer). So newcomers fill empty micro-batches
        # first, and when every micro-batch is decoding, a dynamic count (M..2M) opens
        # one more for them: it fills the links' bubbles meanwhile and leaves when its
        # requests finish. (A fixed count -- the FIFO baseline, --micro-batches, stages
        # sharing this CPU -- keeps vLLM's behaviour: newcomers join decoding batches.)
        if self.waiting and not self.pausing and self.dynamic_micro_batches \
                and all(g.seqs and not g.retiring for g in self.groups) and len(self.groups) < 2 * self.n_stages:
            g = Group(len(self.groups), step=self._last_steps.get(len(self.groups), 0))
            self.groups.append(g)
            idle.append(g)
        for g in sorted(idle, key=lambda g: bool(g.seqs)):
            self._admit(g)
        for g in idle:
            if g.seqs:
                g.in_flight = True
                g.step += 1
                asyncio.ensure_future(self._launch(g))

    def _admit(self, g: Group):
        if g.retiring or self.pausing:
            return
        active = sum(len(x.seqs) for x in self.groups) + len(self.waiting)
        fair = max(1, math.ceil(active / max(1, self.micro_batches)))
        limit = min(fair, self.max_batch)
        while self.waiting and len(g.seqs) < limit:
            seq = self.waiting[0]
            if self.reserved + seq.reservation > self.capacity:
                break  # wait for KV memory to come back
            self.waiting.pop(0)
            self.reserved += seq.reservation
            g.seqs.append(seq)

    async def _launch(self, g: Group):
        try:
            for s in list(g.seqs):
                if not s.opened and not s.done:
                    s.in_flight = len(s.prompt) - s.pos
                    await self._stream_prompt(g, s)
        except ConnectionClosed:
            self._pipeline_failed("the connection to stage 1 closed")
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
        rows, inputs, new = [], [], {}
        for s in g.seqs:
            if s.done:
                continue
            if not s.opened:
                n = len(s.prompt) - s.pos
                inputs.extend(s.prompt[s.pos:])
                new[str(s.id)] = {"sampling": s.params.to_dict(), "prompt": s.prompt}
                s.opened = True
            else:
                n = 1
                inputs.append(s.generated[-1])
            s.in_flight = n
            rows.append([s.id, s.pos, n])
        if not rows:
            for s in g.seqs:  # no step to trail behind: free now
                if s.needs_free:
                    s.needs_free = False
                    asyncio.ensure_future(self._free_everywhere([s.id]))
            g.seqs = []
            g.in_flight = False
            self._kick()
            return
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        x = torch.tensor(inputs, dtype=torch.long)
        try:
            if self.remotes:
                decode = not new
                t0 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_started(t0, len(rows))
                out = await self._step0(decode, batch, x)
                t1 = time.monotonic()
                if decode:
                    self.link.sched.decode_compute_finished(t1)
                kind = "decode" if decode else "prefill"
                frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step, {"rows": rows, "new": new}, out,
                                    q8=self._q8(kind, out, t1 - t0))
                self.link.submit(frame, kind)
            else:
                toks = await self._run(self._local_last, batch, x, new)
                self._on_tokens(g.id, g.step, [[s, t] for s, t in zip(batch.seq_ids, toks)], [])
        except ConnectionClosed:
            self._pipeline_failed("the connection to stage 1 closed")
        except (ValueError, RuntimeError) as exc:
            log.warning("step failed on the head: %s", exc)
            self._on_tokens(g.id, g.step, [], [[s, str(exc)] for s in batch.seq_ids])

    async def _stream_prompt(self, g: Group, s: Sequence):
        """Send all but the last chunk of a new prompt ahead of its micro-batch step."""
        c = self.prompt_chunk_tokens()
        if not c:
            return
        if sum(len(x.seqs) for x in self.groups) + len(self.waiting) <= 1:
            if self.cores is not None:
                # alone, with stages sharing this CPU (so on one machine, over loopback):
                # the whole prompt in one step, each stage in turn borrowing every core
                # (cores.py), beats chunks that each pay a step's fixed cost (reading
                # the weights) again. (A first try kept chunks when the measured link
                # looked slow, but goodput measured from small acked volumes reads far
                # below loopback's rate, and TTFT went from 1.08x to 1.4x.)
                return
            # alone in the pipeline: cut the prompt finer so every stage works on it at
            # once (time to first token), though each chunk pays a step's fixed cost
            c = min(c, max(16, math.ceil(len(s.prompt) / (2 * self.n_stages))))
        while len(s.prompt) - s.pos > c and not s.done:
            batch = StageBatch([s.id], [s.pos], [c])
            x = torch.tensor(s.prompt[s.pos: s.pos + c], dtype=torch.long)
            try:
                t0 = time.monotonic()
                out = await self._step0(False, batch, x)
            except (ValueError, RuntimeError) as exc:
                self._finish(s, "error", str(exc))
                raise
            frame = frames.encode(frames.FrameType.ACTIVATIONS, g.id, g.step,
                                {"rows": [[s.id, s.pos, c]], "partial": True}, out,
                                q8=self._q8("prefill", out, time.monotonic() - t0))
            s.pos += c
            s.in_flight -= c
            self.link.submit(frame, "prefill")

    def prompt_chunk_tokens(self) -> int | None:
        """Tokens per prompt chunk for the next prompt (None: whole prompts)."""
        c = self.prefill_chunk
        if c != "auto":
            return c
        if self.cores is None and self.link is not None:   # a real link between machines
            return prompt_chunk.prompt_chunk_tokens(
                self.profiles[0]["prefill"], self.config.hidden_size * self.dtype.itemsize,
                self.dtype.itemsize, self.link.sched.link.bandwidth, compress=self.compress)
        return prompt_chunk.CAP

    def _q8(self, kind: str, out: torch.Tensor, compute_seconds: float) -> bool:
        return should_compress(self.compress, kind, out.numel() * out.element_size(),
                               self.link.sched.link.bandwidth, compute_seconds)

    def _local_last(self, batch, x, new):
        for k, v in new.items():
            self.sampler.open(int(k), SamplingParams.from_dict(v["sampling"]), v["prompt"])
        logits = self.stage0.forward(batch, x)
        return self.sampler.sample(batch.seq_ids, logits)

    async def _read_stage(self, index: int, r: RemoteStage):
        """Tokens (from the last stage) and step errors (from any stage)."""
        try:
            async for data in r.ws:
                if isinstance(data, str):
                    msg = frames.parse_control(data)
                    if msg["type"] == "error":
                        log.warning("stage %d: %s", index, msg["message"])
                    elif msg["type"] == "pausing":
                        # its owner is taking the stage back: let what runs finish, admit nothing new
                        self.pausing = f"stage {index} is being paused by its owner: {msg['reason']}"
                        log.warning("%s", self.pausing)
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
            self._pipeline_failed(f"stage {index} sent a bad frame: {exc}")
        except ConnectionClosed as exc:
            reason = exc.rcvd.reason if exc.rcvd is not None else ""
            if reason and not self.pausing:
                self.pausing = f"stage {index}: {reason}"
        if not self.error:
            self._pipeline_failed(self.pausing or f"stage {index} ({r.address}) disconnected")

    def _pipeline_failed(self, why: str):
        if self.error:
            return
        self.error = why
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
        members = {s.id: s for s in g.seqs}
        for sid, msg in errors:
            s = members.get(sid)
            if s is not None and not s.done:
                s.in_flight = 0
                self._finish(s, "error", msg)
        for sid, tok in tokens:
            s = members.get(sid)
            if s is None or s.done or not s.in_flight:
                continue
            s.pos += s.in_flight
            s.in_flight = 0
            if s.cancelled:
                self._finish(s, "cancelled")
                continue
            self._append(s, tok)
        for s in g.seqs:
            s.in_flight = 0
            if s.needs_free:
                s.needs_free = False
                asyncio.ensure_future(self._free_everywhere([s.id]))
        g.seqs = [s for s in g.seqs if not s.done]
        g.in_flight = False
        self._kick()

    def _append(self, s: Sequence, tok: int):
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
            s.queue.put_nowait(Delta(delta, [tok]))
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
        in_group = any(s in g.seqs for g in self.groups)
        if in_group:
            self.reserved -= s.reservation
            for g in self.groups:
                if s in g.seqs and not g.in_flight:
                    g.seqs.remove(s)
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
