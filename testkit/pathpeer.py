"""Both ends of a tunnel between two homes, as processes, for the path tests (issue 33).

    python -m testkit.pathpeer host --folder F [--relay URL] [--no-upnp] [--seconds S]
    python -m testkit.pathpeer join --folder F --code CODE
    python -m testkit.pathpeer host --folder F --hop ...   and two joiners, the first --hop-stream S

The host (engine/wire/tunnel.py TunnelHost, the node's own code) listens on 0.0.0.0:7870,
gathers its candidates (a UPnP mapping included unless --no-upnp), prints `CODE <invite>`
and `CANDIDATES <json>`, waits for one joiner, then streams numbered lines through the
tunnel to the joiner's echo server for S seconds and checks each echo: one line a
`PATH <path>` whenever the session's path changes, and at the end `RESULT <json>` (lines
sent, echoes in order, the paths seen). Then it closes (removing the router's mapping)
and prints `CLOSED`.

With --hop the host waits for two joiners, introduces the first to the second
(engine/wire/friend_hop.py) and prints `HOP <json>` (path, round trip, seconds); the
first joiner (--hop-stream S) streams numbered lines through that hop to the second's
echo server and prints `HOPRESULT <json>`.

The joiner runs an echo server on loopback and engine.wire.tunnel.Joiner over the code
(POTLUCK_DIRECT_RETRY_S applies), printing `JOINED <path>` and the Joiner's events, or
`FAILED <reason>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path


# in every line: what an observer of the wire must never find in the bytes it captured
MARKER = "potluck-plaintext-line-marker"


def say(*parts) -> None:
    print(*parts, flush=True)


async def host(a) -> int:
    from engine.wire.identity import load_or_create_identity
    from engine.wire.invite import HostState
    from engine.wire.tunnel import TunnelHost

    folder = Path(a.folder)
    folder.mkdir(parents=True, exist_ok=True)
    th = TunnelHost(load_or_create_identity(folder), HostState(folder), on_event=lambda t: say("EVENT", t))
    await th.listen("0.0.0.0", 7870, upnp=not a.no_upnp)
    if a.relay:
        await th.use_relay(a.relay)
        await asyncio.sleep(1.0)          # registered before the code goes out
    say("CANDIDATES", json.dumps({"direct": th.direct_addresses, "kinds": th.direct_kinds,
                                  "nat": th.gathered.nat if th.gathered else None,
                                  "mapping": th.gathered.mapping.why_not if th.gathered else None}))
    say("CODE", th.invite(uses=2 if a.hop else 1))
    if a.reply_stdin:      # a line on stdin: a joiner's reply code, as pasted in the app
        async def replies():
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                try:
                    th.take_reply(line.strip())
                    say("REPLY-TAKEN")
                except Exception as exc:  # noqa: BLE001 -- said, for the test to read
                    say("REPLY-REFUSED", exc)
        asyncio.ensure_future(replies())
    try:
        peer = await asyncio.wait_for(th.wait_peer(), a.wait)
    except asyncio.TimeoutError:
        say("RESULT", json.dumps({"joined": False}))
        await th.close()
        say("CLOSED")
        return 0
    say("JOINED", peer.path)
    if a.hop:              # a second friend, and the first one's stage reaching it
        second = await asyncio.wait_for(th.wait_peer(), a.wait)
        say("JOINED", second.path)
        t0 = time.monotonic()
        await th.open_hop(peer, second)
        (link,) = th.hop_links()
        say("HOP", json.dumps({**link, "seconds": time.monotonic() - t0}))
        await asyncio.sleep(a.seconds)
        await th.close()
        say("CLOSED")
        return 0
    if a.bulk:             # goodput: once the path is direct, MB through the joiner's echo
        for _ in range(int(a.wait * 10)):
            if peer.path.startswith("direct"):
                break
            await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", peer.port)
        size, block = int(a.bulk * 1e6), b"x" * (64 << 10)

        async def pour():
            left = size
            while left > 0:
                writer.write(block[:min(left, len(block))])
                await writer.drain()
                left -= len(block)

        t0 = time.monotonic()
        task = asyncio.ensure_future(pour())
        got = 0
        while got < size:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 60)
            if not chunk:
                break
            got += len(chunk)
        await task
        say("BULK", json.dumps({"path": peer.path, "bytes": got, "seconds": time.monotonic() - t0}))
        writer.close()
        await th.close()
        say("CLOSED")
        return 0
    reader, writer = await asyncio.open_connection("127.0.0.1", peer.port)
    paths, sent, echoed, bad = [peer.path], 0, 0, []

    async def read_echoes():
        nonlocal echoed
        while True:
            line = await reader.readline()
            if not line:
                return
            if int(line.split()[0]) != echoed:
                bad.append((echoed, line.decode().strip()))
            echoed += 1

    reading = asyncio.ensure_future(read_echoes())
    t_end = time.monotonic() + a.seconds
    while time.monotonic() < t_end:
        writer.write(f"{sent} {MARKER}\n".encode())
        await writer.drain()
        sent += 1
        if peer.path != paths[-1]:
            paths.append(peer.path)
            say("PATH", peer.path)
        await asyncio.sleep(0.02)
    for _ in range(200):                   # the last echoes are on their way
        if echoed >= sent:
            break
        await asyncio.sleep(0.05)
    reading.cancel()
    writer.close()
    say("RESULT", json.dumps({"joined": True, "sent": sent, "echoed": echoed, "out_of_order": bad[:5],
                              "paths": paths, "moves": peer.session.moves if peer.session else None}))
    await th.close()
    say("CLOSED")
    return 0


async def join(a) -> int:
    from engine.wire.identity import load_or_create_identity
    from engine.wire.invite import parse
    from engine.wire.tunnel import Joiner, TunnelError

    async def echo(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    folder = Path(a.folder)
    folder.mkdir(parents=True, exist_ok=True)
    joiner = Joiner(parse(a.code), load_or_create_identity(folder), ("127.0.0.1", srv.sockets[0].getsockname()[1]),
                    name="friend", on_event=lambda t: say("EVENT", t),
                    reply_listen=a.reply_listen or None, on_reply=lambda code: say("REPLY", code))
    say("START")              # imports done: the join itself starts now
    try:
        session = await joiner.connect()
    except TunnelError as exc:
        say("FAILED", exc)
        return 1
    say("JOINED", session.path)
    if a.hop_stream:
        asyncio.ensure_future(stream_through_hop(joiner, a.hop_stream))
    try:
        await joiner.run()
    except TunnelError as exc:
        say("ENDED", exc)
    return 0


async def stream_through_hop(joiner, seconds: float) -> None:
    """Once the host introduced this joiner to the next friend (a hop it dials), stream
    numbered lines through it to that friend's echo for `seconds`: `HOPRESULT <json>`."""
    for _ in range(600):
        session = joiner.session
        friends = session.friends if session is not None else None
        dialed = [i for i in (friends.intros.values() if friends else ()) if i.listener is not None]
        # or, where the two found no direct path, the host's hop (a LISTEN port: via the host)
        listeners = list(session._hop_listeners.values()) if session is not None else []
        if dialed or listeners:
            break
        await asyncio.sleep(0.1)
    else:
        say("HOPRESULT", json.dumps({"hop": False}))
        return
    server = dialed[0].listener if dialed else listeners[0]
    path = dialed[0].sessions[0].path if dialed else "via the host"
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    sent = echoed = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        writer.write(f"{sent} {MARKER}\n".encode())
        await writer.drain()
        sent += 1
        line = await asyncio.wait_for(reader.readline(), 10)
        echoed += int(line.split()[0]) == sent - 1
        await asyncio.sleep(0.02)
    writer.close()
    say("HOPRESULT", json.dumps({"hop": True, "sent": sent, "echoed": echoed, "path": path}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("host")
    h.add_argument("--folder", required=True)
    h.add_argument("--relay", default="")
    h.add_argument("--no-upnp", action="store_true")
    h.add_argument("--seconds", type=float, default=3.0)
    h.add_argument("--wait", type=float, default=60.0)
    h.add_argument("--reply-stdin", action="store_true", help="take reply codes from stdin")
    h.add_argument("--hop", action="store_true", help="wait for two joiners and introduce the first to the second")
    h.add_argument("--bulk", type=float, default=0.0,
                   help="MB through the joiner's echo once the path is direct (goodput): `BULK <json>`")
    j = sub.add_parser("join")
    j.add_argument("--folder", required=True)
    j.add_argument("--code", required=True)
    j.add_argument("--reply-listen", default="", help="HOST:PORT: offer a reply code when the host is unreachable")
    j.add_argument("--hop-stream", type=float, default=0.0,
                   help="seconds of lines through a hop the host sets up from this joiner (friend_hop.py)")
    a = p.parse_args(argv)
    return asyncio.run(host(a) if a.cmd == "host" else join(a))


if __name__ == "__main__":
    sys.exit(main())
