"""Hosting a pipeline: the host request's checks (host_args), the memory plan, and the head
with its OpenAI-compatible API, started in the background and stopped; friends invited to it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from engine.core import precision
from engine.core.errors import ModelError
from engine.core.ws_address import address_problem
from engine.core.local_stages import MOST as MOST_STAGES
from engine.core.local_stages import local_stages
from engine.core.sizes import size_words
from engine.model.device import DTYPES, compute_dtype, free_memory, release_memory
from engine.node.control_basics import NodeError, lan_address
from engine.node.plain_errors import host_failed
from engine.node.ring_view import gives_words, path_words

log = logging.getLogger("potluck.node")

DEFAULT_SHARE_PIPELINE = "potluck"   # the name a plain "Share this GPU" accepts
INVITE_HOURS = 24                    # an invite from the app lasts a day (the host window says so)
# what a reply still streaming on the pipeline that gave way to one with friends ends with
REPLACED = ("the host moved this chat onto the model they share with their friends; it answers again once "
            "that has loaded")


class Hosting:
    """Mixed into control.Node: its __init__ holds the state these methods read and change."""

    def start_hosting(self, args: dict, name: str | None = None):
        """Start loading the pipeline `args` describes (host_args) in the background;
        status() shows its progress."""
        self.error = None
        # what the pipeline serving on while friends come was asked for, should they not come
        self._kept_request = self.host_request if self.pipe is not None else None
        # shown in the status: never the API key
        self.host_request = dict(args, api_key="(set)") if args.get("api_key") else args
        self.loading_name = name or args["model"]   # what the person chose, in its own words
        self.loading = {"message": f"Loading {self.loading_name}…", "stages": {}}
        self.host_task = asyncio.ensure_future(self._host(args))

    def host_args(self, body: dict) -> dict:
        model = body.get("model", "default")
        if not isinstance(model, str) or not model.strip():
            raise NodeError("'model' must be a model name, a Hugging Face id or a folder")
        try:   # None or 0: one process (core/local_stages.py)
            stages = local_stages(body.get("stages"), self.device)
        except ModelError:
            raise NodeError(f"'stages' must be a whole number from 1 to {MOST_STAGES}") from None
        addrs = body.get("stage_addr", []) or []
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a.startswith(("ws://", "wss://"))
                                                   for a in addrs):
            raise NodeError("'stage_addr' must be a list of ws:// addresses, as each friend's Status window shows theirs")
        layers = body.get("layers")
        if layers is not None and not isinstance(layers, str):
            raise NodeError("'layers' must be text like '0:10,10:30'")
        friends = body.get("friends", 0)
        if isinstance(friends, bool) or not isinstance(friends, int) or not (0 <= friends <= 8):
            raise NodeError("'friends' must be a whole number from 0 to 8")
        relay = body.get("relay") or ""
        listen = body.get("listen") or ""
        if not isinstance(relay, str):
            raise NodeError("'relay' must be a ws:// address")
        problem = relay.strip() and address_problem(relay.strip(), "a relay's address", relay=True)
        if problem:
            raise NodeError(problem)
        relay = relay.strip()
        if not isinstance(listen, str) or (listen and ":" not in listen):
            raise NodeError("'listen' must be HOST:PORT, e.g. 0.0.0.0:7870")
        if friends and not (relay or listen):
            raise NodeError("friends need a way in: a relay ('relay') or an address to accept them on ('listen')")
        if friends and addrs:
            raise NodeError("invite friends or give their addresses ('stage_addr'), not both")
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
            raise NodeError("'api_lan_port' needs an API key: anyone on the network could use this model "
                            "otherwise")
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
        where = ["This computer"] * (total_stages if not stage_addr else 1) + [split_address(a)[0] for a in stage_addr]
        # Each precision's weights, and what of them this machine holds: all of them when
        # every stage runs here, else the head's stage (friends' memory is only known once
        # they connect: the head then settles `auto` against the whole pool).
        here_range = tuple(split[0]) if stage_addr else (0, n)
        usable = available * precision.USABLE  # the rest: KV cache, activations, slack
        missing = bnb_missing()
        rows = []
        for w in precision.EXPLICIT:
            here_bytes = precision.slice_bytes(cfg, *here_range, w, nbytes)
            whole = precision.slice_bytes(cfg, 0, n, w, nbytes)
            # needs: the weights and room for the conversations' cache, as the model list's
            # "fits on this computer: needs ..." (core/group_fit.py) says it
            rows.append({"weights": w, "bytes": whole, "here_bytes": here_bytes, "fits_here": here_bytes <= usable,
                         "needs_here_bytes": int(here_bytes / precision.USABLE),
                         "needs_bytes": int(whole / precision.USABLE),
                         # as the model list rounds them, for the app to show as they are
                         "needs_here_words": size_words(here_bytes / precision.USABLE, up=True),
                         "needs_words": size_words(whole / precision.USABLE, up=True),
                         "available": missing is None or w not in precision.QUANTIZED})
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
            usable_rows = [r for r in rows if r["available"] and r["weights"] != precision.INT4]  # asked for by name
            chosen = next((r["weights"] for r in usable_rows if r["fits_here"]), usable_rows[-1]["weights"])
        row = next(r for r in rows if r["weights"] == chosen)
        local_needed, fits = row["here_bytes"], row["fits_here"] and row["available"]
        here = f"on {self.device_name}" if self.device.startswith("cuda") else "here"
        # "full (float32)" on a CPU, as the first screen and the host dialog say it
        label = chosen if chosen != precision.FULL else precision.full_label(compute_dtype(self.device))
        need = row["needs_here_bytes"]
        message = (f"{source.name} needs about {size_words(need, up=True)} {here} ({size_words(local_needed, up=True)} "
                   f"of it its {label} weights, the rest for conversations); {size_words(available)} available")
        if not row["available"]:
            message = f"{source.name} cannot load {chosen} weights here: {missing}"
        elif not fits:
            smaller = next((r["weights"] for r in rows if r["available"] and r["fits_here"]), None)
            hint = (f"Choose {smaller} weights, add friends' GPUs" if smaller and weights != "auto" else
                    "Add friends' GPUs")
            message = (f"{source.name} does not fit: it needs about {size_words(need, up=True)} {here} "
                       f"with {label} weights but only {size_words(available)} is free. {hint}, pick a "
                       f"smaller model, or raise the memory limit in Settings.")
        if saved and fits:
            message += f". The checkpoint is saved as {saved}, so it loads as {saved}"
        if friends_stages and fits:
            message += (". Friends' memory is known once they join: Potluck then picks the weights for "
                        "the whole pool" if weights == "auto" and not saved else
                        ". Friends' memory is known once they join")
        return {"model": source.name, "spec": source.spec, "layers": n, "needed_bytes": row["bytes"],
                "device": self.device, "dtype": compute_dtype(self.device),
                "needed_here_bytes": local_needed, "needs_here_bytes": need,
                "needs_here_words": size_words(need, up=True), "available_words": size_words(available),
                "available_bytes": available, "usable_bytes": int(usable),
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

        def on_weights(chosen):   # the precision the head settled, as fields for the app
            if self.loading is not None:
                self.loading["weights"] = chosen.as_dict()

        cfg = PipelineConfig(model=args["model"], stages=args["stages"], stage_addr=args["stage_addr"],
                             layers=args["layers"], threads=self.threads, device=self.device,
                             weights=args.get("weights") or "auto", memory_cap_mb=args.get("memory_limit_mb"),
                             wait_timeout=args.get("wait_timeout_s", 300.0), draft=args.get("draft"),
                             # friends' shares check the name; our own stage processes use "local"
                             pipeline=args.get("pipeline", DEFAULT_SHARE_PIPELINE) if args["stage_addr"] else "local")
        pipe, replaced = None, False
        try:
            if args.get("friends"):
                cfg = await self._wait_for_friends(args, cfg)
            # a pipeline kept serving while the friends came (routes.h_host) gives way now:
            # the new one's head takes its memory and its API's port
            await self._close_pipeline(REPLACED)
            replaced = True
            if args.get("friends") and self.friends_gate is not None:
                def told(text):
                    log.info("host: %s", text)
                    if self.loading is not None:
                        self.loading["message"] = text
                peers = [f["peer"] for f in self.friends]
                pipe = await self.friends_gate.launch_over(peers, lambda: launch(cfg, progress, say, on_weights), told,
                                                           cfg.wait_timeout)
            else:
                pipe = await launch(cfg, progress, say, on_weights)
            if self.friends_gate is not None:
                self.friends_gate.follow(pipe.head)  # friends joining later take a slice
            try:
                self.api_runner = await serve_api(pipe.head, "127.0.0.1", self.api_port)
            except OSError:
                # the port asked for (the app's stable one) is another program's now: a free
                # one serves instead, and the status says which
                log.info("host: port %s is taken: the API goes on a free port", self.api_port)
                self.api_runner = await serve_api(pipe.head, "127.0.0.1", 0)
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
            if replaced:   # the API's runners are the new pipeline's (e.g. the LAN port is taken)
                for runner in (self.api_runner, self.api_lan_runner):
                    if runner is not None:
                        await runner.cleanup()
                self.api_runner = self.api_lan_runner = None
                self.openai_url = self.api_lan_url = None
            # else the friends never came: the pipeline kept serving meanwhile serves on
            if pipe is not None:
                await pipe.close()
            await self._close_friends_gate()
            if not replaced and self.pipe is not None:   # what serves on is what was asked before
                self.host_request, self.invite_code, self.friends = self._kept_request, None, []
            self.loading = None
            # the engine's account is in the log above; a pipeline serving on stays "serving"
            self.error = host_failed(str(exc))

    async def _wait_for_friends(self, args: dict, cfg):
        """Invite friends (engine/node/homes.py) and wait for them; they become the stages."""
        from engine.node.homes import Friends

        self.friends_gate = gate = Friends(on_event=lambda t: log.info("host: %s", t))
        await gate.open(args["relay"], args["listen"])
        n = args["friends"]
        code = gate.invite(ttl_s=INVITE_HOURS * 3600, uses=n)
        self.invite_code = code

        def arrived(peers):
            # who came, and how their computer reaches this one (the host dialog lists them)
            self.loading.update(message=f"Waiting for friends to join: {len(peers)} of {n}", invite=code,
                                invite_hours=INVITE_HOURS, invite_uses=n,
                                friends=[p.name or p.node_id for p in peers],
                                arrived=[{"name": p.name or p.node_id, "path": path_words(p.path),
                                          "device": p.about.get("device"), "memory": p.about.get("memory"),
                                          "gives": gives_words(p.about)} for p in peers])

        # with a relay, a short code to read out too (one friend each, for 10 minutes; a
        # new one when it is used or expires)
        short = asyncio.ensure_future(self._offer_short_codes(args["relay"], code)) if args["relay"] else None
        try:
            peers = await gate.wait(n, on_arrival=arrived)
        finally:
            if short is not None:
                short.cancel()
            if self.loading is not None:
                self.loading.pop("short_code", None)
        self.friends = [{"name": p.name, "node_id": p.node_id, "via": p.path, "peer": p} for p in peers]
        self.loading.update(message=f"Loading {self.loading_name} across {n + 1} computers…",
                            friends=[p.name or p.node_id for p in peers])
        return await gate.route(peers, cfg)

    async def _offer_short_codes(self, relay: str, code: str):
        from engine.wire import shortcode

        while True:
            channel, password = shortcode.make()
            if self.loading is not None:
                self.loading.update(short_code=f"{channel}-{password}", relay=relay)
            try:
                await shortcode.offer(relay, channel, password, code)
                log.info("host: a short code was used: the invite code was handed over")
            except shortcode.ShortCodeError as exc:
                log.info("host: short code: %s", exc)
                await asyncio.sleep(2.0)      # the relay may be down: not a busy loop

    def keeps_serving_while_friends_join(self, args: dict) -> bool:
        """Whether a new pipeline can wait for its friends while the one running now serves:
        a pipeline on this computer alone (one with friends shares their gate with the new
        invite) replaced by one with friends (who may take minutes to come)."""
        return bool(args.get("friends")) and self.pipe is not None and not self.friends \
            and self.friends_gate is None and not (self.host_request or {}).get("stage_addr")

    def waiting_for_friends(self) -> bool:
        """Whether a pipeline with friends is waiting for them to join (none has loaded)."""
        return bool(self.host_task is not None and not self.host_task.done() and self.friends_gate is not None
                    and not self.friends and (self.loading or {}).get("invite"))

    async def _stop_waiting(self):
        """The invite withdrawn while no friend has joined yet: its code stops working, and a
        pipeline that served meanwhile serves on (what `_stop_host` would close too)."""
        await self._cancel_host_task()
        await self._close_friends_gate(withdraw=True)
        if self.pipe is not None:   # what serves on is what was asked before
            self.host_request = self._kept_request
        self.invite_code, self.friends, self.loading = None, [], None

    async def _stop_host(self, why: str = "the host stopped hosting"):
        await self._cancel_host_task()
        await self._close_pipeline(why)
        self.loading = None
        await self._close_friends_gate()
        self.invite_code, self.friends = None, []

    async def _cancel_host_task(self):
        task, self.host_task = self.host_task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def _close_friends_gate(self, withdraw: bool = False):
        """The door friends come in by, closed; `withdraw`: its invite revoked too (a gate
        opened later on the same port would take it otherwise)."""
        if self.friends_gate is not None:
            gate, self.friends_gate = self.friends_gate, None
            if withdraw and self.invite_code:
                gate.withdraw(self.invite_code)
            await gate.close()

    async def _close_pipeline(self, why: str):
        """The pipeline serving now and its API, closed (a replacement may be loading)."""
        if self.pipe is not None:
            # the pipeline first: each reply still streaming ends with why, and the API
            # gets a moment to send it before its connections close
            pipe, self.pipe, self.head = self.pipe, None, None
            # shielded: a stop that cancels the hosting task mid-switch must not leave the
            # old pipeline half-closed with nothing holding it
            await asyncio.shield(pipe.close(why))
            await asyncio.sleep(0.2)
            # what it held goes back before a new pipeline measures the memory it has
            # (on a GPU the allocator's cache would still count as used)
            await asyncio.get_running_loop().run_in_executor(None, release_memory, self.device)
        for runner in (self.api_runner, self.api_lan_runner):
            if runner is not None:
                await runner.cleanup()
        self.api_runner = self.api_lan_runner = None
        self.api_lan_url = None
        self.openai_url = None

