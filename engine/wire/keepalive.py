"""A websockets client connection whose heartbeat does not blame the peer for our own
stalls (engine/core/heartbeat.py says why).

Only the waiting differs from websockets' own keepalive: a ping every `ping_interval`,
and on a silence of `ping_timeout` the connection fails the way websockets fails it
(close 1011 "keepalive ping timeout", no close frame awaited from a peer that stopped
answering), which is what the head reads as "the stage stopped answering".
"""

from __future__ import annotations

import asyncio

from websockets.asyncio.client import ClientConnection
from websockets.frames import CloseCode

from engine.core.heartbeat import Silence

TICK_S = 0.25


class HeartbeatConnection(ClientConnection):
    tick = TICK_S

    async def keepalive(self) -> None:
        assert self.ping_interval is not None
        latency = 0.0
        try:
            while True:
                await asyncio.sleep(max(0.0, self.ping_interval - latency))
                pong = await self.ping()
                if self.ping_timeout is None:
                    continue
                silence = Silence(self.ping_timeout, self.tick, self.loop.time())
                while not pong.done():
                    # asyncio.wait leaves the pong's future alone when it times out
                    await asyncio.wait([pong], timeout=self.tick)
                    if not pong.done() and silence.advance(self.loop.time()):
                        async with self.send_context():
                            self.protocol.fail(CloseCode.INTERNAL_ERROR, "keepalive ping timeout")
                        raise AssertionError("send_context() waits for connection_lost(), which cancels keepalive()")
                latency = pong.result()
        except Exception:
            self.logger.error("keepalive ping failed", exc_info=True)
