"""The heartbeat of the connections a head opens, over real sockets: a peer that stops
answering is given up on; our own loop held for longer than the timeout is not taken
for a silent peer (websockets' own keepalive takes it for one: checked side by side)."""

import asyncio
import threading
import time

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import serve
from websockets.protocol import State

from engine.wire.keepalive import HeartbeatConnection


class Peer:
    """An echo server on its own thread and loop; `freeze(s)` holds that loop, as a PC
    that went to sleep holds everything: the kernel still takes the bytes, nobody reads."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.port = None
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._up.wait(10)

    def _run(self):
        async def echo(ws):
            async for m in ws:
                await ws.send(m)

        async def main():
            self._stop = asyncio.Event()
            async with serve(echo, "127.0.0.1", 0) as server:
                self.port = server.sockets[0].getsockname()[1]
                self._up.set()
                await self._stop.wait()

        self.loop.run_until_complete(main())

    def freeze(self, seconds: float):
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def close(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def client(peer, cls, timeout):
    return connect(f"ws://127.0.0.1:{peer.port}", create_connection=cls, ping_interval=0.2, ping_timeout=timeout,
                   close_timeout=1.0)


async def test_a_peer_that_stops_answering_is_given_up_on(peer):
    async with client(peer, HeartbeatConnection, 1.0) as ws:
        await ws.send("hi")
        assert await ws.recv() == "hi"
        peer.freeze(8.0)
        start = time.monotonic()
        await asyncio.wait_for(ws.wait_closed(), 6.0)      # well before the peer wakes
        assert time.monotonic() - start >= 0.9
        # what the head reads as "the stage stopped answering"
        assert ws.protocol.close_sent.code == 1011 and ws.protocol.close_rcvd is None
        assert ws.protocol.close_sent.reason == "keepalive ping timeout"


async def test_our_own_loop_held_past_the_timeout_is_not_a_silent_peer(peer):
    ours = await client(peer, HeartbeatConnection, 2.0)
    theirs = await client(peer, ClientConnection, 2.0)
    try:
        await asyncio.sleep(0.3)
        # the peer is slow for a moment, so that a ping is outstanding on each...
        peer.freeze(3.0)
        await asyncio.sleep(0.5)
        # ...when our loop is held (the pong arrives meanwhile, at ~3 s, and waits in the socket)
        time.sleep(5.0)
        await asyncio.sleep(0.5)
        # websockets' own keepalive timed out on waking: the check can tell the difference
        assert theirs.state is not State.OPEN
        assert theirs.protocol.close_sent is not None and theirs.protocol.close_sent.code == 1011
        assert ours.state is State.OPEN
        await ours.send("still there")
        assert await asyncio.wait_for(ours.recv(), 5.0) == "still there"
    finally:
        await ours.close()
        await theirs.close()
