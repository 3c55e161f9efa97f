"""Pipelines across homes, in one place for the CLI (`potluck host | join`) and the
node (the tray's Host and Join dialogs): inviting friends and routing the pipeline
through their tunnels, and joining a friend's pipeline with a code.

The host's side:

    friends = Friends(on_event=print)
    await friends.open(relay="ws://relay:8765", listen="0.0.0.0:7870")
    code = friends.invite(ttl_s=3600, uses=2)
    peers = await friends.wait(2)              # in pipeline order
    cfg = await friends.route(peers, cfg)      # their stages, hops between them, the pipeline id
    pipe = await launch(cfg)
    ...
    await friends.close()

The joiner's side:

    invite = await redeem(code, relay)         # a full code, or a short one through the relay
    joined = await join_stage(invite, on_event=print)   # a stage on loopback, reached only
    ...                                                  # through the encrypted tunnel
    await joined.close("leaving")

Tunnels, invites and short codes themselves live in engine/wire/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import re
from dataclasses import dataclass

from engine.boot.join_link import LinkError, is_link, parse_link
from engine.pipeline.launch import PipelineConfig
from engine.pipeline.stage_server import StageServer
from engine.wire import shortcode
from engine.wire.identity import config_dir, load_or_create_identity
from engine.wire.invite import HostState, Invite, InviteError, parse
from engine.wire.stage_auth import tunnel_stage_secret
from engine.wire.tunnel_host import Peer, TunnelHost
from engine.wire.tunnel_join import Joiner, default_name
from engine.wire.tunnel_session import HostRefused, TunnelError


class HomeError(Exception):
    """Something the person at the keyboard can fix (a code, an address), said plainly."""


class Friends:
    """The host's open door: tunnels to friends (direct and/or through a relay), the
    invite codes that let them in, and the friends who came."""

    def __init__(self, config: str | None = None, on_event=None):
        self.folder = config_dir(config)
        self.me = load_or_create_identity(self.folder)
        self.state = HostState(self.folder)
        self.tunnels = TunnelHost(self.me, self.state, on_event=on_event)
        # (src's tunnel session, dst's port) -> address; keyed on the session object itself,
        # so a reconnected friend (a new session) gets a new hop
        self._hops: dict[object, tuple[object, str]] = {}   # A's session -> (B's session, the hop address)
        self._follow: asyncio.Task | None = None

    @property
    def pipeline_id(self) -> str:
        return self.state.pipeline.hex()

    async def open(self, relay: str = "", listen: str = "", advertise: list[str] | None = None) -> int | None:
        """Start accepting friends; returns the direct port bound (None: relay only)."""
        if not relay and not listen:
            raise HomeError("give a relay address (--relay ws://...) and/or a listen address (--listen HOST:PORT) "
                            "so friends can reach you")
        bound = None
        if listen:
            host, _, port = listen.rpartition(":")
            try:
                port_n = int(port or 0)
            except ValueError:
                raise HomeError(f"cannot read listen address {listen!r}: use HOST:PORT, e.g. 0.0.0.0:7870") from None
            try:
                bound = await self.tunnels.listen(host or "0.0.0.0", port_n, advertise=advertise or None)
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)):
                    raise HomeError(f"cannot accept friends on {listen}: {exc.strerror or exc}") from None
                where = "this computer" if host in ("", "0.0.0.0", "::") else host
                raise HomeError(f"port {port_n} is already in use on {where} (another Potluck, "
                                f"or another program): stop it, or accept friends on another port") from None
        if relay:
            await self.tunnels.use_relay(relay)
        self.state.set_routes(self.tunnels.relay_url, self.tunnels.direct_addresses, self.tunnels.direct_kinds)
        return bound

    @property
    def direct_addresses(self) -> list[str]:
        return self.tunnels.direct_addresses

    def invite(self, ttl_s: float = 24 * 3600, uses: int = 1) -> str:
        return self.tunnels.invite(ttl_s=ttl_s, uses=uses)

    def withdraw(self, code: str) -> None:
        """The invite in `code` revoked: no one joins with it again (it would have worked
        for its day, with whatever gate this host opens next)."""
        from engine.wire.invite import parse

        self.state.revoke(parse(code).invite_id.hex())

    async def wait(self, n: int, on_arrival=None) -> list[Peer]:
        """The next n friends to join, in the order they came (= pipeline order)."""
        peers: list[Peer] = []
        while len(peers) < n:
            if on_arrival is not None:
                on_arrival(peers)
            peers.append(await self.tunnels.wait_peer())
        return peers

    @staticmethod
    def gone(peers: list[Peer]) -> list[Peer]:
        """Those of `peers` whose tunnel is closed now (they left, or their computer slept)."""
        return [p for p in peers if p.session is None or p.session.closed.is_set()]

    async def launch_over(self, peers: list[Peer], start, say, wait_s: float):
        """start() (the pipeline's launch over these friends' stages), again where it failed
        because a friend left while it loaded (switched sharing off, their computer went to
        sleep): once they are back, within wait_s. A friend who leaves a running pipeline is
        its failover's; one who left before it formed ended the hosting, everyone else's
        wait and load with it."""
        while True:
            try:
                return await start()
            except Exception:
                gone = self.gone(peers)
                if not gone:
                    raise
                names = ", ".join(p.name or p.node_id for p in gone)
                say(f"{names} left while the model loaded: waiting up to {wait_s:.0f} s for them to come back")
                deadline = asyncio.get_running_loop().time() + wait_s
                while self.gone(peers):
                    if asyncio.get_running_loop().time() > deadline:
                        raise HomeError(f"{names} left while the model loaded and did not come back within "
                                        f"{wait_s:.0f} s: host again when they can stay") from None
                    await asyncio.sleep(0.25)
                say(f"{names} came back: loading again")

    async def route(self, peers: list[Peer], cfg: PipelineConfig) -> PipelineConfig:
        """The pipeline over these friends' stages: the head reaches each through its
        tunnel, and each stage its next one (two other homes) through both tunnels, via
        this host (hop)."""
        return dataclasses.replace(cfg, stage_addr=[p.control_address for p in peers], hop=self.hop,
                                   pipeline=self.pipeline_id)

    async def hop(self, src: str, dst: str) -> str:
        """How the stage at address `src` (a friend's, as the head reaches it) reaches the
        one at `dst`: a loopback port on src's machine whose connections go straight to
        dst's home (engine/wire/friend_hop.py) or, where the two find no direct path,
        through both tunnels via this host. The head asks at every arrangement (after a
        friend leaves, neighbours change); a hop lasts as long as both friends' sessions."""
        peers = {p.address: p for p in self.tunnels.peers.values()}
        a, b = peers.get(src), peers.get(dst)
        if a is None or b is None:
            return dst  # not a friend behind a tunnel: reached as the head reaches it
        # a stage has one next hop at a time (opening one ends the one before), and a
        # direct hop lasts as long as both friends' sessions: the hop is asked again when
        # either changed (a friend came back) or the next stage is another one
        held = self._hops.get(a.session)
        if held is None or held[0] is not b.session:
            self._hops[a.session] = (b.session, await self.tunnels.open_hop(a, b))
        return self._hops[a.session][1]

    def follow(self, head) -> None:
        """From now on, friends who join (with a code still valid) offer their stage to
        this head, which takes it in (engine/pipeline/head.py: offer). Friends who were in
        the pipeline and come back have the same address here: the head asks it for a while
        by itself (core/recovery.py REJOIN_GRACE_S), and their tunnel opening again offers
        it too, however long they were away (a laptop asleep overnight)."""
        async def offer_arrivals():
            while True:
                peer = await self.tunnels.wait_peer()
                head.offer(peer.control_address)

        if self._follow is not None:
            self._follow.cancel()
        self._follow = asyncio.ensure_future(offer_arrivals())
        self.tunnels.on_back = lambda peer: head.offer(peer.control_address)

    async def close(self):
        if self._follow is not None:
            self._follow.cancel()
        self.tunnels.on_back = None
        await self.tunnels.close()


class FriendNames(logging.Filter):
    """`potluck host`'s log lines name a friend's stage by the friend's name ("friend1 is
    back: …"), not by the loopback port its tunnel arrives on ("ws://127.0.0.1:45157 is
    back"), which the person reading cannot tell apart."""

    def __init__(self, friends: "Friends"):
        super().__init__()
        self.friends = friends

    def filter(self, record: logging.LogRecord) -> bool:
        names = {p.address: p.name for p in self.friends.tunnels.peers.values() if p.name and p.port}
        if names:
            text = record.getMessage()
            named = text
            for address, name in names.items():
                named = re.sub(re.escape(address) + r"(?!\d)", name, named)
            if named != text:
                record.msg, record.args = named, None
        return True


async def redeem(code: str, relay: str = "") -> Invite:
    """An invite from a full code, or from a short code handed over through the relay;
    either may come as the potluck://join/ link the host's app shares, pasted whole."""
    if is_link(code):
        try:
            link = parse_link(code)
        except LinkError as exc:
            raise HomeError(f"that invite link cannot be used: {exc}") from None
        code, relay = link.code, relay or link.relay or ""
    if shortcode.is_short(code):
        if not relay:
            raise HomeError("a short code needs the host's relay address too (--relay ws://..., as the host "
                            "printed it)")
        try:
            code = await shortcode.redeem(relay, code)
        except shortcode.ShortCodeError as exc:
            raise HomeError(str(exc)) from None
    try:
        invite = parse(code)
        invite.check_fresh()
    except InviteError as exc:
        raise HomeError(f"that invite code cannot be used: {exc}") from None
    return invite


@dataclass
class Joined:
    """This machine's stage in a friend's pipeline, and the tunnel that reaches it."""
    server: StageServer
    joiner: Joiner

    async def close(self, why: str = "leaving"):
        if self.joiner.session is not None:
            try:
                await self.joiner.session.close(why[:120])
            except Exception:  # the tunnel may be gone already
                pass
        await self.joiner.close()
        await self.server.close()


async def join_stage(invite: Invite, *, joiner: Joiner | None = None, name: str | None = None,
                     prefer: str = "auto", device: str = "auto", threads: int | None = None,
                     memory_cap: int | None = None, config: str | None = None, on_event=None,
                     accept_models=(), reply_listen: str | None = None, on_reply=None,
                     member: bool = False) -> Joined:
    """A stage server on loopback, connected to the host through the invite's tunnel.
    Pass the joiner of an earlier session to rejoin as a member (after a pause), or
    member=True for a machine the host admitted before (its key is the host's member:
    Potluck started again, its invite may have expired since)."""
    me = joiner.identity if joiner is not None else load_or_create_identity(config_dir(config))
    # behind the tunnel: on loopback, but the head is a friend's (models by name only), and
    # only the host's head may drive it: other friends' streams reach this port too
    server = await StageServer("127.0.0.1", 0, pipeline=invite.pipeline_id, device=device, trusted_head=False,
                               secret=tunnel_stage_secret(me.private, invite.host_key, invite.pipeline_id),
                               accept_models=accept_models, threads=threads, memory_cap=memory_cap,
                               on_event=on_event).start()
    if joiner is None:
        joiner = Joiner(invite, me, ("127.0.0.1", server.port), name=name or default_name(),
                        prefer=prefer, on_event=on_event, reply_listen=reply_listen, on_reply=on_reply)
        joiner.member = member
    else:
        joiner.target = ("127.0.0.1", server.port)   # a new stage server behind the same membership
    joiner.about = server.about   # the host shows each friend's device and memory as they join
    try:
        await joiner.connect()
    except (TunnelError, OSError) as exc:
        await joiner.close()
        await server.close()
        # a refusal came from the host, which was reached: said as it is ("the host refused:
        # this invite is used up"), not as "could not reach"
        raise HomeError(str(exc) if isinstance(exc, HostRefused) else f"could not reach the host's pipeline: {exc}") \
            from None
    except asyncio.CancelledError:      # given up while waiting (on a reply code, say)
        await joiner.close()
        await server.close()
        raise
    return Joined(server, joiner)
