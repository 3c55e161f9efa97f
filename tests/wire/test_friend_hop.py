"""Friend-to-friend hops (engine/wire/friend_hop.py): three homes, the host introduces
joiner A (stage i) to joiner B (stage i+1) and A's stage reaches B's directly; where no
address of B's answers, through the host as before; nobody but the friend the host
named gets in at B's door, and the host ending the hop (or revoking A) closes it.

Real sockets on this machine (B's door listens on its addresses, A dials them); the
emulated homes behind NAT routers are bench/paths.py's and tests/wire/test_homes.py's.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from websockets.asyncio.client import connect

from engine.wire import invite as inv
from engine.wire import frames, noise
from engine.wire.friend_hop import DIAL_TIMEOUT_S, check_intro, end
from engine.wire.identity import load_or_create_identity
from engine.wire.tunnel import TunnelHost, open_session
from engine.wire.tunnel_session import LISTEN, MODE_FRIEND, WS_OPTIONS, _hello_prefix


@pytest.fixture(autouse=True)
def no_upnp(monkeypatch):
    monkeypatch.setenv("POTLUCK_UPNP", "0")       # no router here: its search would only wait


async def _echo():
    async def echo(r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


class Three:
    """A host and two joiners, A (target: nothing) and B (target: an echo standing for its
    stage server), all on this machine."""

    async def start(self, tmp_path):
        self.echo, echo_port = await _echo()
        self.events: list[str] = []
        (tmp_path / "host").mkdir(parents=True, exist_ok=True)
        state = inv.HostState(tmp_path / "host")
        self.host = TunnelHost(load_or_create_identity(tmp_path / "host"), state, on_event=self.events.append)
        await self.host.listen("127.0.0.1", 0)
        invite = inv.parse(self.host.invite(uses=2))
        self.a = await open_session(invite, load_or_create_identity(tmp_path / "a"), ("127.0.0.1", 9), name="ana")
        self.pa = await asyncio.wait_for(self.host.wait_peer(), 10)
        self.b = await open_session(invite, load_or_create_identity(tmp_path / "b"), ("127.0.0.1", echo_port),
                                    name="ben")
        self.pb = await asyncio.wait_for(self.host.wait_peer(), 10)
        return self

    async def close(self):
        for s in (self.a, self.b):
            await s.close("done")
        await self.host.close()
        self.echo.close()


async def roundtrip(port: int, size: int = 200_000) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    payload = os.urandom(size)
    w.write(payload)
    assert await asyncio.wait_for(r.readexactly(size), 30) == payload
    w.close()


async def test_a_hop_between_two_friends_goes_direct_and_the_host_carries_none_of_it(tmp_path):
    t = await Three().start(tmp_path)
    try:
        addr = await t.host.open_hop(t.pa, t.pb)
        a_in, b_in = t.pa.session.bytes_in, t.pb.session.bytes_in
        await roundtrip(int(addr.rsplit(":", 1)[1]))
        # the 200 KB went A -> B -> A without crossing either friend's tunnel to the host
        assert t.pa.session.bytes_in - a_in < 10_000 and t.pb.session.bytes_in - b_in < 10_000
        (link,) = t.host.hop_links()
        assert link["hop"] == "ana → ben" and link["path"].startswith("direct (") and link["rtt_ms"] >= 0
        assert any("ana → ben: direct" in e for e in t.events)
        # and a second connection on the same hop (a stage reconnecting) works as well
        await roundtrip(int(addr.rsplit(":", 1)[1]), 10_000)
    finally:
        await t.close()


async def test_the_host_shows_a_hop_as_it_goes_now_not_as_its_handshake_found_it(tmp_path, monkeypatch):
    """The friend who dialed a hop reports its tunnel's round trip and goodput every
    HOP_REPORT_S; only that friend speaks for its hop (another's report changes nothing
    and closes nothing)."""
    from engine.wire import friend_hop
    from engine.wire.friend_hop import pack
    from engine.wire.tunnel_session import INTRO

    monkeypatch.setattr(friend_hop, "HOP_REPORT_S", 0.3)
    t = await Three().start(tmp_path)
    try:
        addr = await t.host.open_hop(t.pa, t.pb)
        (link,) = t.host.hop_links()
        assert link["live"] is False and link["mbit_s"] is None     # the handshake's round trip so far
        await roundtrip(int(addr.rsplit(":", 1)[1]))               # traffic the report's goodput counts
        deadline = asyncio.get_running_loop().time() + 10
        while not t.host.hop_links()[0]["live"] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        (link,) = t.host.hop_links()
        assert link["live"] and link["rtt_ms"] is not None and link["rtt_ms"] >= 0
        assert link["mbit_s"] > 0                                   # 400 KB crossed it in the last seconds
        # ben did not dial this hop: his word on it is dropped, his tunnel stays up
        hop = next(iter(t.host.hops))
        await t.b.send(INTRO, 0, pack({"op": "hop_link", "hop": hop, "rtt_ms": 999.0, "mbit_s": 0.0}))
        await asyncio.sleep(0.5)
        assert t.host.hops[hop].rtt_ms != 999.0 and not t.b.closed.is_set()
    finally:
        await t.close()


def unreachable_door(monkeypatch):
    from engine.wire import candidates as cand

    async def unreachable(port, **kw):         # B's door names an address nothing answers at
        return cand.Gathered([cand.Candidate("public", "ws://192.0.2.1:9")])

    monkeypatch.setattr(cand, "gather", unreachable)


async def test_no_address_of_the_next_home_answers_so_the_two_punch_a_hole(tmp_path, monkeypatch):
    """Both friends' UDP sockets (their LAN addresses here; across homes the STUN-mapped
    ones): A's candidates reach B through the host, both punch, QUIC carries the hop."""
    unreachable_door(monkeypatch)
    t = await Three().start(tmp_path)
    try:
        addr = await t.host.open_hop(t.pa, t.pb)
        a_in, b_in = t.pa.session.bytes_in, t.pb.session.bytes_in
        await roundtrip(int(addr.rsplit(":", 1)[1]))
        assert t.pa.session.bytes_in - a_in < 10_000 and t.pb.session.bytes_in - b_in < 10_000
        (link,) = t.host.hop_links()
        assert link["path"] == "direct (punched)"
        # the same two homes again (a friend came back): punched at once, no dialing first
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        addr = await t.host.open_hop(t.pa, t.pb)
        assert loop.time() - t0 < DIAL_TIMEOUT_S, "it waited on the door's addresses again"
        await roundtrip(int(addr.rsplit(":", 1)[1]), 10_000)
        assert t.host.hop_links()[0]["path"] == "direct (punched)"
        assert any("punched at once" in e for e in t.events), t.events
    finally:
        await t.close()


async def test_no_address_answers_and_no_hole_so_the_hop_goes_through_the_host(tmp_path, monkeypatch):
    unreachable_door(monkeypatch)
    monkeypatch.setenv("POTLUCK_PUNCH", "0")
    t = await Three().start(tmp_path)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        addr = await t.host.open_hop(t.pa, t.pb)
        assert loop.time() - t0 < DIAL_TIMEOUT_S + 5
        b_in = t.pb.session.bytes_in
        await roundtrip(int(addr.rsplit(":", 1)[1]))
        assert t.pb.session.bytes_in - b_in > 200_000      # it crossed B's tunnel: via the host
        (link,) = t.host.hop_links()
        assert link["path"] == "via the host" and link["rtt_ms"] is None
        assert any("no direct path" in e and "through this computer" in e for e in t.events)
        assert not t.b.friends.intros                      # B forgot the introduction
        # the same two homes again: through the host at once, not ~DIAL_TIMEOUT_S of trying
        addr = await t.host.open_hop(t.pa, t.pb)
        await roundtrip(int(addr.rsplit(":", 1)[1]), 10_000)
        assert any("as the last time" in e for e in t.events), t.events
    finally:
        await t.close()


async def test_friend_hops_off_keeps_every_hop_through_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_FRIEND_HOPS", "0")
    t = await Three().start(tmp_path)
    try:
        addr = await t.host.open_hop(t.pa, t.pb)
        await roundtrip(int(addr.rsplit(":", 1)[1]), 10_000)
        assert t.host.hop_links()[0]["path"] == "via the host"
    finally:
        await t.close()


async def test_only_the_introduced_friend_gets_in_and_ending_the_hop_closes_it(tmp_path):
    t = await Three().start(tmp_path)
    try:
        addr = await t.host.open_hop(t.pa, t.pb)
        intro = next(iter(t.b.friends.intros.values()))
        door = next(a for a in t.b.friends._door_cands)
        prologue = _hello_prefix(MODE_FRIEND, t.host.pipeline, intro.id)

        async def knock(key, psk, intro_prologue=prologue) -> bytes | None:
            async with connect(door.url, **WS_OPTIONS) as ws:
                ini = noise.Initiator(key, t.b.friends.identity.public, intro_prologue, psk=psk)
                await ws.send(intro_prologue + ini.write_1(b"{}"))
                try:
                    return await asyncio.wait_for(ws.recv(), 10)
                except Exception:   # noqa: BLE001 -- closed on us: refused
                    return None

        stranger = load_or_create_identity(tmp_path / "stranger")
        assert await knock(stranger.private, intro.psk) is None               # right secret, wrong friend
        a_key = load_or_create_identity(tmp_path / "a")
        assert await knock(a_key.private, os.urandom(32)) is None             # right friend, wrong secret
        other = _hello_prefix(MODE_FRIEND, os.urandom(8), intro.id)
        assert await knock(a_key.private, intro.psk, other) is None           # another pipeline
        # the host ends the hop: B closes A's session at its door, A's hop port goes dead
        session = t.b.friends.intros[intro.hop].sessions[0]
        await end(t.pb.session, intro.hop)
        await asyncio.wait_for(session.closed.wait(), 10)
        assert intro.hop not in t.b.friends.intros
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError)):
            await roundtrip(int(addr.rsplit(":", 1)[1]), 1000)
    finally:
        await t.close()


@pytest.mark.parametrize("hops", ["direct", "via the host"])
async def test_a_friend_reaches_the_next_friends_stage_for_data_but_cannot_drive_it(tmp_path, monkeypatch, hops):
    """B's stage listens on loopback behind its tunnel, and A's hop reaches that port (as
    it must: A's stage sends B its activations). A control connection there drives the
    stage -- its model, its shutdown -- so it takes the secret only B and the host can
    compute (stage_auth.tunnel_stage_secret): A with the empty key, or with B's pipeline
    and any guess, is refused; the host's head, with the peer's control_address, is in."""
    from engine.node.homes import join_stage
    from engine.pipeline.stage_protocol import NotAuthorized, connect_stage

    if hops != "direct":
        monkeypatch.setenv("POTLUCK_FRIEND_HOPS", "0")
    (tmp_path / "host").mkdir()
    host = TunnelHost(load_or_create_identity(tmp_path / "host"), inv.HostState(tmp_path / "host"))
    await host.listen("127.0.0.1", 0)
    invite = inv.parse(host.invite(uses=2))
    a = await open_session(invite, load_or_create_identity(tmp_path / "a"), ("127.0.0.1", 9), name="ana")
    pa = await asyncio.wait_for(host.wait_peer(), 10)
    b = await join_stage(invite, name="ben", config=str(tmp_path / "b"), threads=1, device="cpu")
    pb = await asyncio.wait_for(host.wait_peer(), 10)
    try:
        addr = await host.open_hop(pa, pb)      # on A's machine, reaching B's stage
        assert host.hop_links()[0]["path"].startswith("direct" if hops == "direct" else "via")
        with pytest.raises(NotAuthorized):
            await connect_stage(addr, "control", invite.pipeline_id, key="", timeout=10)
        with pytest.raises(NotAuthorized):
            await connect_stage(addr, "control", invite.pipeline_id, key=b.server.pipeline, timeout=10)
        assert b.server.rejected_frames == 2
        head = await connect_stage(pb.control_address, "control", invite.pipeline_id, timeout=10)
        welcome = frames.parse_control(await asyncio.wait_for(head.recv(), 60))
        assert welcome["type"] == "welcome"
        await head.close()
        # the secret is kept apart from what status and logs show
        assert pb.secret and pb.secret not in pb.address and pb.control_address == f"{pb.address}#{pb.secret}"
    finally:
        await b.close()
        await a.close("done")
        await host.close()


async def test_revoking_a_friend_ends_its_hops_at_the_other_friend(tmp_path):
    t = await Three().start(tmp_path)
    try:
        await t.host.open_hop(t.pa, t.pb)
        (hop,) = t.b.friends.intros
        t.host.state.revoke(t.pa.node_id)
        for _ in range(100):
            if hop not in t.b.friends.intros:
                break
            await asyncio.sleep(0.1)
        assert hop not in t.b.friends.intros and not t.host.hop_links()
    finally:
        await t.close()


async def test_a_friends_hop_carries_no_tunnel_control_frames(tmp_path):
    """Inside a hop, A may only open streams to B's stage: a LISTEN (or INTRO, MOVE,
    PUNCH) closes the session."""
    t = await Three().start(tmp_path)
    try:
        await t.host.open_hop(t.pa, t.pb)
        intro = next(iter(t.a.friends.intros.values()))
        a_side = intro.sessions[0]
        b_side = next(iter(t.b.friends.intros.values())).sessions[0]
        await a_side.send(LISTEN, 7)
        await asyncio.wait_for(b_side.closed.wait(), 10)
        assert "does not carry" in b_side.close_reason
    finally:
        await t.close()


@pytest.mark.parametrize("kind, why", [("PUNCH", "malformed PUNCH frame"), ("INTRO", "JSON object")])
async def test_json_nested_thousands_deep_ends_the_session_with_its_reason(tmp_path, kind, why):
    """A PUNCH or INTRO frame of JSON nested 4,000 deep raised RecursionError, which no
    handler caught: the session's reader died and the session hung on, deaf, until its
    keepalive gave up. It is a malformed frame like any other now."""
    from engine.wire import tunnel_session

    t = await Three().start(tmp_path)
    try:
        await t.a.send(getattr(tunnel_session, kind), 0, b"[" * 4000 + b"]" * 4000)   # within INTRO's 8 KB
        await asyncio.wait_for(t.pa.session.closed.wait(), 10)
        assert why in t.pa.session.close_reason
    finally:
        await t.close()


@pytest.mark.parametrize("msg, frm, why", [
    ({"op": "dial", "hop": 1}, "friend", "not for this end"),
    ({"op": "door", "hop": 1, "addresses": ["ws://x"], "kinds": []}, "friend", "malformed addresses"),
    ({"op": "door", "hop": 1, "addresses": ["file:///etc/passwd"], "kinds": ["lan"]}, "friend", "malformed"),
    # a path or query on the other friend's machine, or its home network: a door is ws://host:port
    ({"op": "door", "hop": 1, "addresses": ["ws://192.168.1.1:80/admin/reboot"], "kinds": ["lan"]}, "friend",
     "malformed addresses"),
    ({"op": "door", "hop": 1, "addresses": ["ws://10.0.0.2:8080?x=1"], "kinds": ["lan"]}, "friend", "malformed"),
    ({"op": "accept", "hop": 0, "id": "00" * 8, "psk": "00" * 32, "key": "00" * 32}, "host", "hop number"),
    ({"op": "accept", "hop": 2, "id": "zz" * 8, "psk": "00" * 32, "key": "00" * 32}, "host", "id must be"),
    ({"op": "dialed", "hop": 2, "port": 70000, "path": "direct", "rtt_ms": 1}, "friend", "malformed answer"),
    ({"op": "hop_link", "hop": 2, "rtt_ms": "fast", "mbit_s": 1}, "friend", "malformed rtt_ms"),
    ({"op": "hop_link", "hop": 2, "rtt_ms": 3, "mbit_s": -1}, "friend", "malformed mbit_s"),
    ({"op": "hop_link", "hop": 2, "rtt_ms": True, "mbit_s": 1}, "friend", "malformed rtt_ms"),
    ({"op": "hop_link", "hop": 2, "rtt_ms": 3, "mbit_s": 1}, "host", "not for this end"),
    ([1, 2], "host", "JSON object"),
])
def test_malformed_introductions_are_refused(msg, frm, why):
    with pytest.raises(noise.NoiseError, match=why):
        check_intro(msg, frm)


def test_a_well_formed_introduction_reads_back():
    msg = {"op": "dial", "hop": 3, "id": "ab" * 8, "psk": "cd" * 32, "key": "ef" * 32,
           "addresses": ["ws://10.0.0.2:5000"], "kinds": ["lan"]}
    got = check_intro(json.loads(json.dumps(msg)), "host")
    assert got["id"] == bytes.fromhex("ab" * 8) and got["addresses"] == ["ws://10.0.0.2:5000"]
    assert check_intro({"op": "door", "hop": 3, "why": "no address"}, "friend")["why"] == "no address"


def test_how_two_homes_last_hop_went_decides_the_next():
    from engine.wire.friend_hop import REMEMBER_S, hop_plan

    assert hop_plan(None, 0) == "full"
    assert hop_plan("direct (lan)", 5) == "full"          # dialing answers at once there
    assert hop_plan("direct (punched)", 5) == "punch"
    assert hop_plan("via the host", 5) == "host"
    assert hop_plan("via the host", REMEMBER_S + 1) == "full"   # a router may have changed


async def test_many_arrangements_through_the_host_keep_the_tunnel(tmp_path, monkeypatch):
    """Each arrangement asks a joiner for a new listener for its hop through the host; the
    host says nothing when one ends, so the joiner keeps only the newest few (refusing the
    fifth once closed the tunnel, and a rearrangement waited on it for ever)."""
    from engine.wire.tunnel_session import MAX_HOP_LISTENERS

    monkeypatch.setenv("POTLUCK_FRIEND_HOPS", "0")
    t = await Three().start(tmp_path)
    try:
        for _ in range(MAX_HOP_LISTENERS + 3):
            addr = await t.host.open_hop(t.pa, t.pb)
            await roundtrip(int(addr.rsplit(":", 1)[1]), 10_000)
        assert not t.a.closed.is_set() and len(t.a._hop_listeners) == MAX_HOP_LISTENERS
        assert len(t.pa.session.targets) <= 2          # the host forgot the hops that ended
    finally:
        await t.close()


async def test_a_tunnel_closing_while_a_listener_is_asked_is_an_error_not_a_cancellation(tmp_path, monkeypatch):
    from engine.wire import tunnel_session

    async def never(self, hop):      # the joiner never answers (its tunnel is about to go)
        return None

    monkeypatch.setattr(tunnel_session.Session, "_on_listen", never)
    t = await Three().start(tmp_path)
    try:
        asked = asyncio.ensure_future(t.pa.session.request_listener(7, ("127.0.0.1", 9)))
        await asyncio.sleep(0.2)
        await t.pa.session.close("gone")
        with pytest.raises(ConnectionError, match="the tunnel closed"):
            await asked
    finally:
        await t.close()
