"""The node's control API: the aiohttp app over a Node (control.py) and its request handlers,
each checking its request and answering JSON (NodeError: an error with its HTTP status).

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
    POST /stop   {what: host|share|invite|all}  (invite: friends no longer awaited)
    POST /host/offer {address}  a friend's stage (ws://...) offers itself to the hosted pipeline: taken
                               when the pipeline waits for room, else at its next rearrangement
    POST /power  {state: sleeping|awake}   the computer is about to sleep (a shared stage hands its
                               layers over first, within SLEEP_LEAVE_S) / woke up (sharing resumes)

Every request carries `Authorization: Bearer <token>` (control.py: where the token comes from).
"""

from __future__ import annotations

import asyncio
import hmac
import json

from aiohttp import web

from engine.core.group_fit import group_fit
from engine.core.ws_address import address_problem
from engine.model.device import compute_dtype, free_memory
from engine.model.quant import bnb_missing
from engine.node.control_basics import NodeError
from engine.node.share_stage import SLEEP_LEAVE_S
from engine.node.sharing import Limits, SharePolicy


class NodeRoutes:
    """Mixed into control.Node: its __init__ holds the state these handlers read and change."""

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
            body = {"error": exc.message}
            if exc.details:
                body["details"] = exc.details
            return web.json_response(body, status=exc.status)

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
        friends, waiting = self.group_memory()
        # unquantized weights are held at the dtype this machine computes in: float32 on a
        # CPU, twice bf16's bytes (the list said 269 MB where the plan then needed 0.5 GB)
        dtype_name = compute_dtype(self.device)
        out = []
        for e in catalog.MODELS:
            sizes = e.sizes(catalog.DTYPE_BYTES[dtype_name])
            out.append({"id": e.id, "name": e.name, "label": e.label(dtype_name), "params": e.params, "gated": e.gated,
                        "draft": e.draft, "sizes": sizes,
                        "fits_here": {w: b <= precision.USABLE * free for w, b in sizes.items()},
                        # with the friends in the ring: which precision, or who else is needed
                        "group": group_fit(sizes, free, friends, waiting, quantized_ok=bnb_missing() is None)})
        return out

    def group_memory(self) -> tuple[list[tuple[str, int]], int]:
        """(name, free memory) of each friend in the ring we host, as each said when it
        last joined the ring (before loading its layers) or, while the ring waits for
        friends, as each said joining; and how many invited friends have not joined yet."""
        named = {getattr(f.get("peer"), "address", None): f["name"] or f["node_id"] for f in self.friends}
        friends = [(named[r.address], int((r.welcome or {}).get("free_memory") or 0))
                   for r in (self.head.remotes if self.head is not None else []) if r.address in named]
        loading = self.loading or {}
        if self.head is None or loading.get("invite"):   # waiting: those who joined said what they give as they came
            friends = [(a["name"], int(a["memory"])) for a in loading.get("arrived") or [] if a.get("memory")]
        invited = (self.host_request or {}).get("friends") or 0
        waiting = max(0, invited - len(loading.get("friends") or [])) if loading.get("invite") else 0
        return friends, waiting

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
                raise NodeError("a model is already starting: wait until it is ready, then host again", 409)
            if not self.keeps_serving_while_friends_join(args):
                await self._stop_host()
            self.start_hosting(args, plan["model"])
        return web.json_response({"ok": True, "plan": plan})

    def _take_name(self, body: dict) -> None:
        """How a friend's host sees this computer when it joins (the app's setting; absent:
        its computer name)."""
        name = body.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise NodeError("'name' must be text")
            self.join_name = " ".join(name.split())[:64] or None

    async def h_share(self, request):
        body = await self._body(request)
        on = body.get("on")
        if not isinstance(on, bool):
            raise NodeError("'on' must be true or false")
        self._take_name(body)
        await self.set_share(on)
        return web.json_response(await self.status())

    async def h_join(self, request):
        body = await self._body(request)
        code = body.get("code")
        self._take_name(body)
        if code is not None:
            if not isinstance(code, str) or not code.strip() or len(code) > 4000:
                raise NodeError("'code' must be the invite code your friend sent")
            relay = body.get("relay") or ""
            if not isinstance(relay, str):
                raise NodeError("'relay' must be a ws:// address")
            problem = relay.strip() and address_problem(relay.strip(), "a relay's address", relay=True)
            if problem:
                raise NodeError(problem)
            if body.get("check") is True:    # whose code it is, before the join window asks to leave
                return web.json_response(self.check_invite(code.strip()))
            return web.json_response(await self.join_invite(code.strip(), relay.strip()))
        pipeline = body.get("pipeline")
        if not isinstance(pipeline, str) or not pipeline.strip() or len(pipeline) > 200:
            raise NodeError("give an invite code or the host's name ('pipeline')")
        port = body.get("port", self.share_port)
        if isinstance(port, bool) or not isinstance(port, int) or not (0 <= port < 65536):
            raise NodeError("'port' must be a TCP port number")
        async with self._lock:
            await self._stop_share("joining another friend")
            self.invite = self.joiner = None
            self.share_pipeline, self.share_port = pipeline.strip(), port
            self._forget_join()   # shared by name now: not the friend joined by code before
        await self.set_share(True)
        return web.json_response(await self.status())

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
            raise NodeError("this computer is not hosting", 409)
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
        if what not in ("host", "share", "all", "invite"):
            raise NodeError("'what' must be host, share, invite or all")
        async with self._lock:
            if what == "invite":   # friends no longer awaited; what serves meanwhile goes on
                if not self.waiting_for_friends():
                    raise NodeError("no invite is waiting for friends now (they may have joined)", 409)
                await self._stop_waiting()
            if what in ("host", "all"):
                await self._stop_host()
                self.error = None
            if what in ("share", "all"):
                self.share_wanted = False
                await self._stop_share("sharing switched off")
        return web.json_response(await self.status())
