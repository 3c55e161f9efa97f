"""A tunnel gives up on a silent peer, not on its own stalls.

Each side of a tunnel pings every PING_INTERVAL and closes the session once nothing came
from the peer for DEAD_AFTER. That silence used to be timed on the wall clock, so a
process whose loop was held (a swapping laptop hosting, a debugger) closed every tunnel
at the first wake-up, its friends having answered all along. Real sessions over a real
websocket on loopback, the timings shortened.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

import engine.wire.tunnel_session as tunnel_session
from engine.wire.tunnel_session import WS_OPTIONS, Session


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(tunnel_session, "PING_INTERVAL", 0.1)
    monkeypatch.setattr(tunnel_session, "DEAD_AFTER", 0.6)


async def session_pair(start_host: bool = True):
    """(joiner, host, server): two sessions with each other's keys over one websocket;
    the host's started or not (a peer that says nothing)."""
    to_host, to_joiner = os.urandom(32), os.urandom(32)
    made: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(ws):
        s = Session(ws, to_joiner, to_host, role="host", peer_key=b"j" * 32, path="direct")
        made.set_result(s.start() if start_host else s)
        await s.closed.wait() if start_host else await ws.wait_closed()

    server = await serve(handler, "127.0.0.1", 0, **WS_OPTIONS)
    ws = await connect(f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}", **WS_OPTIONS)
    joiner = Session(ws, to_host, to_joiner, role="joiner", peer_key=b"h" * 32, path="direct").start()
    return joiner, await made, server


async def test_a_peer_that_says_nothing_is_given_up_on(quick):
    joiner, host, server = await session_pair(start_host=False)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(joiner.closed.wait(), 10)
        assert time.monotonic() - t0 >= 0.6
        assert "no traffic from the peer" in joiner.close_reason, joiner.close_reason
    finally:
        await joiner.close()
        server.close()


async def test_a_loop_held_past_the_deadline_keeps_its_tunnel(quick):
    joiner, host, server = await session_pair()
    try:
        await asyncio.sleep(0.5)                       # pings answered both ways
        assert joiner.rtt is not None and host.rtt is not None
        time.sleep(2.0)                                # this process does not run: 3 x DEAD_AFTER
        await asyncio.sleep(1.0)                       # both wake; the pings waiting are read
        assert not joiner.closed.is_set() and not host.closed.is_set(), (joiner.close_reason, host.close_reason)
        joiner.rtt = None
        await asyncio.sleep(0.5)
        assert joiner.rtt is not None                  # still answering
    finally:
        await joiner.close()
        await host.close()
        server.close()
