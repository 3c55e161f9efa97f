"""Stage links are sealed (protocol 13): what a peer that proved its key may still not do,
and what a proof or a recorded message is worth on another connection."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from conftest import THREADS
from engine.pipeline.launch import PipelineConfig, launch
from engine.pipeline.stage_server import PROTOCOL_VERSION, StageServer, connect_stage
from engine.wire import frames
from engine.pipeline.stage_protocol import NotAuthorized
from engine.wire.stage_auth import HelloOpener


async def closed_with(ws, timeout: float = 10.0) -> tuple[int, str]:
    """Read until the stage closes this connection; its close code and reason."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as exc:
        assert exc.rcvd is not None, "closed without a close frame"
        return exc.rcvd.code, exc.rcvd.reason


@pytest.fixture
async def stage():
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    try:
        yield server, f"ws://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def head_link(address: str):
    """A control link, as a head opens one (loopback, no secret: the empty key), welcomed."""
    ws = await connect_stage(address, "control", "local")
    assert frames.parse_control(await asyncio.wait_for(ws.recv(), 30))["type"] == "welcome"
    return ws


async def test_after_the_proof_only_sealed_messages_in_order_are_taken(stage):
    """A proven link that sends a plain message, replays a sealed one or flips a bit of one
    is closed with the reason; the stage serves the next head."""
    server, address = stage
    stats = frames.control("get_stats")

    ws = await head_link(address)
    sealed = ws.seal.seal(stats)
    await ws.ws.send(sealed)
    assert frames.parse_control(await ws.recv())["type"] == "stats"   # taken once
    await ws.ws.send(sealed)                                          # the same message again
    code, reason = await closed_with(ws)
    assert code == 1008 and "replayed" in reason, reason

    ws = await head_link(address)
    await ws.ws.send(stats)                                           # plain, after the handshake
    code, reason = await closed_with(ws)
    assert code == 1008 and "plain" in reason, reason

    ws = await head_link(address)
    sealed = bytearray(ws.seal.seal(stats))
    sealed[-20] ^= 1                                                  # one bit of the ciphertext
    await ws.ws.send(bytes(sealed))
    code, reason = await closed_with(ws)
    assert code == 1008 and "tampered" in reason, reason

    # a bad message, then at once a plain shutdown: nothing after the bad one is taken
    # (websockets still hands out what was queued before the close)
    ws = await head_link(address)
    await ws.ws.send("garbage")
    await ws.ws.send(frames.control("shutdown"))
    code, _ = await closed_with(ws)
    assert code == 1008
    await asyncio.sleep(0.5)
    assert not server.closed, "a plain shutdown after a bad message reached the stage"

    ws = await head_link(address)
    await ws.send(stats)
    assert frames.parse_control(await ws.recv())["type"] == "stats"
    await ws.close()
    assert not server.closed


async def test_a_recorded_hello_proves_nothing_on_another_connection(pipeline):
    """The handshake is bound to the connection's challenge: a hello recorded on one
    connection (an observer has it) is refused on the next."""
    address = pipeline.remotes[0].address
    async with connect(address) as first:
        nonce = json.loads(await first.recv())["nonce"]
        recorded = frames.control("hello", role="data", version=PROTOCOL_VERSION, pipeline="local",
                                  auth=HelloOpener(pipeline.route, "data", "local", nonce).auth)
        await first.send(recorded)
        assert json.loads(await first.recv())["type"] == "accept"   # it was good here
    async with connect(address) as second:
        await second.recv()
        await second.send(recorded)
        code, reason = await closed_with(second)
    assert (code, reason) == (1008, "not authorized")


async def test_a_route_token_dies_with_its_head():
    """A data link proven with the route token is closed when the head that gave the token
    lets go of the stage, and the token proves nothing after."""
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    address = f"ws://127.0.0.1:{server.port}"
    try:
        pipe = await launch(PipelineConfig(stage_addr=[address], threads=THREADS))
        route = pipe.head.route
        link = await connect_stage(address, "data", "local", key=route)   # proven: "ready" came
        await pipe.close()
        code, reason = await closed_with(link)
        assert code == 1008 and "head" in reason, reason
        with pytest.raises(ConnectionClosed) as refused:   # (a data link: a machine to try again)
            await connect_stage(address, "data", "local", key=route, timeout=30)
        assert refused.value.rcvd.reason == "not authorized"
        assert not server.closed                          # the stage itself serves on
    finally:
        await server.close()


async def test_a_head_with_a_wrong_or_missing_stage_secret_is_told_which():
    """`--stage-addr ws://host:port` without the #secret the stage printed, or with a wrong
    one: the head says what to fix, not the websocket's "1008 (policy violation)"."""
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS, secret="s3cret").start()
    address = f"ws://127.0.0.1:{server.port}"
    try:
        for given in (address, address + "#wrong"):
            with pytest.raises(NotAuthorized, match="secret in its address"):
                await connect_stage(given, "control", "local", timeout=30)
        proven = await connect_stage(address + "#s3cret", "control", "local", timeout=30)
        assert frames.parse_control(await proven.recv())["type"] == "welcome"
        await proven.close()
    finally:
        await server.close()


async def test_a_closed_stage_server_is_freed():
    """A stage that links on to the next one, closed (its owner stopped sharing): nothing
    keeps it, its model or its threads alive -- no task of its link to the next stage."""
    import gc
    import weakref

    first = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    last = await StageServer("127.0.0.1", 0, pipeline="local", threads=THREADS).start()
    try:
        pipe = await launch(PipelineConfig(stage_addr=[f"ws://127.0.0.1:{first.port}",
                                                       f"ws://127.0.0.1:{last.port}"], threads=THREADS))
        assert first._link is not None                     # it sends on to `last`
        await pipe.close()
        computed_on = list(first._exec._threads)
        assert computed_on
        gone = weakref.ref(first)
        await first.close(wait_s=10)
        del first
        for _ in range(50):
            gc.collect()
            if gone() is None:
                break
            await asyncio.sleep(0.1)
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
        for t in computed_on:
            t.join(10)
            assert not t.is_alive()
    finally:
        await last.close()
        if gone() is not None:
            await gone().close()


async def test_a_web_page_cannot_open_a_link_to_a_stage_or_a_tunnel(stage, tmp_path):
    """A page the user visits may open a WebSocket to this machine's loopback, and a stage
    there with no secret is driven by whoever says hello. A browser always sends Origin
    with the handshake, our clients never do: every server of ours answers it 403
    (engine/wire/ws_server.py), the stage and the host's tunnel port alike."""
    from websockets.exceptions import InvalidStatus

    from engine.wire import invite as inv
    from engine.wire.identity import load_or_create_identity
    from engine.wire.tunnel import TunnelHost

    from engine.wire.relay import Relay

    server, address = stage
    host = TunnelHost(load_or_create_identity(tmp_path), inv.HostState(tmp_path))
    await host.listen("127.0.0.1", 0)
    relay = await Relay().start("127.0.0.1", 0)      # the relay too (aiohttp's, not websockets')
    try:
        for url in (address, f"ws://127.0.0.1:{host._server.sockets[0].getsockname()[1]}",
                    f"ws://127.0.0.1:{relay.port}/v1/pake/4821"):
            with pytest.raises(InvalidStatus) as refused:
                await connect(url, origin="http://evil.example", open_timeout=10)
            assert refused.value.response.status_code == 403, url
        await (await head_link(address)).close()     # a head sends no Origin: in
        await (await connect(f"ws://127.0.0.1:{relay.port}/v1/pake/4821", open_timeout=10)).close()
    finally:
        await host.close()
        await relay.close()


async def test_another_program_on_this_machine_cannot_drive_the_pipelines_own_stages():
    """The stage processes `serve --stages N` starts listen on loopback, where every program
    and every user of this computer reaches them, and a control connection drives a stage
    (a model by path, shutdown). Each is given a fresh secret through its environment,
    which only this user's processes read, never on its command line, which everyone's do.
    As users run it: `serve --stages 2` with no other setting."""
    from engine.wire.stage_auth import split_address

    pipe = await launch(PipelineConfig(model="default", stages=2))
    try:
        (proc,), (address,) = pipe.local.procs, pipe.local.addresses
        url, secret = split_address(address)
        assert secret and pipe.head.remotes[0].address == url == f"ws://127.0.0.1:{pipe.local.ports[0]}"
        with pytest.raises(NotAuthorized):
            await connect_stage(url, "control", "local", timeout=30)
        assert secret.encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
        assert secret not in json.dumps(pipe.head.info())       # nor in what the head shows
        prompt = pipe.head.chat_prompt([{"role": "user", "content": "Hello"}])
        from engine.core.sampling import SamplingParams

        done = None
        async for ev in pipe.head.submit(list(prompt), SamplingParams(greedy=True, max_tokens=4)):
            done = ev
        assert done is not None and getattr(done, "error", None) is None   # its own head: in
    finally:
        await pipe.close()
