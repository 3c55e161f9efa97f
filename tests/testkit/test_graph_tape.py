"""testkit/graph_tape.py replays a capture as a CUDA graph would: the capture's operators
over its memory, reading what the buffers hold now, with the sizes the capture saw."""

from __future__ import annotations

import pytest
import torch

from testkit.graph_tape import CaptureRefused, TapeCuda


def capture(cuda, step):
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        out = step()
    return g, out


def test_a_replay_reads_the_buffers_anew_and_writes_where_the_capture_wrote():
    cuda = TapeCuda()
    x = torch.arange(6.0).view(2, 3)
    store = torch.zeros(4, 3)
    slot = torch.tensor([1])

    def step():
        y = (x.t().contiguous() * 2).t()          # a copy that reshape/contiguous call a view
        store[slot] = y[:1]
        return y.reshape(-1).to(torch.float32).sum(-1, keepdim=True)

    g, out = capture(cuda, step)
    assert out.item() == 30.0 and store[1].tolist() == [0.0, 2.0, 4.0]
    x.copy_(torch.ones(2, 3))
    slot.fill_(3)
    g.replay()
    assert out.item() == 12.0 and store[3].tolist() == [2.0, 2.0, 2.0]


def test_a_replay_past_what_a_tensor_held_at_capture_raises():
    cuda = TapeCuda()
    store = torch.zeros(2, 3)
    slot = torch.tensor([1])

    def step():
        store[slot] = torch.ones(1, 3)

    g, _ = capture(cuda, step)
    slot.fill_(2)
    with pytest.raises(IndexError):
        g.replay()


def test_a_host_read_fails_the_capture():
    cuda = TapeCuda()
    x = torch.ones(3)
    with pytest.raises(CaptureRefused, match="stream is capturing"):
        capture(cuda, lambda: x.sum().item())
