"""`potluck` command line: each command run (parser.py beside it reads the arguments),
calling into the layers below with typed configs (engine/pipeline/launch.py's
PipelineConfig, engine/node/homes.py for pipelines across homes). Nothing here decides
how a pipeline runs."""

from __future__ import annotations

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
from engine.cli.parser import build_parser
from engine.node.control_basics import hold_port, lan_address, port_taken
from engine.core.sizes import counted


class ProgressBar:
    """One line per stage on stderr, redrawn in place: model loading takes a while. Where
    stderr is a file or a pipe (a service's log), a line as each part is done instead: the
    redraws would pile into one long line."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
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
        if not self.tty:
            if done >= total:
                self.stream.write(f"  stage {stage}: {what} {done}/{total}\n")
                self.stream.flush()
            return
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


def pipeline_config(args, **over):
    """The PipelineConfig a command's arguments describe."""
    from engine.pipeline.launch import PipelineConfig

    given = {f.name: getattr(args, f.name) for f in fields(PipelineConfig) if hasattr(args, f.name)}
    return PipelineConfig(**{**given, **over})


def _bound(runner, port: int) -> int:
    """The port the API listens on: `--port 0` asks for a free one, and the address
    printed is what a client needs (it read :0)."""
    for addr in getattr(runner, "addresses", None) or ():
        if isinstance(addr, tuple) and len(addr) >= 2:
            return addr[1]
    return port


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
    from engine.model.sources import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    n = _stage_count(args)
    name = f"the default model ({DEFAULT_MODEL_NAME})" if args.model == DEFAULT_MODEL else args.model
    return f"Loading {name}" + (f" on {counted(int(n), 'stage')}..." if n else "...")


def _describe(head) -> str:
    # counted from 1, as a friend's machine and the app say them ("layers 20–30 of 30")
    stages = head.info()["stages"]
    total = stages[-1]["layers"][1] if stages else 0
    parts = [f"{s['address']}: " + (f"layer {b}" if b - a == 1 else f"layers {a + 1}–{b}")
             for s in stages for a, b in [s["layers"]]]
    parts[-1:] = [f"{parts[-1]} of {total}"] if parts else []
    return f"{head.source.name}, {counted(len(parts), 'stage')} — " + "; ".join(parts)


async def _chat(args) -> int:
    held, taken = hold_port("127.0.0.1", args.api_port, "--api-port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    terminated = _end_on_sigterm()
    try:
        return await _chat_until_done(args, held)
    except asyncio.CancelledError:
        if terminated:   # `kill`, a logout: the stages closed and their files gone, as Ctrl+C does
            return 143
        raise
    finally:
        for sock in held:    # the API's, or still ours if it never started
            sock.close()


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


async def _chat_until_done(args, held=()) -> int:
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import launch
    from engine.pipeline.terminal import chat_loop

    _say(_loading(args))
    bar = ProgressBar()
    pipe = await launch(pipeline_config(args), bar, _say)
    bar.finish()
    runner = None
    try:
        _say(f"Ready: {_describe(pipe.head)}")
        if args.api_port:
            runner = await serve_api(pipe.head, "127.0.0.1", args.api_port, socks=held)
            _say(f"OpenAI-compatible API: http://127.0.0.1:{args.api_port}/v1")
        failed = await chat_loop(pipe.head, args.prompt, args.max_tokens, seed=args.seed,
                        sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                  "min_p": args.min_p,
                                  "repetition_penalty": args.repetition_penalty,
                                  "presence_penalty": args.presence_penalty,
                                  "frequency_penalty": args.frequency_penalty})
    finally:
        if runner is not None:
            await runner.cleanup()
        await pipe.close()
    # a script's --prompt that could not be sent (too long for the window) or answered
    return 1 if failed and args.prompt else 0


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


async def _serve(args) -> int:
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import launch

    ok, tls = _api_security(args)
    if not ok:
        return 2
    held, taken = hold_port(args.host, args.port, "--port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    _say(_loading(args))
    try:
        pipe = await launch(pipeline_config(args), ProgressBar(), _say)
    except BaseException:
        for sock in held:
            sock.close()
        raise
    runner = await serve_api(pipe.head, args.host, args.port, api_key=args.api_key, tls=tls,
                             cors_origins=args.cors_origin, socks=held)
    _say(f"Ready: {_describe(pipe.head)}")
    _say(f"OpenAI-compatible API on {'https' if tls else 'http'}://{args.host}:{_bound(runner, args.port)}/v1")
    stopped, requests = _stop_requests()
    try:
        await stopped.wait()
        _say("Stopping: replies in progress are told why...")
    finally:
        await _close_serving(pipe, runner)
        requests.done()
    _say("Stopped.")
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
    from engine.wire.stage_auth import MIN_SECRET_CHARS, is_loopback, new_secret

    taken = port_taken(args.host, args.port, "--port")
    if taken:
        _say(f"potluck: {taken}")
        return 2
    secret = args.secret or os.environ.get("POTLUCK_STAGE_SECRET") or None
    if secret is not None and len(secret) < MIN_SECRET_CHARS and not is_loopback(args.host):
        # anyone on the network may guess it: a head that proves it drives this machine
        _say(f"potluck: a stage listening beyond this machine needs a secret of at least {MIN_SECRET_CHARS} "
             "characters (anyone on the network could guess a short one): leave --secret out and a strong "
             "one is made and printed")
        return 2
    if secret is None and not is_loopback(args.host):
        # never an open port on the LAN: a fresh secret, printed in the address to give the head
        secret = new_secret()
    server = await StageServer(args.host, args.port, pipeline=args.pipeline, device=args.device,
                               threads=args.threads, cores=cores, memory_cap=cap, secret=secret,
                               # on loopback, a head that proves the secret its parent gave it (or
                               # any head, with none) is this machine's own: it may name a model
                               # by path
                               trusted_head=is_loopback(args.host) and (not secret or args.announce),
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


# where `potluck host` accepts friends when told neither --listen nor --relay
DEFAULT_LISTEN = "0.0.0.0:7870"


async def _host(args) -> int:
    """`potluck host`: invite friends, wait for them, run the pipeline over their stages."""
    from engine.core.sampling import SamplingParams
    from engine.node.homes import FriendNames, Friends, HomeError
    from engine.pipeline.api import is_loopback, serve_api
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
    # the model first: an invite handed out for a model this machine cannot have would
    # bring friends to a host that fails as they arrive (config and tokenizer only: the
    # weights come later, each machine its own layers')
    from engine.model.sources import resolve

    try:
        await asyncio.get_running_loop().run_in_executor(None, resolve, args.model)
    except ModelError as exc:
        _say(f"potluck: {exc}")
        return 2
    if not args.relay and not args.listen:
        # friends reach this computer directly (its router asked for a mapping), as the
        # app's host does; it said "give a relay address and/or a listen address"
        args.listen = DEFAULT_LISTEN
    elif args.listen and not args.advertise and is_loopback(args.listen.rpartition(":")[0].strip("[]")):
        _say(f"  note: --listen {args.listen} accepts friends from this computer only: friends in other homes "
             f"need --listen 0.0.0.0:{args.listen.rpartition(':')[2]} (or --relay)")
    friends = Friends(args.config, on_event=lambda t: _say(f"  {t}"))
    names = FriendNames(friends)
    for handler in logging.getLogger().handlers:
        handler.addFilter(names)
    if args.listen:     # the router's answer (UPnP) can take seconds
        _say(f"Opening port {args.listen.rpartition(':')[2]} for friends (asking the router to forward it)...")
    try:
        bound = await friends.open(args.relay, args.listen, args.advertise)
    except HomeError as exc:
        _say(f"potluck: {exc}")
        await friends.close()
        return 2
    if bound is not None:
        _say(f"Accepting friends directly on port {bound}: {', '.join(friends.direct_addresses)}")
    # held from now (the friends' door may have taken it: said before the model loads)
    held, taken = ([], None) if args.prompt else hold_port(args.host, args.port, "--port")
    if taken:
        # the friends' door took it: said before the model loads (the API binds once it has)
        _say(f"potluck: {taken}" + (" (by --listen: friends and the API need a port each)"
                                    if bound == args.port else ""))
        await friends.close()
        return 2
    uses = args.uses or max(1, args.peers)
    code = friends.invite(ttl_s=args.expires * 3600, uses=uses)
    _say(f"Host node {friends.me.node_id} (key in {friends.me.store}); pipeline {friends.pipeline_id}")
    print(f"Invite code (valid {args.expires:g} h, {counted(uses, 'use')}):\n{code}", flush=True)
    _say(f"Waiting for {counted(args.peers, 'friend')}: on their machine, `potluck join <code>`" if args.peers else
         "Serving on this machine now; friends who join (`potluck join <code>`) take their share of the layers")
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
        pipe = await friends.launch_over(peers, lambda: launch(cfg, bar, _say), lambda t: _say(f"  {t}"),
                                         args.wait_timeout)
        bar.finish()
        friends.follow(pipe.head)  # friends joining later (`potluck invites --new`) take a slice
        paths = ", ".join(f"stage {i + 1} via {p.path}" for i, p in enumerate(peers))
        _say(f"Ready: {pipe.head.source.name}, {len(peers) + 1} stages ({paths})" if peers else
             f"Ready: {pipe.head.source.name}, on this machine until friends join")
        if args.prompt:
            for text in args.prompt:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, greedy=True)
                answer, done = await reply(ask(pipe.head, [{"role": "user", "content": text}], params))
                print(f"you> {text}\nbot> {answer}\n     [{done.completion_tokens} tokens, "
                      f"{done.finish_reason}" + (f"; {paths}]" if paths else "]"), flush=True)
            return 0
        runner = await serve_api(pipe.head, args.host, args.port, api_key=args.api_key, tls=tls,
                                 cors_origins=args.cors_origin, socks=held)
        print(f"OpenAI-compatible API on {'https' if tls else 'http'}://{args.host}:{_bound(runner, args.port)}/v1",
              flush=True)
        stopped, requests = _stop_requests()
        await stopped.wait()
        _say("Stopping: replies in progress are told why, friends that the host is gone...")
    finally:
        if short_task is not None:
            short_task.cancel()
        await _close_serving(pipe, runner)
        for sock in held:    # the API's, or still ours if it never started
            sock.close()
        await friends.close()
        if requests is not None:
            requests.done()
    if requests is not None:
        _say("Stopped.")
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
            # "the peer closed the tunnel: this node's key was revoked by the host": the words
            # the app says it in (the account with -v)
            from engine.node.plain_errors import membership_ended

            logging.getLogger("potluck.join").info("membership ended: %s", keep.exception())
            _say(f"potluck: {membership_ended(str(keep.exception()))}")
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
                    rate=args.rate * 1e6, burst=max(args.rate * 1e6 / 5, 2 * args.max_frame),
                    per_address=args.per_address)
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


COMMANDS = {"chat": _chat, "serve": _serve, "stage": _stage, "host": _host, "join": _join,
            "relay": _relay, "node": _node}


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl+C while torch and transformers are imported, before a command runs: what a
        # user pressing it wants (to stop) without a traceback from inside an import
        sys.stderr.write("\n")
        return 130


def _main(argv=None) -> int:
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
    if not argv:    # `potluck` alone: what it can do, not "the following arguments are required"
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    command = getattr(args, "command_parser", parser)   # its usage line with the error
    if getattr(args, "stage_addr", None) and getattr(args, "stages", None):
        # it ran on this machine and the stages named, the --stages given unread
        command.error(f"--stage-addr names the other stages ({len(args.stage_addr) + 1} in all with this machine's), "
                     "so --stages has nothing to count: leave out one of them")
    if getattr(args, "draft", None) and getattr(args, "speculate", None) == "off":
        command.error("--draft loads a model that guesses for speculation, which --speculate off switches off: "
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
    except BrokenPipeError:
        # the reader went away (`potluck chat --prompt … | head`): quiet, as other tools
        # are, and nothing more written to the closed pipe as Python exits
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ModelError as exc:
        print(f"potluck: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a clear line for the user; details with -v
        from engine.pipeline.requests import PipelineError

        if isinstance(exc, (PipelineError, OSError)):
            # "[Errno 2] No such file or directory: '/proc/nope'": the file and what is wrong
            words = exc
            if isinstance(exc, OSError) and exc.strerror:
                words = f"cannot use {exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
            print(f"potluck: {words}", file=sys.stderr)
            if args.verbose:
                raise
            return 1
        raise
