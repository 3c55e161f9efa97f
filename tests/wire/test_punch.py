"""Hole punching and the QUIC channel on the punched socket (engine/wire/punch.py), on
loopback: the packet rules without sockets, then real UDP sockets and real QUIC. The
path through two real NAT routers is tests/node/test_home_paths.py's."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from engine.wire import punch
from engine.wire.punch import PunchCodec, Puncher, UdpEndpoint, parse_candidates, udp_candidates

KEY = punch.punch_key(b"k" * 32)


def test_a_punch_packet_proves_the_session_and_nothing_else_passes():
    codec = PunchCodec(KEY)
    assert codec.check(codec.make(answer=False)) is False
    assert codec.check(codec.make(answer=True)) is True
    assert PunchCodec(punch.punch_key(b"x" * 32)).check(codec.make(answer=False)) is None   # another session
    pkt = bytearray(codec.make(answer=False))
    pkt[5] ^= 1                                                     # the nonce
    assert codec.check(bytes(pkt)) is None
    assert codec.check(bytes(pkt[:-1])) is None
    assert codec.check(b"\x16\x03\x01" + bytes(26)) is None        # a stranger's packet


def test_the_puncher_takes_the_first_address_heard_and_answers_there():
    a = Puncher(KEY, [("11.0.0.10", 4000), ("192.168.1.2", 4000), ("11.0.0.10", 4000)])
    assert [to for _, to in a.round()] == [("11.0.0.10", 4000), ("192.168.1.2", 4000)]   # deduplicated
    assert a.receive(b"junk" * 8, ("6.6.6.6", 1)) is None and a.peer is None
    # the peer's NAT shows another port than its candidates said: that is the path
    reply = a.receive(PunchCodec(KEY).make(answer=False), ("11.0.0.10", 4123))
    assert a.peer == ("11.0.0.10", 4123) and reply and reply[0][1] == ("11.0.0.10", 4123)
    assert not a.done                                              # it has not heard us yet
    assert [to for _, to in a.round()] == [("11.0.0.10", 4123)]    # from now on only there
    assert a.receive(PunchCodec(KEY).make(answer=False), ("11.0.0.10", 9999)) == []   # a second path: ignored
    a.receive(PunchCodec(KEY).make(answer=True), ("11.0.0.10", 4123))
    assert a.done and a.peer == ("11.0.0.10", 4123)


def test_a_puncher_that_hears_but_is_never_answered_stops_after_a_few_rounds():
    a = Puncher(KEY, [("11.0.0.10", 4000)])
    a.receive(PunchCodec(KEY).make(answer=False), ("11.0.0.10", 4000))
    for _ in range(punch.PUNCH_ROUNDS_AFTER):
        assert not a.done
        a.round()
    assert a.done


def test_port_predictions_hard_side_keeps_only_the_socket_the_easy_side_chose():
    """Two of the hard side's mappings are met in one spray round (a few are, on average):
    the easy side takes the first heard and tells it so; the other socket, heard but never
    chosen, is not done however many rounds pass (it used to be, after PUNCH_ROUNDS_AFTER,
    and could win the race to a socket the easy side never dials)."""
    easy_public = ("11.0.0.10", 4000)
    maps = {"x": ("11.0.0.20", 31000), "y": ("11.0.0.20", 52000)}   # the symmetric router's mappings
    easy = Puncher(KEY, [("11.0.0.20", 7000)], spray=[maps["x"], maps["y"], ("11.0.0.20", 1234)])
    hard = {k: Puncher(KEY, [easy_public], chosen_only=True) for k in maps}
    probes = [pkt for pkt, to in easy.round() if to in maps.values()]
    assert len(probes) == 2
    # each met socket answers the probe; x's answer happens to arrive first
    answers = {k: hard[k].receive(probes[i], easy_public) for i, k in enumerate(maps)}
    assert all(len(a) == punch.CHOICE_COPIES for a in answers.values())
    back = easy.receive(answers["x"][0][0], maps["x"])
    assert easy.done and easy.peer == maps["x"]
    assert easy.receive(answers["y"][0][0], maps["y"]) == []           # y is heard, not chosen
    assert len(back) == punch.CHOICE_COPIES and all(to == maps["x"] for _, to in back)
    for _ in range(punch.PUNCH_ROUNDS_AFTER * 3):                     # y keeps asking, unanswered
        hard["y"].round()
    assert not hard["y"].done
    hard["x"].receive(back[0][0], easy_public)
    assert hard["x"].done and hard["x"].peer == easy_public


async def test_a_socket_heard_but_never_chosen_gives_up_at_its_deadline():
    import socket

    a = await UdpEndpoint.open()
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)      # probes, never answers
    other.bind(("127.0.0.1", 0))
    try:
        here = ("127.0.0.1", a.transport.get_extra_info("sockname")[1])
        waiting = asyncio.ensure_future(a.punch(KEY, [other.getsockname()], 1.0, chosen_only=True))
        await asyncio.sleep(0.2)
        other.sendto(PunchCodec(KEY).make(answer=False), here)
        with pytest.raises(punch.PunchError, match="chose another path"):
            await waiting
    finally:
        a.close()
        other.close()


def test_candidates_off_the_wire_are_addresses_never_names():
    assert parse_candidates([["11.0.0.10", 4000], ["192.168.1.2", 5]]) == [("11.0.0.10", 4000), ("192.168.1.2", 5)]
    for bad in ([["localhost", 1]], [["127.0.0.1", 1]], [["0.0.0.0", 1]], [["224.0.0.1", 1]], [["1.2.3.4", 0]],
                [["1.2.3.4", 70000]], [["1.2.3.4"]], "1.2.3.4:5", [[1, 2]], None):
        with pytest.raises(ValueError):
            parse_candidates(bad)
    assert len(parse_candidates([["10.0.0.1", 1000 + i] for i in range(50)])) == punch.MAX_TARGETS


def test_this_machines_candidates_put_the_mapped_address_first_and_leave_out_loopback():
    got = udp_candidates(5000, ["127.0.0.1", "192.168.1.2", "fe80::1", "169.254.1.1", "2001:db8::1"],
                         [("11.0.0.10", 61000)])
    assert got == [("11.0.0.10", 61000), ("192.168.1.2", 5000)]


async def _pair():
    a, b = await UdpEndpoint.open("127.0.0.1"), await UdpEndpoint.open("127.0.0.1")
    pa, pb = await asyncio.gather(a.punch(KEY, [("127.0.0.1", b.port)], 3),
                                  b.punch(KEY, [("127.0.0.1", a.port)], 3))
    assert pa == ("127.0.0.1", b.port) and pb == ("127.0.0.1", a.port)
    ca, cb = await asyncio.gather(a.quic_connect(pa), b.quic_accept(pb))
    return a, b, ca, cb


@pytest.mark.asyncio
async def test_two_sockets_punch_and_carry_messages_in_order_over_quic():
    a, b, ca, cb = await _pair()
    try:
        msgs = [os.urandom(n) for n in (0, 1, 1200, 5000, punch.MAX_MESSAGE)] + [bytes([i]) * 3000 for i in range(200)]

        async def send_all():
            for m in msgs:
                await ca.send(m)

        sending = asyncio.ensure_future(send_all())
        got = [await asyncio.wait_for(cb.recv(), 10) for _ in msgs]
        await sending
        assert got == msgs
        await cb.send(b"back")
        assert await asyncio.wait_for(ca.recv(), 5) == b"back"
        with pytest.raises(ValueError):
            await ca.send(bytes(punch.MAX_MESSAGE + 1))
    finally:
        await ca.close()
        await asyncio.sleep(0.3)
    with pytest.raises(ConnectionError):           # the peer learns of the close
        await asyncio.wait_for(cb.recv(), 5)
    b.close()


@pytest.mark.asyncio
async def test_a_peer_announcing_a_message_over_the_limit_is_cut_off_before_it_is_held():
    a, b, ca, cb = await _pair()
    try:
        # what a hostile peer would write: a length beyond the limit, then bytes
        ca.conn.send_stream_data(ca.stream_id, struct.pack("<I", punch.MAX_MESSAGE + 1) + bytes(4096))
        ca._transmit()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(cb.recv(), 5)
        assert "over the limit" in cb.close_reason and len(cb._rx) <= 4096 + 4
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio
async def test_a_reader_that_falls_behind_holds_a_bounded_backlog_and_loses_nothing(monkeypatch):
    monkeypatch.setattr(punch, "RECV_BUFFER", 64 << 10)
    a, b, ca, cb = await _pair()
    try:
        msgs = [bytes([i % 251]) * 16000 for i in range(64)]            # 1 MB, 16x the backlog

        async def send_all():
            for m in msgs:
                await ca.send(m)

        sending = asyncio.ensure_future(send_all())
        await asyncio.sleep(1.0)                                        # nobody reads meanwhile
        assert cb._queued <= (64 << 10) + 2 * 16000, cb._queued
        got = [await asyncio.wait_for(cb.recv(), 30) for _ in msgs]
        await asyncio.wait_for(sending, 30)
        assert got == msgs
    finally:
        await ca.close()
        b.close()


@pytest.mark.asyncio
async def test_punching_toward_nobody_gives_up_with_a_reason():
    a = await UdpEndpoint.open("127.0.0.1")
    silent = await UdpEndpoint.open("127.0.0.1")           # bound, never answers
    try:
        with pytest.raises(punch.PunchError, match="no answer"):
            await a.punch(KEY, [("127.0.0.1", silent.port)], 0.3)
        with pytest.raises(punch.PunchError):
            await a.punch(KEY, [], 0.3)
    finally:
        a.close()
        silent.close()


@pytest.mark.asyncio
async def test_a_wrong_sessions_punches_open_nothing():
    a, b = await UdpEndpoint.open("127.0.0.1"), await UdpEndpoint.open("127.0.0.1")
    try:
        other = punch.punch_key(b"o" * 32)
        results = await asyncio.gather(a.punch(KEY, [("127.0.0.1", b.port)], 0.5),
                                       b.punch(other, [("127.0.0.1", a.port)], 0.5), return_exceptions=True)
        assert all(isinstance(r, punch.PunchError) for r in results), results
    finally:
        a.close()
        b.close()
