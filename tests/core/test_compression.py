"""Blockwise int8 activations: bounded error, strict validation, policy."""

import struct

import pytest
import torch

from engine.wire import frames
from engine.core.compression import should_compress


def frame(x, q8):
    return frames.encode(frames.FrameType.ACTIVATIONS, 1, 1, {"rows": [[1, 0, x.shape[0]]]}, x, q8=q8)


def test_q8_roundtrip_error_is_bounded_per_block():
    torch.manual_seed(0)
    x = torch.randn(7, 576) * torch.logspace(-2, 2, 576)   # blocks with very different scales
    f = frames.decode(frame(x, True))
    assert f.quantized and f.tensor.shape == x.shape
    B = frames.Q8_BLOCK
    blocks = x.view(7, 576 // B, B)
    bound = blocks.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-6   # half a quantization step
    assert ((f.tensor.view(7, 576 // B, B) - blocks).abs() <= bound).all()
    assert len(frame(x, True)) < 0.35 * len(frame(x, False))


def test_q8_skipped_when_hidden_is_not_a_block_multiple():
    x = torch.randn(3, 100 + frames.Q8_BLOCK // 2)
    f = frames.decode(frame(x, True))
    assert not f.quantized and torch.equal(f.tensor, x)


def test_q8_frames_are_validated():
    x = torch.randn(2, 128)
    good = bytearray(frame(x, True))
    bad_flags = bytearray(good)
    struct.pack_into("<H", bad_flags, 6, 0x8001)
    with pytest.raises(frames.FrameError, match="flags"):
        frames.decode(bytes(bad_flags))
    # an int8 tensor whose width is not whole blocks of 68 bytes
    odd = frames.encode(frames.FrameType.ACTIVATIONS, 1, 1, {"rows": [[1, 0, 2]]},
                      torch.zeros(2, 3 * (frames.Q8_BLOCK + 4) + 1, dtype=torch.int8))
    odd = bytearray(odd)
    struct.pack_into("<H", odd, 6, frames.FLAG_Q8)
    with pytest.raises(frames.FrameError, match="int8"):
        frames.decode(bytes(odd))


def test_policy():
    assert not should_compress("off", "prefill", 10**9, 1.0, 0.0)
    assert not should_compress("auto", "decode", 10**9, 1.0, 0.0)       # decode stays exact
    assert should_compress("auto", "prefill", 10_000_000, 1e6, 1.0)     # 10 s to send, 1 s to compute
    assert not should_compress("auto", "prefill", 100_000, 1e9, 1.0)    # a fast link: exact
    # sending about as long as computing: int8 would not speed the prompt up, stays exact
    assert not should_compress("auto", "prefill", 1_500_000, 1e6, 1.0)
    assert should_compress("auto", "prefill", 2_500_000, 1e6, 1.0)
    assert should_compress("prefill", "prefill", 1, 1e12, 1.0)
    assert should_compress("all", "decode", 1, 1e12, 1.0)
