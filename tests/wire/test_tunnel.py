"""Invites, the Noise handshake, the tunnel and the relay, over real loopback sockets.

Everything here runs in one process (host, joiner and relay are asyncio objects) with
an echo server standing in for a stage; tests/test_across_homes.py runs the real
processes in network namespaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from websockets.asyncio.server import serve
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from websockets.asyncio.client import connect

os.environ["POTLUCK_KEYSTORE"] = "file"

from engine.wire import invite as inv
from engine.wire import noise
from engine.wire.identity import load_or_create_identity  # noqa: E402
from engine.wire.relay import Limits, Relay  # noqa: E402
from engine.wire.relay_auth import Challenge, prove  # noqa: E402
from engine.wire.tunnel import TunnelError, TunnelHost, open_session  # noqa: E402


# ---- invite codes -----------------------------------------------------------------------
def _invite(**over):
    fields = dict(pipeline=os.urandom(8), invite_id=os.urandom(8), secret=os.urandom(16),
                  host_key=os.urandom(32), expires=int(time.time()) + 3600, max_uses=3,
                  relay="ws://relay.example:8765", direct=["ws://10.0.0.2:7870", "ws://[::1]:7870"])
    fields.update(over)
    return inv.Invite(**fields)


def test_invite_round_trip_case_and_separators():
    i = _invite()
    code = inv.encode(i)
    assert inv.parse(code) == i
    assert inv.parse(code.lower()) == i
    assert inv.parse("  " + code.replace("-", " ") + "\n") == i
    # Crockford: O reads as 0, I and L as 1
    assert inv.parse(code.replace("0", "o").replace("1", "l")) == i
    assert set(code) <= set(inv.ALPHABET + "-")


def test_invite_typos_are_reported_as_typos():
    code = inv.encode(_invite())
    chars = list(code)
    for pos in range(0, len(chars), 7):
        if chars[pos] == "-":
            continue
        wrong = list(chars)
        wrong[pos] = "7" if chars[pos] != "7" else "8"
        with pytest.raises(inv.InviteError, match="typo"):
            inv.parse("".join(wrong))
    with pytest.raises(inv.InviteError, match="typo"):
        inv.parse(code[:-3])                      # truncated
    with pytest.raises(inv.InviteError, match="typo"):
        inv.parse(code.replace(code[5], "U", 1) if code[5] != "-" else "U" + code)   # not in the alphabet
    swapped = code[:12] + code[13] + code[12] + code[14:]   # two neighbours swapped
    if swapped != code:
        with pytest.raises(inv.InviteError, match="typo"):
            inv.parse(swapped)
    with pytest.raises(inv.InviteError):
        inv.parse("")
    # a word is no code with a typo (`potluck join hello` said "this code has a typo")
    with pytest.raises(inv.InviteError, match="this is not an invite code"):
        inv.parse("hello")
    with pytest.raises(inv.InviteError, match="this is not a reply code"):
        inv.parse_reply("garbage")


def test_host_state_expiry_uses_and_revocation(tmp_path):
    st = inv.HostState(tmp_path)
    host_key = os.urandom(32)
    i, code = st.create_invite(host_key, relay="ws://r:1", max_uses=2)
    assert inv.parse(code).invite_id == i.invite_id
    assert st.invite_psk(i.invite_id) == i.psk()
    st.record_join(i.invite_id, b"a" * 32, "alice")
    st.record_join(i.invite_id, b"a" * 32, "alice")     # the same machine again: not a second use
    st.record_join(i.invite_id, b"b" * 32, "bob")
    with pytest.raises(inv.InviteError, match="used up"):
        st.invite_psk(i.invite_id)
    with pytest.raises(inv.InviteError, match="used up"):
        st.record_join(i.invite_id, b"c" * 32, "carol")
    assert st.invite_psk(i.invite_id, used_up_ok=True) == i.psk()
    assert st.check_member(b"a" * 32)["name"] == "alice"
    with pytest.raises(inv.InviteError, match="unknown node key"):
        st.check_member(b"c" * 32)
    st.revoke(st.check_member(b"a" * 32)["node_id"])
    with pytest.raises(inv.InviteError, match="revoked"):
        st.check_member(b"a" * 32)
    with pytest.raises(inv.InviteError, match="key was revoked"):   # its old code says why, not "used up"
        st.record_join(i.invite_id, b"a" * 32, "alice")
    old, _ = st.create_invite(host_key, relay="ws://r:1", ttl_s=-1)
    with pytest.raises(inv.InviteError, match="expired"):
        st.invite_psk(old.invite_id)
    with pytest.raises(inv.InviteError, match="expired"):
        old.check_fresh()
    third, _ = st.create_invite(host_key, relay="ws://r:1")
    st.revoke(third.invite_id.hex())
    with pytest.raises(inv.InviteError, match="revoked"):
        st.invite_psk(third.invite_id)
    with pytest.raises(inv.InviteError, match="unknown invite"):
        st.invite_psk(os.urandom(8))
    assert oct(os.stat(st.path).st_mode & 0o777) == "0o600"


def test_identity_file_fallback(tmp_path):
    a = load_or_create_identity(tmp_path)
    b = load_or_create_identity(tmp_path)
    assert a.public == b.public and a.store == "file" and len(a.node_id) == 10
    assert oct(os.stat(tmp_path / "node_key").st_mode & 0o777) == "0o600"


# ---- Noise ------------------------------------------------------------------------------
def _pair(psk_i=None, psk_r=None, host=None, rs=None):
    host = host or X25519PrivateKey.generate()
    joiner = X25519PrivateKey.generate()
    ini = noise.Initiator(joiner, rs or noise.public_bytes(host), b"pro", psk=psk_i)
    res = noise.Responder(host, b"pro", psk=psk_r)
    return ini, res, joiner


def test_handshake_and_transport():
    psk = os.urandom(32)
    ini, res, joiner = _pair(psk, psk)
    assert res.read_1(ini.write_1(b"hi")) == b"hi"
    assert res.remote_static == noise.public_bytes(joiner)
    assert ini.read_2(res.write_2(b"yo")) == b"yo"
    assert ini.handshake_hash == res.handshake_hash
    (i_tx, i_rx), (r_tx, r_rx) = ini.keys(), res.keys()
    a, b = noise.TransportCipher(i_tx), noise.TransportCipher(r_rx)
    f1, f2 = a.encrypt(b"one"), a.encrypt(b"two")
    assert b.decrypt(f1) == b"one"
    with pytest.raises(noise.NoiseError, match="replayed"):
        b.decrypt(f1)
    tampered = bytearray(f2)
    tampered[-1] ^= 1
    with pytest.raises(noise.NoiseError, match="tampered"):
        b.decrypt(bytes(tampered))
    assert b.decrypt(f2) == b"two"
    with pytest.raises(noise.NoiseError, match="out of order"):
        b.decrypt(a.encrypt(b"x") and a.encrypt(b"y"))


def test_handshake_rejections():
    ini, res, _ = _pair(os.urandom(32), os.urandom(32))
    with pytest.raises(noise.NoiseError, match="wrong join secret"):
        res.read_1(ini.write_1(b""))
    # a relay (or anyone) without the host's private key cannot read message 1
    ini, res, _ = _pair(None, None, rs=noise.public_bytes(X25519PrivateKey.generate()))
    with pytest.raises(noise.NoiseError, match="not encrypted to this host"):
        res.read_1(ini.write_1(b""))
    # an impostor answering message 2 without the host key
    host = X25519PrivateKey.generate()
    ini, _, _ = _pair(None, None, host=host)
    m1 = ini.write_1(b"")
    impostor = noise.Responder(X25519PrivateKey.generate(), b"pro")
    impostor.re, impostor.remote_static = m1[:32], noise.public_bytes(X25519PrivateKey.generate())
    with pytest.raises(noise.NoiseError, match="not from the host"):
        ini.read_2(impostor.write_2(b""))


def test_interoperates_with_noiseprotocol():
    """Byte-for-byte agreement with an established Noise implementation."""
    conn = pytest.importorskip("noise.connection")
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    def raw(k):
        return k.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    for psk in (None, os.urandom(32)):
        hs, js = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        ours = noise.Initiator(js, noise.public_bytes(hs), b"pro", psk)
        lib = conn.NoiseConnection.from_name(noise.protocol_name(psk is not None))
        lib.set_as_responder()
        lib.set_prologue(b"pro")
        lib.set_keypair_from_private_bytes(conn.Keypair.STATIC, raw(hs))
        if psk:
            lib.set_psks(psk=psk)
        lib.start_handshake()
        assert lib.read_message(ours.write_1(b"hello")) == b"hello"
        assert ours.read_2(lib.write_message(b"world")) == b"world"
        tx, rx = ours.keys()
        assert ChaCha20Poly1305(rx).decrypt(noise._nonce(0), lib.encrypt(b"z"), b"") == b"z"
        assert lib.decrypt(ChaCha20Poly1305(tx).encrypt(noise._nonce(0), b"x", b"")) == b"x"

        lib = conn.NoiseConnection.from_name(noise.protocol_name(psk is not None))
        lib.set_as_initiator()
        lib.set_prologue(b"pro")
        lib.set_keypair_from_private_bytes(conn.Keypair.STATIC, raw(js))
        lib.set_keypair_from_public_bytes(conn.Keypair.REMOTE_STATIC, noise.public_bytes(hs))
        if psk:
            lib.set_psks(psk=psk)
        lib.start_handshake()
        ours = noise.Responder(hs, b"pro", psk)
        assert ours.read_1(lib.write_message(b"a")) == b"a"
        assert ours.remote_static == noise.public_bytes(js)
        assert lib.read_message(ours.write_2(b"b")) == b"b"
        tx, _ = ours.keys()
        assert lib.decrypt(ChaCha20Poly1305(tx).encrypt(noise._nonce(0), b"y", b"")) == b"y"



def test_the_stage_links_nnpsk0_interoperates_with_noiseprotocol():
    """The stage links' handshake (NNpsk0) agrees byte for byte with the noiseprotocol
    package, both ways round, and a wrong psk fails on the first message."""
    conn = pytest.importorskip("noise.connection")
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    psk = os.urandom(32)
    ours = noise.PskInitiator(psk, b"pro")
    lib = conn.NoiseConnection.from_name(noise.NNPSK0)
    lib.set_as_responder()
    lib.set_prologue(b"pro")
    lib.set_psks(psk=psk)
    lib.start_handshake()
    assert lib.read_message(ours.write_1(b"hello")) == b"hello"
    assert ours.read_2(lib.write_message(b"world")) == b"world"
    tx, rx = ours.keys()
    assert ChaCha20Poly1305(rx).decrypt(noise._nonce(0), lib.encrypt(b"z"), b"") == b"z"
    assert lib.decrypt(ChaCha20Poly1305(tx).encrypt(noise._nonce(0), b"x", b"")) == b"x"

    lib = conn.NoiseConnection.from_name(noise.NNPSK0)
    lib.set_as_initiator()
    lib.set_prologue(b"pro")
    lib.set_psks(psk=psk)
    lib.start_handshake()
    ours = noise.PskResponder(psk, b"pro")
    assert ours.read_1(lib.write_message(b"a")) == b"a"
    assert lib.read_message(ours.write_2(b"b")) == b"b"
    tx, _ = ours.keys()
    assert lib.decrypt(ChaCha20Poly1305(tx).encrypt(noise._nonce(0), b"y", b"")) == b"y"

    for psk2, prologue in ((os.urandom(32), b"pro"), (psk, b"another nonce")):
        with pytest.raises(noise.NoiseError, match="wrong key"):
            noise.PskResponder(psk2, prologue).read_1(noise.PskInitiator(psk, b"pro").write_1())

# ---- the tunnel, direct and through the relay -----------------------------------------------
async def _echo_server():
    async def echo(r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


class Home:
    """A host (TunnelHost + identity + state) in a temp folder."""

    def __init__(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        self.identity = load_or_create_identity(folder)
        self.state = inv.HostState(folder)
        self.host = TunnelHost(self.identity, self.state)


async def _roundtrip(peer, size=200_000):
    r, w = await asyncio.open_connection("127.0.0.1", peer.port)
    payload = os.urandom(size)
    w.write(payload)
    await w.drain()
    got = await asyncio.wait_for(r.readexactly(size), 30)
    w.close()
    return got == payload


async def test_direct_and_relay_tunnels_carry_streams(tmp_path):
    seen: list[bytes] = []
    relay = await Relay(dump=seen.append).start("127.0.0.1", 0)
    echo, echo_port = await _echo_server()
    home = Home(tmp_path / "host")
    try:
        await home.host.use_relay(f"ws://127.0.0.1:{relay.port}")
        await home.host.listen("127.0.0.1", 0)
        for _ in range(100):
            if relay.pipelines:
                break
            await asyncio.sleep(0.05)
        code = home.host.invite(uses=2)
        invite = inv.parse(code)
        me = load_or_create_identity(tmp_path / "joiner")
        s1 = await open_session(invite, me, ("127.0.0.1", echo_port), name="bob", prefer="direct",
                                about={"device": "NVIDIA GeForce RTX 4090", "memory": 24 * 10**9})
        peer = await asyncio.wait_for(home.host.wait_peer(), 10)
        assert s1.path == "direct" and peer.path == "direct" and peer.name == "bob"
        assert peer.about == {"device": "NVIDIA GeForce RTX 4090", "memory": 24 * 10**9}
        assert await _roundtrip(peer)
        for _ in range(100):     # the keepalive's first PING goes out at once: a round trip to show
            if peer.session.link()["rtt_ms"] is not None:
                break
            await asyncio.sleep(0.05)
        link = peer.session.link()
        assert link["path"] == "direct" and 0 < link["rtt_ms"] < 5000 and link["mbit_s"] > 0, link
        await s1.close("test")
        assert seen == []                       # direct: the relay saw nothing
        # the same key again, now through the relay, as an allowlisted member
        s2 = await open_session(invite, me, ("127.0.0.1", echo_port), prefer="relay", member=True)
        assert s2.path == "relay"
        for _ in range(100):
            if peer.session is not None and peer.session.path == "relay" and not peer.session.closed.is_set():
                break
            await asyncio.sleep(0.05)
        marker = b"PLAINTEXT-MARKER-" * 100
        r, w = await asyncio.open_connection("127.0.0.1", peer.port)
        w.write(marker)
        assert await asyncio.wait_for(r.readexactly(len(marker)), 30) == marker
        w.close()
        assert seen and not any(b"PLAINTEXT-MARKER" in f for f in seen)
        assert relay.stats["paired"] == 1
        await s2.close("test")
    finally:
        await home.host.close()
        await relay.close()
        echo.close()


async def test_refusals_have_clear_reasons(tmp_path):
    echo, echo_port = await _echo_server()
    home = Home(tmp_path / "host")
    await home.host.listen("127.0.0.1", 0)
    try:
        target = ("127.0.0.1", echo_port)
        me = load_or_create_identity(tmp_path / "joiner")
        good = inv.parse(home.host.invite(uses=1))
        # wrong secret
        bad = inv.Invite(**{**good.__dict__, "secret": os.urandom(16)})
        with pytest.raises(TunnelError, match="wrong join secret"):
            await open_session(bad, me, target)
        # a code whose host key is not this host's (a relay impersonating the host)
        other = inv.Invite(**{**good.__dict__, "host_key": noise.public_bytes(X25519PrivateKey.generate())})
        with pytest.raises(TunnelError, match="not encrypted to this host"):
            await open_session(other, me, target)
        # unknown key asking as a member
        with pytest.raises(TunnelError, match="unknown node key"):
            await open_session(good, me, target, member=True)
        s = await open_session(good, me, target)
        await s.close("done")
        # used up
        other_me = load_or_create_identity(tmp_path / "joiner2")
        with pytest.raises(TunnelError, match="used up"):
            await open_session(good, other_me, target)
        # ...but the member it admitted may join with it again (its node started afresh and
        # no longer knows it is a member): the same machine, not one more use
        s = await open_session(good, me, target)
        await s.close("done")
        with pytest.raises(TunnelError, match="used up"):
            await open_session(good, other_me, target)
        # expired
        old = inv.parse(home.host.invite(uses=1))
        data = home.state.data()
        data["invites"][old.invite_id.hex()]["expires"] = 0
        home.state.path.write_text(__import__("json").dumps(data))
        with pytest.raises(TunnelError, match="expired"):
            await open_session(old, other_me, target)
        # revoked member: refused at reconnect, and its live session is closed
        s = await open_session(good, me, target, member=True)
        home.state.revoke(me.node_id)
        await asyncio.wait_for(s.closed.wait(), 15)
        assert "revoked" in s.close_reason
        with pytest.raises(TunnelError, match="revoked"):
            await open_session(good, me, target, member=True)
        # and with its used-up code, as `potluck join CODE` again: told it was revoked
        with pytest.raises(TunnelError, match="revoked"):
            await open_session(good, me, target)
        assert home.host.rejected
    finally:
        await home.host.close()
        echo.close()


def test_a_relay_proof_binds_the_hosts_key_the_pipeline_and_the_challenge():
    host = X25519PrivateKey.generate()
    pid = os.urandom(8).hex()
    c = Challenge(pid, _public(host))
    assert c.check(prove(host, pid, c.message()))
    assert not c.check(prove(X25519PrivateKey.generate(), pid, c.message()))   # another key
    assert not c.check(prove(host, os.urandom(8).hex(), c.message()))         # another pipeline
    assert not c.check(prove(host, pid, Challenge(pid, _public(host)).message()))   # another challenge
    assert not Challenge(pid, bytes(32)).check(prove(host, pid, c.message()))       # a low-order key
    for bad in [None, "x", {"type": "proof"}, {"type": "proof", "proof": 5}, [], {"type": "proof", "proof": "é"},
                {"type": "proof", "proof": "é" * 64}, {"type": "proof", "proof": "0" * 63}]:
        assert not c.check(bad)     # (a str not ASCII made compare_digest raise)
    for bad in [None, {}, {"type": "challenge"}, {"type": "challenge", "key": "zz", "nonce": "00"},
                {"type": "challenge", "key": "00" * 31, "nonce": "00" * 16}]:
        with pytest.raises(ValueError):
            prove(host, pid, bad)


async def _listed(base: str, pid: str, key: X25519PrivateKey):
    """A host's control connection to the relay, listed once it proved its key."""
    ws = await connect(f"{base}/host/{pid}/{_public(key).hex()}")
    await ws.send(json.dumps(prove(key, pid, json.loads(await ws.recv()))))
    assert json.loads(await ws.recv()) == {"type": "registered"}
    return ws


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


async def test_relay_limits():
    relay = await Relay(Limits(max_frame=1024, max_channels=1, pair_timeout=1.0, idle_timeout=1.0,
                               rate=100_000, burst=10_000)).start("127.0.0.1", 0)
    base = f"ws://127.0.0.1:{relay.port}/v1"
    pid, secret = os.urandom(8).hex(), X25519PrivateKey.generate()
    key = _public(secret).hex()
    try:
        async with connect(f"{base}/join/{pid}/{key}") as ws:          # nobody hosts it
            with pytest.raises(Exception):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_reason == "no host online for this pipeline"
        async with connect(f"{base}/join/not-an-id/{key}") as ws:
            with pytest.raises(Exception):
                await ws.recv()
            assert ws.close_reason == "bad pipeline id or host key"
        async with connect(f"{base}/join/{pid}") as ws:                # an older Potluck: told why
            with pytest.raises(Exception):
                await ws.recv()
            assert "newer Potluck" in ws.close_reason
        async with await _listed(base, pid, secret) as host:
            async with connect(f"{base}/host/{pid}/{key}") as dup:
                with pytest.raises(Exception):
                    await dup.recv()
                assert "already registered" in dup.close_reason
            async with connect(f"{base}/join/{pid}/{key}") as j1:       # the host never accepts
                note = await host.recv()
                assert "incoming" in note
                async with connect(f"{base}/join/{pid}/{key}") as j2:   # over the channel limit
                    with pytest.raises(Exception):
                        await j2.recv()
                    assert "too many" in j2.close_reason
                with pytest.raises(Exception):
                    await asyncio.wait_for(j1.recv(), 10)
                assert "did not accept" in j1.close_reason
            # paired: frame size, text frames, idle time and rate
            async with connect(f"{base}/join/{pid}/{key}") as j:
                sid = json.loads(await host.recv())["session"]
                async with connect(f"{base}/accept/{pid}/{key}/{sid}") as acc:
                    await j.send(b"x" * 500)
                    assert await acc.recv() == b"x" * 500
                    t0 = time.monotonic()
                    for _ in range(60):                           # 60 KB at 100 KB/s, 10 KB burst
                        await j.send(b"y" * 1000)
                    for _ in range(60):
                        await acc.recv()
                    assert time.monotonic() - t0 >= 0.4
                    await j.send(b"z" * 5000)                     # over max_frame
                    with pytest.raises(Exception):
                        await asyncio.wait_for(acc.recv(), 10)
            async with connect(f"{base}/join/{pid}/{key}") as j:
                sid = json.loads(await host.recv())["session"]
                async with connect(f"{base}/accept/{pid}/{key}/{sid}") as acc:
                    with pytest.raises(Exception):
                        await asyncio.wait_for(acc.recv(), 10)    # idle: closed after 1 s
        async with connect(f"{base}/accept/{pid}/{key}/{'0' * 32}") as ws:
            with pytest.raises(Exception):
                await ws.recv()
            assert ws.close_reason == "no such waiting joiner"
    finally:
        await relay.close()


async def test_one_address_holds_a_few_listings_and_codes_at_the_relay():
    """Anyone may list a host under a key of their own, and open short-code mailboxes: one
    client held them all (1000 of each) and the relay said "relay full" to every real
    host. One address holds per_address of them at once; one let go makes room again."""
    relay = await Relay(Limits(per_address=2)).start("127.0.0.1", 0)
    base = f"ws://127.0.0.1:{relay.port}/v1"
    try:
        keys = [X25519PrivateKey.generate() for _ in range(3)]
        pids = [os.urandom(8).hex() for _ in range(3)]
        first = await _listed(base, pids[0], keys[0])
        second = await _listed(base, pids[1], keys[1])
        async with connect(f"{base}/host/{pids[2]}/{_public(keys[2]).hex()}") as third:
            with pytest.raises(Exception):
                await asyncio.wait_for(third.recv(), 10)
            assert "too many listings" in third.close_reason
        async with connect(f"{base}/pake/1234") as mailbox:      # the address's share is taken
            with pytest.raises(Exception):
                await asyncio.wait_for(mailbox.recv(), 10)
            assert "too many listings" in mailbox.close_reason
        await first.close()
        for _ in range(100):
            if not relay.pipelines.get(f"{pids[0]}/{_public(keys[0]).hex()}"):
                break
            await asyncio.sleep(0.05)
        await (await _listed(base, pids[2], keys[2])).close()   # room again
        await second.close()
    finally:
        await relay.close()


async def test_whoever_knows_the_pipeline_id_cannot_take_the_hosts_place_at_the_relay(tmp_path):
    """An invite code shows the pipeline id to anyone it reaches. Before, whoever knew the
    id could register first (the host's computer asleep) and every join through the relay
    waited on them. Now the relay lists a host under the key the invites name, only once
    it proves it holds it: an impostor is refused, or listed under its own key, which no
    joiner asks for; the real host comes back and friends join as before."""
    relay = await Relay(Limits(handshake_timeout=2.0)).start("127.0.0.1", 0)
    base = f"ws://127.0.0.1:{relay.port}/v1"
    echo, echo_port = await _echo_server()
    home = Home(tmp_path / "host")
    key = home.host.identity.public.hex()
    pid = home.host.pipeline.hex()
    impostors = []
    try:
        # the host is away; an impostor who read the code claims its listing ...
        eve = X25519PrivateKey.generate()
        for answer in ("nothing", "a made-up proof", "a proof with its own key"):
            async with connect(f"{base}/host/{pid}/{key}") as ws:
                challenge = json.loads(await ws.recv())
                assert challenge["type"] == "challenge"
                if answer == "a made-up proof":
                    await ws.send(json.dumps({"type": "proof", "proof": "0" * 64}))
                elif answer == "a proof with its own key":
                    await ws.send(json.dumps(prove(eve, pid, challenge)))
                with pytest.raises(Exception):
                    await asyncio.wait_for(ws.recv(), 10)
                assert ws.close_reason == "the host did not prove its key", answer
        # ... or lists the pipeline under its own key: allowed, and harmless
        impostors.append(await _listed(base, pid, eve))
        assert relay.refused["the host did not prove its key"] == 3
        # the real host comes back and registers; a friend with the code joins through the relay
        await home.host.use_relay(f"ws://127.0.0.1:{relay.port}")
        for _ in range(100):
            if f"{pid}/{key}" in relay.pipelines:
                break
            await asyncio.sleep(0.05)
        invite = inv.parse(home.host.invite(uses=1))
        s = await open_session(invite, load_or_create_identity(tmp_path / "friend"), ("127.0.0.1", echo_port),
                               prefer="relay")
        peer = await asyncio.wait_for(home.host.wait_peer(), 10)
        assert s.path == "relay" and await _roundtrip(peer)
        await s.close("test")
    finally:
        for ws in impostors:
            await ws.close()
        await home.host.close()
        await relay.close()
        echo.close()


async def _relay_of(routes: dict, **runner_options):
    """A relay of our making on loopback, answering GET `routes` {path: handler}: (its
    runner, its port)."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_a_hostile_relay_cannot_make_the_host_dial_it_without_end(tmp_path):
    """Each "incoming" the relay sends has the host dial the relay back for that channel: a
    relay that sends a flood of them, and answers none of the dials, gets MAX_RELAYED
    dials at once (before, one per message: 1500 in 4 s, every file descriptor gone)."""
    from engine.wire.tunnel_host import MAX_RELAYED

    from aiohttp import web

    dials, held = 0, asyncio.Event()

    async def host_route(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"type": "challenge", "key": _public(X25519PrivateKey.generate()).hex(),
                            "nonce": os.urandom(16).hex()})
        await ws.receive()
        await ws.send_json({"type": "registered"})
        for i in range(200):
            await ws.send_json({"type": "incoming", "session": f"s{i}"})
        await held.wait()
        return ws

    async def accept_route(request):   # takes the dial, says nothing: the host's handshake waits
        nonlocal dials
        dials += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await held.wait()
        return ws

    # its handlers' sockets are the host's to close: no waiting on them at cleanup
    runner, port = await _relay_of({"/v1/host/{pid}/{key}": host_route, "/v1/accept/{pid}/{key}/{sid}": accept_route},
                                   shutdown_timeout=0.5)
    home = Home(tmp_path / "host")
    try:
        await home.host.use_relay(f"ws://127.0.0.1:{port}")
        for _ in range(100):
            if home.host.rejected["too many relayed channels"] >= 200 - MAX_RELAYED:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert dials == MAX_RELAYED and home.host.rejected["too many relayed channels"] == 200 - MAX_RELAYED
    finally:
        held.set()
        await home.host.close()
        await runner.cleanup()


async def test_a_relay_of_an_older_potluck_is_named_as_such_not_a_bare_404(tmp_path):
    """An older relay lists hosts under /v1/host/{pipeline} alone: this version's routes
    (the host's key in the path) get HTTP 404. The host's event and the joiner's error say
    what that means."""
    from aiohttp import web

    async def old_route(request):   # a WebSocket route of the old shape only
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close()
        return ws

    runner, port = await _relay_of({"/v1/host/{pid}": old_route, "/v1/join/{pid}": old_route})
    events = []
    home = Home(tmp_path / "host")
    home.host.on_event = events.append
    try:
        await home.host.use_relay(f"ws://127.0.0.1:{port}")
        for _ in range(100):
            if any("cannot register" in e for e in events):
                break
            await asyncio.sleep(0.05)
        said = next(e for e in events if "cannot register" in e)
        assert "older Potluck" in said and "update the relay" in said, said
        invite = inv.parse(home.host.invite(uses=1))
        with pytest.raises(TunnelError, match="older Potluck"):
            await open_session(invite, load_or_create_identity(tmp_path / "friend"), ("127.0.0.1", 9),
                               prefer="relay")
    finally:
        await home.host.close()
        await runner.cleanup()


async def test_hop_between_two_joiners_goes_through_the_host(tmp_path, monkeypatch):
    """Three homes: stage 1 (joiner A) reaches stage 2 (joiner B) through the host (the
    fallback where the two find no direct path: tests/wire/test_friend_hop.py)."""
    monkeypatch.setenv("POTLUCK_FRIEND_HOPS", "0")
    echo, echo_port = await _echo_server()
    home = Home(tmp_path / "host")
    await home.host.listen("127.0.0.1", 0)
    try:
        invite = inv.parse(home.host.invite(uses=2))
        a = await open_session(invite, load_or_create_identity(tmp_path / "a"), ("127.0.0.1", 9), name="a")
        pa = await asyncio.wait_for(home.host.wait_peer(), 10)
        b = await open_session(invite, load_or_create_identity(tmp_path / "b"), ("127.0.0.1", echo_port), name="b")
        pb = await asyncio.wait_for(home.host.wait_peer(), 10)
        addr = await home.host.open_hop(pa, pb)
        port = int(addr.rsplit(":", 1)[1])
        # a connection on A's machine to that port ends at B's stage (here: an echo)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        payload = os.urandom(100_000)
        w.write(payload)
        assert await asyncio.wait_for(r.readexactly(len(payload)), 30) == payload
        w.close()
        # B cannot use A's hop: the host accepts streams only for the hops it gave out
        b_sid = b._next_stream
        await b.send(__import__("engine.wire.tunnel", fromlist=["OPEN"]).OPEN, b_sid, (1).to_bytes(4, "little"))
        await asyncio.wait_for(b.closed.wait(), 10)
        assert "does not accept streams" in b.close_reason
        await a.close("done")
    finally:
        await home.host.close()
        echo.close()


async def test_short_code_hands_over_the_invite_through_the_relay():
    from engine.wire import shortcode

    seen: list[bytes] = []
    relay = await Relay(dump=seen.append).start("127.0.0.1", 0)
    url = f"ws://127.0.0.1:{relay.port}"
    full = inv.encode(_invite())
    try:
        ch, pw = shortcode.make()
        host = asyncio.ensure_future(shortcode.offer(url, ch, pw, full, timeout=30))
        await asyncio.sleep(0.2)
        assert await shortcode.redeem(url, f"{ch}-{pw}") == full
        assert await host == "delivered"
        assert seen and not any(full.encode() in f or full.replace("-", "").encode() in f for f in seen)
        # wrong digits: the joiner is told, the host's code is spent
        ch, pw = shortcode.make()
        host = asyncio.ensure_future(shortcode.offer(url, ch, pw, full, timeout=30))
        await asyncio.sleep(0.2)
        wrong = f"{int(pw) ^ 1:06d}"
        with pytest.raises(shortcode.ShortCodeError, match="wrong short code"):
            await shortcode.redeem(url, f"{ch}-{wrong}")
        with pytest.raises(shortcode.ShortCodeError):
            await host
        # the spent code, and a mistyped mailbox: nobody offers them, and the joiner is told
        # what to do rather than "the relay closed the exchange: closed"
        for code in (f"{ch}-{pw}", f"{(int(ch) + 1) % 10000:04d}-{pw}"):
            with pytest.raises(shortcode.ShortCodeError, match="no host is offering .* ask the host for a new one"):
                await shortcode.redeem(url, code, timeout=1)
        for _ in range(50):   # a first side that left holds no mailbox (for the ten minutes an offer lasts)
            if not relay.mailboxes:
                break
            await asyncio.sleep(0.1)
        assert not relay.mailboxes
        with pytest.raises(shortcode.ShortCodeError, match="4 digits"):
            await shortcode.redeem(url, "12-34")
    finally:
        await relay.close()


async def test_joiner_reconnects_as_a_member_after_the_host_restarts(tmp_path):
    from conftest import free_port
    from engine.wire.tunnel import Joiner

    echo, echo_port = await _echo_server()
    port = free_port()
    home = Home(tmp_path / "host")
    await home.host.listen("127.0.0.1", port)
    code = home.host.invite(uses=1)
    events: list[str] = []
    joiner = Joiner(inv.parse(code), load_or_create_identity(tmp_path / "j"), ("127.0.0.1", echo_port), name="j",
                    on_event=events.append)
    await joiner.connect()
    keep = asyncio.ensure_future(joiner.run())
    try:
        peer = await asyncio.wait_for(home.host.wait_peer(), 10)
        assert await _roundtrip(peer, 1000)
        await home.host.close()                       # the host goes away...
        await asyncio.sleep(2.5)                      # (a retry or two find nobody)
        # ...on purpose: the friend is told it waits, not advised about routers at each retry
        assert any("the host stopped Potluck" in e for e in events), events
        assert not any("reconnect failed" in e or "UPnP" in e for e in events), events
        # nor told each route's socket error at each retry ("route … unreachable ([Errno 111] …)")
        assert not any("unreachable" in e for e in events), events
        again = Home(tmp_path / "host")               # ...and comes back: same key, same record
        await again.host.listen("127.0.0.1", port)
        try:
            peer = await asyncio.wait_for(again.host.wait_peer(), 60)   # the invite is used up: as a member
            assert peer.name == "j" and await _roundtrip(peer, 1000)
            assert not keep.done()
        finally:
            await again.host.close()
    finally:
        keep.cancel()
        echo.close()



async def test_a_host_that_is_not_hosting_is_named_first_not_the_router(tmp_path):
    """Every address of the code refused the connection: most often the host's computer is
    there and Potluck does not listen, so the joiner hears that first; a router that resets
    an unforwarded port refuses the same way, so the router's remedies follow it."""
    home = Home(tmp_path / "host")
    await home.host.listen("127.0.0.1", 0)
    invite = inv.parse(home.host.invite(uses=1))
    await home.host.close()
    with pytest.raises(TunnelError) as failed:
        await open_session(invite, load_or_create_identity(tmp_path / "friend"), ("127.0.0.1", 9))
    said = str(failed.value)
    assert "most likely Potluck is not hosting there now" in said
    assert said.index("not hosting") < said.index("UPnP") and "No direct path" not in said


async def test_a_refusal_at_one_address_does_not_stop_the_join_at_the_next(tmp_path):
    """Refusals before the Noise answer are not authenticated: something else listening
    at the invite's first address (another program, a stranger) that says "go away" must
    not end the join; the host at the next address takes it."""
    async def impostor(ws):
        await ws.recv()
        await ws.send(b"\x00this host serves another pipeline")
        await ws.close()

    echo, echo_port = await _echo_server()
    home = Home(tmp_path / "host")
    async with serve(impostor, "127.0.0.1", 0) as fake:
        try:
            await home.host.listen("127.0.0.1", 0)
            real = home.host.direct_addresses[0]
            home.host.direct_addresses = [f"ws://127.0.0.1:{fake.sockets[0].getsockname()[1]}", real]
            home.host.direct_kinds = ["lan", "mapped"]
            invite = inv.parse(home.host.invite())
            said = []
            s = await open_session(invite, load_or_create_identity(tmp_path / "j"), ("127.0.0.1", echo_port),
                                   log_event=said.append)
            assert s.path == "direct (mapped)", said
            assert any("another pipeline" in x for x in said), said
            await s.close("test")
        finally:
            await home.host.close()
            echo.close()


def _joiner_to_a_closed_port(tmp_path, monkeypatch, on_reply):
    """A joiner whose invite names only an address nothing answers at, with a reply
    listener on loopback (no router asked)."""
    from engine.wire.tunnel import Joiner

    monkeypatch.setenv("POTLUCK_UPNP", "0")
    (tmp_path / "h").mkdir()
    state = inv.HostState(tmp_path / "h")
    _, code = state.create_invite(os.urandom(32), "", ["ws://127.0.0.1:9"], kinds=["lan"])
    return Joiner(inv.parse(code), load_or_create_identity(tmp_path / "j"), ("127.0.0.1", 9),
                  reply_listen="127.0.0.1:0", on_reply=on_reply)


async def test_a_reply_code_is_shown_when_the_hosts_addresses_fail_however_fast_it_was_made(tmp_path, monkeypatch):
    """The joiner makes its reply code while it tries the host's addresses: shown the
    moment they have failed, whether making it took longer than failing (a router to
    ask) or not (nothing to ask: here)."""
    shown = []
    j = _joiner_to_a_closed_port(tmp_path, monkeypatch, shown.append)
    t0 = time.monotonic()
    task = asyncio.ensure_future(j.connect())
    try:
        for _ in range(100):
            if shown:
                break
            await asyncio.sleep(0.05)
        assert shown and shown[0] == j.reply_code and time.monotonic() - t0 < 3.0
        # listening on loopback, it offers loopback: its LAN address (all it offered) answers nothing
        port = j._reply_server.sockets[0].getsockname()[1]
        assert inv.parse_reply(j.reply_code).direct == [f"ws://127.0.0.1:{port}"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await j.close()


async def test_a_member_reconnecting_retries_quietly_before_it_offers_a_reply_code(tmp_path, monkeypatch):
    """A friend already in the pipeline whose tunnel dropped (its own line down, the host's
    lid shut) was told to send the host a reply code, and its reply listener stayed bound
    for the rest of the session; the next retry reconnected by itself seconds later. It
    retries quietly now, and offers a code only when the host's addresses have failed for
    REPLY_AFTER_S (they may have changed for good)."""
    from engine.wire import tunnel_join
    from engine.wire.tunnel import TunnelError

    shown = []
    j = _joiner_to_a_closed_port(tmp_path, monkeypatch, shown.append)
    j.member = True                     # joined directly before; the tunnel just closed
    j._down_since = time.monotonic()
    try:
        with pytest.raises(TunnelError):
            await asyncio.wait_for(j.connect(), 30)
        assert shown == [] and j.reply_code is None and j._reply_server is None
        j._down_since = time.monotonic() - tunnel_join.REPLY_AFTER_S - 1
        task = asyncio.ensure_future(j.connect())
        for _ in range(100):
            if shown:
                break
            await asyncio.sleep(0.05)
        assert shown and shown[0] == j.reply_code
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await j.close()


def test_a_joiners_word_on_its_computer_is_kept_only_as_far_as_it_is_well_formed():
    from engine.wire.tunnel_host import joiner_about

    assert joiner_about({"device": "x" * 500, "memory": 10**9}) == {"device": "x" * 64, "memory": 10**9}
    assert joiner_about({"device": 7, "memory": -1}) == {}
    assert joiner_about({"memory": True}) == {} and joiner_about({"memory": 2**60}) == {}
    assert joiner_about("a string") == {} and joiner_about(None) == {}


async def test_a_first_join_waits_for_its_reply_code_only_so_long(tmp_path, monkeypatch):
    """The host's addresses failing may mean nobody hosts there now (an invite withdrawn,
    Potluck closed): a first join waited on its reply code without end, sharing on and
    nothing said. It gives up after REPLY_WAIT_S and says what to check."""
    from engine.node.plain_errors import join_failed
    from engine.wire import tunnel_join
    from engine.wire.tunnel import TunnelError

    monkeypatch.setattr(tunnel_join, "REPLY_WAIT_S", 1.5)
    shown = []
    j = _joiner_to_a_closed_port(tmp_path, monkeypatch, shown.append)
    j.direct_retry_s = 0.5
    try:
        with pytest.raises(TunnelError, match="reply code within") as gave_up:
            await asyncio.wait_for(j.connect(), 30)
        assert shown                                   # the code was offered first
        assert "withdrew" in join_failed(f"could not reach the host's pipeline: {gave_up.value}")
    finally:
        await j.close()


async def test_a_reply_code_whose_joiner_is_gone_is_said_once_and_given_up(tmp_path, monkeypatch):
    """The joiner of a reply code went away (it joined another way, or gave up): the host
    said "no address of the joiner answers" every few seconds for the invite's whole day.
    Once, now, and it stops dialling when the joiner has stopped waiting too."""
    from engine.wire import tunnel_host
    from engine.wire.tunnel import TunnelHost

    monkeypatch.setattr(tunnel_host, "UNANSWERED_REPLY_S", 3.5)
    said: list[str] = []
    host = TunnelHost(load_or_create_identity(tmp_path), inv.HostState(tmp_path), on_event=said.append)
    invite, _ = host.state.create_invite(host.identity.public, "", ["ws://127.0.0.1:9"], kinds=["lan"])
    r = host.take_reply(inv.encode_reply(inv.Reply(host.pipeline, invite.invite_id, ["ws://127.0.0.1:9"], ["lan"])))
    try:
        await asyncio.wait_for(host._dialers[r.key], 30)      # it ends by itself
        answers = [x for x in said if "no address of the joiner answers" in x]
        assert len(answers) == 1 and "no longer dialled" in said[-1], said
    finally:
        await host.close()


def test_a_windows_computer_keeps_its_hosting_keys_where_the_app_and_its_uninstaller_look(tmp_path):
    """On Windows the keys, invites and members went to %USERPROFILE%\\.config\\potluck,
    which the uninstaller (it removes %LOCALAPPDATA%\\potluck) left behind."""
    from engine.wire.identity import default_dir

    home, local = tmp_path / "user", tmp_path / "local"
    env = {"LOCALAPPDATA": str(local)}
    assert default_dir(windows=True, env=env, home=home) == local / "potluck"
    # one that hosted with an earlier Potluck keeps its folder: its invites and members
    (home / ".config" / "potluck").mkdir(parents=True)
    assert default_dir(windows=True, env=env, home=home) == local / "potluck"     # empty: nothing to keep
    (home / ".config" / "potluck" / "host.json").write_text("{}")
    assert default_dir(windows=True, env=env, home=home) == home / ".config" / "potluck"
    # elsewhere: the XDG folder, as before
    assert default_dir(windows=False, env={}, home=home) == home / ".config" / "potluck"
    assert default_dir(windows=False, env={"XDG_CONFIG_HOME": str(tmp_path / "x")}, home=home) == \
        tmp_path / "x" / "potluck"
