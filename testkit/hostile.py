"""Hostile-input suite (run it with bench/hostile.py): attack a live cross-home pipeline
and count what happens.

Starts, as separate processes on loopback, a relay (`potluck relay`), a host
(`potluck host --relay ... --listen ...`: head + stage 0 + API) and a joiner
(`potluck join CODE`: stage 1 through the relay), then, while a client keeps sending
legitimate chat requests to the host's API, throws at them:

  * fuzzing (hypothesis) of the invite parser, the stage frame decoder, the tunnel's
    handshake and inner-frame parsers, the Noise responder and the transport cipher;
  * the host's direct tunnel port: garbage, text, truncated and oversized messages;
    a flood of joins with wrong secrets; wrong host keys; unknown, expired, used-up
    and revoked credentials; replayed handshakes; after a real handshake, tampered,
    replayed and out-of-order frames and forbidden stream opens;
  * the relay: garbage bytes and bad requests, unknown pipelines, hijacking the
    host's registration, forged accepts, text and oversized frames, a join flood;
  * the joiner's stage server itself: bad hellos, garbage, truncated and oversized
    frames, a second head;
  * the host's OpenAI-compatible API: malformed n, logprobs, top_logprobs, tools,
    response_format, presence_penalty and frequency_penalty (bounds, types, NaN, huge
    and deeply nested values, schemas no grammar can be made of), and fields it does not
    implement (modalities, audio, prediction), each a 400 naming its field;
  * a web page in the user's browser (testkit/hostile_pages.py): WebSocket handshakes
    with an Origin, the API from an origin not named and addressed to another host;
  * slow connections that never finish a handshake (TCP only, WebSocket without a
    hello), on all three.

Every input must be rejected (an exception of the parser's own error type, or the
server closing that connection / refusing with a reason), no process may die or log a
traceback, and the legitimate chat must keep completing. Prints a summary table.

    .venv/bin/python bench/hostile.py                 # full run (a few minutes)
    .venv/bin/python bench/hostile.py --scale 0.1     # quick (tests/wire/test_hostile.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["POTLUCK_KEYSTORE"] = "file"

import aiohttp  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus  # noqa: E402

from engine.wire import invite as inv
from engine.wire import noise
from engine.wire import tunnel
from engine.wire import frames
from engine.wire.identity import load_or_create_identity  # noqa: E402
from engine.pipeline.stage_server import PROTOCOL_VERSION  # noqa: E402
from testkit.hostile_pages import attack_pages  # noqa: E402

PROMPT = "What is the capital of France?"


@dataclass
class Row:
    tried: int = 0
    rejected: int = 0
    crashes: int = 0
    reasons: Counter = field(default_factory=Counter)


class Tally:
    def __init__(self):
        self.rows: dict[str, Row] = {}

    def row(self, name) -> Row:
        return self.rows.setdefault(name, Row())

    def rejected(self, name, reason: str):
        r = self.row(name)
        r.tried += 1
        r.rejected += 1
        r.reasons[_short(reason)] += 1

    def accepted(self, name, what: str):
        """An input that was not rejected: a hole (counted as tried, not rejected)."""
        r = self.row(name)
        r.tried += 1
        r.reasons["NOT REJECTED: " + _short(what)] += 1

    def crash(self, name, what: str):
        r = self.row(name)
        r.tried += 1
        r.crashes += 1
        r.reasons["CRASH: " + _short(what)] += 1


def _short(s: str) -> str:
    s = re.sub(r"\d+", "N", str(s))
    return s[:70]


# ---- processes ------------------------------------------------------------------------
class Proc:
    def __init__(self, name, argv, env, folder: Path):
        self.name = name
        self.err_path = folder / f"{name}.err"
        self.out_path = folder / f"{name}.out"
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                  stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"))

    async def wait_line(self, pattern: str, timeout: float, stream="out") -> re.Match:
        path = self.out_path if stream == "out" else self.err_path
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, path.read_text(errors="replace"), re.M)
            if m:
                return m
            if self.p.poll() is not None:
                break
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name}: no {pattern!r} (exit {self.p.poll()}); stderr:\n"
                           f"{self.err_path.read_text(errors='replace')[-3000:]}")

    def tracebacks(self) -> int:
        return self.err_path.read_text(errors="replace").count("Traceback")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_world(folder: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    py = sys.executable
    relay = Proc("relay", [py, "-m", "engine", "relay", "--host", "127.0.0.1", "--port", "0"],
                 dict(env, POTLUCK_HOME=str(folder / "relay")), folder)
    m = await relay.wait_line(r"--relay ws://127.0.0.1:(\d+)", 60)
    relay_url = f"ws://127.0.0.1:{m.group(1)}"
    api_port = _free_port()
    host_home = folder / "host"
    host = Proc("host", [py, "-m", "engine", "host", "--relay", relay_url, "--listen", "127.0.0.1:0",
                         "--port", str(api_port), "--threads", "1"],
                dict(env, POTLUCK_HOME=str(host_home)), folder)
    m = await host.wait_line(r"^Invite code.*\n(\S+)$", 120)
    code = m.group(1)
    m = await host.wait_line(r"directly on port (\d+)", 10, stream="err")
    direct_url = f"ws://127.0.0.1:{m.group(1)}"
    joiner = Proc("joiner", [py, "-m", "engine", "join", code, "--prefer", "relay", "--threads", "1",
                             "--name", "legit-friend"],
                  dict(env, POTLUCK_HOME=str(folder / "joiner")), folder)
    await host.wait_line(r"^OpenAI-compatible API", 300)
    return dict(relay=relay, host=host, joiner=joiner, relay_url=relay_url, direct_url=direct_url,
                api=f"http://127.0.0.1:{api_port}/v1", code=code, host_home=host_home)


def stage_port(pid: int) -> int | None:
    import psutil

    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1":
            return c.laddr.port
    return None


# ---- legitimate traffic ------------------------------------------------------------------
class Legit:
    def __init__(self, api: str):
        self.api = api
        self.completed = self.failed = 0
        self.errors: list[str] = []
        self.stop = asyncio.Event()

    async def one(self, session) -> bool:
        body = {"model": "default", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT}]}
        try:
            async with session.post(f"{self.api}/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=180)) as r:
                data = await r.json()
            text = data["choices"][0]["message"]["content"]
            ok = r.status == 200 and bool(text)
        except Exception as exc:  # noqa: BLE001
            ok, text = False, repr(exc)
        if ok:
            self.completed += 1
        else:
            self.failed += 1
            self.errors.append(str(text)[:200])
        return ok

    async def loop(self):
        async with aiohttp.ClientSession() as s:
            while not self.stop.is_set():
                await self.one(s)
                await asyncio.sleep(0.2)


# ---- helpers for network attacks ---------------------------------------------------------
WS = dict(open_timeout=15, close_timeout=5, max_size=1 << 20, ping_interval=None)


async def ws_exchange(url: str, first, *, wait: float = 20.0):
    """Connect, send `first` (or nothing), and return how the server answered:
    ("refused", reason) or ("open", None) if it kept the connection open for `wait` s."""
    try:
        async with connect(url, **WS) as ws:
            if first is not None:
                await ws.send(first)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    msg = await asyncio.wait_for(ws.recv(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
                if isinstance(msg, (bytes, bytearray)) and msg[:1] == b"\x00":
                    return "refused", bytes(msg[1:]).decode(errors="replace")
            else:
                pass
            return "open", None
    except ConnectionClosed as exc:
        r = exc.rcvd
        return "refused", (f"{r.code} {r.reason}" if r else "closed")
    except (InvalidStatus, InvalidHandshake) as exc:
        return "refused", f"http {exc}"
    except (OSError, asyncio.TimeoutError) as exc:
        return "refused", f"connection {type(exc).__name__}"


async def gather_limited(coros, limit=16):
    sem = asyncio.Semaphore(limit)

    async def run(c):
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


def _hello(mode, pipeline, invite_id, msg1: bytes) -> bytes:
    return tunnel.MAGIC + bytes([mode]) + pipeline + invite_id + msg1


# ---- fuzzing ------------------------------------------------------------------------
def fuzz(t: Tally, n: int, code: str):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cfg = settings(max_examples=n, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))
    valid = inv.parse(code)

    def guard(name, fn, expected):
        def run(data):
            try:
                fn(data)
            except expected as exc:
                t.rejected(name, str(exc))
                return
            except Exception as exc:  # noqa: BLE001
                t.crash(name, f"{type(exc).__name__}: {exc}")
                return
            t.accepted(name, "parsed")
        return run

    # invite parser: random text, and valid codes with edits
    g = guard("fuzz: invite parser", inv.parse, inv.InviteError)

    @cfg
    @given(st.one_of(st.text(max_size=400), st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
                     st.tuples(st.integers(0, len(code) - 1), st.characters()).map(
                         lambda e: code[:e[0]] + e[1] + code[e[0] + 1:]),
                     st.integers(1, len(code) - 1).map(lambda k: code[:k])))
    def f1(s):
        try:
            same = inv.parse(s) == valid
        except inv.InviteError:
            same = False
        if same:    # the same code spelled another way (case, O/0, I/L/1, spaces): not a typo
            t.row("fuzz: invite parser").reasons["(same code, other spelling; not counted)"] += 1
            return
        g(s)

    f1()

    g = guard("fuzz: stage frame decoder", frames.decode, frames.FrameError)
    import torch

    good = frames.encode(frames.FrameType.ACTIVATIONS, 1, 1, {"rows": [[1, 0, 2]]}, torch.zeros(2, 8))

    @cfg
    @given(st.one_of(st.binary(max_size=400),
                     st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)).map(
                         lambda e: good[:e[0]] + bytes([e[1]]) + good[e[0] + 1:]),
                     st.integers(0, len(good) - 1).map(lambda k: good[:k])))
    def f2(b):
        if b == good:
            return
        try:
            frames.decode(b)
        except frames.FrameError as exc:
            t.rejected("fuzz: stage frame decoder", str(exc))
        except Exception as exc:  # noqa: BLE001
            t.crash("fuzz: stage frame decoder", f"{type(exc).__name__}: {exc}")
        else:   # a mutation that is still a well-formed frame (e.g. in the tensor bytes): not an attack input
            t.row("fuzz: stage frame decoder").reasons["(well-formed mutation, decoded; not counted)"] += 1

    f2()

    host_priv = X25519PrivateKey.generate()
    psk = os.urandom(32)

    def responder(b):
        mode, pipeline, iid, prologue, msg1 = tunnel.parse_hello(b)
        noise.Responder(host_priv, prologue, psk=psk if mode == 1 else None).read_1(msg1)

    g = guard("fuzz: tunnel handshake", responder, noise.NoiseError)
    real = _hello(1, valid.pipeline, valid.invite_id,
                  noise.Initiator(X25519PrivateKey.generate(), noise.public_bytes(host_priv), b"x", psk).write_1(b"{}"))

    @cfg
    @given(st.one_of(st.binary(max_size=300),
                     st.binary(min_size=0, max_size=200).map(lambda b: real[:21] + b),
                     st.tuples(st.integers(0, len(real) - 1), st.integers(0, 255)).map(
                         lambda e: real[:e[0]] + bytes([e[1] ^ 0x5A]) + real[e[0] + 1:])))
    def f3(b):
        g(b)

    f3()

    key = os.urandom(32)
    sender = noise.TransportCipher(key)
    sealed = [sender.encrypt(tunnel.pack_inner(tunnel.DATA, 1, os.urandom(20))) for _ in range(3)]

    def transport(b):
        rx = noise.TransportCipher(key)
        tunnel.parse_inner(rx.decrypt(b))

    g = guard("fuzz: tunnel transport", transport, noise.NoiseError)

    @cfg
    @given(st.one_of(st.binary(max_size=200), st.sampled_from(sealed[1:]),
                     st.tuples(st.integers(0, len(sealed[0]) - 1), st.integers(1, 255)).map(
                         lambda e: sealed[0][:e[0]] + bytes([sealed[0][e[0]] ^ e[1]]) + sealed[0][e[0] + 1:])))
    def f4(b):
        g(b)

    f4()


# ---- the host's direct tunnel port ------------------------------------------------------
async def attack_host(t: Tally, w: dict, n: int, flood: int, folder: Path):
    url = w["direct_url"]
    real = inv.parse(w["code"])
    name = "host: garbage/truncated/oversized"
    samples = [os.urandom(random.randint(0, 3000)) for _ in range(n)]
    samples += [b"PLT1", b"PLT1\x09" + os.urandom(60), _hello(1, real.pipeline, real.invite_id, os.urandom(40)),
                _hello(2, os.urandom(8), bytes(8), os.urandom(100)), "a text frame",
                os.urandom(tunnel.MAX_MESSAGE + 5000)]
    for kind, reason in await gather_limited([ws_exchange(url, s) for s in samples]):
        (t.rejected if kind == "refused" else t.accepted)(name, reason or "kept open")

    # a flood of joins with wrong secrets, against an open invite (uses left)
    name = "host: wrong-secret join flood"
    state = inv.HostState(w["host_home"])
    open_inv, _ = state.create_invite(real.host_key, w["relay_url"], [url], max_uses=1000)

    async def wrong_secret():
        bad = inv.Invite(**{**open_inv.__dict__, "secret": os.urandom(16)})
        me = load_or_create_identity(folder / "mallory")
        try:
            s = await tunnel.open_session(bad, me, ("127.0.0.1", 9), prefer="direct")
        except tunnel.TunnelError as exc:
            return str(exc)
        await s.close("oops")
        return None

    for reason in await gather_limited([wrong_secret() for _ in range(flood)], 32):
        (t.rejected if reason else t.accepted)(name, reason or "joined")

    # credentials: wrong host key, unknown member, expired, used up, revoked, replayed
    name = "host: bad credentials"
    state = inv.HostState(w["host_home"])
    mallory = load_or_create_identity(folder / "mallory")
    cases = []
    other = inv.Invite(**{**real.__dict__, "host_key": noise.public_bytes(X25519PrivateKey.generate())})
    cases.append(("wrong host key", other, False))
    cases.append(("unknown member", real, True))
    exp, _ = state.create_invite(real.host_key, "", [url], ttl_s=-10)
    cases.append(("expired", exp, False))
    cases.append(("used up", real, False))      # the legit joiner used the only use
    for _ in range(max(1, n // 10)):
        for label, invite, member in cases:
            try:
                s = await tunnel.open_session(invite, mallory, ("127.0.0.1", 9), member=member, prefer="direct")
                await s.close("x")
                t.accepted(name, label)
            except tunnel.TunnelError as exc:
                t.rejected(name, str(exc))

    # a real join by mallory (its own invite), then abuse inside the session
    mine, _ = state.create_invite(real.host_key, "", [url], max_uses=1)
    s = await tunnel.open_session(mine, mallory, ("127.0.0.1", 9), prefer="direct")
    await s.close("bye")
    name = "host: replayed handshake"
    for _ in range(max(1, n // 10)):
        prologue = _hello(2, real.pipeline, bytes(8), b"")
        ini = noise.Initiator(mallory.private, real.host_key, prologue)
        msg = prologue + ini.write_1(b"{}")
        first = await ws_exchange(url, msg, wait=3)
        again = await ws_exchange(url, msg, wait=10)
        (t.rejected if again[0] == "refused" and "replayed" in (again[1] or "") else t.accepted)(
            name, again[1] or "kept open")
        del first
    name = "host: tampered/replayed/forbidden frames"
    for i in range(max(3, n // 5)):
        s = await tunnel.open_session(mine, mallory, ("127.0.0.1", 9), member=True, prefer="direct")
        kind = i % 4
        good = s.tx.encrypt(tunnel.pack_inner(tunnel.PING, 0))
        if kind == 0:                                 # tampered
            bad = bytearray(good)
            bad[-3] ^= 0x40
            await s.ws_out.send(bytes(bad))
        elif kind == 1:                               # replayed
            await s.ws_out.send(good)
            await s.ws_out.send(good)
        elif kind == 2:                               # a joiner may not open streams on the host
            await s.ws_out.send(good)
            await s.ws_out.send(s.tx.encrypt(tunnel.pack_inner(tunnel.OPEN, 7)))
        else:                                         # unknown inner type
            await s.ws_out.send(good)
            await s.ws_out.send(s.tx.encrypt(bytes([99]) + bytes(4)))
        try:
            await asyncio.wait_for(s.closed.wait(), 20)
            t.rejected(name, s.close_reason)
        except asyncio.TimeoutError:
            t.accepted(name, f"case {kind} kept open")
            await s.close("x")
    # revoke mallory: refused from now on
    state.revoke(mallory.node_id)
    try:
        s = await tunnel.open_session(mine, mallory, ("127.0.0.1", 9), member=True, prefer="direct")
        await s.close("x")
        t.accepted("host: bad credentials", "revoked key joined")
    except tunnel.TunnelError as exc:
        t.rejected("host: bad credentials", str(exc))


# ---- the relay ------------------------------------------------------------------------------
async def raw_tcp(host, port, payload: bytes, wait=20.0) -> str | None:
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"connect {type(exc).__name__}"
    try:
        w.write(payload)
        await w.drain()
        data = await asyncio.wait_for(r.read(4096), wait)
        first = data.split(b"\r\n", 1)[0].decode(errors="replace")
        return first or "closed"
    except asyncio.TimeoutError:
        return None
    except (OSError, ConnectionError) as exc:
        return f"reset {type(exc).__name__}"
    finally:
        w.close()


async def attack_relay(t: Tally, w: dict, n: int, flood: int, folder: Path):
    base = w["relay_url"]
    port = int(base.rsplit(":", 1)[1])
    real = inv.parse(w["code"])
    pid = real.pipeline.hex()
    name = "relay: garbage bytes / bad requests"
    payloads = [os.urandom(random.randint(1, 2000)) for _ in range(n)]
    payloads += [b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 100_000 + b"\r\n\r\n",
                 b"GET /v1/join/" + b"z" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(200)]   # a TLS hello
    for reason in await gather_limited([raw_tcp("127.0.0.1", port, p) for p in payloads]):
        (t.rejected if reason else t.accepted)(name, reason or "no answer")
    key = real.host_key.hex()
    urls = [f"{base}/v1/join/{os.urandom(8).hex()}/{key}", f"{base}/v1/join/NOT-AN-ID/{key}",
            f"{base}/v1/join/{pid}/{os.urandom(32).hex()}", f"{base}/v1/join/{pid}", f"{base}/v1/host/{pid}/{key}",
            f"{base}/v1/accept/{pid}/{key}/{'ab' * 16}", f"{base}/v1/accept/{pid}/{key}/../../etc", f"{base}/nope"]
    asks = [ws_exchange(u, None, wait=5) for u in urls * max(1, n // 20)]
    # an impostor listing a pipeline under the host's key, with a proof it cannot make
    forged = json.dumps({"type": "proof", "proof": "0" * 64})
    asks += [ws_exchange(f"{base}/v1/host/{os.urandom(8).hex()}/{key}", forged, wait=15) for _ in range(3)]
    for kind, reason in await gather_limited(asks):
        (t.rejected if kind == "refused" else t.accepted)("relay: unknown pipeline / hijack / forged accept",
                                                       reason or "kept open")
    name = "relay: garbage, text, oversized frames"
    join_url = f"{base}/v1/join/{pid}/{key}"
    samples = [os.urandom(random.randint(1, 5000)) for _ in range(max(3, n // 4))]
    samples += ["text frame", os.urandom(200 << 10)]
    for kind, reason in await gather_limited([ws_exchange(join_url, s) for s in samples], 3):
        (t.rejected if kind == "refused" else t.accepted)(name, reason or "kept open")

    name = "relay: wrong-secret join flood"
    open_inv, _ = inv.HostState(w["host_home"]).create_invite(real.host_key, base, [], max_uses=1000)

    async def wrong_secret():
        bad = inv.Invite(**{**open_inv.__dict__, "secret": os.urandom(16)})
        me = load_or_create_identity(folder / "eve")
        try:
            s = await tunnel.open_session(bad, me, ("127.0.0.1", 9), prefer="relay")
        except tunnel.TunnelError as exc:
            return str(exc)
        await s.close("oops")
        return None

    # under the relay's 8 channels per pipeline (the legitimate joiner holds one), so
    # that the attempts reach the host; beyond it the relay refuses them itself
    for reason in await gather_limited([wrong_secret() for _ in range(flood)], 5):
        (t.rejected if reason else t.accepted)(name, reason or "joined")


# ---- the joiner's stage server --------------------------------------------------------------
async def attack_stage(t: Tally, w: dict, n: int):
    port = stage_port(w["joiner"].p.pid)
    if port is None:
        t.crash("stage: bad frames", "no stage port found")
        return
    url = f"ws://127.0.0.1:{port}"
    pid = inv.parse(w["code"]).pipeline.hex()
    name = "stage: bad hellos and frames"
    # a stranger: it knows the pipeline but not the route token, so its proof is empty
    data_hello = frames.control("hello", role="data", version=PROTOCOL_VERSION, pipeline=pid, auth="")

    async def data_then(frame):
        said = None
        try:
            async with connect(url, **WS) as ws:
                try:
                    await asyncio.wait_for(ws.recv(), 20)   # the stage's challenge (a nonce, nothing else)
                    await ws.send(data_hello)
                    await ws.send(frame)
                    await asyncio.wait_for(ws.recv(), 20)
                    return "open", None
                except ConnectionClosed as exc:
                    said = "refused", exc.rcvd.reason if exc.rcvd else "closed"
                    return said
        except ConnectionClosed as exc:
            return "refused", exc.rcvd.reason if exc.rcvd else "closed"
        except asyncio.TimeoutError:
            return "open", None
        except OSError as exc:
            return "refused", str(exc)
        except AttributeError:
            # CPython 3.11's asyncio, under load: websockets' teardown aborts a transport
            # that the stage's close already finished ('NoneType' has no 'call_soon').
            # The attacker's own exit, after the stage had refused it
            if said is None:
                raise
            return said

    import torch

    good = frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[10 ** 6, 0, 1]]}, torch.zeros(1, 576))
    blobs = [os.urandom(random.randint(0, 3000)) for _ in range(n)]
    blobs += [good[:30], good[:-1], good + b"\0", good[:20] + b"\xff\xff\xff\x7f" + good[24:],
               frames.encode(frames.FrameType.ACTIVATIONS, 0, 1, {"rows": [[1, 0, 1]]}, torch.zeros(1, 7)),
               os.urandom(4 << 20)]
    for kind, reason in await gather_limited([data_then(f) for f in blobs], 8):
        (t.rejected if kind == "refused" else t.accepted)(name, reason or "kept open")
    hellos = [os.urandom(50), "not json", json.dumps({"type": "hello"}),
              frames.control("hello", role="data", version=PROTOCOL_VERSION, pipeline="someone-else", auth=""),
              frames.control("hello", role="data", version=PROTOCOL_VERSION, pipeline=pid, auth="0" * 64),
              frames.control("hello", role="control", version=PROTOCOL_VERSION, pipeline=pid, auth="")]  # a second head
    for kind, reason in await gather_limited([ws_exchange(url, h, wait=10) for h in hellos * max(1, n // 20)]):
        (t.rejected if kind == "refused" else t.accepted)(name, reason or "kept open")


# ---- the host's OpenAI-compatible API: malformed n / logprobs / top_logprobs ----------------
def api_bad_requests() -> list[tuple[str, str, bytes, str]]:
    """(category, path, raw body, the param its 400 must name (a tuple: any of them), None for the body as a
    whole): out-of-bounds and wrongly typed `n`, `logprobs` and `top_logprobs` (chat and
    completions), values JSON allows but OpenAI's types do not (NaN, Infinity, huge
    integers), and values nested deeper than a JSON parser goes."""
    from engine.core.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    compl = {"prompt": "hi", "max_tokens": 2}
    wrong = ["2", 2.5, 2.0, True, False, [], [2], {}, {"n": 2}, "", "NaN"]
    out = []

    def add(category, path, base, field, value, param=None, **extra):
        out.append((category, path, json.dumps({**base, **extra, field: value}).encode(), param or field))

    def raw(category, path, base, field, literal: str):
        body = json.dumps(base)[:-1] + f', "{field}": {literal}}}'
        # nesting deeper than the parser goes is the body's fault (param None), unless this
        # process's recursion limit lets the parser through: then the field's type is wrong
        out.append((category, path, body.encode(), (None, field) if literal.startswith("[[") else field))


    for path, base in (("/chat/completions", chat), ("/completions", compl)):
        for v in [0, -1, MAX_CHOICES + 1, 10**30, -(10**30)] + wrong:
            add("api: malformed n", path, base, "n", v)
        for lit in ("NaN", "Infinity", "-Infinity", "1e400", "[" * 5000 + "]" * 5000):
            raw("api: malformed n", path, base, "n", lit)
    for v in ["true", 1, 0, 1.0, [], {}, "yes", [True]]:
        add("api: malformed logprobs", "/chat/completions", chat, "logprobs", v)
    for v in [-1, MAX_TOP_LOGPROBS + 1, 10**30, "3", 3.5, True, [], {}, [3]]:
        add("api: malformed top_logprobs", "/chat/completions", chat, "top_logprobs", v, logprobs=True)
    for v in [1, MAX_TOP_LOGPROBS]:   # top_logprobs without logprobs: true
        add("api: malformed top_logprobs", "/chat/completions", chat, "top_logprobs", v)
        add("api: malformed top_logprobs", "/chat/completions", chat, "top_logprobs", v, logprobs=False)
    for lit in ("NaN", "-Infinity", "[" * 5000 + "]" * 5000):
        raw("api: malformed top_logprobs", "/chat/completions", {**chat, "logprobs": True}, "top_logprobs", lit)
    for v in [-1, MAX_TOP_LOGPROBS + 1, 10**30, "5", 5.5, True, [], {}, [5]]:
        add("api: malformed logprobs", "/completions", compl, "logprobs", v)
    for lit in ("NaN", "Infinity", "[" * 5000 + "]" * 5000):
        raw("api: malformed logprobs", "/completions", compl, "logprobs", lit)
    # OpenAI's penalties: numbers in -2..2
    for path, base in (("/chat/completions", chat), ("/completions", compl)):
        for name in ("presence_penalty", "frequency_penalty"):
            for v in [2.01, -2.5, 10**30, "0.5", "", True, [], {}, [1]]:
                add("api: malformed penalties", path, base, name, v)
            for lit in ("NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400, "[" * 5000 + "]" * 5000):
                raw("api: malformed penalties", path, base, name, lit)
    # fields OpenAI defines that this server does not implement: refused, never ignored
    for name, v in (("modalities", ["audio"]), ("modalities", ["text", "audio"]), ("modalities", "text"),
                    ("modalities", []), ("audio", {"voice": "alloy", "format": "wav"}), ("audio", "alloy"),
                    ("prediction", {"type": "content", "content": "Paris"}), ("prediction", "Paris")):
        add("api: unsupported fields", "/chat/completions", chat, name, v)
    # more choices than a request may hold: prompts times n
    add("api: malformed n", "/completions", {**compl, "prompt": ["a"] * 5}, "n", MAX_CHOICES)
    # response_format: shapes OpenAI does not define, and schemas no grammar can be made of
    def schema(s):
        return {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": s}}

    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    for v in ["json", 5, [], {}, {"type": "xml"}, {"type": None}, {"type": "json_schema"},
              {"type": "json_schema", "json_schema": []}, {"type": "json_schema", "json_schema": {"schema": "{}"}},
              {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
              {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}},
              schema({"$ref": "#/nowhere"}), schema({"type": "no-such-type"}), schema({"type": ["string", 5]}),
              schema({"type": "integer", "minimum": "0"}), schema({"type": "string", "pattern": "(unclosed"}),
              schema({"type": "object", "properties": {"k": 5}}), schema({"enum": "notalist"}),
              schema({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                                       for i in range(100)}}),       # too large
              schema(deep)]:
        add("api: malformed response_format", "/chat/completions", chat, "response_format", v)
    raw("api: malformed response_format", "/chat/completions", chat, "response_format",
        '{"type": "json_schema", "json_schema": {"schema": {"type": "number", "minimum": NaN}}}')
    # tools and tool_choice: wrong shapes, names no function may have, choices of nothing
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for v in ["f", 5, {}, [5], [{}], [{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": ""}}], [{"type": "function", "function": {"name": "a b"}}],
              [{"type": "function", "function": {"name": "x" * 65}}],
              [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
              [{"type": "function", "function": {"name": "f", "description": 5}}], [fn, fn], [fn] * 129]:
        add("api: malformed tools", "/chat/completions", chat, "tools", v)
    for v in ["always", 5, [], {}, {"type": "function"}, {"type": "function", "function": {"name": "g"}},
              {"type": "function", "function": "f"}, "required"]:
        add("api: malformed tools", "/chat/completions", chat, "tool_choice", v,
            **({} if v == "required" else {"tools": [fn]}))
    add("api: malformed tools", "/chat/completions", {**chat, "tools": [fn]}, "tool_choice", "required",
        response_format={"type": "json_object"})
    for msgs in ([{"role": "tool", "content": "x"}],
                 [{"role": "assistant", "content": None, "tool_calls": "f"}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 5}}]}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": "{not"}}]}]):
        add("api: malformed tools", "/chat/completions", chat, "messages", msgs)
    return out


async def attack_api(t: Tally, api: str):
    """Each malformed request must get a 400 in OpenAI's error shape naming its field;
    a 5xx or a dropped connection is a crash."""
    async def one(category, path, body, param):
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(api + path, data=body, headers={"Content-Type": "application/json"},
                                  timeout=aiohttp.ClientTimeout(total=60)) as r:
                    status, text = r.status, await r.text()
        except Exception as exc:  # noqa: BLE001
            t.crash(category, f"{param}: {type(exc).__name__}")
            return
        try:
            err = json.loads(text)["error"]
            shaped = set(err) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            err, shaped = {}, False
        if status >= 500:
            t.crash(category, f"{param}: HTTP {status}")
        elif status == 400 and shaped and err["param"] in (param if isinstance(param, tuple) else (param,)):
            t.rejected(category, f"400 {err['param'] or 'body'}: {err['code']}")
        else:
            t.accepted(category, f"{param}: HTTP {status} {text[:80]}")

    await gather_limited([one(*r) for r in api_bad_requests()], 8)


# ---- slow connections ------------------------------------------------------------------------
async def slow(t: Tally, w: dict, n: int):
    """Connections that never finish a handshake: each must be closed by the server."""
    targets = {
        "host tunnel port": w["direct_url"],
        "relay": f"{w['relay_url']}/v1/join/{inv.parse(w['code']).pipeline.hex()}/{inv.parse(w['code']).host_key.hex()}",
    }
    port = stage_port(w["joiner"].p.pid)
    if port:
        targets["stage"] = f"ws://127.0.0.1:{port}"
    name = "slow handshakes (never finished)"

    async def silent_ws(url):
        kind, reason = await ws_exchange(url, None, wait=45)
        return reason if kind == "refused" else None

    async def silent_tcp(url):
        hp = url.split("//", 1)[1].split("/", 1)[0]
        h, p = hp.rsplit(":", 1)
        return await raw_tcp(h, int(p), b"GET / HTTP/1.1\r\n", wait=45)   # a request that never ends

    jobs = []
    for label, url in targets.items():
        for _ in range(max(1, n // 10)):
            jobs.append((label, silent_ws(url)))
            jobs.append((label, silent_tcp(url)))
    results = await asyncio.gather(*(j for _, j in jobs))
    for (label, _), reason in zip(jobs, results):
        (t.rejected if reason else t.accepted)(name, f"{label}: {reason}" if reason else f"{label}: held open 45 s")


# ---- the whole suite ----------------------------------------------------------------------
async def run_suite(scale: float = 1.0, log=print, folder: Path | None = None) -> dict:
    folder = Path(folder or tempfile.mkdtemp(prefix="potluck-hostile-"))
    n = max(10, int(200 * scale))
    flood = max(20, int(300 * scale))
    t = Tally()
    t0 = time.monotonic()
    log(f"starting relay, host and joiner in {folder} ...")
    w = await start_world(folder)
    try:
        return await _attack(w, t, t0, n, flood, folder, log, scale)
    finally:
        for k in ("relay", "host", "joiner"):      # also when an attack raised: no process outlives the suite
            w[k].stop()


async def _attack(w, t, t0, n, flood, folder, log, scale) -> dict:
    legit = Legit(w["api"])
    async with aiohttp.ClientSession() as s:
        assert await legit.one(s), f"the pipeline does not serve before the attacks: {legit.errors}"
    log(f"pipeline ready in {time.monotonic() - t0:.0f} s; attacking ...")
    traffic = asyncio.ensure_future(legit.loop())
    try:
        await asyncio.get_running_loop().run_in_executor(None, fuzz, t, max(50, int(1000 * scale)), w["code"])
        port = stage_port(w["joiner"].p.pid)
        await asyncio.gather(attack_host(t, w, n, flood, folder), attack_relay(t, w, n, flood, folder),
                             attack_stage(t, w, n), attack_api(t, w["api"]),
                             attack_pages(t, w, f"ws://127.0.0.1:{port}" if port else None))
        # slow handshakes hold relay channels for the host's 10 s: on their own, so that
        # the relay attacks above get through to the host
        await slow(t, w, n)
    finally:
        legit.stop.set()
        await traffic
    async with aiohttp.ClientSession() as s:
        final_ok = await legit.one(s)
    procs = {k: w[k] for k in ("relay", "host", "joiner")}
    for name, p in procs.items():
        if p.p.poll() is not None:
            t.crash(f"process: {name}", f"exited with {p.p.returncode}")
        tb = p.tracebacks()
        if tb:
            t.crash(f"process: {name}", f"{tb} traceback(s) in its log")
    for p in procs.values():
        p.stop()
    result = {
        "tried": sum(r.tried for r in t.rows.values()),
        "rejected": sum(r.rejected for r in t.rows.values()),
        "crashes": sum(r.crashes for r in t.rows.values()),
        "not_rejected": sum(r.tried - r.rejected - r.crashes for r in t.rows.values()),
        "legit_completed": legit.completed, "legit_failed": legit.failed, "legit_errors": legit.errors[:5],
        "final_chat_ok": final_ok, "seconds": time.monotonic() - t0, "rows": t.rows, "folder": str(folder),
    }
    return result


def summary(res: dict) -> str:
    lines = ["Hostile-input suite", f"  {'category':<46}{'tried':>7}{'rejected':>10}{'crashes':>9}"]
    for name, r in res["rows"].items():
        lines.append(f"  {name:<46}{r.tried:>7}{r.rejected:>10}{r.crashes:>9}")
        for reason, k in r.reasons.most_common(4):
            lines.append(f"      {k:>5} x {reason}")
    lines.append(f"  {'total':<46}{res['tried']:>7}{res['rejected']:>10}{res['crashes']:>9}")
    lines.append(f"inputs tried: {res['tried']}, rejected: {res['rejected']}, not rejected: {res['not_rejected']}, "
                 f"crashes: {res['crashes']}")
    lines.append(f"legitimate chat requests completed: {res['legit_completed']} "
                 f"(failed: {res['legit_failed']}; final chat after the attacks: "
                 f"{'ok' if res['final_chat_ok'] else 'FAILED'}); {res['seconds']:.0f} s")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of inputs (default 1)")
    args = ap.parse_args()
    res = asyncio.run(run_suite(args.scale))
    print(summary(res))
    return 0 if res["crashes"] == 0 and res["not_rejected"] == 0 and res["final_chat_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
