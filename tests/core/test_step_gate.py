"""The step gate: a decode step cuts into a prompt step between layers, never mid-layer,
never into an exclusive op's critical section without a checkpoint, and the cut-ins
per prompt step are bounded. Threads, real waits (no mocks), and on the default model's
real StageModel: a decode step computed while a prompt step is parked gives the same
numbers as computed alone."""

from __future__ import annotations

import threading
import time

import torch

from engine.core.step_gate import StepGate


def _prompt_step(gate: StepGate, log: list, layers: int = 6, layer_s: float = 0.02):
    with gate.step(decode=False):
        for i in range(layers):
            if i:
                gate.checkpoint()
            log.append(("p", i))
            time.sleep(layer_s)


def _decode_step(gate: StepGate, log: list, tag):
    with gate.step(decode=True) as cut_in:
        log.append(("d", tag, cut_in))


def test_decode_cuts_in_at_the_next_layer():
    gate, log = StepGate(), []
    t = threading.Thread(target=_prompt_step, args=(gate, log))
    t.start()
    while ("p", 1) not in log:
        time.sleep(0.001)
    _decode_step(gate, log, "x")
    t.join()
    d = log.index(("d", "x", True))
    # it ran between two layers of the prompt step, well before the step ended
    assert log[d - 1][0] == "p" and log[d + 1][0] == "p", log
    assert d < len(log) - 2
    assert gate.cut_ins == 1


def test_prompt_step_waits_for_a_waiting_decode_and_decodes_alone_do_not_nest():
    gate, log = StepGate(), []
    release = threading.Event()

    def long_decode():
        with gate.step(decode=True) as cut_in:
            log.append(("d0", cut_in))
            release.wait(2)

    t = threading.Thread(target=long_decode)
    t.start()
    while not log:
        time.sleep(0.001)
    t2 = threading.Thread(target=_decode_step, args=(gate, log, "second"))
    t2.start()
    deadline = time.monotonic() + 10
    while gate._wants != 1 and time.monotonic() < deadline:   # the second decode is waiting
        time.sleep(0.001)
    t3 = threading.Thread(target=_prompt_step, args=(gate, log, 2, 0.001))
    t3.start()
    time.sleep(0.05)
    assert log == [("d0", False)]      # the second decode and the prompt step both wait
    release.set()
    for x in (t, t2, t3):
        x.join(2)
    # a waiting decode goes before a waiting prompt step; neither decode cut into anything
    assert log[1] == ("d", "second", False) and log[2:] == [("p", 0), ("p", 1)], log


def test_cut_ins_per_prompt_step_are_bounded():
    gate, log = StepGate(max_cut_ins=2), []
    stop = threading.Event()

    def decoder():
        while not stop.is_set():
            _decode_step(gate, log, "d")
            time.sleep(0.0005)

    threads = [threading.Thread(target=decoder) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    p = threading.Thread(target=_prompt_step, args=(gate, log, 20, 0.002))
    p.start()
    p.join(10)
    stop.set()
    for t in threads:
        t.join(2)
    assert not p.is_alive(), "the prompt step starved"
    first, last = log.index(("p", 0)), log.index(("p", 19))
    inside = [e for e in log[first:last] if e[0] == "d"]
    assert all(e[2] for e in inside) and len(inside) == 2, inside


def test_checkpoint_outside_a_gated_step_never_parks():
    gate = StepGate()
    gate._wants = 1            # a decode waiting, but this thread owns nothing
    t0 = time.monotonic()
    assert gate.checkpoint() is False
    assert time.monotonic() - t0 < 0.5


def test_cut_in_on_the_default_model_gives_the_same_numbers(default_source):
    from engine.core.product_choice import ProductChoice
    from engine.model.stage import StageBatch, StageModel

    torch.manual_seed(0)
    hidden = default_source.config().hidden_size
    history = [torch.randn(8, hidden) for _ in (1, 2)]
    prompt, dec_in = torch.randn(48, hidden), torch.randn(2, hidden)
    # compared bit for bit: one matrix product for both, where each would pick whichever it
    # times faster (engine/model/cpu_linear.py)
    ref, stage = (StageModel(default_source, 10, 20, products=ProductChoice(fixed="rows")) for _ in (1, 2))
    for s in (ref, stage):
        for sid, h in zip((1, 2), history):
            s.forward(StageBatch([sid], [0], [8]), h)
    # reference: the prompt step, then the decode step, one after the other
    ref_prompt = ref.forward(StageBatch([3], [0], [48]), prompt)
    ref_dec = ref.forward(StageBatch([1, 2], [8, 8], [1, 1]), dec_in)

    # cut in: the prompt step parks at one of its layers while the decode step runs
    at_layer = threading.Event()
    orig = stage.gate.checkpoint

    def checkpoint():
        at_layer.set()
        return orig()

    stage.gate.checkpoint = checkpoint
    out = {}

    def prompt_thread():
        with stage.gate.step(decode=False):
            out["prompt"] = stage.forward(StageBatch([3], [0], [48]), prompt)

    t = threading.Thread(target=prompt_thread)
    t.start()
    assert at_layer.wait(30)
    with stage.gate.step(decode=True) as cut_in:
        out["decode"] = stage.forward(StageBatch([1, 2], [8, 8], [1, 1]), dec_in)
    t.join(60)
    assert cut_in and stage.gate.cut_ins == 1
    assert torch.equal(out["prompt"], ref_prompt)
    assert torch.equal(out["decode"], ref_dec)
    assert stage.kv.length(3) == 48 and stage.kv.length(1) == 9
