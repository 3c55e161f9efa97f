"""The node's plan without bitsandbytes: in-process, the package's absence faked."""

from __future__ import annotations

import pytest

from engine.node.control import Node, NodeError


@pytest.fixture
def no_bnb(monkeypatch):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "bnb_missing", lambda: "8-bit and 4-bit weights need the bitsandbytes package")


async def test_without_bitsandbytes_only_bf16_is_offered(no_bnb):
    node = Node("t" * 32, device="cpu")
    plan = await node.plan(**node.host_args({"model": "default", "stages": 1}))
    # int4 is torch's own kernels: offered without bitsandbytes, never chosen for auto
    assert [(r["weights"], r["available"]) for r in plan["precisions"]] == [
        ("bf16", True), ("int8", False), ("nf4", False), ("int4", True)]
    assert plan["weights"] == "bf16" and plan["fits"]
    plan = await node.plan(**node.host_args({"model": "default", "stages": 1, "weights": "int4"}))
    assert plan["weights"] == "int4" and plan["fits"], plan["message"]
    plan = await node.plan(**node.host_args({"model": "default", "stages": 1, "weights": "nf4"}))
    assert not plan["fits"] and "bitsandbytes" in plan["message"]
    # too little memory for bf16, and nothing smaller to fall back on
    plan = await node.plan(**node.host_args({"model": "default", "stages": 1, "memory_limit_mb": 300}))
    assert plan["weights"] == "bf16" and not plan["fits"] and "does not fit" in plan["message"]


def test_weights_are_checked_and_normalised():
    node = Node("t" * 32, device="cpu")
    assert node.host_args({})["weights"] == "auto"
    assert node.host_args({"weights": " NF4 "})["weights"] == "nf4"
    with pytest.raises(NodeError, match="'weights' must be one of"):
        node.host_args({"weights": "q4_k_m"})


async def test_a_checkpoint_saved_quantized_loads_as_saved(monkeypatch):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "prequantized", lambda cfg: "nf4")
    monkeypatch.setattr(quant, "bnb_missing", lambda: None)
    node = Node("t" * 32, device="cpu")
    plan = await node.plan(**node.host_args({"model": "default", "stages": 1}))
    assert plan["weights"] == "nf4" and "saved as nf4" in plan["message"]
    with pytest.raises(NodeError, match="saved as nf4; it cannot load as bf16"):
        await node.plan(**node.host_args({"model": "default", "stages": 1, "weights": "bf16"}))


def test_stages_default_to_one_process_on_a_gpu_and_on_a_cpu():
    node = Node("t" * 32, device="cpu")
    assert node.host_args({})["stages"] == 1 and node.host_args({"stages": 0})["stages"] == 1
    assert node.host_args({"stages": 3})["stages"] == 3
    node.device = "cuda:0"   # what the node reads of a GPU here (none on this machine)
    assert node.host_args({})["stages"] == 1 and node.host_args({"stages": None})["stages"] == 1
    assert node.host_args({"stages": 2})["stages"] == 2
    for bad in (9, -1, True, "2"):
        with pytest.raises(NodeError, match="'stages' must be a whole number from 1 to 8"):
            node.host_args({"stages": bad})


def test_a_relay_is_a_ws_address_before_anything_starts():
    """The app's host dialog posts what a person typed: a web address is said at once,
    not found at every registration after the invite went out."""
    node = Node("t" * 32, device="cpu")
    assert node.host_args({"relay": " ws://relay.example:8765 ", "friends": 1})["relay"] == "ws://relay.example:8765"
    assert node.host_args({"relay": "wss://relay.example", "friends": 1})["relay"] == "wss://relay.example"
    for bad in ("http://relay.example:8765", "ws://relay.example:port", "relay.example:8765"):
        with pytest.raises(NodeError, match="is not a relay's address"):
            node.host_args({"relay": bad, "friends": 1})
