"""The node: one process per machine that runs the engine for the app and the CLI.

It can *host* a pipeline (a head with local and/or friends' stages, plus the
OpenAI-compatible API on loopback) and *share* this machine's GPU with a friend's
pipeline (a stage server, within the owner's limits: sharing.py). Clients drive it
through a small control API (routes.py). What it does lives beside it: hosting.py (a
pipeline's head), share_stage.py (this GPU's stage for a friend), control_basics.py (NodeError, the LAN address, the token file).

The API binds 127.0.0.1 only and every request carries `Authorization: Bearer
<token>`, a random per-launch token. The app generates it and hands it over on the
node's stdin (never on a command line other users can read); `potluck node` without
`--token-stdin` writes it to a 0600 file and prints that file's path. With
`--token-stdin` the node also exits when its stdin closes, so a parent that dies
(even by SIGKILL) leaves no node and no stage process behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from aiohttp import web

from engine.pipeline.lifeline import Lifeline
from engine.pipeline.stopping import HOST_SHUTTING_DOWN, StopRequests
from engine.model.device import DeviceError, device_name, pick_device
from engine.node.control_basics import NodeError, default_token_file, lan_address, write_token_file
from engine.node.hosting import DEFAULT_SHARE_PIPELINE, Hosting
from engine.node.ring_view import TokenRate, gives_words, path_words, ring, ring_text, with_names
from engine.node.routes import NodeRoutes
from engine.node.share_stage import SLEEP_LEAVE_S, Sharing
from engine.node.sharing import Limits, SharePolicy
from engine.wire.quiet_http import quiet_bad_requests

__all__ = ["ANNOUNCE", "DEFAULT_SHARE_PIPELINE", "Limits", "Node", "NodeError", "SLEEP_LEAVE_S", "STATS_TIMEOUT",
           "SharePolicy", "default_token_file", "lan_address", "run_node", "write_token_file"]

log = logging.getLogger("potluck.node")

ANNOUNCE = "POTLUCK_NODE_PORT="
STATS_TIMEOUT = 2.0



def friend_view(f: dict) -> dict:
    """A friend of the ring for the status: name, its address here, what its computer
    said it gives and the path, in words as the host dialog listed them while they joined."""
    peer = f.get("peer")
    about = getattr(peer, "about", None) or {}
    return {**{k: v for k, v in f.items() if k != "peer"}, "address": getattr(peer, "address", None), **about,
            "gives": gives_words(about), "path": path_words(getattr(peer, "path", None) or f.get("via"))}


class Node(NodeRoutes, Hosting, Sharing):
    """The node's state and lifecycle; its control API (routes.py), hosting (hosting.py) and
    sharing (share_stage.py) are mixed in."""

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
        self.join_name: str | None = None   # how friends' hosts see this computer (None: its name)
        self.joiner_task: asyncio.Task | None = None
        self.join_events: list[str] = []
        # a join that reaches none of the host's addresses listens here and shows a reply
        # code for the host to connect to (POTLUCK_REPLY_LISTEN=off: the join fails instead);
        # /join answers once the code is there, and the join goes on in `_joining`
        self.reply_listen = os.environ.get("POTLUCK_REPLY_LISTEN", "0.0.0.0:7871")
        self.reply_code: str | None = None
        self._reply_shown: asyncio.Event | None = None
        self._joining: asyncio.Task | None = None
        self._back_task: asyncio.Task | None = None   # back to the earlier share, a reply join failed
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
        self._rate = TokenRate()   # tokens per second served, for the ring's live figure
        self._policy_task: asyncio.Task | None = None

    # ---- state ----------------------------------------------------------------
    def state(self) -> str:
        # a pipeline serving on, or a share running on (a join that failed went back to the
        # friend it had), says so instead; the error is still told beside it
        if self.error and self.head is None and self.stage_server is None:
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
                    if st.get("memory"):
                        st["memory"]["cache"] = k["kv_bytes"]
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
            # each friend's stage by its address here (after a friend left, the stages
            # are fewer than the friends and in another order)
            by_address = {getattr(f.get("peer"), "address", None): f for f in self.friends}
            for st in info["stages"][1:]:
                f = by_address.get(st.get("address"))
                if f is None:
                    continue
                st["name"] = f["name"] or f["node_id"]
                peer = f.get("peer")
                live = peer.session.link() if peer is not None and peer.session is not None else None
                # the path as it is now (a relayed friend moves to a direct path by itself)
                st["via"] = live["path"] if live else f["via"]
                st["tunnel"] = live
            info["friends"] = [friend_view(f) for f in self.friends]
            # friend to friend: each hop's path ("direct (lan)", "via the host") and round trip
            gate = getattr(self, "friends_gate", None)
            info["hops"] = gate.tunnels.hop_links() if gate is not None else []
            # the ring in people's words (engine/node/ring_view.py): the app draws it
            rate = self._rate.update(info.get("tokens_served") or 0)
            info["events"] = with_names(info)
            info["ring"] = ring(info, rate)
            info["ring_text"] = ring_text(info["ring"])
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
                # what the share holds in memory now: its slice of the weights, the cache
                sharing["weights_bytes"] = srv.stage.param_bytes()
                sharing["kv_bytes"] = srv.stage.kv.allocated_bytes()
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

    # ---- lifecycle --------------------------------------------------------------
    def start_background(self):
        self._policy_task = asyncio.ensure_future(self._policy_loop())

    async def close(self):
        if self._policy_task is not None:
            self._policy_task.cancel()
        await self._stop_host(HOST_SHUTTING_DOWN)
        await self._stop_share("this computer's Potluck is shutting down")


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
        print(f"potluck node: bad --limits: {exc} (it takes the limits as JSON text, e.g. "
              "--limits '{\"vram_cap_mb\": 8000}', not a file's name)", file=sys.stderr)
        return 2
    try:
        node = Node(token, share_host=args.share_host, share_port=args.share_port, api_port=args.api_port,
                    pipeline=args.pipeline, threads=args.threads, limits=limits, poll_seconds=args.poll,
                    device=getattr(args, "device", "auto"), accept_models=getattr(args, "accept_model", None) or ())
    except DeviceError as exc:
        print(f"potluck node: {exc}", file=sys.stderr)
        return 2
    quiet_bad_requests()
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
