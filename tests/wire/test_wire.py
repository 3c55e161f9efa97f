"""The stage-to-stage wire format: round trips, and every way decode refuses a frame."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.wire import frames
from engine.wire.frames import CONTROL_SCHEMAS, FrameError, FrameType, decode, encode, parse_control  # noqa: E402

ACT = FrameType.ACTIVATIONS
TOK = FrameType.TOKENS
HEAD = frames.HEADER


def raw_frame(ftype=1, meta=b'{"rows":[[1,0,2]]}', code=1, dims=(2, 3), body=None, *, magic=frames.MAGIC,
              version=frames.VERSION, ndim=None, meta_len=None) -> bytes:
    """Build a frame by hand, so the header can lie about anything."""
    if isinstance(meta, dict):
        meta = json.dumps(meta).encode()
    if body is None:
        body = b"\0" * (math.prod(dims) * 4 if dims else 0)
    ndim = len(dims) if ndim is None else ndim
    meta_len = len(meta) if meta_len is None else meta_len
    head = HEAD.pack(magic, version, ftype, 0, 7, 9, meta_len, code, ndim, 0)
    return head + struct.pack(f"<{len(dims)}I", *dims) + meta + body


def act(rows, tensor=None, **extra):
    total = sum(r[2] for r in rows)
    if tensor is None:
        tensor = torch.zeros(total, 4)
    return encode(ACT, 0, 0, {"rows": rows, **extra}, tensor)


def rejects(data, match=None, **kw):
    with pytest.raises(FrameError, match=match) as ei:
        decode(data, **kw)
    assert str(ei.value), "FrameError must carry a reason"
    return ei.value


# ---- round trips --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(5, 7, generator=g) * 100).to(dtype)
    t[0, 0] = -0.0
    t[1, 1] = float("inf")
    meta = {"rows": [[3, 10, 2], [1, 0, 3]], "new": {"1": {"sampling": {"temperature": 0.5}, "prompt": [1, 2, 3]}},
            "partial": True}
    f = decode(encode(ACT, 4, 123456, meta, t))
    assert f.type is ACT and f.micro_batch == 4 and f.step == 123456
    assert f.meta == meta
    assert f.tensor.dtype == dtype and f.tensor.shape == (5, 7)
    # bit-exact, including signed zero and inf
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(f.tensor.view(bits), t.view(bits))


def test_int64_round_trip_and_non_contiguous_input():
    t = torch.arange(24, dtype=torch.int64).view(4, 6).t()  # a transposed, non-contiguous view
    t[0, 0] = -(2**62)
    f = decode(encode(ACT, 0, 0, {"rows": [[0, 0, 6]]}, t))
    assert f.tensor.dtype == torch.int64
    assert torch.equal(f.tensor, t)


def test_decoded_tensor_is_writable_and_owns_its_memory():
    data = bytearray(act([[0, 0, 1]], torch.ones(1, 2)))
    f = decode(bytes(data))
    f.tensor += 1  # frombuffer over read-only bytes would fail or warn
    assert torch.equal(f.tensor, torch.full((1, 2), 2.0))


def test_tokens_frame_round_trip_without_tensor():
    meta = {"tokens": [[1, 42], [2**52, 2**31 - 1]], "errors": [[3, "out of KV memory"]]}
    data = encode(TOK, 2, 5, meta)
    f = decode(data)
    assert f.type is TOK and f.tensor is None and f.meta == meta and (f.micro_batch, f.step) == (2, 5)
    assert len(data) == HEAD.size + len(json.dumps(meta, separators=(",", ":")))
    assert decode(encode(TOK, 0, 0, {})).meta == {}


def test_accepts_bytearray_and_memoryview():
    data = act([[0, 0, 1]])
    assert decode(bytearray(data)).meta["rows"] == [[0, 0, 1]]
    assert decode(memoryview(data)).meta["rows"] == [[0, 0, 1]]
    with pytest.raises(FrameError, match="binary"):
        decode("not bytes")


# ---- header rejections ----------------------------------------------------------

def test_short_frame():
    rejects(b"", "shorter")
    rejects(act([[0, 0, 1]])[: HEAD.size - 1], "shorter")


def test_bad_magic():
    rejects(raw_frame(magic=b"PTLX"), "magic")


def test_wrong_version():
    rejects(raw_frame(version=2), "version 2")
    rejects(raw_frame(version=0), "version 0")


def test_unknown_type():
    rejects(raw_frame(ftype=0), "unknown frame type 0")
    rejects(raw_frame(ftype=99), "unknown frame type 99")


def test_rank_too_high():
    rejects(raw_frame(dims=(1, 1, 1, 1, 2)), "rank 5")


def test_rank_claimed_but_shape_truncated():
    data = raw_frame(ndim=4, dims=(), body=b"", meta=b"")[: HEAD.size + 8]
    rejects(data, "truncated")


def test_unknown_dtype_code():
    rejects(raw_frame(code=9), "dtype code 9")
    rejects(raw_frame(code=0), "dtype code 0")  # a shape needs a dtype


def test_dtype_without_tensor():
    rejects(raw_frame(ftype=2, meta=b"{}", code=1, dims=()), "without a tensor")


def test_empty_dimension_rejected():
    # a zero-size dim used to reach torch.frombuffer(b"") and raise a bare ValueError
    rejects(raw_frame(dims=(0, 4), body=b""), "empty dimension")
    rejects(raw_frame(dims=(4, 0), body=b""), "empty dimension")


def test_oversize_tensor_rejected_before_allocation(monkeypatch):
    calls = []
    real = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: calls.append(a) or real(*a, **k))
    # claims 2^31 x 2^31 float32 (16 EiB) with a 12-byte body
    e = rejects(raw_frame(dims=(2**31, 2**31), body=b"\0" * 12), "exceeds the limit")
    assert str(2**31 * 2**31 * 4) in str(e)
    # max dims on all four axes
    rejects(raw_frame(dims=(2**32 - 1,) * 4, body=b""), "exceeds the limit")
    # just over a small custom limit; exactly at the limit is fine
    t = torch.zeros(2, 4)  # 32 bytes
    data = act([[0, 0, 2]], t)
    rejects(data, "32 bytes exceeds the limit of 31", max_payload=31)
    assert calls == []
    assert decode(data, max_payload=32).tensor.shape == (2, 4)


def test_meta_too_large():
    rejects(raw_frame(meta_len=frames.MAX_META + 1, meta=b"{}"), "metadata too large")


def test_length_mismatch():
    data = act([[0, 0, 2]])
    rejects(data[:-1], "does not match")
    rejects(data + b"\0", "does not match")
    rejects(data[: HEAD.size + 8 + 3], "does not match")  # cut inside the meta
    tok = encode(TOK, 0, 0, {"tokens": []})
    rejects(tok + b"x", "does not match")


def test_meta_not_json_or_not_object():
    rejects(raw_frame(meta=b"{rows"), "not valid JSON")
    rejects(raw_frame(meta=b"\xff\xfe{}"), "not valid JSON")
    rejects(raw_frame(meta=b""), "not valid JSON")
    rejects(raw_frame(meta=b"[1,2]"), "must be an object")
    rejects(raw_frame(ftype=2, code=0, dims=(), meta=b"null"), "must be an object")


def test_meta_must_be_utf8_not_utf16():
    meta = json.dumps({"rows": [[1, 0, 2]]}).encode("utf-16")
    rejects(raw_frame(meta=meta), "not valid JSON")


def test_deeply_nested_meta_is_a_frame_error():
    deep = b"[" * 200_000 + b"]" * 200_000
    rejects(raw_frame(ftype=2, code=0, dims=(), meta=deep), "not valid JSON")


# ---- activation metadata -------------------------------------------------------

@pytest.mark.parametrize("meta, match", [
    ({}, "must have keys"),
    ({"rows": [[0, 0, 2]], "bogus": 1}, "must have keys"),
    ({"rows": []}, "non-empty"),
    ({"rows": {"0": [0, 0, 2]}}, "non-empty"),
    ({"rows": [[0, 0, 1], [0, 1, 1]]}, "appears twice"),
    ({"rows": [[0, 0, 0], [1, 0, 2]]}, r"n>=1"),
    ({"rows": [[-1, 0, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, -1, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0.0, 0, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, 0, 2.0]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[True, 0, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, False, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[2**53, 0, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [["0", 0, 2]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, 0]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, 0, 1, 1]]}, r"\[seq_id, start, n>=1\]"),
    ({"rows": [[0, 0, 1]]}, r"must be \[1, hidden\]"),
    ({"rows": [[0, 0, 1], [1, 0, 2]]}, r"must be \[3, hidden\]"),
    ({"rows": [[0, 0, 2]], "partial": 1}, "partial"),
    ({"rows": [[0, 0, 2]], "partial": "yes"}, "partial"),
    ({"rows": [[0, 0, 2]], "new": []}, "new must be an object"),
    ({"rows": [[0, 0, 2]], "new": {"5": {"sampling": {}, "prompt": []}}}, "'5' is not in this step"),
    ({"rows": [[0, 0, 2]], "new": {"x": {"sampling": {}, "prompt": []}}}, "not in this step"),
    ({"rows": [[0, 0, 2]], "new": {"-0": {"sampling": {}, "prompt": []}}}, "not in this step"),
    ({"rows": [[2, 0, 2]], "new": {"\u00b2": {"sampling": {}, "prompt": []}}}, "not in this step"),
    ({"rows": [[0, 0, 2]], "new": {"9" * 5000: {"sampling": {}, "prompt": []}}}, "not in this step"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"prompt": []}}}, "need sampling and prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": [], "x": 1}}}, "need sampling and prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": []}}, "need sampling and prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": [-1]}}}, "prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": [2**31]}}}, "prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": [1.5]}}}, "prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": [True]}}}, "prompt"),
    ({"rows": [[0, 0, 2]], "new": {"0": {"sampling": {}, "prompt": "1 2"}}}, "prompt"),
    # a verification row's draft: n - 1 token ids, for a row of this step that is not new
    ({"rows": [[0, 0, 2]], "drafts": []}, "drafts must be an object"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": [5]}, "partial": True}, "a prompt chunk has none"),
    ({"rows": [[0, 0, 2]], "drafts": {"1": [5]}}, "does not verify"),
    ({"rows": [[0, 0, 2]], "drafts": {"x": [5]}}, "does not verify"),
    ({"rows": [[0, 0, 2]], "drafts": {"9" * 5000: [5]}}, "does not verify"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": [5]}, "new": {"0": {"sampling": {}, "prompt": [1]}}}, "does not verify"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": [5, 6]}}, "n - 1 drafted"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": []}}, "n - 1 drafted"),
    ({"rows": [[0, 0, 1], [1, 0, 1]], "drafts": {"0": []}}, "n - 1 drafted"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": [2**31]}}, "n - 1 drafted"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": [True]}}, "n - 1 drafted"),
    ({"rows": [[0, 0, 2]], "drafts": {"0": "5"}}, "n - 1 drafted"),
    # a kept reply taken over by a row (cut back to where the row starts), kept ones let go
    ({"rows": [[0, 4, 2]], "rewind": []}, "rewind must be an object"),
    ({"rows": [[0, 4, 2]], "rewind": {"1": 4}}, "not in this step"),
    ({"rows": [[0, 4, 2]], "rewind": {"x": 4}}, "not in this step"),
    ({"rows": [[0, 4, 2]], "rewind": {"0": 3}}, "the tokens its row starts after"),
    ({"rows": [[0, 4, 2]], "rewind": {"0": -1}}, "the tokens its row starts after"),
    ({"rows": [[0, 4, 2]], "rewind": {"0": True}}, "the tokens its row starts after"),
    ({"rows": [[0, 4, 2]], "drop": {"1": 1}}, "drop must list"),
    ({"rows": [[0, 4, 2]], "drop": [0]}, "drop must list"),
    ({"rows": [[0, 4, 2]], "drop": [-3]}, "drop must list"),
    ({"rows": [[0, 4, 2]], "drop": list(range(1, 5000))}, "drop must list"),
])
def test_activation_meta_violations(meta, match):
    rejects(raw_frame(meta=meta, dims=(2, 3)), match)


def test_activation_meta_valid_edges():
    ok = decode(raw_frame(meta={"rows": [[2**53 - 1, 2**53 - 1, 2]], "partial": False,
                                "new": {str(2**53 - 1): {"sampling": {}, "prompt": [0, 2**31 - 1]}}}))
    assert ok.meta["rows"][0][0] == 2**53 - 1
    ok = decode(raw_frame(meta={"rows": [[7, 30, 2]], "drafts": {"7": [2**31 - 1]}}))
    assert ok.meta["drafts"] == {"7": [2**31 - 1]}
    ok = decode(raw_frame(meta={"rows": [[7, 30, 2]], "rewind": {"7": 30}, "drop": [8, 2**53 - 1],
                                "partial": True}))
    assert ok.meta["rewind"] == {"7": 30} and ok.meta["drop"] == [8, 2**53 - 1]


def test_activation_needs_2d_tensor():
    rejects(raw_frame(dims=(2,), body=b"\0" * 8), r"must be \[2, hidden\]")
    rejects(raw_frame(dims=(2, 3, 1)), r"must be \[2, hidden\]")
    rejects(raw_frame(code=0, dims=()), r"must be \[2, hidden\]")


def test_too_many_rows():
    rows = [[i, 0, 1] for i in range(frames.MAX_ROWS + 1)]
    rejects(raw_frame(meta={"rows": rows}, dims=(len(rows), 1)), "non-empty list")


# ---- token metadata ------------------------------------------------------------

@pytest.mark.parametrize("meta, match", [
    ({"tokens": [], "rows": []}, "must have keys tokens, errors"),
    ({"tokens": {}}, "tokens must be a list"),
    ({"tokens": [[1, 2] for _ in range(frames.MAX_ROWS + 1)]}, "tokens must be a list"),
    ({"tokens": [[1]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[1, 2, 3]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[-1, 2]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[1, -2]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[1, 2**31]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[1, 2.0]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [[True, 2]]}, r"\[seq_id, token_id\]"),
    ({"tokens": [7]}, r"\[seq_id, token_id\]"),
    ({"errors": "boom"}, "errors must be a list"),
    ({"errors": [[1, 2]]}, r"\[seq_id, message\]"),
    ({"errors": [[-1, "x"]]}, r"\[seq_id, message\]"),
    ({"errors": [["1", "x"]]}, r"\[seq_id, message\]"),
    ({"errors": [[1, "x", 3]]}, r"\[seq_id, message\]"),
])
def test_token_meta_violations(meta, match):
    rejects(raw_frame(ftype=2, code=0, dims=(), meta=meta), match)


def test_token_frame_with_tensor_rejected():
    rejects(raw_frame(ftype=2, meta={"tokens": [[1, 2]]}, dims=(1, 1)), "no tensor")


# ---- control messages ----------------------------------------------------------

_SAMPLE = {"str": "abc", "int": 3, "str?": None, "int?": 5, "[int]": [1, 2, 3], "num": 1.5, "dict": {"a": 1}, "bool": False,
           "profile": {"decode": [[1, 0.03], [4, 0.05]], "prefill": [[32, 0.1]]},
           "profile?": {"decode": [[1, 0.03]], "prefill": [[32, 0.1]]}, "test_size": 1024, "fill": "xx"}
_WRONG = {"str": 3, "int": "3", "str?": 3, "int?": 1.5, "[int]": [1, -2], "num": "1.5", "dict": [1], "bool": 1,
          "profile": {"decode": [[1, -0.03]], "prefill": [[32, 0.1]]},
          "profile?": {"decode": [], "prefill": [[32, 0.1]]}, "test_size": 0, "fill": 5}


def _valid(kind: str) -> dict:
    return {"type": kind, **{k: _SAMPLE[t] for k, t in CONTROL_SCHEMAS[kind].items()}}


@pytest.mark.parametrize("kind", sorted(CONTROL_SCHEMAS))
def test_control_accepts_each_type(kind):
    msg = _valid(kind)
    assert parse_control(json.dumps(msg)) == msg
    assert json.loads(frames.control(kind, **{k: v for k, v in msg.items() if k != "type"})) == msg


@pytest.mark.parametrize("kind", sorted(k for k, s in CONTROL_SCHEMAS.items() if s))
def test_control_missing_extra_and_wrong_fields(kind):
    msg = _valid(kind)
    first = next(iter(CONTROL_SCHEMAS[kind]))
    missing = {k: v for k, v in msg.items() if k != first}
    with pytest.raises(FrameError, match=rf"missing \['{first}'\]"):
        parse_control(json.dumps(missing))
    with pytest.raises(FrameError, match=r"unexpected \['zzz'\]"):
        parse_control(json.dumps({**msg, "zzz": 1}))
    for field, t in CONTROL_SCHEMAS[kind].items():
        with pytest.raises(FrameError, match=rf"{kind}\.{field} has the wrong type"):
            parse_control(json.dumps({**msg, field: _WRONG[t]}))
    with pytest.raises(FrameError):  # control() refuses to build what parse_control refuses
        frames.control(kind, **{k: v for k, v in msg.items() if k not in ("type", first)})


def test_control_extra_field_on_empty_schema():
    assert parse_control('{"type":"shutdown"}') == {"type": "shutdown"}
    with pytest.raises(FrameError, match="unexpected"):
        parse_control('{"type":"shutdown","now":true}')


@pytest.mark.parametrize("text, match", [
    ('{"type":"launch_missiles"}', "unknown control message type 'launch_missiles'"),
    ('{"role":"data"}', "needs a type"),
    ('{"type":1}', "needs a type"),
    ("[1,2]", "needs a type"),
    ('"hello"', "needs a type"),
    ("null", "needs a type"),
    ("{nope", "not valid JSON"),
    ("", "not valid JSON"),
    ("[" * 200_000 + "]" * 200_000, "not valid JSON"),
    ('{"type":"hello","role":"x","version":true,"pipeline":"p","auth":""}', "version has the wrong type"),
    ('{"type":"hello","role":"x","version":1.0,"pipeline":"p","auth":""}', "version has the wrong type"),
    ('{"type":"hello","role":"x","version":9007199254740992,"pipeline":"p","auth":""}', "version has the wrong type"),
    ('{"type":"welcome","version":1,"free_memory":1,"device":"cpu","device_name":"CPU","quantized":true,"speed":NaN}', "speed has the wrong type"),
    ('{"type":"welcome","version":1,"free_memory":1,"device":"cpu","device_name":"CPU","quantized":true,"speed":Infinity}', "speed has the wrong type"),
    ('{"type":"welcome","version":1,"free_memory":1,"device":"cpu","device_name":"CPU","quantized":true,"speed":true}', "speed has the wrong type"),
    ('{"type":"free","seq_ids":[1,true]}', "seq_ids has the wrong type"),
    ('{"type":"free","seq_ids":[1.0]}', "seq_ids has the wrong type"),
    ('{"type":"free","seq_ids":5}', "seq_ids has the wrong type"),
    ('{"type":"error","message":null}', "message has the wrong type"),
])
def test_control_rejections(text, match):
    with pytest.raises(FrameError, match=match):
        parse_control(text)


def test_a_line_test_asks_for_and_carries_at_most_its_limit():
    """A head asks a stage for filler to time its line (engine/core/line_check.py): a stage
    sends no more than LINE_TEST_MAX for one request, and a head reads no more."""
    n = frames.LINE_TEST_MAX
    assert parse_control(json.dumps({"type": "line_test", "bytes": n}))["bytes"] == n
    for bad in (0, -1, n + 1, True, 1.5):
        with pytest.raises(FrameError, match="bytes has the wrong type"):
            parse_control(json.dumps({"type": "line_test", "bytes": bad}))
    assert len(parse_control(frames.control("line_fill", fill="x" * n))["fill"]) == n
    with pytest.raises(FrameError, match="fill has the wrong type"):
        parse_control(json.dumps({"type": "line_fill", "fill": "x" * (n + 1)}))


def test_control_limits():
    long = json.dumps({"type": "error", "message": "x" * 4097})
    with pytest.raises(FrameError, match="message has the wrong type"):
        parse_control(long)
    assert parse_control(json.dumps({"type": "error", "message": "x" * 4096}))["message"] == "x" * 4096
    big = json.dumps({"type": "free", "seq_ids": [1] * (frames.MAX_ROWS + 1)})
    with pytest.raises(FrameError, match="seq_ids has the wrong type"):
        parse_control(big)
    huge = '{"type":"error","message":"' + "x" * frames.MAX_CONTROL + '"}'
    with pytest.raises(FrameError, match="too large"):
        parse_control(huge)


@pytest.mark.parametrize("data", [b'{"type":"shutdown"}', bytearray(b'{"type":"shutdown"}')])
def test_control_rejects_binary(data):
    with pytest.raises(FrameError, match="text control message"):
        parse_control(data)


# ---- fuzzing --------------------------------------------------------------------

_VALID_FRAMES = [
    act([[1, 0, 2], [2, 5, 1]], torch.randn(3, 4),
        new={"1": {"sampling": {"temperature": 0.7}, "prompt": [5, 6]}}, partial=False),
    encode(ACT, 1, 2, {"rows": [[0, 0, 1]]}, torch.ones(1, 3, dtype=torch.bfloat16)),
    encode(TOK, 3, 4, {"tokens": [[1, 2], [3, 4]], "errors": [[5, "oops"]]}),
]
_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_frame_error(data: bytes) -> None:
    try:
        f = decode(data, max_payload=1 << 16)
    except FrameError as e:
        assert str(e)
        return
    assert isinstance(f.meta, dict)
    if f.tensor is not None:
        assert f.tensor.numel() * f.tensor.element_size() <= 1 << 16


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data):
    _decode_or_frame_error(data)


@_FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_body_after_valid_header(tail):
    head = HEAD.pack(frames.MAGIC, frames.VERSION, 1, 0, 0, 0, len(tail) // 2, 1, 2, 0)
    _decode_or_frame_error(head + tail)


@_FUZZ
@given(st.sampled_from(range(len(_VALID_FRAMES))),
       st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 3), st.binary(max_size=16))
def test_fuzz_mutated_valid_frames(which, flips, cut, junk):
    data = bytearray(_VALID_FRAMES[which])
    for pos, val in flips:
        data[pos % len(data)] = val
    if cut == 1:
        data = data[: len(data) // 2]
    elif cut == 2:
        data += junk
    _decode_or_frame_error(bytes(data))


@_FUZZ
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20))
def test_fuzz_arbitrary_meta(meta):
    for ftype, dims in ((1, (2, 3)), (2, ())):
        code = 1 if dims else 0
        _decode_or_frame_error(raw_frame(ftype=ftype, meta=json.dumps(meta).encode(), code=code, dims=dims))
        if isinstance(meta, dict):
            _decode_or_frame_error(raw_frame(ftype=ftype, meta=json.dumps({"rows": [[0, 0, 2]], **meta}).encode(),
                                             code=code, dims=dims))


@_FUZZ
@given(st.text(max_size=200) | st.sampled_from([json.dumps(_valid(k)) for k in CONTROL_SCHEMAS]).flatmap(
    lambda s: st.integers(0, len(s)).map(lambda i: s[:i] + s[i + 1:])))
def test_fuzz_control(text):
    try:
        msg = parse_control(text)
    except FrameError:
        return
    assert msg["type"] in CONTROL_SCHEMAS
