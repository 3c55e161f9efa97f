"""The node: one process per machine that runs the engine for the app and the CLI.

It can *host* a pipeline (a head with local and/or friends' stages, plus the
OpenAI-compatible API on loopback) and *share* this machine's GPU with a friend's
pipeline (a stage server, within the owner's limits: sharing.py). Clients drive it
through a small control API:

    GET  /status               state (idle|loading|serving|sharing|paused|error), what runs
    GET  /models               the curated model list, each model's weights per precision and its
                               `draft`: the catalog's draft model for speculation ('' for none)
    POST /plan   {model, stages, weights?, memory_limit_mb?}   memory needed vs available, split,
                               and what each weight precision (bf16, int8, nf4) needs here
    POST /host   {model, stages, weights?, stage_addr?, layers?, memory_limit_mb?, wait_timeout_s?, friends?,
                  relay?, listen?, draft?}
                               start a head; with friends, hand out an invite and wait for them;
                               draft: a draft model beside the head's stage, MODEL[@WEIGHTS] or
                               "auto" (the catalog's pairing, /models' `draft`); none when left out
    POST /share  {on}          the Share-this-GPU toggle
    POST /join   {code, relay?} or {pipeline, port?}  contribute this GPU to a friend's pipeline
    POST /limits {...}         the owner's limits (guest.Limits fields)
    POST /stop   {what: host|share|all}
    POST /host/offer {address}  a friend's stage (ws://...) offers itself to the hosted pipeline: taken
                               when the pipeline waits for room, else at its next rearrangement
    POST /power  {state: sleeping|awake}   the computer is about to sleep (a shared stage hands its
                               layers over first, within SLEEP_LEAVE_S) / woke up (sharing resumes)

The API binds 127.0.0.1 only and every request carries `Authorization: Bearer
<token>`, a random per-launch token. The app generates it and hands it over on the
node's stdin (never on a command line other users can read); `potluck node` without
`--token-stdin` writes it to a 0600 file and prints that file's path. With
`--token-stdin` the node also exits when its stdin closes, so a parent that dies
(even by SIGKILL) leaves no node and no stage process behind.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from aiohttp import web

from engine.pipeline.lifeline import Lifeline
from engine.pipeline.stopping import StopRequests
from engine.core import precision
from engine.model.device import DTYPES, DeviceError, compute_dtype, device_name, free_memory, pick_device
from engine.node.gpu import gpu_summary, own_pids, read_gpus
from engine.node.sharing import Limits, SharePolicy
from engine.pipeline.stage_server import LEAVE_S

log = logging.getLogger("potluck.node")

ANNOUNCE = "POTLUCK_NODE_PORT="
STATS_TIMEOUT = 2.0
DEFAULT_SHARE_PIPELINE = "potluck"   # the name a plain "Share this GPU" accepts
# logind lets a sleep inhibitor delay suspend by InhibitDelayMaxSec (5 s by default), and
# Windows gives a power broadcast about 2 s: a stage going to sleep gets this long to be
# let go (its head closes the connection as soon as it starts moving the layers)
SLEEP_LEAVE_S = 3.0


class NodeError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message, self.status = message, status


class Node:
    def __init__(self, token: str, *, share_host: str = "127.0.0.1", share_port: int = 0,
                 api_port: int = 0, pipeline: str = "potluck", threads: int | None = None,
                 limits: Limits | None = None, poll_seconds: float = 2.0, device: str = "auto",
                 share_secret: str | None = None, accept_models=()):
        self.token = token
        # what a friend's head proves to drive the plain share (in the address we show);
        # read from the config folder when sharing first starts
        self._share_secret = share_secret
        # models a friend's head may ask for beyond the default and the curated list
        self.accept_models = tuple(accept_models)
        self.share_host, self.share_port = share_host, share_port
        self.api_port = api_port
        self.pipeline = pipeline
        self.threads = threads
        self.device = pick_device(device)   # a shared stage and the head we host compute here
        self.device_name = device_name(self.device)
        self.policy = SharePolicy(limits)
        self.poll_seconds = poll_seconds
        self.pipe = None                    # the pipeline we host (engine/pipeline/launch.py)
        self.head = None                    # its head, once it serves
        self.api_runner = None
        self.openai_url: str | None = None
        # the API for other computers on the LAN (the Host dialog's option): a second
        # listener that requires the API key; the app's own chat keeps the loopback one
        self.api_lan_runner = None
        self.api_lan_url: str | None = None
        self.host_task: asyncio.Task | None = None
        self.host_request: dict | None = None
        self.friends_gate = None            # friends invited to the pipeline we host (engine/node/homes.py)
        self.invite_code: str | None = None
        self.friends: list[dict] = []
        self.loading: dict | None = None
        self.error: str | None = None
        self.share_wanted = False
        self.stage_server = None
        self.share_pipeline = pipeline
        self.invite = None                  # set by /join with an invite code: share through a tunnel
        self.joiner = None
        self.joiner_task: asyncio.Task | None = None
        self.join_events: list[str] = []
        # a join that reaches none of the host's addresses listens here and shows a reply
        # code for the host to connect to (POTLUCK_REPLY_LISTEN=off: the join fails instead);
        # /join answers once the code is there, and the join goes on in `_joining`
        self.reply_listen = os.environ.get("POTLUCK_REPLY_LISTEN", "0.0.0.0:7871")
        self.reply_code: str | None = None
        self._reply_shown: asyncio.Event | None = None
        self._joining: asyncio.Task | None = None
        self.paused_reason: str | None = None
        # the share's stage server stopped by itself (told to shut down, crashed): how often
        # it was started again, and why the last time
        self.share_restarts = 0
        self.share_stopped: str | None = None
        self.gpu: dict = {"available": False, "gpus": [], "message": "not read yet"}
        self.idle_seconds: float | None = None
        self.asleep = False   # the computer is going to (or is) asleep: nothing is shared
        self.started = time.time()
        self._lock = asyncio.Lock()
        self._policy_task: asyncio.Task | None = None

    # ---- the control API ----------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._auth])
        app.router.add_get("/status", self.h_status)
        app.router.add_get("/models", self.h_models)
        app.router.add_post("/plan", self.h_plan)
        app.router.add_post("/host", self.h_host)
        app.router.add_post("/share", self.h_share)
        app.router.add_post("/join", self.h_join)
        app.router.add_post("/limits", self.h_limits)
        app.router.add_post("/activity", self.h_activity)
        app.router.add_post("/stop", self.h_stop)
        app.router.add_post("/power", self.h_power)
        app.router.add_post("/host/offer", self.h_offer)
        app.router.add_post("/host/reply", self.h_reply)
        return app

    @web.middleware
    async def _auth(self, request, handler):
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return web.json_response({"error": "missing or wrong token"}, status=401)
        try:
            return await handler(request)
        except NodeError as exc:
            return web.json_response({"error": exc.message}, status=exc.status)

    @staticmethod
    async def _body(request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise NodeError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise NodeError("the request body must be a JSON object")
        return body

    async def h_status(self, request):
        return web.json_response(await self.status())

    async def h_models(self, request):
        return web.json_response({"models": await self.models()})

    async def models(self) -> list[dict]:
        """The curated list (engine/model/catalog.py): each model's weights per precision,
        and which precisions fit this machine's free memory on their own."""
        from engine.core import precision
        from engine.model import catalog

        loop = asyncio.get_running_loop()
        free = await loop.run_in_executor(None, free_memory, self.device)
        cap = self.policy.limits.vram_cap_mb
        if cap is not None:
            free = min(free, int(cap * 2**20))
        out = []
        for e in catalog.MODELS:
            sizes = e.sizes()
            out.append({"id": e.id, "name": e.name, "label": e.label(), "params": e.params, "gated": e.gated,
                        "draft": e.draft, "sizes": sizes, "fits_here": {w: b <= precision.USABLE * free for w, b in sizes.items()}})
        return out

    async def h_plan(self, request):
        body = await self._body(request)
        return web.json_response(await self.plan(**self.host_args(body)))

    async def h_host(self, request):
        body = await self._body(request)
        args = self.host_args(body)
        plan = await self.plan(**args)
        if not plan["fits"]:
            raise NodeError(plan["message"])
        if args["weights"] == "auto" and not args["stage_addr"] and not args["friends"]:
            # every stage on this machine: the plan's pick is the pool's (the head would count
            # this machine's memory once per local stage)
            args = dict(args, weights=plan["weights"])
        async with self._lock:
            if self.host_task is not None and not self.host_task.done():
                raise NodeError("a pipeline is already starting; wait for it or stop it first", 409)
            await self._stop_host()
            self.start_hosting(args, plan["model"])
        return web.json_response({"ok": True, "plan": plan})

    def start_hosting(self, args: dict, name: str | None = None):
        """Start loading the pipeline `args` describes (host_args) in the background;
        status() shows its progress."""
        self.error = None
        # shown in the status: never the API key
        self.host_request = dict(args, api_key="(set)") if args.get("api_key") else args
        self.loading = {"message": f"Loading {name or args['model']}…", "stages": {}}
        self.host_task = asyncio.ensure_future(self._host(args))

    async def h_share(self, request):
        body = await self._body(request)
        on = body.get("on")
        if not isinstance(on, bool):
            raise NodeError("'on' must be true or false")
        await self.set_share(on)
        return web.json_response(await self.status())

    async def h_join(self, request):
        body = await self._body(request)
        code = body.get("code")
        if code is not None:
            if not isinstance(code, str) or not code.strip() or len(code) > 4000:
                raise NodeError("'code' must be the invite code your friend sent")
            relay = body.get("relay") or ""
            if not isinstance(relay, str):
                raise NodeError("'relay' must be a ws:// address")
            return web.json_response(await self.join_invite(code.strip(), relay.strip()))
        pipeline = body.get("pipeline")
        if not isinstance(pipeline, str) or not pipeline.strip() or len(pipeline) > 200:
            raise NodeError("give an invite code or the host's pipeline name")
        port = body.get("port", self.share_port)
        if isinstance(port, bool) or not isinstance(port, int) or not (0 <= port < 65536):
            raise NodeError("'port' must be a TCP port number")
        async with self._lock:
            await self._stop_share("joining another pipeline")
            self.invite = self.joiner = None
            self.share_pipeline, self.share_port = pipeline.strip(), port
        await self.set_share(True)
        return web.json_response(await self.status())

    async def join_invite(self, code: str, relay: str = "") -> dict:
        """Contribute this machine through the host's tunnel (engine/wire/tunnel.py): a stage on
        loopback, reached only through the end-to-end encrypted session the invite opens."""
        from engine.node.homes import HomeError, redeem

        try:
            invite = await redeem(code, relay)
        except HomeError as exc:
            raise NodeError(str(exc)) from None
        async with self._lock:
            await self._stop_share("joining another pipeline")
            self.invite, self.joiner = invite, None
            self.share_pipeline = invite.pipeline_id
            self.share_wanted = True
            self.error = None
            if not self._decide().paused:
                self._reply_shown = asyncio.Event()
                task = asyncio.ensure_future(self._start_share(reply=True))
                shown = asyncio.ensure_future(self._reply_shown.wait())
                await asyncio.wait({task, shown}, return_when=asyncio.FIRST_COMPLETED)
                shown.cancel()
                if task.done():
                    try:
                        task.result()
                    except NodeError:
                        self.share_wanted, self.invite = False, None
                        raise
                else:        # waiting for the host to use our reply code
                    self._joining = task
                    task.add_done_callback(self._joined_by_reply)
        return await self.status()

    def _joined_by_reply(self, task: asyncio.Task):
        if self._joining is task:
            self._joining = None
        self.reply_code = None
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.error = getattr(exc, "message", None) or str(exc)
            self.share_wanted, self.invite = False, None

    def _on_reply(self, code: str):
        self.reply_code = code
        self._join_event("the host's addresses do not answer from here: send the host your reply code")
        if self._reply_shown is not None:
            self._reply_shown.set()

    async def h_limits(self, request):
        body = await self._body(request)
        try:
            limits = Limits.from_json({**self.policy.limits.to_json(), **body})
        except (TypeError, ValueError) as exc:
            raise NodeError(f"bad limits: {exc}") from None
        self.policy = SharePolicy(limits)
        await self._apply_policy()
        return web.json_response(limits.to_json())

    async def h_offer(self, request):
        body = await self._body(request)
        address = body.get("address")
        if not isinstance(address, str) or not address.startswith(("ws://", "wss://")) or len(address) > 300:
            raise NodeError("'address' must be a stage's ws:// address")
        if self.head is None:
            raise NodeError("this computer hosts no pipeline", 409)
        self.head.offer(address)
        return web.json_response(await self.status())

    async def h_reply(self, request):
        """A friend's reply code (they cannot reach this host; it can reach them): the host
        connects to their addresses, and they join as if they had come in."""
        from engine.wire.invite import InviteError

        body = await self._body(request)
        code = body.get("code")
        if not isinstance(code, str) or not code.strip() or len(code) > 2000:
            raise NodeError("'code' must be the friend's reply code")
        gate = self.friends_gate
        if gate is None:
            raise NodeError("this computer is not waiting for friends (host with friends to invite first)", 409)
        try:
            gate.tunnels.take_reply(code)
        except InviteError as exc:
            raise NodeError(f"that reply code cannot be used: {exc}") from None
        return web.json_response(await self.status())

    async def h_power(self, request):
        """The app heard that the computer is about to sleep (logind's PrepareForSleep, the
        Windows power broadcast) or woke up. Answered once a shared stage is let go: the app
        holds the sleep back until then (at most SLEEP_LEAVE_S)."""
        body = await self._body(request)
        state = body.get("state")
        if state not in ("sleeping", "awake"):
            raise NodeError("'state' must be sleeping or awake")
        if state == "sleeping":
            async with self._lock:
                self.asleep = True
                self.paused_reason = "this computer is asleep"
                if self.stage_server is not None:
                    await self._stop_share("this computer is going to sleep", leave_s=SLEEP_LEAVE_S)
        else:
            self.asleep = False
            await self._apply_policy()
        return web.json_response(await self.status())

    async def h_activity(self, request):
        body = await self._body(request)
        idle = body.get("idle_seconds")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0):
            raise NodeError("'idle_seconds' must be a non-negative number or null")
        self.idle_seconds = idle
        return web.json_response({"ok": True})

    async def h_stop(self, request):
        body = await self._body(request)
        what = body.get("what", "all")
        if what not in ("host", "share", "all"):
            raise NodeError("'what' must be host, share or all")
        async with self._lock:
            if what in ("host", "all"):
                await self._stop_host()
                self.error = None
            if what in ("share", "all"):
                self.share_wanted = False
                await self._stop_share("sharing switched off")
        return web.json_response(await self.status())

    # ---- state ----------------------------------------------------------------
    def state(self) -> str:
        if self.error:
            return "error"
        if self.share_wanted and self.paused_reason:
            return "paused"
        if self.head is not None:
            return "serving"
        if self.host_task is not None and not self.host_task.done():
            return "loading"
        if self.stage_server is not None:
            return "sharing"
        return "idle"

    async def status(self) -> dict:
        hosting = None
        if self.head is not None:
            info = self.head.info()
            try:
                kv = await asyncio.wait_for(self.head.stage_stats(), STATS_TIMEOUT)
            except (asyncio.TimeoutError, Exception):
                kv = None
            if kv:
                for st, k in zip(info["stages"], kv):
                    st.update(seqs=k["seqs"], kv_tokens=k["kv_tokens"])
            info["kv_used_tokens"] = sum(k["kv_tokens"] for k in kv) if kv else None
            est = getattr(getattr(getattr(self.head, "link", None), "sched", None), "link", None)
            if est is not None and len(info["stages"]) > 1:  # the head's link to stage 1, as measured
                bw, rtt = getattr(est, "bandwidth", None), getattr(est, "rtt", None)
                if not getattr(est, "samples", 0):
                    bw = None  # still the scheduler's prior, not a measurement
                info["stages"][1]["link"] = {"rtt_ms": None if not rtt else rtt * 1000,
                                             "mbit_s": None if not bw else bw * 8 / 1e6}
            info["openai_url"] = self.openai_url
            info["api_lan_url"] = self.api_lan_url
            info["invite"] = self.invite_code
            for st, f in zip(info["stages"][1:], self.friends):
                st["name"] = f["name"] or f["node_id"]
                peer = f.get("peer")
                live = peer.session.link() if peer is not None and peer.session is not None else None
                # the path as it is now (a relayed friend moves to a direct path by itself)
                st["via"] = live["path"] if live else f["via"]
                st["tunnel"] = live
            info["friends"] = [{k: v for k, v in f.items() if k != "peer"} for f in self.friends]
            hosting = info
        sharing = {"on": self.share_wanted, "running": self.stage_server is not None,
                   "paused": bool(self.share_wanted and self.paused_reason), "reason": self.paused_reason,
                   "pipeline": self.share_pipeline, "address": None, "layers": None, "seqs": 0, "kv_tokens": 0,
                   "device": self.device, "device_name": self.device_name,
                   "restarts": self.share_restarts, "stopped": self.share_stopped}
        srv = self.stage_server
        if srv is not None:
            host = self.share_host if self.share_host not in ("0.0.0.0", "::") else lan_address()
            # the address to send a friend carries the secret; a share through an invite
            # is reached through its tunnel, not this address
            secret = f"#{srv.secret}" if srv.secret else ""
            sharing["address"] = f"ws://{host}:{srv.port}{secret}"
            if srv.stage is not None:
                sharing["layers"] = [srv.stage.start, srv.stage.end] if hasattr(srv.stage, "start") else None
                sharing["seqs"] = len(srv.stage.kv.seqs)
                sharing["kv_tokens"] = srv.stage.kv.used_tokens
            sharing["connected"] = srv.connected
            if self.invite is not None:
                sess = self.joiner.session if self.joiner is not None else None
                sharing["address"] = None  # loopback only: friends reach it through the tunnel
                sharing["joined"] = {"pipeline": self.invite.pipeline_id,
                                     "via": getattr(sess, "path", None) if sess is not None else None,
                                     "events": self.join_events[-5:]}
        if self._joining is not None and not self._joining.done() and self.invite is not None:
            sharing["joining"] = {"pipeline": self.invite.pipeline_id, "reply_code": self.reply_code,
                                  "events": self.join_events[-5:]}
        return {"state": self.state(), "pid": os.getpid(), "uptime": time.time() - self.started,
                "error": self.error, "loading": self.loading, "hosting": hosting, "sharing": sharing,
                "openai_url": self.openai_url if self.head is not None else None,
                "host_request": self.host_request, "gpu": self.gpu, "limits": self.policy.limits.to_json()}

    # ---- hosting ----------------------------------------------------------------
    def host_args(self, body: dict) -> dict:
        model = body.get("model", "default")
        if not isinstance(model, str) or not model.strip():
            raise NodeError("'model' must be a model name, a Hugging Face id or a folder")
        stages = body.get("stages", 2)
        if isinstance(stages, bool) or not isinstance(stages, int) or not (1 <= stages <= 8):
            raise NodeError("'stages' must be a whole number from 1 to 8")
        addrs = body.get("stage_addr", []) or []
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a.startswith(("ws://", "wss://"))
                                                   for a in addrs):
            raise NodeError("'stage_addr' must be a list of ws:// addresses")
        layers = body.get("layers")
        if layers is not None and not isinstance(layers, str):
            raise NodeError("'layers' must be text like '0:10,10:30'")
        friends = body.get("friends", 0)
        if isinstance(friends, bool) or not isinstance(friends, int) or not (0 <= friends <= 8):
            raise NodeError("'friends' must be a whole number from 0 to 8")
        relay = body.get("relay") or ""
        listen = body.get("listen") or ""
        if not isinstance(relay, str) or (relay and not relay.startswith(("ws://", "wss://"))):
            raise NodeError("'relay' must be a ws:// address")
        if not isinstance(listen, str) or (listen and ":" not in listen):
            raise NodeError("'listen' must be HOST:PORT, e.g. 0.0.0.0:7870")
        if friends and not (relay or listen):
            raise NodeError("friends need a way in: give a relay address and/or a listen address")
        if friends and addrs:
            raise NodeError("invite friends or give stage addresses, not both")
        weights = body.get("weights")
        weights = "auto" if weights is None else weights
        if not isinstance(weights, str) or weights.strip().lower() not in precision.CHOICES:
            raise NodeError(f"'weights' must be one of {', '.join(precision.CHOICES)} "
                            "(auto: the highest precision that fits)")
        limit = body.get("memory_limit_mb", self.policy.limits.vram_cap_mb)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
            raise NodeError("'memory_limit_mb' must be a positive number")
        # the name friends' shares expect (theirs is "potluck" unless they chose another)
        name = body.get("pipeline", DEFAULT_SHARE_PIPELINE)
        if not isinstance(name, str) or not (0 < len(name.strip()) <= 64):
            raise NodeError("'pipeline' must be the name the friends' shares use (default potluck)")
        wait = body.get("wait_timeout_s", 300)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (0 <= wait <= 86400):
            raise NodeError("'wait_timeout_s' must be a number of seconds from 0 to 86400")
        api_lan_port = body.get("api_lan_port")
        api_key = body.get("api_key") or ""
        if api_lan_port is not None and (isinstance(api_lan_port, bool) or not isinstance(api_lan_port, int)
                                         or not 1 <= api_lan_port <= 65535):
            raise NodeError("'api_lan_port' must be a port number from 1 to 65535")
        if not isinstance(api_key, str) or (api_key and not 8 <= len(api_key) <= 256):
            raise NodeError("'api_key' must be 8 to 256 characters")
        if api_lan_port and not api_key:
            raise NodeError("the API on the LAN needs an API key ('api_key'): anyone on the network "
                            "could use this pipeline otherwise")
        draft = body.get("draft") or None
        if draft is not None and (not isinstance(draft, str) or not draft.strip() or len(draft) > 300):
            raise NodeError("'draft' must be a draft model (MODEL[@WEIGHTS]) or 'auto'")
        return {"model": model.strip(), "stages": stages, "stage_addr": addrs, "layers": layers,
                "draft": draft.strip() if draft else None,
                "api_lan_port": api_lan_port, "api_key": api_key,
                "memory_limit_mb": limit, "friends": friends, "relay": relay, "listen": listen,
                "weights": weights.strip().lower(), "wait_timeout_s": float(wait), "pipeline": name.strip()}

    async def plan(self, model: str, stages: int, stage_addr: list, layers, memory_limit_mb, friends: int = 0,
                   relay: str = "", listen: str = "", weights: str = "auto", wait_timeout_s: float = 300.0,
                   pipeline: str = "", api_lan_port: int | None = None, api_key: str = "",
                   draft: str | None = None) -> dict:
        """Memory needed vs available and the proposed split, before anything loads, and
        what each weight precision needs on this machine (`precisions`); `weights` is the
        one that will load here: the requested one, or (auto) the highest that fits."""
        from engine.model.sources import ModelError, resolve

        loop = asyncio.get_running_loop()
        try:
            source = await loop.run_in_executor(None, resolve, model)
            cfg = await loop.run_in_executor(None, source.config)
        except ModelError as exc:
            raise NodeError(str(exc)) from None
        except Exception as exc:  # a broken config, an unreadable folder
            raise NodeError(f"cannot read model '{model}': {exc}") from None
        from engine.model.cores import cpu_shares
        from engine.core.partition import lm_head_layers_estimate, parse_layers, partition
        from engine.model.quant import bnb_missing, prequantized

        n = cfg.num_hidden_layers
        friends_stages = bool(friends or stage_addr)
        if friends:  # friends' stages: known once they join, planned as placeholders
            stage_addr = [f"friend {i + 1} (joins with the invite)" for i in range(friends)]
        # what the head will load here: at its compute dtype (bf16 on a GPU), into the
        # memory of the device it computes on (VRAM on a GPU, host RAM on the CPU)
        nbytes = DTYPES[compute_dtype(self.device)].itemsize
        available = await loop.run_in_executor(None, free_memory, self.device)
        if memory_limit_mb is not None:
            available = min(available, int(memory_limit_mb * 2**20))
        total_stages = (1 + len(stage_addr)) if stage_addr else stages
        if layers:
            try:
                split = parse_layers(layers, n)
            except Exception as exc:
                raise NodeError(str(exc)) from None
            if len(split) != total_stages:
                raise NodeError(f"{len(split)} layer ranges for {total_stages} stages")
        else:
            # what the head will do: the LM head weighs on the last stage; local stage
            # processes split by their share of this CPU (friends: unknown until they join)
            extra = [0.0] * total_stages
            extra[-1] = lm_head_layers_estimate(cfg)
            speeds = [1.0] * total_stages if stage_addr else cpu_shares(total_stages, os.cpu_count() or 1)
            try:
                split = partition(n, speeds, None, extra)
            except Exception as exc:
                raise NodeError(str(exc)) from None
        from engine.wire.stage_auth import split_address

        # a friend's address may carry its share's secret: never echoed back
        where = ["this machine"] * (total_stages if not stage_addr else 1) + [split_address(a)[0] for a in stage_addr]
        # Each precision's weights, and what of them this machine holds: all of them when
        # every stage runs here, else the head's stage (friends' memory is only known once
        # they connect: the head then settles `auto` against the whole pool).
        here_range = tuple(split[0]) if stage_addr else (0, n)
        usable = available * precision.USABLE  # the rest: KV cache, activations, slack
        missing = bnb_missing()
        rows = []
        for w in (precision.FULL,) + precision.QUANTIZED:
            here_bytes = precision.slice_bytes(cfg, *here_range, w, nbytes)
            rows.append({"weights": w, "bytes": precision.slice_bytes(cfg, 0, n, w, nbytes),
                         "here_bytes": here_bytes, "fits_here": here_bytes <= usable,
                         "available": missing is None or w == precision.FULL})
        try:
            saved = prequantized(cfg)  # a checkpoint saved quantized loads as it was saved
        except ModelError as exc:  # quantized some other way (GPTQ, AWQ, FP4...)
            raise NodeError(str(exc)) from None
        if saved and weights not in ("auto", saved):
            raise NodeError(f"this checkpoint is saved as {saved}; it cannot load as {weights}: "
                            f"choose {saved} or Auto")
        if saved:
            chosen = saved
        elif weights != "auto":
            chosen = weights
        else:  # the highest precision that fits here, else the smallest there is
            usable_rows = [r for r in rows if r["available"]]
            chosen = next((r["weights"] for r in usable_rows if r["fits_here"]), usable_rows[-1]["weights"])
        row = next(r for r in rows if r["weights"] == chosen)
        local_needed, fits = row["here_bytes"], row["fits_here"] and row["available"]
        gib = 2**30
        here = f"on {self.device_name}" if self.device.startswith("cuda") else "here"
        # "full (float32)" on a CPU, as the first screen and the host dialog say it
        label = chosen if chosen != precision.FULL else precision.full_label(compute_dtype(self.device))
        message = (f"{source.name} needs about {local_needed / gib:.2f} GiB {here} with {label} weights; "
                   f"{available / gib:.1f} GiB available")
        if not row["available"]:
            message = f"{source.name} cannot load {chosen} weights here: {missing}"
        elif not fits:
            smaller = next((r["weights"] for r in rows if r["available"] and r["fits_here"]), None)
            hint = (f"Choose {smaller} weights, add friends' GPUs" if smaller and weights != "auto" else
                    "Add friends' GPUs")
            message = (f"{source.name} does not fit: it needs about {local_needed / gib:.2f} GiB {here} "
                       f"with {label} weights but only {usable / gib:.2f} GiB can be used. {hint}, pick a "
                       f"smaller model, or raise the memory limit in Settings.")
        if saved and fits:
            message += f". The checkpoint is saved as {saved}, so it loads as {saved}"
        if friends_stages and fits:
            message += (". Friends' memory is known once they join: the pipeline then picks the weights for "
                        "the whole pool" if weights == "auto" and not saved else
                        ". Friends' memory is known once they join")
        return {"model": source.name, "spec": source.spec, "layers": n, "needed_bytes": row["bytes"],
                "device": self.device, "dtype": compute_dtype(self.device),
                "needed_here_bytes": local_needed, "available_bytes": available, "usable_bytes": int(usable),
                "fits": fits, "weights": chosen, "requested_weights": weights,
                "precisions": rows,
                "split": [{"where": w, "layers": list(r)} for w, r in zip(where, split)], "message": message}

    async def _host(self, args: dict):
        from engine.pipeline.api import serve_api
        from engine.pipeline.launch import PipelineConfig, launch

        def progress(stage, done, total, what):
            if self.loading is not None:
                self.loading["stages"][str(stage)] = {"done": done, "total": total, "what": what}

        def say(text):  # the head's table of what each weight precision needs across the pool
            log.info("host: %s", text)
            if self.loading is not None:
                self.loading["weights_table"] = text

        cfg = PipelineConfig(model=args["model"], stages=args["stages"], stage_addr=args["stage_addr"],
                             layers=args["layers"], threads=self.threads, device=self.device,
                             weights=args.get("weights") or "auto", memory_cap_mb=args.get("memory_limit_mb"),
                             wait_timeout=args.get("wait_timeout_s", 300.0), draft=args.get("draft"),
                             # friends' shares check the name; our own stage processes use "local"
                             pipeline=args.get("pipeline", DEFAULT_SHARE_PIPELINE) if args["stage_addr"] else "local")
        pipe = None
        try:
            if args.get("friends"):
                cfg = await self._wait_for_friends(args, cfg)
            pipe = await launch(cfg, progress, say)
            if self.friends_gate is not None:
                self.friends_gate.follow(pipe.head)  # friends joining later take a slice
            self.api_runner = await serve_api(pipe.head, "127.0.0.1", self.api_port)
            port = self.api_runner.addresses[0][1]
            self.openai_url = f"http://127.0.0.1:{port}/v1"
            if args.get("api_lan_port"):
                self.api_lan_runner = await serve_api(pipe.head, "0.0.0.0", args["api_lan_port"],
                                                      api_key=args["api_key"])
                self.api_lan_url = f"http://{lan_address()}:{args['api_lan_port']}/v1"
            self.pipe, self.head = pipe, pipe.head
            self.loading = None
        except asyncio.CancelledError:
            if pipe is not None:
                await pipe.close()
            raise
        except Exception as exc:
            log.exception("hosting failed")
            for runner in (self.api_runner, self.api_lan_runner):   # e.g. the LAN port is taken
                if runner is not None:
                    await runner.cleanup()
            self.api_runner = self.api_lan_runner = None
            self.openai_url = self.api_lan_url = None
            if pipe is not None:
                await pipe.close()
            if self.friends_gate is not None:
                gate, self.friends_gate = self.friends_gate, None
                await gate.close()
            self.loading = None
            self.error = f"Could not start the pipeline: {exc}"

    async def _wait_for_friends(self, args: dict, cfg):
        """Invite friends (engine/node/homes.py) and wait for them; they become the stages."""
        from engine.node.homes import Friends

        self.friends_gate = gate = Friends(on_event=lambda t: log.info("host: %s", t))
        await gate.open(args["relay"], args["listen"])
        n = args["friends"]
        code = gate.invite(ttl_s=24 * 3600, uses=n)
        self.invite_code = code

        def arrived(peers):
            self.loading.update(message=f"Waiting for friends to join: {len(peers)} of {n}", invite=code,
                                friends=[p.name or p.node_id for p in peers])

        peers = await gate.wait(n, on_arrival=arrived)
        self.friends = [{"name": p.name, "node_id": p.node_id, "via": p.path, "peer": p} for p in peers]
        self.loading.update(message=f"Loading {args['model']} across {n + 1} computers…",
                            friends=[p.name or p.node_id for p in peers])
        return await gate.route(peers, cfg)

    async def _stop_host(self):
        if self.host_task is not None and not self.host_task.done():
            self.host_task.cancel()
            try:
                await self.host_task
            except (asyncio.CancelledError, Exception):
                pass
        self.host_task = None
        for runner in (self.api_runner, self.api_lan_runner):
            if runner is not None:
                await runner.cleanup()
        self.api_runner = self.api_lan_runner = None
        self.api_lan_url = None
        if self.pipe is not None:
            pipe, self.pipe, self.head = self.pipe, None, None
            await pipe.close()
        self.openai_url = None
        self.loading = None
        if self.friends_gate is not None:
            gate, self.friends_gate = self.friends_gate, None
            await gate.close()
        self.invite_code, self.friends = None, []

    # ---- sharing ------------------------------------------------------------------
    async def set_share(self, on: bool):
        async with self._lock:
            self.share_wanted = on
            if not on:
                await self._stop_share("sharing switched off by the owner")
                self.paused_reason = None
                return
        await self._apply_policy()

    async def _start_share(self, reply: bool = False):
        """reply: a first join, which may offer a reply code (see join_invite); a resume
        after a pause fails instead of waiting on one."""
        from engine.pipeline.stage_server import StageServer

        if self.stage_server is not None:
            return
        if self.invite is None:
            if self._share_secret is None:
                from engine.wire.identity import share_secret

                self._share_secret = share_secret()
            # whoever connects is someone else's head, even over loopback: it proves the
            # secret and may only ask for models by name (stage_server.remote_model_ok)
            self.stage_server = await StageServer(self.share_host, self.share_port, pipeline=self.share_pipeline,
                                                  secret=self._share_secret, trusted_head=False,
                                                  accept_models=self.accept_models,
                                                  device=self.device, threads=self.threads,
                                                  memory_cap=self._memory_cap()).start()
            log.info("sharing on ws://%s:%d", self.share_host, self.stage_server.port)
            return
        from engine.node.homes import HomeError, join_stage

        try:
            # a resume after a pause rejoins with the same joiner: a member by now
            joined = await join_stage(self.invite, joiner=self.joiner, device=self.device, threads=self.threads,
                                      memory_cap=self._memory_cap(), on_event=self._join_event,
                                      accept_models=self.accept_models,
                                      reply_listen=self.reply_listen if reply and self.reply_listen != "off" else None,
                                      on_reply=self._on_reply)
        except HomeError as exc:
            raise NodeError(str(exc), 502) from None
        self.stage_server, self.joiner = joined.server, joined.joiner
        self.joiner_task = asyncio.ensure_future(self._keep_joined(self.joiner))

    def _memory_cap(self) -> int | None:
        """The owner's VRAM cap in bytes, for a stage started now (None: no cap)."""
        cap = self.policy.limits.vram_cap_mb
        return None if cap is None else int(cap * 2**20)

    def _join_event(self, text: str):
        self.join_events.append(text)
        del self.join_events[:-20]
        log.info("join: %s", text)

    async def _keep_joined(self, joiner):
        try:
            await joiner.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # revoked, or the host refuses us now
            self.error = f"The host's pipeline ended this machine's membership: {exc}"
            self.share_wanted = False
            await self._stop_share("membership ended")

    async def _stop_share(self, why: str, leave_s: float = LEAVE_S):
        joining, self._joining = self._joining, None
        if joining is not None and not joining.done() and joining is not asyncio.current_task():
            joining.cancel()            # its reply listener and stage server close with it
            await asyncio.gather(joining, return_exceptions=True)
        self.reply_code = None
        srv, self.stage_server = self.stage_server, None
        if srv is None:
            return
        if srv.stage is not None:
            # tell the head first: it moves this stage's layers to the others and replays
            # the conversations there, then lets go (or we go anyway after leave_s)
            await srv.leave(why, leave_s)
        if srv.connected:   # the head hears why before the server goes
            await srv.close(why)
        task, self.joiner_task = self.joiner_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if self.joiner is not None and self.joiner.session is not None:
            try:
                await self.joiner.session.close(why[:120])
            except Exception:
                pass
        await srv.close(wait_s=10)  # until the port is free: sharing may start again on it

    def _decide(self, reading=None):
        return self.policy.evaluate(reading, own_pids(), self.idle_seconds, time.monotonic())

    async def _apply_policy(self):
        gpus, _why = await asyncio.get_running_loop().run_in_executor(None, read_gpus)
        decision = self._decide(gpus[0] if gpus else None)
        async with self._lock:
            if self.asleep:
                self.paused_reason = "this computer is asleep"
                return
            self.paused_reason = decision.reason if decision.paused else None
            if not self.share_wanted:
                return
            srv = self.stage_server
            if srv is not None and srv.closed and self.invite is None:
                # it stopped by itself (a head told it to shut down, it crashed): the toggle
                # still says "sharing", so share again rather than report a port nobody serves
                self.share_restarts += 1
                self.share_stopped = "the shared stage stopped by itself; started again"
                log.warning("%s (%d so far)", self.share_stopped, self.share_restarts)
                self.stage_server = None
                await srv.close(wait_s=10)  # until the port is free
            if decision.paused and self.stage_server is not None:
                await self._stop_share(f"paused by the GPU owner: {decision.reason}")
            elif not decision.paused and self.stage_server is None and (self._joining is None or self._joining.done()):
                try:
                    await self._start_share()
                except (OSError, NodeError) as exc:
                    self.error = f"Could not share this GPU: {getattr(exc, 'message', exc)}"
                    self.share_wanted = False

    async def _policy_loop(self):
        while True:
            try:
                self.gpu = await asyncio.get_running_loop().run_in_executor(None, gpu_summary)
                await self._apply_policy()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("policy check failed")
            await asyncio.sleep(self.poll_seconds)

    def start_background(self):
        self._policy_task = asyncio.ensure_future(self._policy_loop())

    async def close(self):
        if self._policy_task is not None:
            self._policy_task.cancel()
        await self._stop_host()
        await self._stop_share("this computer's Potluck is shutting down")


def lan_address() -> str:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outbound interface
            return s.getsockname()[0]
    except OSError:
        pass
    # no default route (a LAN without internet): the first interface that is not loopback
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return "127.0.0.1"


def default_token_file() -> Path:
    try:
        from platformdirs import user_runtime_dir

        base = Path(user_runtime_dir("potluck"))
    except Exception:
        base = Path.home() / ".cache" / "potluck"
    return base / "node-token"


def write_token_file(path: Path, token: str):
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)


async def run_node(args) -> int:
    loop = asyncio.get_running_loop()
    lifeline = None
    if args.token_stdin:
        lifeline = Lifeline(loop)   # the token, then EOF when our parent is gone
        token = (await lifeline.readline()).strip()
        if len(token) < 16:
            print("potluck node: expected a token of 16+ characters on stdin", file=sys.stderr)
            return 2
    else:
        token = secrets.token_urlsafe(32)
    try:
        limits = Limits.from_json(json.loads(args.limits)) if args.limits else Limits()
    except (ValueError, TypeError) as exc:
        print(f"potluck node: bad --limits: {exc}", file=sys.stderr)
        return 2
    try:
        node = Node(token, share_host=args.share_host, share_port=args.share_port, api_port=args.api_port,
                    pipeline=args.pipeline, threads=args.threads, limits=limits, poll_seconds=args.poll,
                    device=getattr(args, "device", "auto"), accept_models=getattr(args, "accept_model", None) or ())
    except DeviceError as exc:
        print(f"potluck node: {exc}", file=sys.stderr)
        return 2
    runner = web.AppRunner(node.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    if not args.token_stdin:
        path = Path(args.token_file) if args.token_file else default_token_file()
        write_token_file(path, token)
        print(f"Node control API on http://127.0.0.1:{port} (token in {path})", file=sys.stderr)
    print(f"{ANNOUNCE}{port}", flush=True)
    node.start_background()
    if args.host_model:
        node.start_hosting(node.host_args({"model": args.host_model, "stages": args.stages}))
    stop = asyncio.Event()
    requests = StopRequests(loop, stop.set).install()
    waits = [asyncio.ensure_future(stop.wait())]
    if lifeline is not None:
        waits.append(asyncio.ensure_future(lifeline.wait_closed()))  # EOF: our parent is gone
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    try:
        await asyncio.wait_for(node.close(), 30)
    except asyncio.TimeoutError:
        log.warning("node shutdown timed out")
    requests.done()
    await runner.cleanup()
    return 0

