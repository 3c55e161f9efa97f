"""A stage process: a WebSocket server that holds one slice of the model.

Connections, each opened by a peer and introduced with a `hello`:
  * control (from the head): configure / free / shutdown; the stage answers with
    progress, configured, and — on the last stage — the sampled tokens;
  * data (from the previous stage or the head): activation frames in, which are
    computed in order and forwarded to the next stage.

A frame that fails validation closes the connection that sent it, with the reason;
the stage keeps serving. Torch work runs on one compute thread so the event loop
stays free to move bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.protocol import State

from engine.wire import frames
from engine.core.compression import POLICIES as COMPRESS_POLICIES
from engine.model.static_decode import decode_counts
from engine.core.cpu_share import asked_threads
from engine.core.product_choice import ProductChoice
from engine.model.cores import CoreLease
from engine.model.device import (HostStaging, device_name, free_memory, kv_budget_tokens_for, memory_for_kv,
                                 pick_device, release_memory, speed_score, step_failure)
from engine.pipeline.hop_trace import HopTrace
from engine.pipeline.link import LinkSender, open_link
from engine.core.link_scheduler import MODES as LINK_MODES
from engine.core.profile import differs, interp
from engine.model.measure import load_and_measure
from engine.model.quant import bnb_missing
from engine.pipeline.inbox import Inbox
from engine.wire.volumes import DEFAULT_MAX_VOLUME, Reassembler
from engine.model.sources import ModelError
from engine.pipeline.configure_check import check_configure
from engine.pipeline import step_rows
from engine.pipeline.stage_compute import StageCompute
from engine.pipeline.load_ahead import ahead_profile, build_alone, build_beside
from engine.model.handover import HeldLayers
from engine.pipeline.outbox import Outbox
from engine.wire.sealed_socket import SealedSocket
from engine.wire.write_watch import watch_writes
from engine.wire.stage_auth import answer_hello, is_loopback, new_nonce, split_address
from engine.wire.ws_server import serve
from engine.core.ws_address import address_problem
# what a stage and its peers agree on, importable from here as before
from engine.pipeline.stage_protocol import (CLIENT_WS_OPTIONS, HEARTBEAT_S, HEARTBEAT_TIMEOUT_S,  # noqa: F401
                                            HELLO_TIMEOUT, LEAVE_S, LET_GO_S, MAX_DATA_LINKS, NEXT_LINK_GRACE_S, PROFILE_REPORT_S,
                                            CONTROL_MAX, CONTROL_QUEUE, DATA_MAX, PROOF_MAX, PROOF_QUEUE, PROTOCOL_VERSION,
                                            SEND_STALL_S, WS_OPTIONS, connect_stage, lift_proof_limit)
from engine.model.sampler import Sampler
from engine.model.stage import StageModel, import_model_code
from engine.core.step_gate import COMPUTE_ORDERS

log = logging.getLogger("potluck.stage")


# how long a new head's control connection waits for the handler of one whose head hung
# up mid-work to let go, before it is refused (the head waits 30 s for its welcome)
BUSY_LET_GO_S = 25.0


class StageServer(StageCompute):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, pipeline: str = "local",
                 device: str = "auto", threads: int | None = None, cores=None, memory_cap: int | None = None,
                 secret: str | None = None, trusted_head: bool | None = None, accept_models=(),
                 on_event=None):
        # Beyond this machine, only a head that proves the share's secret may drive it
        if not is_loopback(host) and not secret:
            raise ValueError(f"a stage listening on {host or 'every interface'} needs a secret "
                             "(--secret, or share through an invite)")
        self.host, self.port = host, port
        self.secret = secret
        # what the owner of this computer hears of its share (a friend's `potluck join`
        # terminal): taken into the pipeline, with which layers, and let go
        self.on_event = on_event or (lambda text: None)
        # a trusted head (this machine's own pipeline, over loopback) may name any model,
        # a path included; any other head only what configure_check.remote_model_ok allows
        self.trusted_head = (is_loopback(host) and not secret) if trusted_head is None else trusted_head
        self.accept_models = frozenset(accept_models)   # what the owner allows beyond the list
        self._route: str | None = None   # the data-link token of the head that configured us
        self._route_set = asyncio.Event()
        self._data_links: dict = {}       # the data links that proved the route token, oldest first
        # a CoreLease when this machine's cores are shared (engine/model/cores.py); alone on
        # them (a friend's shared stage) and with no thread count fixed, a lease of its own:
        # its steps keep off the cores the owner's programs use
        self._own_cores = CoreLease.solo() if cores is None and threads is None else None
        self.cores = cores if cores is not None else self._own_cores
        # which matrix product a CPU decode step takes, kept across the stages this server
        # builds: one built anew after a rearrangement does not time them again
        self.products = ProductChoice()
        self.trace = HopTrace.from_env("stage")   # where a round's time goes (POTLUCK_HOP_TRACE)
        self.pipeline = pipeline
        self.device = pick_device(device)
        # bytes the owner lets this stage use (their VRAM cap): the head sees no more free
        # memory than this, a slice whose weights exceed it is refused, the KV fits beside
        self.memory_cap = memory_cap
        if threads:
            threads, note = asked_threads(threads, os.cpu_count() or 1)
            if note:
                log.warning("%s", note)
            torch.set_num_threads(threads)
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="compute")
        # decode steps' own thread, with compute="decode-first": they cut into prompt
        # steps between layers (engine/core/step_gate.py); by default everything runs in order
        self._decode_exec = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self.decode_first = False
        self.stage: StageModel | None = None
        self.sampler = Sampler()
        self._to_host = HostStaging()   # a GPU step's output leaves through pinned memory
        self._control_ws = None
        self._head_gone = False   # the control connection's head has gone; it is being let go
        self._leaving = False
        self._next_ws = None
        self._link: LinkSender | None = None
        self.profile: dict = {}        # what the head was last told (startup, then StepLog's)
        # a slice loaded ahead ("prepare"): its profile, the layers it was measured for and
        # how it was built (model, dtype, weights), for the configure that takes it
        self._ahead: tuple[dict, int, tuple] | None = None
        # beside a serving stage: the layers its next slice lacks, loaded ahead
        self._extra: HeldLayers | None = None
        self._preparing: asyncio.Future | None = None
        self._load_exec = ThreadPoolExecutor(1, thread_name_prefix="load-ahead")
        self._profile_sent_at = 0.0
        self._speed_at: tuple[float, float] | None = None   # (when, speed_score) of the last welcome
        self.compress = "off"
        self.acks = True               # until configured (see _configure)
        self._server = None
        self._closed = asyncio.Event()
        self._out: Outbox | None = None
        self._sender_task: asyncio.Task | None = None
        self.rejected_frames = 0
        self.send_stall_s = SEND_STALL_S   # a peer that reads nothing this long is cut

    async def start(self):
        self._server = await serve(self._handle, self.host, self.port,
                                   **dict(WS_OPTIONS, max_size=PROOF_MAX, max_queue=PROOF_QUEUE))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def warm_up(self) -> None:
        """Import the model code while no head has asked for layers yet. On the compute
        thread, where every load runs: a configure (or the welcome's speed probe) that
        comes sooner waits behind it, where two threads importing at once could be
        handed a half-built module. A failure here is the configure's to report."""
        def imports():
            try:
                import_model_code()
            except Exception as exc:   # (an ImportError here is one the load would meet too)
                log.debug("warming up the model code failed: %s", exc)
        self._exec.submit(imports)

    def _free_memory(self) -> int:
        # the slice held now goes when the next configure comes: its memory is on offer too
        # (else after a rearrangement a GPU full of layers would offer a few layers' room)
        free = free_memory(self.device) + (self.stage.held_bytes() if self.stage is not None else 0) \
            + (self._extra.nbytes() if self._extra is not None else 0)
        return free if self.memory_cap is None else min(free, self.memory_cap)

    def about(self) -> dict:
        """What this stage offers, in a joiner's hello: its device's name and free memory."""
        return {"device": device_name(self.device), "memory": self._free_memory()}

    async def wait_closed(self):
        await self._closed.wait()

    @property
    def closed(self) -> bool:
        """Whether this server stopped serving (closed by its owner, or told to shut down)."""
        return self._closed.is_set()

    @property
    def connected(self) -> bool:
        """Whether a head holds this stage (its control connection is open)."""
        return self._control_ws is not None

    async def close(self, reason: str | None = None, wait_s: float = 0.0):
        """Stop serving. With a reason, the head hears it first (close code 1001: going
        away). With wait_s, wait up to that long until the port is free again."""
        if reason and self._control_ws is not None:
            try:
                await self._control_ws.close(1001, reason[:120])
            except Exception:  # the head may be gone already
                pass
        if self._server is not None:
            self._server.close()
        await self._drop_next()
        if self._sender_task is not None:
            self._sender_task.cancel()
        self._closed.set()
        self.trace.flush()
        self._extra = self._ahead = None   # layers loaded ahead: nobody will take them now
        if self._control_ws is None:   # else its handler does, once the head's sequences are freed
            self._retire_threads()
        if wait_s and self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), wait_s)
            except asyncio.TimeoutError:
                log.warning("the stage's server took long to close")

    async def _drop_next(self):
        """Close the link to the next stage (an idle link's task would outlive us otherwise)."""
        link, self._link, ws, self._next_ws = self._link, None, self._next_ws, None
        for other in (link, ws):
            if other is not None:
                await other.close()

    def _retire_threads(self):
        """Compute threads end with the server (each keeps its own heap arena), not at gc."""
        for executor in (self._exec, self._decode_exec, self._load_exec):
            executor.shutdown(wait=False, cancel_futures=True)
        if self._own_cores is not None:   # a step still running finds it closed, and locks nothing
            self._own_cores.close()
            self._own_cores = None

    async def leave(self, reason: str, seconds: float = LEAVE_S) -> bool:
        """Tell the head we are leaving (it moves our layers and replays our sequences) and wait
        at most `seconds` for it to let go; whether it did. The server stays up (see close)."""
        self._leaving = True  # no head takes it meanwhile
        ws = self._control_ws
        if ws is None:
            return True
        async def tell_and_wait():
            await ws.send(frames.control("leaving", reason=reason[:500], seconds=float(seconds)))
            await ws.wait_closed()

        try:   # the telling within the owner's `seconds` too: a head that reads nothing cannot hold it
            await asyncio.wait_for(tell_and_wait(), seconds)
        except ConnectionClosed:
            pass
        except asyncio.TimeoutError:
            log.warning("the head did not let this stage go within %.0f s: leaving anyway", seconds)
            return False
        await self._let_go(ws)
        return True

    async def _let_go(self, ws, patience: float = LET_GO_S + 2.0):
        """Until the handler of control connection `ws` has closed its data links, freed its
        sequences and let go (at most `patience` seconds): only then is this stage free."""
        deadline = asyncio.get_running_loop().time() + patience
        while self._control_ws is ws and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    def _hand_over(self, start: int, end: int):
        """The old stage's layers in [start, end), on the compute thread once a decode step
        that cut in is done."""
        old, self.stage = self.stage, None
        extra, self._extra = self._extra, None   # loaded ahead beside it
        if old is None:
            return extra.narrow(start, end) if extra is not None else None
        self._decode_exec.submit(lambda: None).result()
        return old.hand_over().merge(extra).narrow(start, end)

    async def _speed(self) -> float:
        """The welcome's speed score, measured again only after SPEED_FRESH_S: a
        rearrangement's head asks every stage at once, and each measuring (0.15 s of
        matrix products, the survivors' on the cores they share) held every reply."""
        now = time.monotonic()
        if self._speed_at is None or now - self._speed_at[0] > SPEED_FRESH_S:
            self._speed_at = (now, await self._run(speed_score, self.device))
        return self._speed_at[1]

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    # ---- connections --------------------------------------------------------
    async def _handle(self, ws):
        try:
            # nothing about this machine before the peer proves a key: only a nonce
            nonce = new_nonce()
            await ws.send(frames.control("challenge", nonce=nonce))
            try:
                first = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT)
            except asyncio.TimeoutError:
                raise frames.FrameError(f"no hello within {HELLO_TIMEOUT:g} s") from None
            hello = frames.parse_control(first)
            if hello["type"] != "hello" or hello["role"] not in ("control", "data"):
                raise frames.FrameError("first message must be hello with role control or data")
            if hello["version"] != PROTOCOL_VERSION:
                raise frames.FrameError(f"protocol version {hello['version']} not supported")
            # control: the share's secret (none on loopback: this machine's own pipeline);
            # data: the route token of the head that holds this stage
            if hello["role"] == "data" and self._route is None:
                # the head configures every stage at once; the one before may be quicker
                try:
                    await asyncio.wait_for(self._route_set.wait(), HELLO_TIMEOUT)
                except asyncio.TimeoutError:
                    raise frames.FrameError("not authorized") from None
            key = (self.secret or "") if hello["role"] == "control" else self._route
            if key is None or hello["pipeline"] != self.pipeline:
                raise frames.FrameError("not authorized")
            answer, seal = answer_hello(key, hello["role"], hello["pipeline"], nonce, hello["auth"])
            await ws.send(frames.control("accept", auth=answer))
            if hello["role"] == "data":
                lift_proof_limit(ws, DATA_MAX)
            else:   # control messages only, a few at a time: megabytes at most, not gigabytes
                lift_proof_limit(ws, CONTROL_MAX, CONTROL_QUEUE)
        except (frames.FrameError, ConnectionClosed) as exc:
            log.warning("refused connection: %s", exc)
            self.rejected_frames += 1
            await ws.close(1008, str(exc)[:120] or "bad hello")
            return
        sealed = SealedSocket(ws, seal)
        # a proven peer that reads nothing for send_stall_s is cut (engine/wire/write_watch.py)
        watch = asyncio.ensure_future(watch_writes(ws.transport, self.send_stall_s))
        try:
            await self._proven(sealed, hello["role"], key)
        finally:
            watch.cancel()

    async def _proven(self, sealed, role: str, key: str):
        """A connection whose peer proved `key`: a head's control connection, or a data link."""
        if role == "control":
            await self._control(sealed)   # its first message, the welcome, says the proof was taken
            return
        if key != self._route:   # the head that gave it let go meanwhile
            await sealed.close(1008, "not authorized")
            return
        if len(self._data_links) >= MAX_DATA_LINKS:
            # the newest is the live one (a stage before this one reconnecting while its
            # old link is not yet known dead): the oldest goes, and what links can hold
            # stays bounded (each buffers volumes and queued frames) whoever opens them
            oldest = next(iter(self._data_links))
            self._data_links.pop(oldest)
            asyncio.ensure_future(oldest.close(1008, "too many data links"))
        self._data_links[sealed] = None
        try:
            await sealed.send(frames.control("ready"))
            await self._data(sealed)
        except ConnectionClosed:
            pass
        finally:
            self._data_links.pop(sealed, None)

    async def _control(self, ws):
        old = self._control_ws
        if old is not None and self._head_gone:
            # its last head has gone and it is letting go (a rearrangement's next head, at
            # once): wait for that rather than refuse -- a refusal costs the head a retry
            # interval while every reply waits
            await self._let_go(old)
        elif old is not None and old.state in (State.CLOSING, State.CLOSED):
            # its last head hung up while the handler was busy on its behalf (loading the
            # weights it asked for, then refused): the handler lets go once that is done,
            # within the new head's wait for its welcome (30 s)
            await self._let_go(old, patience=BUSY_LET_GO_S)
        if self._control_ws is not None:
            await ws.close(1008, "this stage already has a head")
            return
        if self._leaving or self.closed:
            await ws.close(1013, "this stage is leaving")
            return
        self._control_ws, self._head_gone = ws, False
        try:
            await ws.send(frames.control("welcome", version=PROTOCOL_VERSION,
                                       free_memory=self._free_memory(), device=self.device,
                                       device_name=device_name(self.device), quantized=bnb_missing() is None,
                                       speed=await self._speed()))
            async for text in ws:
                try:
                    msg = frames.parse_control(text)
                except frames.FrameError as exc:
                    log.warning("bad control message from head: %s", exc)
                    await ws.close(1008, str(exc)[:120])
                    return
                kind = msg["type"]
                if kind == "configure":
                    await self._configure(ws, msg)
                elif kind == "prepare":
                    self._preparing = asyncio.ensure_future(self._prepare(ws, msg, self._preparing))
                elif kind == "free":
                    await self._run(self._free, msg["seq_ids"])
                elif kind == "get_stats":
                    kv = self.stage.kv if self.stage is not None else None
                    await ws.send(frames.control("stats", seqs=len(kv.seqs) if kv else 0,
                                               kv_tokens=kv.used_tokens if kv else 0,
                                               kv_bytes=kv.allocated_bytes() if kv else 0,
                                               rejected=self.rejected_frames,
                                               cut_ins=self.stage.gate.cut_ins if self.stage else 0,
                                               **decode_counts(self.stage)))
                elif kind == "line_test":   # the head times what our line carries
                    await ws.send(frames.control("line_fill", fill="x" * msg["bytes"]))
                elif kind == "shutdown":
                    await self.close()
                    return
                else:   # what a stage sends (welcome, line_fill, ...): no head sends it
                    self.rejected_frames += 1
                    log.warning("closing the head's connection: it sent %r", kind)
                    await ws.close(1008, f"a head does not send {kind}")
                    return
        except ConnectionClosed:
            pass
        finally:
            # the head is gone, and the route token it gave out with it: no data link may
            # prove it any more, and the ones that did are closed
            self._head_gone = True
            self._route = None
            self._route_set.clear()     # a data hello waiting now waits for the next head
            closing = {link: asyncio.ensure_future(link.close(1008, "the head that opened this link has gone"))
                       for link in list(self._data_links)}
            if closing:
                # a frozen upstream never answers its close: a moment for a live one's
                # answer, then the rest are cut (the head's next arrangement waits on this)
                await asyncio.wait(closing.values(), timeout=LET_GO_S)
                for link, closed in closing.items():
                    transport = getattr(link, "transport", None)
                    if not closed.done() and transport is not None:
                        transport.abort()
            # its sequences are gone too -- before the next head may come in: a head that
            # rearranged after a stage left replays the same sequence ids at once, and a
            # free that came after its replay took their KV and sampling state from it
            if self.stage is not None:
                await self._run(self._free, list(self.stage.kv.seqs))
                if not self.closed and not self._leaving:
                    self.on_event("the pipeline let this computer go for now (a link dropped or it rearranged); "
                                  "its layers stay loaded for when it is taken back")
            self._control_ws = None
            if self.closed:
                self._retire_threads()

    @staticmethod
    def _progress_to(ws):
        """progress(done, total, what) from the compute thread, sent to the head."""
        loop = asyncio.get_running_loop()

        def progress(done, total, what):
            message = frames.control("progress", done=done, total=total, what=what)
            # the coroutine is made on the loop, when it runs: one made here would be left
            # never awaited by a loop that closes first (a Ctrl+C mid-load)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(StageServer._send_quietly(ws, message)))
        return progress

    async def _prepare(self, ws, msg, before: asyncio.Future | None):
        """Load ahead what the slice [start, end) lacks, while the pipeline serves
        (engine/pipeline/load_ahead.py): the whole slice, built and measured, on a machine
        not serving; the layers it lacks, beside the stage it serves, on one that is. The
        configure that follows keeps them. Runs beside the control loop (frees and stats
        go on); answers "prepared", with the reason when nothing was loaded."""
        if before is not None and not before.done():
            await asyncio.wait([before])
        progress = self._progress_to(ws)
        serving = self.stage if self._route is not None else None

        def alone():
            c = check_configure(msg, self.trusted_head, self.accept_models, self.memory_cap)
            held = self._hand_over(msg["start"], msg["end"])   # a machine back with its old slice
            release_memory(self.device)
            self.stage, self._ahead = build_alone(c, msg, held, self.device, self.cores, progress)

        def beside():
            c = check_configure(msg, self.trusted_head, self.accept_models, self.memory_cap)
            self._extra = HeldLayers.merged(self._extra, build_beside(c, msg, serving, self.device, self.memory_cap,
                                                                      progress, self._extra, msg["spare"]))

        error = None
        try:
            if serving is None:
                await self._run(alone)
            else:
                await asyncio.get_running_loop().run_in_executor(self._load_exec, beside)
        except Exception as exc:   # (a bug too: the head waits for this answer)
            if not isinstance(exc, (ModelError, OSError, ValueError)):
                log.exception("loading ahead failed")
            error = str(exc) or type(exc).__name__
        if self.closed:
            self._extra = None   # closed meanwhile: let them go with the server
        held = self.stage if serving is None else self._extra
        n = 0 if error or held is None else (held.end - held.start if serving is None else len(held))
        log.info("layers %d-%d: %s", msg["start"], msg["end"] - 1, error or f"{n} loaded ahead")
        try:
            await ws.send(frames.control("prepared", n_layers=n, error=error))
        except ConnectionClosed:
            pass   # the head let go meanwhile (a stage lost): what was loaded stays for the next configure

    def _next_link_failed(self, head_ws, why: str):
        """The link to the next stage ended under us. Where the next stage died, the head
        already knows (its connection to that stage closed too) and lets this arrangement
        go within a moment; where only the link dropped (a keepalive that timed out, a
        router that forgot the connection), nothing else would tell it, and every step
        sent down this way would wait for ever. So, unless the head has let go by then,
        this stage leaves its arrangement and the head forms the pipeline again (asking
        this stage back)."""
        # a warning only once it matters: when a pipeline stops, its stages' links end in
        # turn, and a stage told to go meanwhile has nothing to report
        log.info("link to the next stage ended: %s", why)

        async def tell():
            await asyncio.sleep(NEXT_LINK_GRACE_S)
            if self._control_ws is head_ws and not self.closed:
                log.warning("link to the next stage ended (%s), and the head still holds this stage: "
                            "leaving the arrangement", why)
                try:
                    await head_ws.close(1001, f"its link to the next stage dropped ({why})"[:120])
                except Exception:   # the head went meanwhile
                    pass

        asyncio.ensure_future(tell())

    async def _configure(self, ws, msg):
        # before loading: the stage before this one may finish loading first and connect
        self._route = msg["route"]
        self._route_set.set()
        progress = self._progress_to(ws)
        if self._preparing is not None and not self._preparing.done():
            await asyncio.wait([self._preparing])   # what it loads is this slice's too

        def load():
            t0 = time.perf_counter()
            c = check_configure(msg, self.trusted_head, self.accept_models, self.memory_cap)
            source, dtype, fp, cfg = c.source, c.dtype, c.fingerprint, c.cfg
            # the old slice's memory goes before the new one loads, but for the layers both
            # hold: kept, not read again (engine/model/handover.py)
            held = self._hand_over(msg["start"], msg["end"])
            release_memory(self.device)
            available = memory_for_kv(c.weight_bytes - (held.nbytes() if held else 0), self.device, self.memory_cap)
            budget = kv_budget_tokens_for(cfg, (msg["start"], msg["end"]), dtype, self.device, available)
            if msg["kv_budget_tokens"]:
                budget = msg["kv_budget_tokens"] if available is None else min(budget, msg["kv_budget_tokens"])
            t1 = time.perf_counter()
            ahead, self._ahead = self._ahead, None
            profile = msg["profile"] or ahead_profile(ahead, fp, msg)
            stage, prof = load_and_measure(lambda: StageModel(
                source, msg["start"], msg["end"], dtype=dtype, device=self.device, reuse=held,
                kv_budget_tokens=budget, progress=progress, cores=self.cores, weights=msg["weights"],
                products=self.products),
                profile=profile)
            # where a rearrangement's seconds go, stage by stage (the head waits for the slowest)
            log.info("layers %d-%d ready in %.2f s (opening the model %.2f s, loading%s %.2f s, %d layers kept; "
                     "KV for %d tokens)", msg["start"], msg["end"] - 1, time.perf_counter() - t0, t1 - t0,
                     "" if profile else " and measuring", time.perf_counter() - t1, stage.kept_layers, budget)
            return stage, fp, prof

        problem = msg["next"] and address_problem(msg["next"])
        if problem:   # said before anything loads or is dialled
            await ws.send(frames.control("error", message=f"the next stage: {problem}"[:500]))
            return
        link_mode = msg["link"] or "jit"
        if link_mode not in LINK_MODES:
            await ws.send(frames.control("error", message=f"unknown link mode {link_mode!r}"))
            return
        compress = msg["compress"] or "off"
        if compress not in COMPRESS_POLICIES:
            await ws.send(frames.control("error", message=f"unknown compression policy {compress!r}"))
            return
        self.compress = compress
        compute = msg["compute"] or "in-order"
        if compute not in COMPUTE_ORDERS:
            await ws.send(frames.control("error", message=f"unknown compute order {compute!r}"))
            return
        self.decode_first = compute == "decode-first"
        # whether data links acknowledge pieces (off between processes sharing one CPU:
        # nothing to measure over loopback, and every ack costs the cores the stages compute on)
        self.acks = msg["acks"]
        try:
            self.stage, fp, self.profile = await self._run(load)
        except (ModelError, OSError, ValueError) as exc:
            await ws.send(frames.control("error", message=(str(exc) or type(exc).__name__)[:2000]))
            return
        await self._drop_next()
        if msg["next"]:
            try:
                self._next_ws = await connect_stage(msg["next"], "data", self.pipeline, key=msg["route"])
            except (OSError, asyncio.TimeoutError, WebSocketException, frames.FrameError) as exc:
                # the head sees why (it rearranges without that hop), and this stage goes on
                await ws.send(frames.control("error", message=f"cannot reach the next stage at "
                                             f"{split_address(msg['next'])[0]}: {exc or type(exc).__name__}"[:500]))
                return
            # the profile as last reported: the scheduler's windows follow it too
            self._link = open_link(self._next_ws, link_mode, lambda n: interp(self.profile["decode"], n),
                                   on_failed=lambda why: self._next_link_failed(ws, why),
                                   acked=self.acks, trace=self.trace)
        if self._sender_task is not None:
            self._sender_task.cancel()  # a reconfigure: the old route is gone
        # bounded: a head or next stage that reads slowly holds the compute lanes here, and
        # their inboxes then hold the stage before (TCP), instead of tokens piling up in
        # this process's memory without end
        if self._out is not None:
            self._out.retire()   # a lane still putting into the old route's queue is let go
        self._out = Outbox(OUT_QUEUE)
        self._sender_task = asyncio.ensure_future(self._sender(self._out, self._next_ws))
        await ws.send(frames.control("configured", fingerprint=fp, param_bytes=self.stage.param_bytes(),
                                   kv_budget_tokens=self.stage.kv.budget_tokens,
                                   n_layers=self.stage.end - self.stage.start, profile=self.profile,
                                   weights=self.stage.weights, kept_layers=self.stage.kept_layers))
        self.on_event(f"in the pipeline: this computer computes layers {self.stage.start + 1}–{self.stage.end} "
                      f"of {self.stage.n_layers_total}")

    def _free(self, seq_ids):
        if self.stage is None:
            for s in seq_ids:
                self.sampler.close(s)
            return
        with self.stage.gate.step(decode=False):  # never under a parked step's feet
            for s in seq_ids:
                self.stage.free(s)
                self.sampler.close(s)

    async def _data(self, ws):
        volumes = Reassembler()
        # one lane in arrival order (compute="in-order", the default, as vLLM computes),
        # or decode frames in a lane of their own whose steps cut into prompt steps
        inbox = Inbox(maxsize=64, max_bytes=DEFAULT_MAX_VOLUME)
        decodes = Inbox(maxsize=64, max_bytes=DEFAULT_MAX_VOLUME) if self.decode_first else inbox
        # Acknowledgements go out from a task of their own, in order: a decode volume's
        # step is handed to the compute thread first, and its ack is sent meanwhile.
        acks: asyncio.Queue = asyncio.Queue()
        workers = [asyncio.ensure_future(self._work(inbox, self._exec, cut_in=False)),
                   asyncio.ensure_future(self._send_acks(ws, acks))]
        if decodes is not inbox:
            workers.append(asyncio.ensure_future(self._work(decodes, self._decode_exec, cut_in=True)))
        try:
            async for data in ws:
                self.trace("arrived")
                try:
                    if self.stage is None:   # refused from here, not after a gigabyte put together
                        raise frames.FrameError("stage is not configured")
                    width = self.stage.hidden_size
                    volumes.max_volume = inbox.max_bytes = decodes.max_bytes = self._volume_cap()
                    volumes.max_buffered = 2 * volumes.max_volume
                    frame = frames.decode(data, width=width)
                    if frame.type == frames.FrameType.CHUNK:
                        piece = frame.payload
                        done = volumes.feed(frame.micro_batch, frame.meta, piece)
                        # acknowledge on arrival: the sender measures the link by these
                        if self.acks:
                            acks.put_nowait(frames.control("ack", v=frame.micro_batch, bytes=len(piece)))
                        if done is None:
                            continue
                        frame = frames.decode(done[1], width=width)
                    self._check_frame(frame)
                    self.trace("checked")
                except frames.FrameError as exc:
                    self.rejected_frames += 1
                    log.warning("closing data connection: %s", exc)
                    await ws.close(1008, str(exc)[:120])
                    return
                # bounded: a fast sender waits here, then in TCP
                await (decodes if step_rows.is_decode(frame) else inbox).put(frame)
        except ConnectionClosed:
            pass
        finally:
            for w in workers:
                w.cancel()
            self.trace.flush()   # what it marked so far, in case the process is stopped next

    def _volume_cap(self) -> int:
        """The largest volume a head can send this (configured) stage: every row of a step
        takes a KV slot here, so no step has more rows than its KV budget, and none is
        wider than the model at 4 bytes an element."""
        rows = self.stage.kv.budget_tokens * self.stage.hidden_size * 4
        return min(DEFAULT_MAX_VOLUME, frames.HEADER.size + 4 * frames.MAX_NDIM + frames.MAX_META + rows)

    @staticmethod
    async def _send_acks(ws, acks: asyncio.Queue):
        try:
            while True:
                await ws.send(await acks.get())
        except ConnectionClosed:
            pass

    async def _work(self, inbox: "Inbox", executor, cut_in: bool):
        """Computes a lane's frames in arrival order. Decode frames that queued up while
        the previous step ran go through as one batch: decode is memory-bound, so two
        micro-batches cost about what one does once they meet at a busy stage."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await inbox.get()]
            while step_rows.is_decode(batch[0]) and not inbox.empty() and step_rows.is_decode(inbox.peek()) \
                    and sum(len(f.meta["rows"]) for f in batch) < MAX_MERGED_ROWS:
                batch.append(inbox.get_nowait())
            link = self._link
            decode = step_rows.is_decode(batch[0])
            if link is not None and decode:
                link.sched.decode_compute_started(time.monotonic(), sum(len(f.meta["rows"]) for f in batch))
            try:
                self.trace("dequeued")
                outs = await loop.run_in_executor(executor, self._gated_compute, batch, cut_in)
                self.trace("back")
            except Exception as exc:
                # nothing checked for it (a bug): those rows fail with the reason and the lane
                # goes on (its task died before: the inbox filled, every reply here hung)
                log.exception("a step failed unexpectedly")
                outs = [("head", step_rows.failed(f, step_failure(exc, str(self.device)))) for f in batch]
            if link is not None and decode:
                link.sched.decode_compute_finished(time.monotonic())
            self._report_profile()
            for out in outs:
                if out is None:
                    continue
                if out[0] == "next" and link is not None and self._out.empty():
                    # straight onto the link (nothing queued ahead of it to keep in order):
                    # a decode volume saves the sender task's turn of the event loop
                    self._submit_next(out[1], out[2])
                else:
                    await self._out.put(out)

    def _report_profile(self):
        """Tell the head this stage's profile as its steps time it (profile.StepLog), at
        most every PROFILE_REPORT_S and only when a point moved by more than 5%: its
        micro-batch count and this stage's link scheduler decide from it."""
        stage, ws = self.stage, self._control_ws
        log = stage.step_log if stage is not None else None
        now = time.monotonic()
        if log is None or ws is None or not log.steps or now - self._profile_sent_at < PROFILE_REPORT_S:
            return
        current = log.profile()
        if not differs(current, self.profile):   # nothing the head does not know
            return
        self._profile_sent_at, self.profile = now, current
        asyncio.ensure_future(self._send_quietly(ws, frames.control("profile", profile=current)))

    @staticmethod
    async def _send_quietly(ws, message):
        try:
            await ws.send(message)
        except ConnectionClosed:
            pass   # the head is gone; its control task cleans up

    def _submit_next(self, data: bytes, kind: str):
        try:
            self._link.submit(data, kind)
        except RuntimeError as exc:
            log.warning("cannot forward: %s", exc)

    async def _sender(self, queue: asyncio.Queue, next_ws):
        """Sends in order; a separate task so computing the next step overlaps sending."""
        while True:
            where, data, *kind = await queue.get()
            if where == "next" and self._link is not None:
                self._submit_next(data, kind[0])
                continue
            ws = self._control_ws if where == "head" else next_ws
            if ws is None:
                log.warning("dropping a %s frame: no connection", where)
                continue
            try:
                self.trace("out")
                await ws.send(data)
            except ConnectionClosed:
                # and on: frames for the head still go, and the lanes never wait on a queue
                # nobody empties (the link's loss is the head's to handle)
                log.warning("%s connection closed while sending", where)


MAX_MERGED_ROWS = 64
OUT_QUEUE = 64   # frames computed and waiting to be sent
SPEED_FRESH_S = 120.0   # a welcome's speed score is measured again after this long
