"""`potluck` command line: argument parsing, and calls into the layers below with typed
configs (engine/pipeline/launch.py's PipelineConfig, engine/node/homes.py for pipelines
across homes). Nothing here decides how a pipeline runs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from dataclasses import fields

from engine.pipeline.lifeline import Lifeline
from engine.pipeline.stopping import HOST_SHUTTING_DOWN, StopRequests
from engine.core.errors import ModelError
from engine.core.precision import CHOICES as WEIGHT_CHOICES
from engine.core.step_gate import COMPUTE_ORDERS
from engine.model.sources import DEFAULT_MODEL
from engine.core.cli_args import (count_arg, hours_arg, listen_arg, mb_arg, penalty_arg, port_arg,  # noqa: F401
                                  prompt_chunk_arg, ranged_arg, relay_arg, sampling_arg, seconds_arg, stage_addr_arg,
                                  stages_arg)
from engine.node.control_basics import lan_address, port_taken


class ProgressBar:
    """One line per stage on stderr, redrawn in place: model loading takes a while."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.last = 0.0
        self.open = False
        self.open_stage = None

    def finish(self):
        """End a line left open by a bar that never reached its total."""
        if self.open:
            self.stream.write("\n")
            self.open = False

    def __call__(self, stage: int, done: int, total: int, what: str):
        if total <= 0:
            return   # nothing to load (a rearrangement that kept this stage's layers)
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        if self.open and stage != self.open_stage:
            self.stream.write("\n")
        self.stream.write(f"\r  stage {stage}: {what:<18} [{bar}] {done}/{total}   ")
        self.open, self.open_stage = done < total, stage
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def add_pipeline_args(p):
    # the everyday options first; the rest adapt to the machine and its links by themselves
    g = p.add_argument_group("the model and this machine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face id, a local folder or a .gguf file")
    g.add_argument("--stages", type=stages_arg, default=None,
                   help="pieces the model is split into on this machine, this process included (default: 1 on a "
                        "GPU, where more would take turns on it, and 2 on a CPU; with --layers, one per range)")
    g.add_argument("--stage-addr", type=stage_addr_arg, action="append", default=[], metavar="ADDRESS",
                   help="ws://host:port#secret of another computer's stage, as `potluck stage` printed it "
                        "(repeat, in pipeline order); replaces --stages")
    g.add_argument("--device", default="auto",
                   help="where this machine computes: auto (default: the GPU when torch sees one, else the "
                        "CPU), cpu, cuda or cuda:N")
    g.add_argument("--weights", default="auto", choices=list(WEIGHT_CHOICES),
                   help="how finely the weights are stored: auto (default: the finest the machines' memory "
                        "holds), bf16 (as published), int8 or nf4 (about 1/2 and 1/4 the memory, with the "
                        "bitsandbytes package), int4 (about 1/4, torch's own kernels)")
    g.add_argument("--memory-cap-mb", type=mb_arg, default=None,
                   help="the most memory (MiB) this machine's own stage may use (default: what is free)")
    t = p.add_argument_group("tuning (the defaults adapt to the machine and its links; most people leave these)")
    t.add_argument("--layers", default=None, help="the layer split instead of the automatic one: '0:10,10:30' "
                                                  "or '10,20'")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the number format of the computation (default auto: bfloat16 on a GPU, float32 on the CPU)")
    t.add_argument("--threads", type=count_arg, default=None,
                   help="CPU threads per stage process (default: the cores are shared out among the stages, "
                        "leaving those your other programs use)")
    t.add_argument("--micro-batches", type=count_arg, default=None,
                   help="groups of requests in flight along the pipeline at once (default: picked from the "
                        "measured compute and links; 1 for stages sharing this machine's CPU)")
    t.add_argument("--wait-timeout", type=seconds_arg, default=300.0,
                   help="seconds requests wait for a machine to join when the ones left after a friend "
                        "leaves cannot hold the model (default 300)")
    t.add_argument("--kv-budget-tokens", type=count_arg, default=None,
                   help="tokens of conversation each stage keeps in memory (default: what its memory holds)")
    t.add_argument("--link", default="jit", choices=["jit", "fixed", "fifo"],
                   help="how links between computers send: replies' next tokens first, long prompts in pieces "
                        "sized to the link (jit, default), in fixed pieces, or in arrival order (fifo)")
    t.add_argument("--prompt-chunk", default="auto", type=prompt_chunk_arg,
                   help="tokens of a long prompt computed per step before it goes on: auto (default) = "
                        "sized to the measured link, 16-64, smaller over a slow one; or a fixed number")
    t.add_argument("--compress", default="off", choices=["off", "auto", "prefill", "all"],
                   help="send what passes between computers at 8 bits (slightly less exact): auto = long "
                        "prompts' while the link is the bottleneck, prefill = long prompts' always, all")
    t.add_argument("--compute", default="in-order", choices=COMPUTE_ORDERS,
                   help="stages compute steps in arrival order (default), or let replies' next tokens cut "
                        "into a long prompt's step: sooner tokens for those replying, a later start for the prompt")
    t.add_argument("--speculate", default=None, choices=["auto", "off"],
                   help="speculative decoding: auto (default; or POTLUCK_SPECULATE) guesses the next tokens "
                        "from the conversation (prompt lookup, or --draft's model) and checks them in one trip "
                        "round the pipeline where that pays (slow links, a quoting reply): replies are the same "
                        "token for token; off decodes one token per trip")
    t.add_argument("--draft", default=None, metavar="MODEL[@WEIGHTS]",
                   help="a draft model of the same tokenizer, on this machine beside the first stage, that "
                        "guesses the next tokens for speculation instead of prompt lookup: 'default', a Hugging "
                        "Face id, a folder or a .gguf, optionally @bf16 (default), @int8, @nf4 or @int4 (e.g. "
                        "meta-llama/Llama-3.2-1B-Instruct for a Llama-3.1-70B; on a CPU-only machine "
                        "'default@int8' stands in); auto: the catalog's pairing for --model. Not with --speculate off")


def pipeline_config(args, **over):
    """The PipelineConfig a command's arguments describe."""
    from engine.pipeline.launch import PipelineConfig

    given = {f.name: getattr(args, f.name) for f in fields(PipelineConfig) if hasattr(args, f.name)}
    return PipelineConfig(**{**given, **over})


def _say(text: str):
    print(text, file=sys.stderr, flush=True)


def _stage_count(args) -> str:
    """How many stages the pipeline about to load has, said before it loads."""
    from engine.core.local_stages import local_stages
    from engine.model.device import DeviceError, pick_device

    if args.stage_addr:
        return str(len(args.stage_addr) + 1)
    split = len([p for p in (args.layers or "").split(",") if p.strip()]) or None
    try:
        return str(local_stages(args.stages or split, pick_device(args.device)))
    except (DeviceError, ValueError):
        return str(args.stages) if args.stages else ""   # launch says what is wrong


def _loading(args) -> str:
    """The line said before a pipeline loads (seconds to minutes: the terminal is not blank)."""
    n = _stage_count(args)
    return f"Loading {args.model}" + (f" on {n} stage(s)..." if n else "...")


def _describe(head) -> str:
    # counted from 1, as a friend's machine and the app say them ("layers 20–30 of 30")
    stages = head.info()["stages"]
    total = stages[-1]["layers"][1] if stages else 0
    parts = [f"{s['address']}: " + (f"layer {b}" if b - a == 1 else f"layers {a + 1}–{b}")
             for s in stages for a, b in [s["layers"]]]
    parts[-1:] = [f"{parts[-1]} of {total}"] if parts else []
    return f"{head.source.name}, {len(parts)} stage(s) — " + "; ".join(parts)


async def _chat(args) -> int:
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import launch
    from engine.pipeline.terminal import chat_loop

    taken = port_taken("127.0.0.1", args.api_port, "--api-port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    terminated = _end_on_sigterm()
    try:
        return await _chat_until_done(args, launch, serve_api, chat_loop)
    except asyncio.CancelledError:
        if terminated:   # `kill`, a logout: the stages closed and their files gone, as Ctrl+C does
            return 143
        raise


def _end_on_sigterm() -> list[bool]:
    """SIGTERM cancels the chat as Ctrl+C at the prompt does, so the pipeline closes (it
    killed the process outright, leaving the stages' shared-core files behind). Says in
    the list returned whether it came. Windows has no SIGTERM."""
    came: list[bool] = []
    if sys.platform != "win32":
        task = asyncio.current_task()

        def on_term():
            came.append(True)
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
    return came


async def _chat_until_done(args, launch, serve_api, chat_loop) -> int:
    _say(_loading(args))
    bar = ProgressBar()
    pipe = await launch(pipeline_config(args), bar, _say)
    bar.finish()
    runner = None
    try:
        _say(f"Ready: {_describe(pipe.head)}")
        if args.api_port:
            runner = await serve_api(pipe.head, "127.0.0.1", args.api_port)
            _say(f"OpenAI-compatible API: http://127.0.0.1:{args.api_port}/v1")
        await chat_loop(pipe.head, args.prompt, args.max_tokens, seed=args.seed,
                        sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                  "min_p": args.min_p,
                                  "repetition_penalty": args.repetition_penalty,
                                  "presence_penalty": args.presence_penalty,
                                  "frequency_penalty": args.frequency_penalty})
    finally:
        if runner is not None:
            await runner.cleanup()
        await pipe.close()
    return 0


def _api_security(args):
    """Said before anything loads: an API open to the network needs a key, and a
    certificate that will not load is said now, not after the model. Returns whether to
    go on, and the TLS context (None: plain HTTP)."""
    from engine.pipeline.api import is_loopback, tls_context
    from engine.pipeline.api_cors import Cors

    try:
        Cors(args.cors_origin, args.api_key)
    except ValueError as exc:
        _say(f"potluck: {exc}")
        return False, None
    if not (args.api_key or is_loopback(args.host)):
        _say(f"potluck: the API would listen on {args.host}, beyond this machine, without an API key: give one "
             "(--api-key or POTLUCK_API_KEY), or keep the API on 127.0.0.1")
        return False, None
    if bool(args.tls_cert) != bool(args.tls_key):
        _say("potluck: --tls-cert and --tls-key go together (the certificate and its private key, PEM files)")
        return False, None
    if not args.tls_cert:
        if not is_loopback(args.host):
            _say("  note: over plain HTTP the API key travels in the clear: beyond your LAN, "
                 "give --tls-cert and --tls-key")
        return True, None
    try:
        return True, tls_context(args.tls_cert, args.tls_key)
    except ValueError as exc:
        _say(f"potluck: {exc}")
        return False, None


def _add_api_args(p) -> None:
    p.add_argument("--api-key", default=os.environ.get("POTLUCK_API_KEY"),
                   help="key clients must send (Authorization: Bearer KEY); required beyond loopback "
                        "(default: $POTLUCK_API_KEY)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the API over HTTPS with this certificate (chain), PEM; with --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key, PEM")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page's origin (e.g. http://localhost:3000) whose scripts may call the API from a "
                        "browser (repeatable; '*' for any, with --api-key only; default none)")


async def _serve(args) -> int:
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import launch

    ok, tls = _api_security(args)
    if not ok:
        return 2
    taken = port_taken(args.host, args.port, "--port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    _say(_loading(args))
    pipe = await launch(pipeline_config(args), ProgressBar(), _say)
    runner = await serve_api(pipe.head, args.host, args.port, api_key=args.api_key, tls=tls,
                             cors_origins=args.cors_origin)
    _say(f"Ready: {_describe(pipe.head)}")
    _say(f"OpenAI-compatible API on {'https' if tls else 'http'}://{args.host}:{args.port}/v1")
    stopped, requests = _stop_requests()
    try:
        await stopped.wait()
    finally:
        await _close_serving(pipe, runner)
        requests.done()
    return 0


def _stop_requests() -> tuple[asyncio.Event, StopRequests]:
    """An event that SIGTERM and Ctrl+C (Windows: its console's events) set, and what
    listens for them: its done() once the process has left as it should."""
    stopped = asyncio.Event()
    return stopped, StopRequests(asyncio.get_running_loop(), stopped.set).install()


async def _close_serving(pipe, runner) -> None:
    """Asked to stop (SIGTERM, Ctrl+C, Windows' console events): the pipeline first, so each
    reply still streaming ends saying why, and the API has a moment to send it before its
    connections close (service managers stop with SIGTERM, which used to cut replies off)."""
    if pipe is not None:
        await pipe.close(HOST_SHUTTING_DOWN)
        await asyncio.sleep(0.2)
    if runner is not None:
        await runner.cleanup()


async def _stage(args) -> int:
    from engine.pipeline.local import ANNOUNCE
    from engine.pipeline.stage_server import StageServer

    cores = None
    if args.core_lease:
        from engine.model.cores import CoreLease

        cores = CoreLease.from_spec(args.core_lease)
    cap = None if args.memory_cap_mb is None else int(args.memory_cap_mb * 2**20)
    from engine.node.control import lan_address
    from engine.wire.stage_auth import is_loopback, new_secret

    taken = port_taken(args.host, args.port, "--port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    secret = args.secret or os.environ.get("POTLUCK_STAGE_SECRET") or None
    if secret is None and not is_loopback(args.host):
        # never an open port on the LAN: a fresh secret, printed in the address to give the head
        secret = new_secret()
    server = await StageServer(args.host, args.port, pipeline=args.pipeline, device=args.device,
                               threads=args.threads, cores=cores, memory_cap=cap, secret=secret,
                               accept_models=args.accept_model,
                               # its owner hears when a head takes it in and lets it go (one its head
                               # started says nothing: the head speaks)
                               on_event=None if args.announce else _say).start()
    server.warm_up()
    loop = asyncio.get_running_loop()

    async def leave():
        # stopped (a service manager, Ctrl-C): the head moves our layers first
        await server.leave("the stage was stopped by its owner")
        await server.close("the stage was stopped by its owner")

    leaving: list[asyncio.Future] = []
    # a stage its head started (--announce) leaves Ctrl+C to the head, which may go on
    requests = StopRequests(loop, lambda: leaving.append(asyncio.ensure_future(leave())),
                            interrupts=not args.announce).install()
    if args.announce:
        print(f"{ANNOUNCE}{server.port}", flush=True)
        # our parent holds our stdin: when it goes, we go
        lifeline = Lifeline(loop)
        watcher = asyncio.ensure_future(lifeline.wait_closed())
        closed = asyncio.ensure_future(server.wait_closed())
        await asyncio.wait([watcher, closed], return_when=asyncio.FIRST_COMPLETED)
    else:
        shown = args.host if is_loopback(args.host) or args.host not in ("0.0.0.0", "::", "") else lan_address()
        _say(f"Stage listening on ws://{args.host}:{server.port}")
        if secret:
            _say(f"Give the head this address (it carries the secret): ws://{shown}:{server.port}#{secret}")
        await server.wait_closed()
    if leaving:
        await asyncio.gather(*leaving, return_exceptions=True)
    requests.done()
    return 0


async def _host(args) -> int:
    """`potluck host`: invite friends, wait for them, run the pipeline over their stages."""
    from engine.core.sampling import SamplingParams
    from engine.node.homes import FriendNames, Friends, HomeError
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import launch
    from engine.pipeline.terminal import ask, reply
    from engine.wire import shortcode

    if args.short and not args.relay:
        _say("potluck: --short needs --relay: a short code is read out and handed over through a relay")
        return 2
    ok, tls = _api_security(args) if not args.prompt else (True, None)
    if not ok:
        return 2
    taken = None if args.prompt else port_taken(args.host, args.port, "--port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    friends = Friends(args.config, on_event=lambda t: _say(f"  {t}"))
    names = FriendNames(friends)
    for handler in logging.getLogger().handlers:
        handler.addFilter(names)
    try:
        bound = await friends.open(args.relay, args.listen, args.advertise)
    except HomeError as exc:
        _say(f"potluck: {exc}")
        await friends.close()
        return 2
    if bound is not None:
        _say(f"Accepting friends directly on port {bound}: {', '.join(friends.direct_addresses)}")
    uses = args.uses or args.peers
    code = friends.invite(ttl_s=args.expires * 3600, uses=uses)
    _say(f"Host node {friends.me.node_id} (key in {friends.me.store}); pipeline {friends.pipeline_id}")
    print(f"Invite code (valid {args.expires:g} h, {uses} use(s)):\n{code}", flush=True)
    _say(f"Waiting for {args.peers} friend(s): on their machine, `potluck join <code>`")
    short_task = None
    if args.short and args.relay:
        channel, password = shortcode.make()
        print(f"Short code (one use, 10 minutes): {channel}-{password}  "
              f"(`potluck join {channel}-{password} --relay {args.relay}`)", flush=True)

        async def offer():
            try:
                await shortcode.offer(args.relay, channel, password, code)
                _say("  short code used: the invite code was handed over")
            except shortcode.ShortCodeError as exc:
                _say(f"  short code: {exc}")

        short_task = asyncio.ensure_future(offer())
    runner = pipe = requests = None
    try:
        peers = await friends.wait(args.peers)
        for i, p in enumerate(peers):
            _say(f"stage {i + 1}: {p.name or 'unnamed'} (node {p.node_id}) via {p.path}")
        cfg = await friends.route(peers, pipeline_config(args))
        bar = ProgressBar()
        pipe = await launch(cfg, bar, _say)
        bar.finish()
        friends.follow(pipe.head)  # friends joining later (`potluck invites --new`) take a slice
        paths = ", ".join(f"stage {i + 1} via {p.path}" for i, p in enumerate(peers))
        _say(f"Ready: {pipe.head.source.name}, {len(peers) + 1} stages ({paths})")
        if args.prompt:
            for text in args.prompt:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, greedy=True)
                answer, done = await reply(ask(pipe.head, [{"role": "user", "content": text}], params))
                print(f"you> {text}\nbot> {answer}\n     [{done.completion_tokens} tokens, "
                      f"{done.finish_reason}; {paths}]", flush=True)
            return 0
        runner = await serve_api(pipe.head, args.host, args.port, api_key=args.api_key, tls=tls,
                                 cors_origins=args.cors_origin)
        print(f"OpenAI-compatible API on {'https' if tls else 'http'}://{args.host}:{args.port}/v1", flush=True)
        stopped, requests = _stop_requests()
        await stopped.wait()
    finally:
        if short_task is not None:
            short_task.cancel()
        await _close_serving(pipe, runner)
        await friends.close()
        if requests is not None:
            requests.done()
    return 0


async def _join(args) -> int:
    """`potluck join CODE`: share this machine with a friend's pipeline until Ctrl+C."""
    from engine.node.homes import HomeError, join_stage, redeem
    from engine.wire import shortcode

    try:
        invite = await redeem(args.code, args.relay)
    except HomeError as exc:   # a code that cannot be used: the user's to fix
        _say(f"potluck: {exc}")
        return 2
    if shortcode.is_short(args.code):
        _say("  short code accepted: received the invite code")
    try:
        joined = await join_stage(invite, name=args.name, prefer=args.prefer, device=args.device,
                                  threads=args.threads, config=args.config, on_event=lambda t: _say(f"  {t}"),
                                  accept_models=args.accept_model,
                                  reply_listen=None if args.no_reply else args.reply_listen,
                                  on_reply=lambda code: print(f"Reply code (send it to the host, who runs "
                                                              f"`potluck invites --reply CODE` or pastes it in "
                                                              f"the app):\n{code}", flush=True))
    except HomeError as exc:   # the host could not be reached
        _say(f"potluck: {exc}")
        return 1
    print(f"Joined pipeline {invite.pipeline_id} as node {joined.joiner.identity.node_id} via "
          f"{joined.joiner.session.path}; sharing this machine until you stop it (Ctrl+C)", flush=True)
    keep = asyncio.ensure_future(joined.joiner.run())
    closed = asyncio.ensure_future(joined.server.wait_closed())
    # Ctrl+C or SIGTERM: the host is told first and moves this machine's layers to the
    # others (the app's "Share this GPU" off does the same), rather than finding it gone
    stopped, requests = _stop_requests()
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait([keep, closed, stop], return_when=asyncio.FIRST_COMPLETED)
        if keep.done() and keep.exception() is not None:
            _say(f"potluck: {keep.exception()}")
            return 1
        if stopped.is_set():
            why = "the friend stopped sharing"
            session = joined.joiner.session
            # only a host still there moves the layers (one that stopped has nobody to move them to)
            if joined.server.stage is not None and session is not None and not session.closed.is_set():
                _say("Stopping: the host is moving this computer's layers to the others...")
                await joined.server.leave(why)
            _say("Stopped sharing this machine.")
    finally:
        keep.cancel()
        stop.cancel()
        await joined.close("leaving")
        requests.done()
    return 0


def _invites(args) -> int:
    """`potluck invites`: list this host's invites and members; make or revoke one."""
    from engine.wire.identity import config_dir, load_or_create_identity
    from engine.wire.invite import HostState, InviteError

    folder = config_dir(args.config)
    if not (folder / HostState.FILE).exists() and not (args.revoke or args.new or args.reply is not None):
        # nothing to list, and nothing written for asking
        print("This computer has not hosted a pipeline yet: `potluck host` makes its first invite.")
        return 0
    state = HostState(folder)
    if args.revoke:
        try:
            print(f"revoked {state.revoke(args.revoke)}")
        except KeyError as exc:
            print(f"potluck: {exc.args[0]}", file=sys.stderr)
            return 2
        return 0
    if args.reply is not None:
        try:
            r = state.add_reply(args.reply)
        except InviteError as exc:
            print(f"potluck: that reply code cannot be used: {exc}", file=sys.stderr)
            return 2
        print(f"reply taken: the running host connects to {', '.join(r.direct)}")
        return 0
    if args.new:
        routes = state.data().get("routes") or {}
        if not routes.get("relay") and not routes.get("direct"):
            print("potluck: run `potluck host` once first (it records the relay and addresses)", file=sys.stderr)
            return 2
        me = load_or_create_identity(folder)
        invite, code = state.create_invite(me.public, routes.get("relay", ""), routes.get("direct", []),
                                        ttl_s=args.expires * 3600, max_uses=args.uses, kinds=routes.get("kinds"))
        print(code)   # alone on stdout, for scripts; what it is on stderr
        iid = invite.invite_id.hex()
        print(f"invite {iid}: admits {args.uses} computer{'s' if args.uses != 1 else ''}, valid until "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(time.time() + args.expires * 3600))} "
              f"(`potluck invites --revoke {iid}` withdraws it)", file=sys.stderr)
        return 0
    data = state.data()
    now = time.time()
    print(f"pipeline {data['pipeline']}")
    print("invites:")
    for iid, r in sorted(data["invites"].items(), key=lambda kv: kv[1]["created"]):
        status = ("revoked" if r["revoked"] else "expired" if now > r["expires"]
                  else "used up" if r["uses"] >= r["max_uses"] else "open")
        print(f"  {iid}  {status:8} uses {r['uses']}/{r['max_uses']}  expires "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(r['expires']))}")
    print("members:")
    for key, m in sorted(data["members"].items(), key=lambda kv: kv[1]["joined"]):
        print(f"  {m['node_id']}  {'revoked' if m['revoked'] else 'allowed':8} {m['name']}  joined "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(m['joined']))}")
    return 0


async def _relay(args) -> int:
    from engine.wire.relay import Limits, Relay

    taken = port_taken(args.host, args.port, "--port")
    if taken:   # said as the other commands say it, not in the socket library's words
        _say(f"potluck: {taken}")
        return 2
    dump = None
    if args.dump:
        f = open(args.dump, "ab", buffering=0)
        dump = f.write
    limits = Limits(max_frame=args.max_frame, max_channels=args.max_channels, idle_timeout=args.idle,
                    rate=args.rate * 1e6, burst=max(args.rate * 1e6 / 5, 2 * args.max_frame))
    r = await Relay(limits, dump=dump).start(args.host, args.port)
    where = args.host if args.host not in ("0.0.0.0", "::", "") else lan_address()
    print(f"Relay listening on port {r.port} ({'every address' if where != args.host else args.host}): hosts "
          f"give it as --relay ws://{where}:{r.port} on this network, or with this machine's public address "
          "from other homes", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await r.close()
    return 0


async def _node(args) -> int:
    from engine.node.control import run_node

    return await run_node(args)


def _add_homes_args(sub):
    p = sub.add_parser("host", help="host a pipeline: print an invite code, wait for friends, serve the API")
    add_pipeline_args(p)
    p.add_argument("--relay", type=relay_arg, default="", help="ws://relay:port that both homes can reach")
    p.add_argument("--listen", type=listen_arg, default="", help="HOST:PORT to accept friends directly (e.g. 0.0.0.0:7870)")
    p.add_argument("--advertise", action="append", default=[],
                   help="address to put in the code for --listen (default: this machine's addresses)")
    p.add_argument("--peers", type=count_arg, default=1, help="friends to wait for, in pipeline order (default 1)")
    p.add_argument("--uses", type=count_arg, default=None, help="how many machines the code admits (default --peers)")
    p.add_argument("--expires", type=hours_arg, default=24.0, help="hours until the code expires (default 24)")
    p.add_argument("--host", default="127.0.0.1", help="API bind address (default loopback only)")
    _add_api_args(p)
    p.add_argument("--port", type=port_arg, default=8000, help="API port (default 8000)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")
    p.add_argument("--prompt", action="append", help="send this message once ready, print the answer, exit")
    p.add_argument("--max-tokens", type=sampling_arg("max_tokens", int), default=64,
                   help="with --prompt: the longest answer, in tokens (default 64)")
    p.add_argument("--short", action="store_true",
                   help="also print a short code to read out (one use, 10 minutes; needs --relay)")

    p = sub.add_parser("join", help="contribute this machine to a friend's pipeline with their invite code")
    p.add_argument("code", help="the invite code (or its potluck://join/… link), or a short code (4821-917305) "
                                "with --relay")
    p.add_argument("--relay", type=relay_arg, default="", help="the host's relay, for a short code")
    p.add_argument("--name", default=None, help="how the host sees this machine (default: hostname)")
    p.add_argument("--prefer", default="auto", choices=["auto", "direct", "relay"],
                   help="auto: a direct address from the code first, then the relay")
    p.add_argument("--reply-listen", type=listen_arg, default="0.0.0.0:7871", metavar="HOST:PORT",
                   help="when nothing in the code reaches the host: listen here (asking this router for a "
                        "mapping) and show a reply code for the host to paste (default %(default)s)")
    p.add_argument("--no-reply", action="store_true", help="fail instead of offering a reply code")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=count_arg, default=None, help="CPU threads for this machine's stage "
                                                                   "(default: the cores your programs leave free)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model a friend's head may have this machine load, beyond the default and "
                        "Potluck's model list (a hub id or a folder/GGUF path here; repeatable)")

    p = sub.add_parser("invites", help="list this host's invites and members; make or revoke one")
    p.add_argument("--revoke", metavar="ID", help="an invite id or a member's node id")
    p.add_argument("--new", action="store_true", help="make a new code (with the host's last relay/addresses)")
    p.add_argument("--reply", metavar="CODE", help="a friend's reply code: the running host connects to them")
    p.add_argument("--uses", type=count_arg, default=1, help="with --new: how many machines the code admits "
                                                             "(default 1)")
    p.add_argument("--expires", type=hours_arg, default=24.0, help="hours until the code expires (default 24)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")

    p = sub.add_parser("relay", help="run a relay that pairs homes by pipeline id and forwards ciphertext")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every address)")
    p.add_argument("--port", type=port_arg, default=8765, help="port to listen on (default 8765)")
    p.add_argument("--max-frame", type=ranged_arg(int, 4096, 16 << 20, "a number of bytes from 4096 to 16 MiB"),
                   default=128 << 10, help="bytes per frame (default %(default)s)")
    p.add_argument("--max-channels", type=count_arg, default=8,
                   help="joiner connections per pipeline (default %(default)s)")
    p.add_argument("--idle", type=ranged_arg(float, 1, float("inf"), "a number of seconds from 1"), default=120.0,
                   help="seconds a channel may stay silent (default %(default)s)")
    p.add_argument("--rate", type=ranged_arg(float, 0.01, float("inf"), "a number of MB/s above 0"), default=20.0,
                   help="MB/s per pipeline (default %(default)s)")
    p.add_argument("--dump", default=None, help=argparse.SUPPRESS)  # tests: forwarded bytes


def _add_node_args(p):
    p.add_argument("--port", type=port_arg, default=0, help="control API port on 127.0.0.1 (default: a free one)")
    p.add_argument("--token-stdin", action="store_true",
                   help="read the API token from the first line of stdin and exit when stdin closes")
    p.add_argument("--token-file", default=None, help="where to write the API token (mode 0600)")
    p.add_argument("--share-host", default="0.0.0.0", help="address friends' heads reach this GPU on")
    p.add_argument("--share-port", type=port_arg, default=7860, help="port friends' heads reach this GPU on "
                                                                     "(default 7860)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model a friend's head may have this machine load, beyond the default and "
                        "Potluck's model list (a hub id or a folder/GGUF path here; repeatable)")
    p.add_argument("--api-port", type=port_arg, default=0,
                   help="OpenAI API port on 127.0.0.1, a free one if it is taken (default: a free one)")
    p.add_argument("--pipeline", default="potluck", help="pipeline name a shared stage accepts")
    p.add_argument("--threads", type=count_arg, default=None,
                   help="CPU threads for this machine's stages (default: the cores your programs leave free)")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--limits", default=None, help="the sharing limits as JSON (the app passes its settings), e.g. "
                        '\'{"vram_cap_mb": 8000, "temp_pause_c": 83, "only_when_idle": true}\'')
    p.add_argument("--poll", type=float, default=2.0, help="seconds between GPU/limit checks")
    p.add_argument("--host-model", default=None, help="start hosting this model right away")
    p.add_argument("--stages", type=stages_arg, default=None,
                   help="local stages when hosting (head included; default: 1 on a GPU, 2 on a CPU)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("potluck")
    except PackageNotFoundError:  # run from a checkout that was never installed: no second copy to drift
        return "(not installed)"


def _gpu(args) -> int:
    """`potluck gpu --check`: one JSON line on the torch this process imports (the app asks
    in a child process; it never imports torch itself). Exit 1 when torch does not import."""
    import json

    from engine.boot.overlay import active

    if args.enable or args.disable:   # `python -m engine gpu --enable`: not the potluck command
        print("potluck gpu: installing or removing the CUDA build is the `potluck` command's "
              "(run `potluck gpu --enable`)", file=sys.stderr)
        return 2
    if not args.check:
        print("potluck gpu: say what to do: --enable (use the NVIDIA GPU), --disable (back to the CPU) "
              "or --check (which build runs)", file=sys.stderr)
        return 2
    out = {"torch": None, "cuda": None, "cuda_available": False, "device_name": None, "overlay": active()}
    try:
        import torch

        out.update(torch=torch.__version__, cuda=torch.version.cuda)
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["device_name"] = str(torch.cuda.get_device_name(0))
    except Exception as exc:  # a broken CUDA build: say why, on the same one line
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="potluck", description="Pool GPUs with friends to run one LLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens, for a bug report")
    parser.add_argument("--version", action="version", version=f"potluck {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("chat", help="terminal chat with a pipeline on this machine")
    add_pipeline_args(p)
    p.add_argument("--max-tokens", type=sampling_arg("max_tokens", int), default=256,
                   help="the longest reply, in tokens (default 256)")
    p.add_argument("--temperature", type=sampling_arg("temperature", float), default=None,
                   help="0 = greedy (default: the model's own, else 0.7; /set temperature X while chatting)")
    p.add_argument("--top-p", type=sampling_arg("top_p", float), default=None, help="default: the model's own, else 0.9")
    p.add_argument("--top-k", type=sampling_arg("top_k", int), default=None, help="default: the model's own, else off (0)")
    p.add_argument("--min-p", type=sampling_arg("min_p", float), default=None,
                   help="leave out tokens less likely than this times the likeliest, 0..1 (default: the "
                        "model's own, else off)")
    p.add_argument("--repetition-penalty", type=sampling_arg("repetition_penalty", float), default=None,
                   help="default: the model's own, else 1.1")
    p.add_argument("--presence-penalty", type=penalty_arg, default=None,
                   help="OpenAI's, -2..2: lowers the odds of every token the reply already holds (default 0)")
    p.add_argument("--frequency-penalty", type=penalty_arg, default=None,
                   help="OpenAI's, -2..2: lowers each token's odds by how often the reply holds it (default 0)")
    p.add_argument("--seed", type=sampling_arg("seed", int), default=None, help="make sampled replies reproducible")
    p.add_argument("--api-port", type=port_arg, default=0, help="also serve the OpenAI API on this port")
    p.add_argument("--prompt", "--once", action="append",
                   help="send this message instead of reading stdin, print the reply and exit (repeatable)")

    p = sub.add_parser("serve", help="run the head with an OpenAI-compatible API")
    add_pipeline_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    _add_api_args(p)
    p.add_argument("--port", type=port_arg, default=8000, help="API port (default 8000)")

    p = sub.add_parser("stage", help="run one stage server; the head tells it which layers to load")
    p.add_argument("--host", default="127.0.0.1", help="address heads reach it on (default loopback only; "
                                                       "0.0.0.0 for the LAN, with a secret)")
    p.add_argument("--port", type=port_arg, default=7860, help="port (default 7860)")
    p.add_argument("--pipeline", default="local", help="the pipeline's name a head must give (default local)")
    p.add_argument("--secret", default=None,
                   help="what a head must prove to drive this stage (default: $POTLUCK_STAGE_SECRET; "
                        "beyond loopback a new one is made and printed in the address to give the head)")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=count_arg, default=None, help="CPU threads (default: the cores your "
                                                                   "programs leave free)")
    p.add_argument("--memory-cap-mb", type=mb_arg, default=None,
                   help="the most memory (MiB) this stage may give a head's layers and cache (default: what is free)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model (hub id or path) a head may have this stage load beyond the default and "
                        "Potluck's list (repeatable)")
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core-lease", default=None, help=argparse.SUPPRESS)  # engine/model/cores.py

    sub.add_parser("prepare", help="read the embedded default model's settings and tokenizer once, so that "
                                   "later starts are quick (make setup runs it)")
    p = sub.add_parser("doctor", help="can this machine compute on its GPU, can friends in other homes reach it? "
                                      "if not, what to do")
    p.add_argument("--no-network", action="store_true", help="skip the network checks (router mapping, NAT)")
    p = sub.add_parser("gpu", help="use this computer's NVIDIA GPU: install or remove the CUDA build of torch, "
                                   "or check which build runs")
    what = p.add_mutually_exclusive_group()
    # --enable / --disable are handled by the `potluck` command before the engine starts
    # (app/launcher.py -> app/gpu_enable.py): listed here so that --help shows them
    what.add_argument("--enable", action="store_true", help="download the CUDA build (~2.5 GB) and switch to it")
    what.add_argument("--disable", action="store_true", help="switch back to the CPU build and delete the CUDA one")
    what.add_argument("--check", action="store_true", help="print one JSON line: torch version, CUDA, device")
    p.add_argument("--index", action="append", metavar="URL", help="with --enable: a package index to use")
    _add_homes_args(sub)
    p = sub.add_parser("node", help="this machine's engine process, driven by the app over a local control API")
    _add_node_args(p)
    sub.add_parser("app", help="the desktop app (tray icon, chat window); see `potluck-app --help`", add_help=False)
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, command in sub.choices.items():
        if command.description is None and helps.get(name):   # `potluck chat --help` says what it is
            command.description = helps[name][0].upper() + helps[name][1:] + "."
        if name != "app":   # `potluck chat -v` as well as `potluck -v chat`
            command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log what happens, for a bug report")
    return parser


COMMANDS = {"chat": _chat, "serve": _serve, "stage": _stage, "host": _host, "join": _join,
            "relay": _relay, "node": _node}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["app"]:  # `potluck app` is dispatched by app/launcher.py, above the engine
        print("potluck: the desktop app is `potluck app` (or `potluck-app`), not `python -m engine app`",
              file=sys.stderr)
        return 2
    # before torch is imported: this process and the stage processes it may start take
    # turns on the CPU's cores, and OpenMP's idle threads must not spin on them (cores.py)
    from engine.model.cores import apply_openmp_env

    apply_openmp_env(os.environ)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "draft", None) and getattr(args, "speculate", None) == "off":
        parser.error("--draft loads a model that guesses for speculation, which --speculate off switches off: "
                     "leave out one of them")
    if args.cmd == "gpu":  # before transformers: only torch's own import is under test
        return _gpu(args)
    # what a user reads beside the chat's and host's own lines: the time and the words
    # (which module said it, and how loudly, is for a bug report: -v)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s" if args.verbose else
                        "%(asctime)s %(message)s", datefmt=None if args.verbose else "%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.cmd == "prepare":
        from engine.model.sources import prepare_default

        try:
            source = prepare_default(log=lambda m: print(m, file=sys.stderr))
            print(f"Default model ready: {source.gguf_path} (config and tokenizer in {source.root})")
        except ModelError as exc:
            print(f"potluck: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "invites":
        return _invites(args)
    if args.cmd == "doctor":
        from engine.node.doctor import main as doctor

        return doctor(network=not args.no_network)
    try:
        return asyncio.run(COMMANDS[args.cmd](args))
    except KeyboardInterrupt:
        sys.stderr.write("\n")   # the shell's prompt on a line of its own, not after "you> ^C"
        return 130
    except ModelError as exc:
        print(f"potluck: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a clear line for the user; details with -v
        from engine.pipeline.requests import PipelineError

        if isinstance(exc, (PipelineError, OSError)):
            print(f"potluck: {exc}", file=sys.stderr)
            if args.verbose:
                raise
            return 1
        raise
