"""The frame fields n > 1 and logprobs add: forks on a new sequence (activation frames),
logprobs on a sampled token (token frames). Checked before anything is used."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.core.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS  # noqa: E402
from engine.wire.frames import FrameError, FrameType, decode, encode  # noqa: E402


def activations(new: dict, rows=((0, 0, 2),), partial=None) -> bytes:
    meta = {"rows": [list(r) for r in rows], "new": new}
    if partial is not None:
        meta["partial"] = partial
    return encode(FrameType.ACTIVATIONS, 0, 1, meta, torch.zeros(sum(r[2] for r in rows), 4))


def tokens(entries) -> bytes:
    return encode(FrameType.TOKENS, 0, 1, {"tokens": entries})


def entry(**over):
    return {"sampling": {}, "prompt": [1, 2], **over}


def test_forks_round_trip():
    f = decode(activations({"0": entry(forks=[[5, 3], [6, None]]), "1": entry(forks=[[7, None]])},
                           rows=((0, 0, 2), (1, 0, 2))))
    assert f.meta["new"]["0"]["forks"] == [[5, 3], [6, None]]


@pytest.mark.parametrize("new, match", [
    ({"0": entry(forks=[])}, "forks must be a list"),
    ({"0": entry(forks={"5": {}})}, "forks must be a list"),
    ({"0": entry(forks=[[i + 10, None] for i in range(MAX_CHOICES)])}, "forks must be a list"),
    ({"0": entry(forks=[5])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[-5, None]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5.0, None]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[True, None]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[2**53, None]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5, "greedy"]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5, {}]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5, -1]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5, 2**63]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[5, 1.5]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(replayed=3)}, "replayed must count"),
    ({"0": entry(replayed=-1)}, "replayed must count"),
    ({"0": entry(replayed=True)}, "replayed must count"),
    ({"0": entry(replayed="1")}, "replayed must count"),
    ({"0": entry(forks=[[5, {}, 1]])}, r"\[seq_id, seed or null\]"),
    ({"0": entry(forks=[[0, None]])}, "not a new sequence"),          # a row of the step
    ({"0": entry(forks=[[5, None], [5, None]])}, "not a new sequence"),  # twice
    ({"0": entry(extra=1)}, "need sampling and prompt"),
])
def test_bad_forks(new, match):
    with pytest.raises(FrameError, match=match):
        decode(activations(new))


def test_forks_across_entries_must_differ_and_chunks_fork_nothing():
    with pytest.raises(FrameError, match="not a new sequence"):
        decode(activations({"0": entry(forks=[[5, None]]), "1": entry(forks=[[5, None]])}, rows=((0, 0, 2), (1, 0, 2))))
    with pytest.raises(FrameError, match="forks nothing"):
        decode(activations({"0": entry(forks=[[5, None]])}, partial=True))


def test_token_logprobs_round_trip():
    top = [[i, -0.5 * i] for i in range(MAX_TOP_LOGPROBS)]
    f = decode(tokens([[1, 2], [3, 4, -0.25, top], [5, 6, 0, []], [7, 8, -9999.0, [[8, -9999.0]]]]))
    assert f.meta["tokens"][1] == [3, 4, -0.25, top]


@pytest.mark.parametrize("bad", [
    [1, 2, -0.5],                                   # three fields
    [1, 2, -0.5, [], 0],                            # five
    [1, 2, 0.5, []],                                # a probability above 1
    [1, 2, "-0.5", []],
    [1, 2, True, []],
    [1, 2, None, []],
    [1, 2, -0.5, None],
    [1, 2, -0.5, [[3, -1.0]] * (MAX_TOP_LOGPROBS + 1)],
    [1, 2, -0.5, [[3]]],
    [1, 2, -0.5, [[3, -1.0, 0]]],
    [1, 2, -0.5, [[-3, -1.0]]],
    [1, 2, -0.5, [[2**31, -1.0]]],
    [1, 2, -0.5, [[3.0, -1.0]]],
    [1, 2, -0.5, [[3, 1.0]]],
    [1, 2, -0.5, [[3, "x"]]],
    [1, 2, -0.5, [3, -1.0]],
])
def test_bad_token_logprobs(bad):
    with pytest.raises(FrameError, match="each token entry|logprobs must be"):
        decode(tokens([bad]))


@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_logprobs_are_refused(word):
    """Python's json reads NaN and the infinities: a frame must not carry them."""
    meta = json.dumps({"tokens": [[1, 2, -1.0, [[2, -1.0]]]]}).replace("-1.0", word, 1).encode()
    raw = bytearray(encode(FrameType.TOKENS, 0, 1, {"tokens": []}))
    head = raw[: len(raw) - len(b'{"tokens":[]}')]
    head[16:20] = len(meta).to_bytes(4, "little")   # meta_len in the fixed header
    with pytest.raises(FrameError, match="logprobs must be"):
        decode(bytes(head) + meta)
