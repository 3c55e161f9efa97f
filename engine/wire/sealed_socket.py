"""A websockets connection whose every message is sealed (engine/wire/stage_auth.py Seal).

Stage links hand this to the code that used the plain connection: send, recv, `async
for`, close, ping and the few attributes the link layer reads all behave as before,
with the bytes on the wire sealed. A message that fails to open (tampered, replayed,
plain) closes the connection with 1008 and its reason, and the reader sees the close
as it sees any other: the process goes on.
"""

from __future__ import annotations

from websockets.exceptions import ConnectionClosedOK

from engine.wire.stage_auth import Seal, SealError


class SealedSocket:
    def __init__(self, ws, seal: Seal):
        self.ws = ws
        self.seal = seal

    async def send(self, message: str | bytes) -> None:
        await self.ws.send(self.seal.seal(message))

    async def recv(self) -> str | bytes:
        message = await self.ws.recv()
        try:
            return self.seal.open(message)
        except SealError as exc:
            await self.ws.close(1008, str(exc)[:120])
            # nothing after a bad message is taken: websockets still hands out what was
            # queued before (and during) the close, so drain it until the close shows
            while True:
                await self.ws.recv()      # ends in ConnectionClosed, as any closed link does

    async def __aiter__(self):
        while True:
            try:
                yield await self.recv()
            except ConnectionClosedOK:
                return

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.ws.close(code, reason)

    async def wait_closed(self) -> None:
        await self.ws.wait_closed()

    async def ping(self, data=None):
        return await self.ws.ping(data)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # what the link layer reads of the connection under it
    @property
    def transport(self):
        return self.ws.transport

    @property
    def protocol(self):
        return self.ws.protocol

    @property
    def recv_messages(self):
        return self.ws.recv_messages

    @property
    def close_code(self):
        return self.ws.close_code

    @property
    def close_reason(self):
        return self.ws.close_reason

    @property
    def remote_address(self):
        return self.ws.remote_address

    @property
    def state(self):
        return self.ws.state
