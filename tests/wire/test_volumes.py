"""Chunked volumes: pieces out of order, duplicated, missing or overrunning are refused."""

import pytest

from engine.wire import frames
from engine.wire.volumes import Reassembler, encode_chunk


def piece_of(frame_bytes):
    f = frames.decode(frame_bytes)
    assert f.type == frames.FrameType.CHUNK
    return f.micro_batch, f.meta, bytes(f.payload)


def pieces(vid, data, size, kind="prefill"):
    return [piece_of(encode_chunk(vid, kind, off, len(data), data[off: off + size]))
            for off in range(0, len(data), size)]


def test_roundtrip_in_order():
    data = bytes(range(256)) * 40
    r = Reassembler()
    out = [r.feed(*p) for p in pieces(3, data, 1000)]
    assert out[:-1] == [None] * (len(out) - 1)
    assert out[-1] == ("prefill", data)
    assert r.open_volumes == 0 and r.buffered == 0


def test_interleaved_volumes_complete_independently():
    a, b = b"a" * 3000, b"b" * 1500
    pa, pb = pieces(1, a, 1000), pieces(2, b, 1000, kind="decode")
    r = Reassembler()
    assert r.feed(*pa[0]) is None
    assert r.feed(*pb[0]) is None
    assert r.feed(*pb[1]) == ("decode", b)
    assert r.feed(*pa[1]) is None
    assert r.feed(*pa[2]) == ("prefill", a)


@pytest.mark.parametrize("order,why", [
    ([0, 0], "duplicated"),
    ([0, 2], "missing"),
    ([1], "missing"),
])
def test_out_of_order_duplicate_missing(order, why):
    ps = pieces(9, b"x" * 3000, 1000)
    r = Reassembler()
    with pytest.raises(frames.FrameError, match=why):
        for i in order:
            r.feed(*ps[i])


def test_lengths_that_do_not_add_up():
    r = Reassembler()
    r.feed(*piece_of(encode_chunk(1, "prefill", 0, 2000, b"y" * 1000)))
    with pytest.raises(frames.FrameError, match="overrun"):
        r.feed(*piece_of(encode_chunk(1, "prefill", 1000, 2000, b"y" * 1500)))
    r = Reassembler()
    r.feed(*piece_of(encode_chunk(2, "prefill", 0, 2000, b"y" * 1000)))
    with pytest.raises(frames.FrameError, match="changed"):
        r.feed(*piece_of(encode_chunk(2, "prefill", 1000, 3000, b"y" * 1000)))


def test_limits_on_open_volumes_size_and_buffering():
    r = Reassembler(max_open=2)
    r.feed(*piece_of(encode_chunk(1, "prefill", 0, 10, b"a")))
    r.feed(*piece_of(encode_chunk(2, "prefill", 0, 10, b"a")))
    with pytest.raises(frames.FrameError, match="in progress"):
        r.feed(*piece_of(encode_chunk(3, "prefill", 0, 10, b"a")))
    r = Reassembler(max_volume=100)
    with pytest.raises(frames.FrameError, match="outside"):
        r.feed(*piece_of(encode_chunk(1, "prefill", 0, 101, b"a")))
    r = Reassembler(max_buffered=5)
    with pytest.raises(frames.FrameError, match="buffered"):
        r.feed(*piece_of(encode_chunk(1, "prefill", 0, 10, b"abcdef")))


def test_chunk_frame_validation():
    good = encode_chunk(1, "decode", 0, 4, b"abcd")
    frames.decode(good)
    bad_kind = encode_chunk(1, "other", 0, 4, b"abcd")
    with pytest.raises(frames.FrameError, match="kind"):
        frames.decode(bad_kind)
    with pytest.raises(frames.FrameError):
        frames.decode(good[:-1])


def test_a_volume_in_one_piece_comes_back_as_that_piece_uncopied():
    data = bytes(range(200))
    frame = encode_chunk(4, "decode", 0, len(data), data)
    f = frames.decode(frame)
    assert f.tensor is None and isinstance(f.payload, memoryview) and bytes(f.payload) == data
    r = Reassembler()
    kind, got = r.feed(f.micro_batch, f.meta, f.payload)
    assert kind == "decode" and got is f.payload and r.open_volumes == 0 and r.buffered == 0


def test_a_chunk_whose_piece_is_not_flat_bytes_is_refused():
    import struct

    meta = b'{"off":0,"total":4,"kind":"decode"}'
    head = frames.HEADER.pack(frames.MAGIC, frames.VERSION, int(frames.FrameType.CHUNK), 0, 1, 0, len(meta), 1, 1, 0)
    with pytest.raises(frames.FrameError, match="flat int8"):
        frames.decode(head + struct.pack("<I", 1) + meta + b"\0" * 4)   # one float32, not four bytes
