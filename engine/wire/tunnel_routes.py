"""Routes to the host: the order a joiner tries an invite's addresses, the race between them,
and a relayed session's move onto a direct path (an address that opened later, or a punched one).

The host dials a joiner's reply code with the same race (TunnelHost._dial).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from engine.wire.relay_auth import relay_refusal
from engine.wire.invite import Invite
from engine.wire.noise import NoiseError
from engine.wire.tunnel_session import (CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, MODE_RESUME, PUNCH_TIMEOUT, WS_OPTIONS,
                                        Session, TunnelError, _hello_prefix)

_KIND_ORDER = {"lan": 0, "given": 1, "mapped": 2, "ipv6": 3, "public": 4}


def direct_routes(invite: Invite) -> list[tuple[str, str]]:
    """(path, url) of the invite's direct addresses, in the order a joiner tries them."""
    return [(f"direct ({k})" if k != "given" else "direct", a)
            for k, a in sorted(zip(invite.kinds, invite.direct), key=lambda ka: _KIND_ORDER.get(ka[0], 9))
            if k != "udp"]


STAGGER_S = 0.25    # happy eyeballs: the next address starts this long after the one before
RELAY_AFTER_S = 1.0  # ... and the relay this long after the first direct address
# a private address on none of our networks (another home's LAN): a LAN answers in
# milliseconds, and waiting the full connect timeout there held a reply code up by 5 s
FOREIGN_LAN_S = 1.0
# a host's public address as STUN saw it: open where the host has no NAT or forwarded the
# port by hand (then it answers within a round trip or two), else its router drops the
# connect silently -- the usual case, which held a reply code up by 5 s more
PUBLIC_S = 1.5


def open_timeouts(routes: list[tuple[str, str]]) -> list[float]:
    """Each route's connect timeout: short for addresses that are usually not open."""
    from engine.wire.candidates import on_our_networks

    return [FOREIGN_LAN_S if path == "direct (lan)" and not on_our_networks(url)
            else PUBLIC_S if path == "direct (public)" else CONNECT_TIMEOUT for path, url in routes]


async def _first_to_connect(routes, errors: list, say, delays: list[float] | None = None,
                            timeouts: list[float] | None = None):
    """Open WebSockets to the routes, each STAGGER_S after the one before (in the order
    given; or route i at delays[i]), and keep the first that opens; the rest are closed.
    An address that cannot work (another home's private address) costs no more than its
    stagger."""
    # attempt i starts STAGGER_S after attempt i-1, or at once when every attempt before it
    # has failed (another home's private address fails at once: no route)
    failed = 0
    turn = [asyncio.Event() for _ in routes]

    async def attempt(i, path, url):
        nonlocal failed
        try:
            await asyncio.wait_for(turn[i].wait(), i * STAGGER_S if delays is None else delays[i])
        except asyncio.TimeoutError:
            pass
        try:
            return path, url, await connect(url, open_timeout=CONNECT_TIMEOUT if timeouts is None else timeouts[i],
                                            **WS_OPTIONS)
        except BaseException:
            failed += 1
            if failed < len(turn):
                turn[failed].set()
            raise

    if turn:
        turn[0].set()
    tasks = [asyncio.ensure_future(attempt(i, p, u)) for i, (p, u) in enumerate(routes)]
    names = {t: (p, u) for t, (p, u) in zip(tasks, routes)}
    winner = None
    try:
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None and winner is None:
                    winner = t.result()
                elif exc is not None:
                    path, url = names[t]
                    why = relay_refusal(exc) if path == "relay" else (str(exc) or type(exc).__name__)
                    errors.append(f"{path} {url}: {why}")
                    say(f"{path} route {url} unreachable ({why})")
                else:
                    await t.result()[2].close()
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            if not t.done() or t.cancelled():
                continue
            if t.exception() is None and (winner is None or t.result() is not winner):
                await t.result()[2].close()
    return winner if winner is not None else (None, None, None)


async def resume_direct(session: Session, invite: Invite, say) -> bool:
    """A relayed session tries the invite's direct addresses; where one opens and the
    host there proves it holds this session (and we prove it to it), the session moves
    onto it mid-stream (Session.move_to). Returns whether it moved."""
    errors: list[str] = []
    routes = direct_routes(invite)
    path, url, ws = await _first_to_connect(routes, errors, lambda text: None, timeouts=open_timeouts(routes))
    if ws is None:
        return False
    return await _prove_and_move(session, invite, ws, path, url, say)


async def punch_direct(session: Session, invite: Invite, say) -> bool:
    """A relayed session punches a UDP path through both home routers (engine/wire/punch.py),
    the candidates exchanged inside the session, and moves onto a QUIC channel there.
    Returns whether it moved."""
    try:
        from engine.wire import punch, stun

        ep = await punch.UdpEndpoint.open()
    except (ImportError, OSError) as exc:
        say(f"no hole punching here ({exc})")
        return False
    try:
        mine = await ep.candidates(stun.servers_from_env())
        theirs, why = await session.offer_punch(mine, HANDSHAKE_TIMEOUT)
        if not theirs:
            raise punch.PunchError(why or "the host has no UDP address to punch at")
        # a symmetric NAT on one side: port prediction (punch.py); the host decides alike
        ep, peer = await ep.punch_either(session.punch_key, theirs, PUNCH_TIMEOUT)
        channel = await ep.quic_connect(peer)
    except (punch.PunchError, OSError, ConnectionClosed, asyncio.TimeoutError) as exc:
        ep.close()
        say(f"no punched path to the host ({exc or type(exc).__name__})")
        return False
    return await _prove_and_move(session, invite, channel, "direct (punched)", f"udp://{peer[0]}:{peer[1]}", say)


async def _prove_and_move(session: Session, invite: Invite, ws, path: str, url: str, say) -> bool:
    """On a fresh channel to the host: prove we hold the session and check that the host
    there does too, then move the session onto it (Session.move_to)."""
    try:
        mine = os.urandom(16)      # so a confirm recorded from an earlier try proves nothing now
        await ws.send(_hello_prefix(MODE_RESUME, invite.pipeline, session.resume_id) + mine)
        challenge = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        if not isinstance(challenge, bytes) or len(challenge) != 17 or challenge[0] != 2:
            said = challenge[1:201] if isinstance(challenge, bytes) else str(challenge)[:200]
            raise TunnelError(f"the host there did not take the session: {said!r}")
        nonce = challenge[1:]
        kind = path[len("direct ("):-1] if path.startswith("direct (") else ""
        await ws.send(hmac.new(session.resume_key, b"joiner" + nonce + mine, hashlib.sha256).digest()
                      + kind.encode()[:8])
        confirm = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT)
        if not (isinstance(confirm, bytes) and len(confirm) == 33 and confirm[0] == 3 and hmac.compare_digest(
                confirm[1:], hmac.new(session.resume_key, b"host" + nonce + mine, hashlib.sha256).digest())):
            raise TunnelError("the answer there is not from the host of this session")
        await session.move_to(ws, path)
        return True
    except (TunnelError, NoiseError, ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
        say(f"{path} {url} opened but the session could not move there ({exc or type(exc).__name__})")
        await ws.close()
        return False
