"""`potluck host | join | invites | relay`: pipelines across homes (see engine/tunnel.py)."""

from __future__ import annotations

import asyncio
import sys
import time

from .identity import config_dir, load_or_create_identity
from .invite import HostState, InviteError, parse


def _say(text: str):
    print(text, file=sys.stderr, flush=True)


def add_args(sub, add_pipeline_args):
    p = sub.add_parser("host", help="host a pipeline: print an invite code, wait for friends, serve the API")
    add_pipeline_args(p)
    p.add_argument("--relay", default="", help="ws://relay:port that both homes can reach")
    p.add_argument("--listen", default="", help="HOST:PORT to accept friends directly (e.g. 0.0.0.0:7870)")
    p.add_argument("--advertise", action="append", default=[],
                   help="address to put in the code for --listen (default: this machine's addresses)")
    p.add_argument("--peers", type=int, default=1, help="friends to wait for, in pipeline order (default 1)")
    p.add_argument("--uses", type=int, default=None, help="how many machines the code admits (default --peers)")
    p.add_argument("--expires", type=float, default=24.0, help="hours until the code expires (default 24)")
    p.add_argument("--host", default="127.0.0.1", help="API bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")
    p.add_argument("--prompt", action="append", help="send this message once ready, print the answer, exit")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--short", action="store_true",
                   help="also print a short code to read out (one use, 10 minutes; needs --relay)")

    p = sub.add_parser("join", help="contribute this machine to a friend's pipeline with their invite code")
    p.add_argument("code", help="the invite code, or a short code (4821-917305) with --relay")
    p.add_argument("--relay", default="", help="the host's relay, for a short code")
    p.add_argument("--name", default=None, help="how the host sees this machine (default: hostname)")
    p.add_argument("--prefer", default="auto", choices=["auto", "direct", "relay"],
                   help="auto: a direct address from the code first, then the relay")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--config", default=None)

    p = sub.add_parser("invites", help="list this host's invites and members; make or revoke one")
    p.add_argument("--revoke", metavar="ID", help="an invite id or a member's node id")
    p.add_argument("--new", action="store_true", help="make a new code (with the host's last relay/addresses)")
    p.add_argument("--uses", type=int, default=1)
    p.add_argument("--expires", type=float, default=24.0, help="hours")
    p.add_argument("--config", default=None)

    p = sub.add_parser("relay", help="run a relay that pairs homes by pipeline id and forwards ciphertext")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-frame", type=int, default=128 << 10, help="bytes per frame")
    p.add_argument("--max-channels", type=int, default=8, help="joiner connections per pipeline")
    p.add_argument("--idle", type=float, default=120.0, help="seconds a channel may stay silent")
    p.add_argument("--rate", type=float, default=20.0, help="MB/s per pipeline")
    p.add_argument("--dump", default=None, help=__import__("argparse").SUPPRESS)  # tests: forwarded bytes


async def host(args) -> int:
    from .api import serve_api
    from .cli import ProgressBar, build_head, close_head
    from .head import Delta
    from .sampling import SamplingParams
    from .tunnel import TunnelHost

    if not args.relay and not args.listen:
        _say("potluck: give --relay URL and/or --listen HOST:PORT so friends can reach you")
        return 2
    folder = config_dir(args.config)
    me = load_or_create_identity(folder)
    state = HostState(folder)
    tunnels = TunnelHost(me, state, on_event=lambda t: _say(f"  {t}"))
    if args.listen:
        h, _, port = args.listen.rpartition(":")
        bound = await tunnels.listen(h or "0.0.0.0", int(port or 0), advertise=args.advertise or None)
        _say(f"Accepting friends directly on port {bound}: {', '.join(tunnels.direct_addresses)}")
    if args.relay:
        await tunnels.use_relay(args.relay)
    state.set_routes(tunnels.relay_url, tunnels.direct_addresses)
    code = tunnels.invite(ttl_s=args.expires * 3600, uses=args.uses or args.peers)
    _say(f"Host node {me.node_id} (key in {me.store}); pipeline {state.pipeline.hex()}")
    print(f"Invite code (valid {args.expires:g} h, {args.uses or args.peers} use(s)):\n{code}", flush=True)
    _say(f"Waiting for {args.peers} friend(s): on their machine, `potluck join <code>`")
    short_task = None
    if args.short and args.relay:
        from . import shortcode

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
    runner = head = None
    try:
        peers = [await tunnels.wait_peer() for _ in range(args.peers)]
        for i, p in enumerate(peers):
            _say(f"stage {i + 1}: {p.name or 'unnamed'} (node {p.node_id}) via {p.path}")
        args.stage_addr = [p.address for p in peers]
        # stage i -> stage i+1 across two other homes: through both tunnels, via this host
        args.next_addresses = [await tunnels.open_hop(a, b) for a, b in zip(peers, peers[1:])] + [None]
        args.pipeline = state.pipeline.hex()
        bar = ProgressBar()
        head = await build_head(args, bar)
        bar.finish()
        paths = ", ".join(f"stage {i + 1} via {p.path}" for i, p in enumerate(peers))
        _say(f"Ready: {head.source.name}, {len(peers) + 1} stages ({paths})")
        if args.prompt:
            for text in args.prompt:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, greedy=True)
                handle = head.submit(head.chat_prompt([{"role": "user", "content": text}]), params)
                parts = []
                async for ev in handle:
                    if isinstance(ev, Delta):
                        parts.append(ev.text)
                    else:
                        done = ev
                print(f"you> {text}\nbot> {''.join(parts)}\n     [{done.completion_tokens} tokens, "
                      f"{done.finish_reason}; {paths}]", flush=True)
            return 0
        runner = await serve_api(head, args.host, args.port)
        print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1", flush=True)
        await asyncio.Event().wait()
    finally:
        if short_task is not None:
            short_task.cancel()
        if runner is not None:
            await runner.cleanup()
        if head is not None:
            await close_head(head)
        await tunnels.close()
    return 0


async def join(args) -> int:
    from .stage_server import StageServer
    from .tunnel import Joiner, TunnelError, default_name

    from . import shortcode

    code = args.code
    if shortcode.is_short(code):
        if not args.relay:
            _say("potluck: a short code needs the host's relay: --relay ws://...")
            return 2
        try:
            code = await shortcode.redeem(args.relay, code)
        except shortcode.ShortCodeError as exc:
            _say(f"potluck: {exc}")
            return 2
        _say("  short code accepted: received the invite code")
    try:
        invite = parse(code)
        invite.check_fresh()
    except InviteError as exc:
        _say(f"potluck: {exc}")
        return 2
    me = load_or_create_identity(config_dir(args.config))
    server = await StageServer("127.0.0.1", 0, pipeline=invite.pipeline_id, device=args.device,
                               threads=args.threads).start()
    joiner = Joiner(invite, me, ("127.0.0.1", server.port), name=args.name or default_name(),
                    prefer=args.prefer, on_event=lambda t: _say(f"  {t}"))
    try:
        session = await joiner.connect()
    except TunnelError as exc:
        _say(f"potluck: {exc}")
        await server.close()
        return 1
    print(f"Joined pipeline {invite.pipeline_id} as node {me.node_id} via {session.path}; "
          "sharing this machine until you stop it (Ctrl+C)", flush=True)
    keep = asyncio.ensure_future(joiner.run())
    closed = asyncio.ensure_future(server.wait_closed())
    try:
        await asyncio.wait([keep, closed], return_when=asyncio.FIRST_COMPLETED)
        if keep.done() and keep.exception() is not None:
            _say(f"potluck: {keep.exception()}")
            return 1
    finally:
        keep.cancel()
        if joiner.session is not None:
            await joiner.session.close("leaving")
        await server.close()
    return 0


def invites(args) -> int:
    folder = config_dir(args.config)
    state = HostState(folder)
    if args.revoke:
        try:
            print(f"revoked {state.revoke(args.revoke)}")
        except KeyError as exc:
            print(f"potluck: {exc.args[0]}", file=sys.stderr)
            return 2
        return 0
    if args.new:
        routes = state.data().get("routes") or {}
        if not routes.get("relay") and not routes.get("direct"):
            print("potluck: run `potluck host` once first (it records the relay and addresses)", file=sys.stderr)
            return 2
        me = load_or_create_identity(folder)
        _, code = state.create_invite(me.public, routes.get("relay", ""), routes.get("direct", []),
                                      ttl_s=args.expires * 3600, max_uses=args.uses)
        print(code)
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


async def relay(args) -> int:
    from .relay import Limits, Relay

    dump = None
    if args.dump:
        f = open(args.dump, "ab", buffering=0)
        dump = f.write
    limits = Limits(max_frame=args.max_frame, max_channels=args.max_channels, idle_timeout=args.idle,
                    rate=args.rate * 1e6, burst=max(args.rate * 1e6 / 5, 2 * args.max_frame))
    r = await Relay(limits, dump=dump).start(args.host, args.port)
    print(f"Relay listening on ws://{args.host}:{r.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await r.close()
    return 0
