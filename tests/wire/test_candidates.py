"""Candidates, STUN and invite v2 (issue 33): the sans-I/O parts, and the joiner's race."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
import time

import pytest
from websockets.asyncio.server import serve

from engine.wire import candidates as cand
from engine.wire import invite as inv
from engine.wire import stun
from engine.wire.tunnel import CONNECT_TIMEOUT, _first_to_connect

# RFC 5769 section 2.2: a Binding success with XOR-MAPPED-ADDRESS 192.0.2.1:32853 (plus
# SOFTWARE, MESSAGE-INTEGRITY and FINGERPRINT, which a reader must step over)
RFC5769_TXID = bytes.fromhex("b7e7a701bc34d686fa87dfae")
RFC5769_IPV4 = bytes.fromhex(
    "0101003c2112a442b7e7a701bc34d686fa87dfae"
    "8022000b7465737420766563746f7220"
    "002000080001a147e112a643"
    "000800142b91f599fd9e90c38c7489f92af9ba53f06be7d7"
    "80280004c07d4c96")


def test_the_rfc_5769_binding_answer_reads_as_its_address():
    assert stun.parse_response(RFC5769_IPV4, RFC5769_TXID) == ("192.0.2.1", 32853)


def test_a_request_is_a_binding_with_the_magic_cookie():
    msg, txid = stun.request()
    assert len(msg) == 20 and len(txid) == 12
    assert struct.unpack("!HHI", msg[:8]) == (0x0001, 0, 0x2112A442) and msg[8:] == txid


@pytest.mark.parametrize("damage,why", [
    (lambda m: m[:19], "size"),
    (lambda m: m[:8] + b"\0" * 12 + m[20:], "not an answer"),
    (lambda m: b"\x01\x11" + m[2:], "not a Binding success"),
    (lambda m: m[:-4], "length"),
    (lambda m: m[:2] + b"\x00\x08" + m[4:20] + b"\x00\x20\x00\x40" + m[24:28], "past the message"),
    (lambda m: m[:2] + b"\x00\x00" + m[4:20], "no mapped address"),
])
def test_a_damaged_or_foreign_answer_is_refused_with_the_reason(damage, why):
    with pytest.raises(stun.StunError, match=why):
        stun.parse_response(damage(RFC5769_IPV4), RFC5769_TXID)


def test_the_nat_behaviour_follows_from_what_two_servers_saw():
    a, b = ("100.64.0.1", 3478), ("100.64.0.2", 3478)
    local = ("192.168.1.2", 40000)
    same = [stun.Mapped(a, ("100.64.5.1", 40000)), stun.Mapped(b, ("100.64.5.1", 40000))]
    other = [stun.Mapped(a, ("100.64.5.1", 40000)), stun.Mapped(b, ("100.64.5.1", 51234))]
    assert stun.nat_behaviour(local, same) == "endpoint-independent"
    assert stun.nat_behaviour(local, other) == "symmetric"
    assert stun.nat_behaviour(local, same[:1]) == "unknown"
    assert stun.nat_behaviour(local, []) == "unknown"
    assert stun.nat_behaviour(("100.64.9.9", 40000), [stun.Mapped(a, ("100.64.9.9", 40000))]) == "open"


async def test_query_asks_every_server_from_one_socket_and_skips_the_silent():
    """Against two STUN responders written here from RFC 8489's layout (not our encoder),
    and one name that does not resolve and one address that never answers."""
    seen_from = []

    class Responder(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.t = transport

        def datagram_received(self, data, addr):
            seen_from.append(addr)
            txid = data[8:20]
            port = addr[1] ^ 0x2112
            ip = bytes(x ^ y for x, y in zip(socket.inet_aton(addr[0]), struct.pack("!I", 0x2112A442)))
            attr = struct.pack("!HHBBH", 0x0020, 8, 0, 1, port) + ip
            self.t.sendto(struct.pack("!HHI", 0x0101, len(attr), 0x2112A442) + txid + attr, addr)

    loop = asyncio.get_running_loop()
    servers = [await loop.create_datagram_endpoint(Responder, local_addr=("127.0.0.1", 0)) for _ in range(2)]
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        names = [("127.0.0.1", t.get_extra_info("sockname")[1]) for t, _ in servers]
        local, seen = await stun.query(names + [("no-such-host.invalid", 3478), silent.getsockname()],
                                       timeout=1.0)
        assert sorted(m.server for m in seen) == sorted(names)
        assert {m.address for m in seen} == {("127.0.0.1", local[1])}     # one socket, one mapping
        assert len({a for a in seen_from}) == 1
    finally:
        for t, _ in servers:
            t.close()
        silent.close()


def test_candidates_are_classified_ordered_and_deduplicated():
    found = cand.local_candidates(7870, ["127.0.0.1", "192.168.1.20", "fe80::1%eth0", "2001:db8::5",
                                         "2a00:1450:4001:81a::200e", "100.64.3.3", "8.8.4.4", "::1"])
    assert [(c.kind, c.url) for c in found] == [
        ("lan", "ws://192.168.1.20:7870"), ("ipv6", "ws://[2a00:1450:4001:81a::200e]:7870"),
        ("lan", "ws://100.64.3.3:7870"), ("public", "ws://8.8.4.4:7870")]
    mixed = found + [cand.Candidate("mapped", "ws://81.2.69.160:7871"), cand.Candidate("given", "ws://8.8.4.4:7870")]
    assert [c.kind for c in cand.ordered(mixed)] == ["lan", "lan", "given", "mapped", "ipv6"]
    with pytest.raises(ValueError):
        cand.Candidate("punched", "ws://1.2.3.4:1")


def _invite(**over):
    kw = dict(pipeline=b"p" * 8, invite_id=b"i" * 8, secret=b"s" * 16, host_key=b"k" * 32,
              expires=int(time.time()) + 3600, max_uses=2, relay="",
              direct=["ws://192.168.1.20:7870", "ws://81.2.69.160:7871", "ws://[2a00:1450::1]:7870"],
              kinds=["lan", "mapped", "ipv6"])
    kw.update(over)
    return inv.Invite(**kw)


def test_an_invite_carries_its_addresses_kinds_and_a_version_1_code_still_parses():
    code = inv.encode(_invite())
    back = inv.parse(code)
    assert back.direct == _invite().direct and back.kinds == ["lan", "mapped", "ipv6"]

    # a version 1 code, as the last release wrote it: addresses without kinds
    old = _invite()
    body = inv._FIXED.pack(1, old.pipeline, old.invite_id, old.secret, old.host_key, old.expires, old.max_uses)
    body += inv._str("", "relay") + bytes([len(old.direct)]) + b"".join(inv._str(a, "a") for a in old.direct)
    body += hashlib.sha256(body).digest()[:inv.CHECKSUM]
    back = inv.parse(inv._b32encode(body))
    assert back.direct == old.direct and back.kinds == ["given"] * 3

    # a kind this version does not know is a damaged code, said so
    body = inv._FIXED.pack(2, old.pipeline, old.invite_id, old.secret, old.host_key, old.expires, old.max_uses)
    body += inv._str("", "relay") + b"\x01\x09" + inv._str(old.direct[0], "a")
    body += hashlib.sha256(body).digest()[:inv.CHECKSUM]
    with pytest.raises(inv.InviteError, match="unknown kind"):
        inv.parse(inv._b32encode(body))


async def test_the_joiner_races_the_addresses_and_a_dead_one_costs_only_its_stagger():
    """The first address accepts TCP and never answers (another home's private address
    behaves like this, or worse); the second is the host. The host wins long before the
    first would time out, and the loser is closed."""
    async def handler(ws):
        await ws.wait_closed()

    async def mute(reader, writer):
        await asyncio.sleep(3600)

    black = await asyncio.start_server(mute, "127.0.0.1", 0)
    async with serve(handler, "127.0.0.1", 0) as host:
        dead = f"ws://127.0.0.1:{black.sockets[0].getsockname()[1]}"
        good = f"ws://127.0.0.1:{host.sockets[0].getsockname()[1]}"
        errors, said = [], []
        t0 = time.monotonic()
        path, url, ws = await _first_to_connect([("direct (lan)", dead), ("direct (mapped)", good)], errors, said.append)
        took = time.monotonic() - t0
        try:
            assert (path, url) == ("direct (mapped)", good)
            assert took < CONNECT_TIMEOUT, took
        finally:
            await ws.close()
        path, url, ws = await _first_to_connect([("direct (lan)", "ws://127.0.0.1:9")], errors, said.append)
        assert ws is None and errors and "127.0.0.1:9" in errors[-1]
    black.close()


def test_a_reply_code_round_trips_and_an_invite_pasted_as_a_reply_is_named():
    r = inv.Reply(b"p" * 8, b"i" * 8, ["ws://81.2.69.160:7871", "ws://192.168.2.5:7871"], ["mapped", "lan"])
    back = inv.parse_reply(inv.encode_reply(r))
    assert (back.pipeline, back.invite_id, back.direct, back.kinds) == (r.pipeline, r.invite_id, r.direct, r.kinds)
    with pytest.raises(inv.InviteError, match="invite code, not a reply"):
        inv.parse_reply(inv.encode(_invite()))
    code = inv.encode_reply(r)
    typo = code[:10] + ("A" if code[10] != "A" else "B") + code[11:]
    with pytest.raises(inv.InviteError, match="typo"):
        inv.parse_reply(typo)


def test_a_host_takes_only_replies_to_its_own_usable_invites(tmp_path):
    state = inv.HostState(tmp_path)
    invite, _ = state.create_invite(b"k" * 32, direct=["ws://192.168.1.2:7870"], kinds=["lan"])
    good = inv.encode_reply(inv.Reply(state.pipeline, invite.invite_id, ["ws://81.2.69.160:7871"], ["mapped"]))
    assert state.add_reply(good).direct == ["ws://81.2.69.160:7871"]
    state.add_reply(good)                                   # the same code twice is one
    assert len(state.replies()) == 1
    other = inv.encode_reply(inv.Reply(b"x" * 8, invite.invite_id, ["ws://81.2.69.160:7871"], ["mapped"]))
    with pytest.raises(inv.InviteError, match="another host"):
        state.add_reply(other)
    unknown = inv.encode_reply(inv.Reply(state.pipeline, b"z" * 8, ["ws://81.2.69.160:7871"], ["mapped"]))
    with pytest.raises(inv.InviteError, match="unknown invite"):
        state.add_reply(unknown)


def test_nat_pmp_messages_follow_rfc_6886():
    from engine.wire import natpmp

    assert natpmp.external_address_request() == b"\x00\x00"
    assert natpmp.map_request(7870, 7870, 3600) == bytes.fromhex("0002 0000 1ebe 1ebe 00000e10")
    addr = natpmp.parse_response(bytes.fromhex("0080" "0000" "00001234" "510245a0"), 0)
    assert addr == {"result": 0, "meaning": "success", "epoch": 0x1234, "external": "81.2.69.160"}
    got = natpmp.parse_response(bytes.fromhex("0082" "0000" "00000009" "1ebe" "1ebf" "00000e10"), natpmp.TCP)
    assert (got["internal_port"], got["external_port"], got["lifetime"]) == (7870, 7871, 3600)
    refused = natpmp.parse_response(bytes.fromhex("0082000200000009"), natpmp.TCP)
    assert refused["result"] == 2 and "refused" in refused["meaning"]
    for bad, op in ((b"\x00\x80", 0), (bytes.fromhex("0081" "0000" "00001234" "510245a0"), 0),
                    (bytes.fromhex("0080" "0000" "00001234" "510245"), 0)):
        with pytest.raises(natpmp.NatPmpError):
            natpmp.parse_response(bad, op)


def test_punching_addresses_ride_in_codes_but_are_never_dialled(tmp_path):
    """Kind "udp" (a socket's public address for hole punching): in an invite and in a reply
    code, only as udp://literal-address:port; a joiner never opens a WebSocket to it; host
    and joiner derive the same punch key from the invite, and nobody else can."""
    from engine.wire.invite import rendezvous_key, udp_addresses
    from engine.wire.tunnel import direct_routes

    state = inv.HostState(tmp_path)
    invite, code = state.create_invite(b"k" * 32, direct=["ws://192.168.1.2:7870", "udp://81.2.69.160:40000"],
                                       kinds=["lan", "udp"])
    back = inv.parse(code)
    assert back.kinds == ["lan", "udp"] and udp_addresses(back.direct, back.kinds) == [("81.2.69.160", 40000)]
    assert direct_routes(back) == [("direct (lan)", "ws://192.168.1.2:7870")]
    assert state.rendezvous_key(invite.invite_id) == rendezvous_key(back.psk())
    assert rendezvous_key(inv.join_psk(b"x" * 16, back.pipeline, back.invite_id)) != rendezvous_key(back.psk())

    r = inv.Reply(state.pipeline, invite.invite_id, ["udp://81.2.69.161:50000"], ["udp"])
    assert inv.parse_reply(inv.encode_reply(r)).direct == ["udp://81.2.69.161:50000"]
    for bad in (inv.Reply(state.pipeline, invite.invite_id, ["ws://81.2.69.161:50000"], ["udp"]),
                inv.Reply(state.pipeline, invite.invite_id, ["udp://81.2.69.161:50000"], ["mapped"])):
        with pytest.raises(inv.InviteError, match="not a"):
            inv.parse_reply(inv.encode_reply(bad))
    # names are never resolved, nor loopback punched at
    assert udp_addresses(["udp://example.com:5", "udp://127.0.0.1:5", "udp://1.2.3.4:x"], ["udp"] * 3) == []


def test_another_homes_lan_address_gets_a_short_connect_timeout():
    from engine.wire import candidates as cand
    from engine.wire.tunnel_routes import CONNECT_TIMEOUT, FOREIGN_LAN_S, PUBLIC_S, open_timeouts

    ours = next((a for a in cand.interface_addresses() if cand.classify(a) == "lan"), None)
    if ours is None:
        pytest.skip("this machine has no private address of its own")
    assert cand.on_our_networks(cand.url_for(ours, 7870))
    foreign = "ws://10.254.253.9:7870" if not ours.startswith("10.") else "ws://172.31.254.9:7870"
    routes = [("direct (lan)", cand.url_for(ours, 7870)), ("direct (lan)", foreign),
              ("direct (public)", "ws://203.0.113.5:7870"), ("direct (mapped)", "ws://203.0.113.5:7871"),
              ("relay", "ws://relay:8765/v1/join/x")]
    assert open_timeouts(routes) == [CONNECT_TIMEOUT, FOREIGN_LAN_S, PUBLIC_S, CONNECT_TIMEOUT, CONNECT_TIMEOUT]


def test_pcp_map_messages_follow_rfc_6887():
    from engine.wire import pcp

    nonce = bytes(range(12))
    req = pcp.map_request(nonce, pcp.TCP, 7870, 7870, 3600, "192.168.1.2")
    assert len(req) == 60 and req[0] == 2 and req[1] == 1
    assert req[8:24] == bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 2])       # the client, IPv4-mapped
    assert req[24:36] == nonce and req[36] == 6 and req[40:44] == bytes([0x1e, 0xbe, 0x1e, 0xbe])
    # the router's answer: success, 7200 s, mapped to 81.2.69.160:7871
    answer = bytes([2, 0x81, 0, 0]) + (7200).to_bytes(4, "big") + (5).to_bytes(4, "big") + bytes(12) + \
        nonce + bytes([6, 0, 0, 0]) + (7870).to_bytes(2, "big") + (7871).to_bytes(2, "big") + \
        bytes(10) + b"\xff\xff" + bytes([81, 2, 69, 160])
    got = pcp.parse_map_response(answer, nonce)
    assert got["result"] == 0 and got["external"] == ("81.2.69.160", 7871) and got["lifetime"] == 7200
    with pytest.raises(pcp.PcpError, match="another request"):
        pcp.parse_map_response(answer, bytes(12))
    refused = answer[:3] + bytes([2]) + answer[4:]
    assert pcp.parse_map_response(refused, nonce)["meaning"] == "not authorized"
    # a router that speaks only NAT-PMP answers with version 0
    assert "NAT-PMP" in pcp.parse_map_response(bytes([0, 0x81, 0, 1, 0, 0, 0, 0]), nonce)["meaning"]
    with pytest.raises(pcp.PcpError):
        pcp.parse_map_response(b"\x02\x81", nonce)
