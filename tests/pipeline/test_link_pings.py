"""The data link's RTT pings (engine/pipeline/link.py): a ping is unanswered only in
time this process ran, and one unanswered ping does not end the measuring.

Real websockets on loopback; a loop "held" is a plain blocking sleep on it, what a step
computed on the loop or a swapping laptop does to a stage."""

import asyncio
import time

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from engine.core.link_scheduler import LinkScheduler
from engine.pipeline.link import LinkSender, pong_rtt


async def _server(handler=None):
    async def idle(ws):
        await ws.wait_closed()

    server = await serve(handler or idle, "127.0.0.1", 0, compression=None)
    return server, server.sockets[0].getsockname()[1]


async def test_a_ping_answered_while_our_loop_was_held_is_a_figure_not_a_timeout():
    """Held past the ping's timeout, our loop finds the pong waiting: a figure (which
    keeps the hold: the acks pacing the link wait on the same loop), not a lost ping."""
    server, port = await _server()
    try:
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            waiter = await ws.ping()
            task = asyncio.ensure_future(pong_rtt(waiter, 0.3, tick=0.02))
            await asyncio.sleep(0)          # the waiter is waiting
            time.sleep(0.6)                 # our loop is held; the peer is fine
            rtt = await task
            assert rtt is not None and rtt >= 0.55, rtt
    finally:
        server.close()


async def test_an_unanswered_ping_gives_no_figure_in_running_time_and_a_held_loop_is_not_silence():
    fut = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    assert await pong_rtt(fut, 0.2, tick=0.02) is None
    assert 0.18 <= time.monotonic() - t0 < 5

    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(pong_rtt(fut, 0.3, tick=0.02))
    await asyncio.sleep(0)
    time.sleep(0.5)                         # longer than the timeout, all of it ours
    fut.set_result(0.52)
    assert await task is not None           # answered: the 0.5 s were not the peer's


async def test_pings_go_on_measuring_after_one_goes_unanswered():
    """The peer stops reading for a while (its pongs stop), then reads again: the link
    measures again (it used to stop pinging for good at the first unanswered ping)."""
    paused = asyncio.Event()

    async def pauses(ws):
        ws.transport.pause_reading()
        paused.set()
        await asyncio.sleep(0.8)
        ws.transport.resume_reading()
        await ws.wait_closed()

    server, port = await _server(pauses)
    try:
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            await paused.wait()
            link = LinkSender(ws, LinkScheduler(mode="jit", decode_time=lambda n: 0.02),
                              stall_timeout=0.2, ping_interval=0.05).start()
            try:
                await asyncio.sleep(0.5)
                assert link.rtt_min is None           # nothing answered yet
                deadline = time.monotonic() + 10
                while link.rtt_min is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert link.rtt_min is not None and link.rtt_min < 0.5, link.rtt_min
            finally:
                await link.close()
    finally:
        server.close()
