"""Hostile inputs: fuzzed parsers (hypothesis) and a short run of the hostile suite
(testkit/hostile.py; bench/hostile.py runs it in full).

The bench script attacks a live relay + host + joiner pipeline on loopback (garbage,
truncated and oversized frames to the relay, the host's tunnel port and the joiner's
stage; wrong-secret join floods; bad credentials; replayed handshakes; tampered and
replayed tunnel frames; slow connections that never finish a handshake) while a
client keeps chatting. Everything must be rejected, nothing may crash, and the chat
must keep completing.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["POTLUCK_KEYSTORE"] = "file"

from engine.wire import invite as inv
from engine.wire import noise
from engine.wire import tunnel

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
CODE = inv.encode(inv.Invite(b"p" * 8, b"i" * 8, b"s" * 16, b"k" * 32, int(time.time()) + 3600, 2,
                             "ws://relay:8765", ["ws://10.0.0.1:7870"]))


@FUZZ
@given(st.one_of(st.text(max_size=400),
                 st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
                 st.tuples(st.integers(0, len(CODE) - 1), st.characters()).map(
                     lambda e: CODE[:e[0]] + e[1] + CODE[e[0] + 1:]),
                 st.integers(0, len(CODE) - 1).map(lambda k: CODE[:k])))
def test_invite_parser_never_crashes(text):
    try:
        got = inv.parse(text)
    except inv.InviteError as exc:
        assert str(exc)
    else:   # only the code itself (up to case, separators and Crockford's aliases) parses
        assert got == inv.parse(CODE)


def _body(fields: bytes) -> str:
    """A code whose checksum is right but whose fields are whatever hypothesis makes."""
    import hashlib

    data = fields + hashlib.sha256(fields).digest()[:4]
    return inv._b32encode(data)


@FUZZ
@given(st.binary(min_size=0, max_size=400))
def test_invite_fields_with_a_valid_checksum(fields):
    try:
        inv.parse(_body(b"\x01" + fields))
    except inv.InviteError as exc:
        assert str(exc)


HOST = X25519PrivateKey.generate()
PSK = os.urandom(32)


@FUZZ
@given(st.one_of(st.binary(max_size=300),
                 st.binary(max_size=200).map(lambda b: tunnel.MAGIC + b"\x01" + b"p" * 16 + b),
                 st.binary(max_size=200).map(lambda b: tunnel.MAGIC + b"\x02" + b"p" * 16 + b)))
def test_handshake_parser_and_responder_never_crash(msg):
    try:
        mode, _, _, prologue, msg1 = tunnel.parse_hello(msg)
        noise.Responder(HOST, prologue, psk=PSK if mode == 1 else None).read_1(msg1)
    except noise.NoiseError as exc:
        assert str(exc)


KEY = os.urandom(32)


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 st.tuples(st.integers(0, 2 ** 64 - 1), st.binary(max_size=100)).map(
                     lambda t: struct.pack("<Q", t[0]) + t[1])))
def test_transport_and_inner_frames_never_crash(frame):
    try:
        tunnel.parse_inner(noise.TransportCipher(KEY).decrypt(frame))
    except noise.NoiseError as exc:
        assert str(exc)
    else:
        pytest.fail("a random frame authenticated")


@FUZZ
@given(st.binary(max_size=64))
def test_inner_frame_parser(data):
    try:
        kind, stream, payload = tunnel.parse_inner(data)
        assert tunnel.CONFIRM <= kind <= tunnel.INTRO
    except noise.NoiseError as exc:
        assert str(exc)


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                        | st.text(max_size=80),
                        lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids,
                                                                                 max_size=8), max_leaves=30)
_INTRO_KEYS = st.sampled_from(["op", "hop", "id", "psk", "key", "addresses", "kinds", "udp", "symmetric", "why",
                               "port", "path", "rtt_ms"])
_OPS = st.sampled_from(["accept", "dial", "end", "punch", "door", "dialed", "??"])


@FUZZ
@given(st.one_of(_JSONISH, st.dictionaries(_INTRO_KEYS, _JSONISH | _OPS, max_size=12)),
       st.sampled_from(["host", "friend"]))
def test_introduction_frames_never_crash(msg, frm):
    """Issue 43's INTRO frames (engine/wire/friend_hop.py): whatever a peer puts in one,
    it is read as a checked introduction or refused with NoiseError."""
    from engine.wire.friend_hop import check_intro

    try:
        out = check_intro(msg, frm)
    except noise.NoiseError:
        return
    assert out["op"] in (("accept", "dial", "end", "punch") if frm == "host" else ("door", "dialed", "punch"))
    assert isinstance(out["hop"], int) and 0 < out["hop"] < 2**31


@pytest.mark.slow
async def test_hostile_suite_keeps_the_pipeline_serving(tmp_path):
    from testkit.hostile import run_suite, summary

    res = await run_suite(scale=0.1, log=lambda *a: None, folder=tmp_path)
    print(summary(res))
    assert res["crashes"] == 0, summary(res)
    assert res["not_rejected"] == 0, summary(res)
    assert res["tried"] > 300
    assert res["legit_completed"] >= 1 and res["legit_failed"] == 0, summary(res)
    assert res["final_chat_ok"], summary(res)


async def test_api_refuses_malformed_choice_and_logprob_fields(api_url, pipeline):
    """The hostile suite's API attacks (testkit/hostile.py attack_api) against the session's
    pipeline: every malformed n / logprobs / top_logprobs is a 400 naming its field."""
    from openai import AsyncOpenAI

    from testkit.hostile import Tally, api_bad_requests, attack_api

    t = Tally()
    await attack_api(t, api_url)
    tried = sum(r.tried for r in t.rows.values())
    assert tried == len(api_bad_requests()) > 60
    assert all(r.rejected == r.tried and not r.crashes for r in t.rows.values()), \
        {k: dict(r.reasons) for k, r in t.rows.items()}
    assert pipeline.error is None
    async with AsyncOpenAI(base_url=api_url, api_key="x", max_retries=0, timeout=120) as c:
        ok = await c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert len(ok.choices) == 2 and ok.choices[1].logprobs.content
