"""The joiner's side of the tunnels: open_session reaches the host and authenticates, and Joiner
keeps this machine's stage connected (reconnecting, seeking a direct path, or a reply code).

default_name: what a joiner calls itself to the host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

from websockets.exceptions import ConnectionClosed

from engine.wire.friend_hop import FriendHops
from engine.wire.identity import Identity
from engine.wire.invite import Invite, Reply, encode_reply, rendezvous_key, udp_addresses
from engine.wire.noise import Initiator, NoiseError
from engine.wire.punch import punch_key
from engine.wire.tunnel_routes import (RELAY_AFTER_S, STAGGER_S, _first_to_connect, direct_routes, open_timeouts,
                                       punch_direct, resume_direct)
from engine.wire.tunnel_session import (BYE, CONFIRM, DEAD_AFTER, HANDSHAKE_TIMEOUT, HOST_STOPPED, MODE_JOIN,
                                        MODE_MEMBER, READY, WS_OPTIONS, HostRefused, Session, TunnelError,
                                        _hello_prefix)
from engine.wire.ws_server import serve

log = logging.getLogger("potluck.tunnel")

DIRECT_RETRY_S = 30.0
# port prediction with no relay (_punch_loop), while the host has not taken our reply code
# yet: the symmetric side keeps its 256 mappings open with a packet each this often, and
# the other side sprays a burst of probes for BURST_S every BURST_S + BURST_REST_S
KEEP_OPEN_S = 5.0
BURST_S = 2.0
BURST_REST_S = 6.0
# a member whose tunnel closed retries the host's addresses this long before it offers a
# reply code (the host's address may have changed for good)
REPLY_AFTER_S = 120.0
REPLY_QUEUE = 8                  # connections to a joiner's reply listener waiting their turn
# a first join waits this long for the host to take its reply code: the host's addresses
# failing may also mean nobody hosts there now (an invite withdrawn, Potluck closed), and
# then a wait without end left sharing on, waiting, with nothing said
REPLY_WAIT_S = 900.0


async def open_session(invite: Invite, identity: Identity, target: tuple[str, int], *, name: str = "",
                       member: bool = False, prefer: str = "auto", log_event=None,
                       about: dict | None = None) -> Session:
    """Reach the host (its direct addresses first, raced, then the relay), authenticate,
    and return a started Session whose streams lead to `target` (our stage server).
    prefer: "auto", "direct" or "relay". about: what this computer gives (its device's name,
    the memory it shares), for the host to show as it joins. Raises TunnelError with the reasons."""
    say = log_event or (lambda text: log.info(text))
    direct = direct_routes(invite)
    relay = ([("relay", f"{invite.relay.rstrip('/')}/v1/join/{invite.pipeline.hex()}/{invite.host_key.hex()}")]
             if prefer in ("auto", "relay") and invite.relay else [])
    if prefer == "relay":
        direct = []
    if not direct and not relay:
        raise TunnelError(f"the code offers no {prefer} route")
    errors: list[str] = []
    refused: HostRefused | None = None
    # one race: the relay joins it RELAY_AFTER_S after the direct addresses started (or at
    # once when they have all failed), so another home's private address, which may hang
    # until its connect times out, holds a join up by that long at most; a relayed tunnel
    # then looks for a direct path at once (Joiner._seek_direct)
    routes = direct + relay
    delays = [i * STAGGER_S for i in range(len(direct))] + \
        [max(len(direct) * STAGGER_S, RELAY_AFTER_S) if direct else 0.0 for _ in relay]
    while routes:
        path, url, ws = await _first_to_connect(routes, errors, say, delays, open_timeouts(routes))
        if ws is None:
            break
        delays = [d for r, d in zip(routes, delays) if r[1] != url]
        routes = [r for r in routes if r[1] != url]      # the rest, should this one fail
        try:
            session = await _client_handshake(ws, invite, identity, target, name, member, path, about)
            if path == "relay" and direct:
                say(f"no direct route to the host answered within {delays[-1]:g} s "
                    f"({', '.join(u for _, u in direct)}): joined through the relay; looking for a direct path")
            return session
        except (TunnelError, ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
            await ws.close()
            reason = getattr(exc, "rcvd", None)
            reason = reason.reason if reason is not None and reason.reason else (str(exc) or type(exc).__name__)
            errors.append(f"{path} {url}: {reason}")
            say(f"{path} route {url} failed ({reason})")
            if isinstance(exc, HostRefused):
                refused = exc       # said by whoever answered there: try the others too
    if refused is not None:
        raise HostRefused(f"{refused}" + (f" (also: {'; '.join(errors)})" if len(errors) > 1 else ""))
    hint = ("" if invite.relay or prefer == "relay" else
            ". No direct path reaches the host, and this code names no relay: the host can turn on UPnP "
            "on their router (`potluck doctor` checks it), forward the port to their computer, or host "
            "with a relay (--relay)")
    if errors and all(_refused(e) for e in errors):
        # something answered and nothing listens on the port: most often Potluck is not
        # running there, though a router that resets an unforwarded port answers the same
        hint = (". Something at the host's address turned the connection away: most likely Potluck is "
                "not hosting there now: ask them to start it (`potluck host`, or Host a model… in the "
                "app); if it is hosting, their router may not pass the port on: they can host with a relay "
                "or turn on UPnP")
    raise TunnelError("cannot reach the host: " + "; ".join(errors) + hint)


def _refused(error: str) -> bool:
    """Whether a route's error is a connection refused (Linux, macOS, Windows)."""
    return any(m in error for m in ("Errno 111]", "Errno 61]", "Errno 10061]", "onnection refused"))


async def _client_handshake(ws, invite: Invite, identity: Identity, target, name, member, path,
                            about: dict | None = None) -> Session:
    mode = MODE_MEMBER if member else MODE_JOIN
    prologue = _hello_prefix(mode, invite.pipeline, b"\x00" * 8 if member else invite.invite_id)
    ini = Initiator(identity.private, invite.host_key, prologue, psk=None if member else invite.psk())
    said = {"name": name[:64], "t": int(time.time())}
    if about:
        said["about"] = about
    if path.startswith("direct ("):
        said["kind"] = path[len("direct ("):-1]
    await ws.send(prologue + ini.write_1(json.dumps(said).encode()))
    answer = await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT * 2)
    if not isinstance(answer, (bytes, bytearray)) or not answer:
        raise TunnelError("the host answered something that is not a handshake")
    if answer[0] == 0:
        raise HostRefused(f"the host refused: {bytes(answer[1:]).decode(errors='replace')[:500]}")
    try:
        ini.read_2(answer[1:])
    except NoiseError as exc:
        raise TunnelError(str(exc)) from None
    send_key, recv_key = ini.keys()
    session = Session(ws, send_key, recv_key, role="joiner", peer_key=invite.host_key, path=path,
                      target=target, name=name)
    # the host may introduce this stage to another friend's (friend_hop.py), for as long
    # as this session lasts
    session.friends = FriendHops(identity, invite.pipeline, target, session)
    session.on_intro = session.friends.on_intro
    await session.send(CONFIRM)
    try:
        kind, _, payload = await session.recv_inner(HANDSHAKE_TIMEOUT * 2)
    except NoiseError as exc:
        raise TunnelError(str(exc)) from None
    if kind == BYE:
        raise HostRefused(f"the host refused: {payload.decode(errors='replace')[:500]}")
    if kind != READY:
        raise TunnelError("the host did not confirm the session")
    return session.start()


class Joiner:
    """Keeps this machine's stage connected to the host: the first session joins with
    the invite; after a drop it reconnects as a member (its key is allowlisted)."""

    def __init__(self, invite: Invite, identity: Identity, target: tuple[str, int], name: str = "",
                 prefer: str = "auto", on_event=None, direct_retry_s: float | None = None,
                 reply_listen: str | None = None, on_reply=None, about=None):
        self.invite, self.identity, self.target, self.name, self.prefer = invite, identity, target, name, prefer
        # () -> {"device": ..., "memory": ...}: read at each connection (the free memory moves)
        self.about = about or (lambda: None)
        # while relayed, how often the direct addresses are tried again (a router's mapping
        # may come late, a firewall may open): the session then moves there mid-stream
        self.direct_retry_s = float(os.environ.get("POTLUCK_DIRECT_RETRY_S", DIRECT_RETRY_S)) \
            if direct_retry_s is None else direct_retry_s
        # how long a first join waits on its reply code (a friend slow to paste it may want longer)
        try:
            self.reply_wait_s = float(os.environ.get("POTLUCK_REPLY_WAIT_S", REPLY_WAIT_S))
        except ValueError:
            self.reply_wait_s = REPLY_WAIT_S
        self.on_event = on_event or (lambda text: log.info(text))
        self.session: Session | None = None
        self.member = False
        # when nothing in the invite reaches the host: listen on this HOST:PORT, show a reply
        # code (on_reply(code)) and wait for the host to connect (None: fail instead)
        self.reply_listen, self.on_reply = reply_listen, on_reply
        self.reply_code: str | None = None
        self.joined_by_reply = False   # the host connected to us: its reconnects come the same way
        self._down_since = 0.0         # when the tunnel last closed (monotonic)
        # reconnecting: each route's failure goes to the log, not to the person (a joiner
        # waiting for its host repeated "route … unreachable ([Errno 111] …)" every 30 s)
        self._quiet_routes = False
        self._incoming: asyncio.Queue | None = None
        self._reply_server = None
        self._mapper = None
        self._udp = None               # with no relay: the socket we punch toward the host from
        self._punch_task: asyncio.Task | None = None
        # while relayed, punch a direct UDP path (POTLUCK_PUNCH=0: never)
        self.punch = os.environ.get("POTLUCK_PUNCH", "1") != "0"

    GIVE_UP_AFTER = 5      # refusals in a row (a revoked member, a used-up code) before giving up

    async def connect(self) -> Session:
        # with no relay in the code, a reply code is the way in wherever the host's
        # addresses fail: gather our own candidates for it while those are tried, so the
        # code is there the moment they have failed
        early = None
        if self.reply_listen is not None and self._reply_server is None and self.prefer != "relay" \
                and not self.invite.relay:
            early = asyncio.ensure_future(self._prepare_reply())
        try:
            self.session = await self._open()
        except TunnelError as exc:
            # a member that reached the host itself and lost the tunnel (its own line down, the
            # host's lid shut) tries again quietly: a reply code now would send a friend to do
            # what the next retry does by itself
            if self.reply_listen is None or isinstance(exc, HostRefused) or self.prefer == "relay" \
                    or (self.member and not self.joined_by_reply
                        and time.monotonic() - self._down_since < REPLY_AFTER_S):
                await self._drop_early(early)
                raise
            self.session = await self._by_reply(str(exc), early)
        else:
            await self._drop_early(early)
        self.member = True
        self.on_event(f"connected to the host via {self.session.path}")
        return self.session

    async def run(self):
        """Reconnects until the host refuses us (revoked) or is gone for good."""
        if self.session is None:
            await self.connect()
        delay = 1.0
        while True:
            seeker = asyncio.ensure_future(self._seek_direct(self.session))
            try:
                await self.session.closed.wait()
            finally:
                seeker.cancel()
            host_stopped = HOST_STOPPED in self.session.close_reason
            self.on_event("the host stopped Potluck: this computer waits for it to come back, its layers "
                          "kept loaded" if host_stopped else f"tunnel closed: {self.session.close_reason}")
            self._down_since = time.monotonic()
            if "revoked" in self.session.close_reason:
                raise TunnelError(self.session.close_reason)
            refusals = failures = 0
            self._quiet_routes = True
            try:
                while True:
                    await asyncio.sleep(delay)
                    try:
                        await self.connect()
                        delay = 1.0
                        break
                    except TunnelError as exc:
                        refusals = refusals + 1 if isinstance(exc, HostRefused) else 0
                        failures += 1
                        if refusals >= self.GIVE_UP_AFTER:
                            raise
                        if host_stopped or failures > 1:
                            # expected until it is back (no advice about routers), or said once
                            log.info("the host is not back yet: %s", exc)
                        else:
                            self.on_event(f"reconnect failed: {exc}; trying again by itself")
                        delay = min(delay * 2, 30.0)
            finally:
                self._quiet_routes = False


    async def _open(self) -> Session:
        say = (lambda text: log.info("%s", text)) if self._quiet_routes else self.on_event
        return await open_session(self.invite, self.identity, self.target, name=self.name,
                                  member=self.member, prefer=self.prefer, log_event=say,
                                  about=self.about())

    async def _drop_early(self, early) -> None:
        """The host answered after all: no reply code needed, stop listening for one."""
        if early is None:
            return
        early.cancel()
        try:
            await early
        except BaseException:   # noqa: BLE001 -- cancelled or failed: either way unused
            pass
        await self.close()

    async def _by_reply(self, why: str, early=None) -> Session:
        """Listen, gather this machine's candidates (its router's mapping among them), show
        a reply code, and take the host's connection when it comes -- or the invite's own
        routes, tried again meanwhile, when one of those answers first (a relay back up).
        early: the listening and gathering, started while the host's addresses were tried."""
        if early is not None or self._reply_server is None:    # (a reconnect's code is out already)
            try:
                await (early if early is not None else self._prepare_reply())
                self._announce_reply()
            except TunnelError as exc:
                await self.close()          # set up again on the next try
                raise TunnelError(f"{why}; {exc}") from None
            except BaseException:
                await self.close()
                raise
        waiting = asyncio.ensure_future(self._next_reply_session())
        give_up = None if self.member else time.monotonic() + self.reply_wait_s
        try:
            while True:
                if give_up is not None and time.monotonic() >= give_up:
                    minutes = max(1, round(self.reply_wait_s / 60))
                    raise TunnelError(f"your friend did not connect with this computer's reply code within "
                                      f"{minutes} minutes, so joining stopped. Check with them that "
                                      "they are hosting now (an invite they withdrew no longer works), then join "
                                      "again")
                try:
                    left = self.direct_retry_s if give_up is None else \
                        max(0.0, min(self.direct_retry_s, give_up - time.monotonic()))
                    session = await asyncio.wait_for(asyncio.shield(waiting), left)
                    self.joined_by_reply = True
                    return session
                except asyncio.TimeoutError:
                    pass
                try:
                    session = await self._open()
                except HostRefused:
                    raise
                except TunnelError:
                    continue
                if not self.joined_by_reply:
                    await self.close()      # the host answered after all: no reply code needed
                return session
        finally:
            waiting.cancel()

    async def _prepare_reply(self):
        """Listen for the host, map the port on the router, gather our candidates and make
        the reply code (TunnelError when this computer has nothing the host could reach)."""
        from engine.wire import candidates as cand, stage_auth

        self._incoming = asyncio.Queue()

        async def handler(ws):
            # anyone may connect here (the address is in a code): a few wait their
            # turn, more are turned away, so a flood costs bounded memory; and none
            # while this joiner is connected another way
            if self._incoming.qsize() >= REPLY_QUEUE or (self.session is not None
                                                         and not self.session.closed.is_set()):
                await ws.close(1013, "busy")
                return
            done = asyncio.Event()
            await self._incoming.put((ws, done, "direct (reply)"))
            await done.wait()          # the connection lives as long as its session

        host, _, port = self.reply_listen.rpartition(":")
        try:
            self._reply_server = await serve(handler, host or "0.0.0.0", int(port or 0), **WS_OPTIONS)
        except OSError as exc:
            raise TunnelError(f"a reply code needs this computer to listen on {self.reply_listen}, which "
                              f"failed ({exc.strerror or exc}): give another with --reply-listen") from None
        bound = self._reply_server.sockets[0].getsockname()[1]
        # as the host's --listen (tunnel_host.listen): a listener on one address offers that
        # address, and on loopback only that (its LAN address would answer nothing)
        wildcard = host in ("0.0.0.0", "::", "")
        given = [] if wildcard else [cand.Candidate("given", cand.url_for(host, bound))]
        if given and stage_auth.is_loopback(host):
            found, udp = given, []
        else:
            self._mapper = cand.PortMapper()
            g, udp = await asyncio.gather(
                cand.gather(bound, upnp=os.environ.get("POTLUCK_UPNP", "1") != "0", mapper=self._mapper,
                            addresses=None if wildcard else []),
                self._punch_toward_host())
            found = given + g.candidates
        if not found and not udp:
            raise TunnelError("this computer has no address the host could reach either")
        cands = (found + udp)[:16]
        self._reply_kinds = [c.kind for c in found]
        self.reply_code = encode_reply(Reply(self.invite.pipeline, self.invite.invite_id,
                                             [c.url for c in cands], [c.kind for c in cands]))

    def _announce_reply(self):
        self.on_event("the host cannot be reached from here; it can reach this computer instead: "
                      f"send the host this reply code ({', '.join(self._reply_kinds)})")
        if self.on_reply is not None:
            self.on_reply(self.reply_code)

    async def _punch_toward_host(self) -> list:
        """With the host's punching address in the invite (kind "udp"): a socket of ours, its
        public address for the reply code, and punching toward the host from it, a round a
        second, until the host (given our code) punches back; then QUIC, and the join's
        handshake over it (_next_reply_session)."""
        from engine.wire import candidates as cand, stun

        targets = udp_addresses(self.invite.direct, self.invite.kinds)
        servers = stun.servers_from_env()
        if not targets or not servers or not self.punch:
            return []
        try:
            from engine.wire.punch import UdpEndpoint

            self._udp = await UdpEndpoint.open(exclusive=False)
        except (ImportError, OSError):
            return []
        await self._udp.candidates(servers)
        if not self._udp.mapped:
            return []
        self._punch_task = asyncio.ensure_future(self._punch_loop(targets))
        return [cand.Candidate("udp", f"udp://{a}:{p}") for a, p in self._udp.mapped[:2]]

    async def _punch_loop(self, targets):
        """Punch toward the host's rendezvous address until the host, given our reply code,
        punches back; with a symmetric NAT on one side, by port prediction (punch.py): our
        side symmetric, 256 mappings kept open toward the host until it sprays them; the
        host's side symmetric, a burst of probes at its public address every few seconds,
        each meeting the mappings it opens once it has our code."""
        from engine.wire.punch import PunchError, predict_roles, symmetric_pair

        key = punch_key(rendezvous_key(self.invite.psk()))
        try:
            role = predict_roles(self._udp.symmetric, symmetric_pair(targets))
        except PunchError as exc:
            self.on_event(f"no punched path to the host ({exc})")
            return
        while True:
            ep = self._udp
            try:
                if role is None:
                    peer = await ep.punch(key, targets, None, interval=1.0)
                elif role == "hard":
                    ep, peer = await ep.punch_predicting(key, targets, "hard", timeout=None, interval=KEEP_OPEN_S)
                else:
                    ep, peer = await ep.punch_predicting(key, targets, "easy", timeout=BURST_S)
                channel = await ep.quic_connect(peer)
            except (PunchError, OSError) as exc:
                if role != "easy":
                    self.on_event(f"no punched path to the host ({exc})")
                await asyncio.sleep(1.0 if role != "easy" else BURST_REST_S)
                continue
            done = asyncio.Event()
            await self._incoming.put((channel, done, "direct (punched)"))
            await done.wait()
            await channel.close()

    async def _next_reply_session(self) -> Session:
        while True:
            ws, done, path = await self._incoming.get()
            try:
                session = await _client_handshake(ws, self.invite, self.identity, self.target, self.name,
                                                  self.member, path, self.about())
            except (TunnelError, ConnectionClosed, OSError, asyncio.TimeoutError, NoiseError) as exc:
                # even a refusal: whoever connected here need not be the host (a refusal
                # is not authenticated), and the host redials; so wait for the next one
                self.on_event(f"a connection to the reply address failed ({exc or type(exc).__name__})")
                done.set()
                continue
            except asyncio.CancelledError:      # connected another way meanwhile
                done.set()
                raise
            asyncio.ensure_future(_release_when_closed(session, done))
            return session

    async def close(self):
        """Stop listening for the host (a reply code's listener) and remove its mapping."""
        if self._reply_server is not None:
            self._reply_server.close()
            self._reply_server = None
        self.reply_code = None
        if self._mapper is not None:
            await self._mapper.close()
            self._mapper = None
        if self._punch_task is not None:
            self._punch_task.cancel()
            self._punch_task = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None

    async def _seek_direct(self, session: Session):
        """While relayed: the invite's direct addresses again (a mapping may come late, a
        firewall open), then hole punching; the first try of punching right away."""
        first = True
        while session.path == "relay" and self.prefer != "relay":
            if not first:
                try:
                    await asyncio.wait_for(session.closed.wait(), self.direct_retry_s)
                    return
                except asyncio.TimeoutError:
                    pass
            moved = (not first and direct_routes(self.invite) and await resume_direct(session, self.invite, self.on_event)) \
                or (self.punch and await punch_direct(session, self.invite, self.on_event))
            first = False
            if moved:
                try:      # the host's MOVE ends the old channel (behind what it still carries)
                    await asyncio.wait_for(session.moved.wait(), DEAD_AFTER)
                except asyncio.TimeoutError:
                    await session.close("the host did not finish moving to the direct path")
                    return
                self.on_event(f"moved to {session.path}: no longer relayed")


async def _release_when_closed(session: Session, done: asyncio.Event):
    await session.closed.wait()
    done.set()


def default_name() -> str:
    return os.environ.get("POTLUCK_NAME") or socket.gethostname()[:64]
