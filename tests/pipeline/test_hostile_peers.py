"""A peer that proved its key can still be frozen, buggy or hostile: what it can make a
stage (or a head) hold is bounded, and it gets its connection closed, never the process
crashed or the stage's one head slot held for ever. Real servers, real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import torch
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from engine.model.sources import resolve
from engine.pipeline import step_rows
from engine.pipeline.stage_server import CONTROL_MAX, StageServer, connect_stage
from engine.wire import frames


@pytest.fixture
async def stage():
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=1).start()
    try:
        yield server, f"ws://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def _head(addr):
    ws = await connect_stage(addr, "control", "local")
    assert frames.parse_control(await asyncio.wait_for(ws.recv(), 30))["type"] == "welcome"
    return ws


async def _closed(ws, timeout=30):
    """The close the stage sent, once it shows."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as exc:
        return exc.rcvd


@pytest.mark.parametrize("then", ["nothing", "a message too big"])
async def test_a_head_that_stops_reading_is_cut_and_the_stage_takes_another(stage, then):
    """A head asks for its line's filler and then reads nothing (frozen, or hostile): the
    stage's send waits on a full buffer, which websockets' keepalive cannot see (its ping
    waits on the same buffer); or, sent a message too big, the stage starts a close that
    waits for that buffer to drain while its handler waits for the next message. The
    stage cuts it after send_stall_s, and the next head is taken (before, the slot stayed
    held while the connection lived)."""
    server, addr = stage
    server.send_stall_s = 1.0
    frozen = await _head(addr)
    # frozen: reads nothing from here on, and sends no heartbeat (which would end it
    # from the head's side)
    frozen.ws.keepalive_task.cancel()
    frozen.transport.pause_reading()

    async def ask():       # 300 x 64 KiB asked: more than the socket buffers hold
        for _ in range(300):
            await frozen.send(frames.control("line_test", bytes=frames.LINE_TEST_MAX))

    try:   # (the asking itself waits once the stage stops reading, until it is cut)
        await asyncio.wait_for(ask(), 30)
        if then == "a message too big":
            await asyncio.wait_for(frozen.ws.send(b"x" * (CONTROL_MAX + 1)), 30)
    except (ConnectionClosed, asyncio.TimeoutError):
        pass
    t0 = time.monotonic()
    while server._control_ws is not None and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.1)
    assert server._control_ws is None, "the stage still holds the frozen head"
    frozen.transport.abort()
    fresh = await _head(addr)                    # the slot is free again
    try:
        await fresh.send(frames.control("get_stats"))
        assert frames.parse_control(await asyncio.wait_for(fresh.recv(), 30))["type"] == "stats"
    finally:
        await fresh.close()


async def test_a_control_message_past_what_control_carries_is_refused_from_its_header(stage):
    """A proven head's control connection carries control messages (at most MAX_CONTROL):
    one larger is refused from its frame header (1009), not read into memory first (it
    was lifted to a data link's gigabyte)."""
    _, addr = stage
    ws = await _head(addr)
    await ws.send("x" * (CONTROL_MAX + 1))
    rcvd = await _closed(ws)
    assert rcvd is not None and rcvd.code == 1009, rcvd


@pytest.mark.parametrize("kind", ["ready", "line_fill", "accept"])
async def test_a_message_only_a_stage_sends_closes_the_heads_connection(stage, kind):
    server, addr = stage
    ws = await _head(addr)
    fields = {"ready": {}, "line_fill": {"fill": "x"}, "accept": {"auth": "00"}}[kind]
    await ws.send(frames.control(kind, **fields))
    rcvd = await _closed(ws)
    assert rcvd is not None and rcvd.code == 1008 and kind in rcvd.reason, rcvd
    assert server.rejected_frames >= 1
    (await _head(addr)).transport.abort()     # and the stage takes the next head


async def test_a_next_stage_that_is_no_address_or_does_not_answer_is_an_error_not_a_dead_link(stage, tiny_folder):
    """configure's `next` is said back as an error, on a connection that goes on: a text
    that is no stage address before anything loads, an address where nothing answers
    after the layers load (it closed the control connection with a traceback)."""
    server, addr = stage
    folder, _ = tiny_folder("llama", seed=0)
    configure = dict(model=str(folder), start=3, end=6, dtype="float32", kv_budget_tokens=None, threads=None,
                     link=None, compress=None, compute=None, acks=True, weights="bf16", profile=None,
                     route="r" * 32, fingerprint=resolve(str(folder)).fingerprint())
    with socket.socket() as s:                   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    ws = await _head(addr)
    try:
        for nxt, said in [("ws://127.0.0.1", "not a stage's address"), ("file:///etc/passwd", "not a stage's address"),
                          (f"ws://127.0.0.1:{closed_port}#secret", "cannot reach the next stage at ws://127.0.0.1:")]:
            await ws.send(frames.control("configure", next=nxt, **configure))
            msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 60))
            while msg["type"] == "progress":
                msg = frames.parse_control(await asyncio.wait_for(ws.recv(), 60))
            assert msg["type"] == "error" and said in msg["message"], msg
            assert "secret" not in msg["message"]
        await ws.send(frames.control("get_stats"))   # the connection goes on
        assert frames.parse_control(await asyncio.wait_for(ws.recv(), 30))["type"] == "stats"
    finally:
        await ws.close()


async def test_a_head_reads_little_from_whoever_answers_before_it_proves_the_key():
    """The head dials a stage's old address (a dropped machine it probes): whoever answers
    there now may send a challenge, not a quarter of a gigabyte the head reads whole."""
    async def impostor(ws):
        await ws.send("x" * (8 << 20))
        await asyncio.sleep(5)

    async with serve(impostor, "127.0.0.1", 0, max_size=1 << 10) as srv:
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(ConnectionClosed) as got:
            await connect_stage(f"ws://127.0.0.1:{port}", "control", "local", timeout=10)
        assert got.value.sent is not None and got.value.sent.code == 1009


def test_a_failed_steps_answer_stays_within_what_a_head_reads():
    """4096 rows failing with a long reason: each row carries it, cut so that the frame
    is one the head decodes (it refused it, and dropped the stage for a fault upstream)."""
    rows = [[i, 0, 1] for i in range(frames.MAX_ROWS)]
    step = frames.decode(frames.encode(frames.FrameType.ACTIVATIONS, 0, 7, {"rows": rows}, torch.zeros(len(rows), 4)))
    why = "no sampling parameters for sequences " + "é" * 600
    answer = frames.decode(step_rows.failed(step, why))
    assert len(answer.meta["errors"]) == frames.MAX_ROWS
    said = answer.meta["errors"][0][1]
    assert said.startswith("no sampling parameters") and said.endswith("…") and len(said) < len(why)
    one = frames.decode(frames.encode(frames.FrameType.ACTIVATIONS, 0, 7, {"rows": rows[:1]}, torch.zeros(1, 4)))
    assert frames.decode(step_rows.failed(one, why)).meta["errors"][0][1] == why   # room for it whole
    assert len(json.dumps(frames.decode(step_rows.failed(step, why)).meta)) <= frames.MAX_META


async def test_a_lane_waiting_on_a_full_outbox_goes_on_once_the_route_changes():
    """The outbound queue is bounded; a reconfigure retires it, and a compute lane waiting
    to put into it must not wait for ever (nobody empties it any more)."""
    from engine.pipeline.outbox import Outbox

    box = Outbox(1)
    await box.put("a")
    waiting = asyncio.ensure_future(box.put("b"))
    await asyncio.sleep(0.05)
    assert not waiting.done()                    # full: the lane waits (backpressure)
    box.retire()
    await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(box.put("c"), 5)      # retired: dropped at once


async def test_a_peer_with_the_route_token_holds_a_few_data_links_and_no_frame_of_another_width(stage, tiny_folder):
    """Every friend stage of a pipeline holds its route token, so one could open data links
    without end, each buffering volumes and queued frames: beyond MAX_DATA_LINKS the oldest
    is closed, and each takes messages of a piece's size and volumes its KV could hold. An int8 activation frame of a width the stage does not compute on is
    refused from its shape, before its dequantized copy (four times its bytes) is made."""
    from engine.pipeline.stage_protocol import MAX_DATA_LINKS
    from engine.wire.volumes import encode_chunk

    server, addr = stage
    folder, _ = tiny_folder("llama", seed=0)
    route = "r" * 32
    configure = dict(model=str(folder), start=3, end=6, dtype="float32", kv_budget_tokens=None, threads=None,
                     link=None, compress=None, compute=None, acks=True, weights="bf16", profile=None,
                     route=route, fingerprint=resolve(str(folder)).fingerprint(), next=None)
    head = await _head(addr)
    links = []
    try:
        await head.send(frames.control("configure", **configure))
        msg = frames.parse_control(await asyncio.wait_for(head.recv(), 60))
        while msg["type"] == "progress":
            msg = frames.parse_control(await asyncio.wait_for(head.recv(), 60))
        assert msg["type"] == "configured", msg
        for _ in range(MAX_DATA_LINKS + 2):
            links.append(await connect_stage(addr, "data", "local", key=route, timeout=30))
        for old in links[:2]:
            closed = await _closed(old)
            assert (closed.code, closed.reason) == (1008, "too many data links")
        assert len(server._data_links) == MAX_DATA_LINKS
        # a width no layer of this model has (the tiny llama's hidden is 64), as int8 blocks
        wide = torch.randn(4, 64 * 256)
        meta = {"rows": [[1, 0, 4]], "new": {}}
        rejected = server.rejected_frames
        await links[-1].send(frames.encode(frames.FrameType.ACTIVATIONS, 0, 0, meta, wide, q8=True))
        closed = await _closed(links[-1])
        assert closed.code == 1008 and "hidden size" in closed.reason
        assert server.rejected_frames == rejected + 1
        # a link's messages are pieces (link.MAX_PIECE): one of 1 MiB is refused from its
        # header; and a volume announced larger than this stage's KV could take rows for
        await links[-2].send(b"\0" * (1 << 20))
        assert (await _closed(links[-2])).code == 1009           # message too big
        cap = server._volume_cap()
        assert cap < 128 << 20                                   # a gigabyte before
        await links[-3].send(encode_chunk(1, "prefill", 0, cap + 1, b"\0" * 1024))
        closed = await _closed(links[-3])
        assert closed.code == 1008 and "outside" in closed.reason, closed.reason
        await head.send(frames.control("get_stats"))   # the stage serves on
        assert frames.parse_control(await asyncio.wait_for(head.recv(), 30))["type"] == "stats"
    finally:
        for link in links:
            await link.close()
        await head.close()
