"""Batched token draws on the logits' device (engine/model/draw.py): what each row draws
is held to a plain float64 reference written from the module's definition, the CPU's
candidate shortcut to the full sort, and on a GPU only the token ids leave the device."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.core.sampling import SamplingParams
from engine.model.draw import Penalties, Shape, draw, penalize
from engine.model.sampler import Sampler


def reference(row: list[float], s: Shape, eps: float = 1e-5) -> tuple[int, bool]:
    """The token the definition draws, in float64, and whether float32 could part from it:
    the uniform, or a top-p cut, within eps of a boundary."""
    V = len(row)
    if s.greedy:
        return max(range(V), key=lambda j: (row[j], -j)), False
    near = False
    x = [v / s.temperature for v in row]
    if not s.ranked:
        order = list(range(V))
        m = max(x)
        probs = [math.exp(v - m) for v in x]
    else:
        order = sorted(range(V), key=lambda j: (-x[j], j))
        if s.top_k:
            order = order[:s.top_k]
        m = x[order[0]]
        w = [math.exp(x[j] - m) for j in order]
        total = sum(w)
        if s.top_p < 1.0:
            keep, before = 0, 0.0
            for p in w:
                near |= abs(before / total - s.top_p) < eps
                if before / total > s.top_p:
                    break
                keep += 1
                before += p
            order, w = order[:keep], w[:keep]
        if s.min_p > 0.0:   # w[0] is the likeliest's, 1.0
            near |= any(abs(p - s.min_p) < eps for p in w)
            keep = sum(p >= s.min_p for p in w)
            order, w = order[:keep], w[:keep]
        probs = w
    total = sum(probs)
    cum, c = [], 0.0
    for p in probs:
        c += p / total
        cum.append(c)
    u = s.uniform
    near |= any(abs(c - u) < eps for c in cum)
    i = next((i for i, c in enumerate(cum) if c > u), len(cum) - 1)
    return order[i], near


def rows_of(kind: str, n: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g)
    if kind == "peaked":       # a trained model's: most of the mass in a few tokens
        x = x * 1.5
        x[:, :V // 50] += 6.0
    elif kind == "ties":       # bf16 logits, coarse: many exact ties, at every boundary
        x = (x * 2).round() / 2
    elif kind == "flat":       # a random-weight model's: the nucleus is most of the row
        x = x * 0.05
    return x.to(torch.bfloat16).float()


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5),
            dict(temperature=0.7, top_k=40, top_p=0.8), dict(temperature=0.5, top_p=0.3),
            dict(temperature=2.0, top_k=1), dict(temperature=0.9, top_p=0.999),
            dict(temperature=0.7, top_p=0.9, min_p=0.1), dict(temperature=1.0, min_p=0.05),
            dict(temperature=1.5, top_k=20, min_p=0.3)]


@pytest.mark.parametrize("kind", ["peaked", "ties", "flat"])
def test_each_row_draws_what_the_definition_says(kind):
    V, n = 300, 24
    x = rows_of(kind, n, V, {"peaked": 1, "ties": 2, "flat": 3}[kind])
    rng = random.Random(7)
    shapes = [Shape(greedy=i % 8 == 7, uniform=rng.random(), **SETTINGS[i % len(SETTINGS)]) for i in range(n)]
    checked = 0
    for candidates in (16, V):   # the CPU's shortcut and the full sort alike
        got = draw(x, shapes, candidates=candidates).tolist()
        for i, s in enumerate(shapes):
            want, near = reference(x[i].tolist(), s)
            if near:
                continue   # float32 and float64 may part on a boundary
            assert got[i] == want, (i, s, candidates)
            checked += 1
    assert checked > 1.5 * n


def test_the_cpu_shortcut_draws_what_the_full_sort_draws():
    """Over many rows, settings and uniforms, including the rows whose nucleus ties or
    reaches past the candidates (those are sorted whole)."""
    V, n = 500, 256
    rng = random.Random(11)
    for kind in ("peaked", "ties", "flat"):
        x = rows_of(kind, n, V, rng.randrange(1 << 30))
        shapes = [Shape(greedy=False, uniform=rng.random(), temperature=rng.choice([0.5, 0.7, 1.0, 1.5]),
                        top_k=rng.choice([0, 0, 3, 20, 64]), top_p=rng.choice([1.0, 0.9, 0.95, 0.5]),
                        min_p=rng.choice([0.0, 0.0, 0.02, 0.1, 0.5]))
                  for _ in range(n)]
        for c in (1, 8, 32, 128):
            assert torch.equal(draw(x, shapes, candidates=c), draw(x, shapes, candidates=V)), (kind, c)


def test_min_p_leaves_out_what_transformers_min_p_leaves_out():
    """min_p alone, against transformers' own warper (temperature first, as there): a
    row only ever draws a token the warper keeps, and every kept token is drawn for
    some uniform."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    V = 64
    for kind, seed in (("peaked", 1), ("flat", 2), ("ties", 3)):
        x = rows_of(kind, 4, V, seed)
        for min_p, t in ((0.05, 0.7), (0.2, 1.0), (0.6, 1.3)):
            kept = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(t)(None, x.clone())) > float("-inf")
            for i in range(4):
                drawn = {draw(x[i:i + 1], [Shape(greedy=False, temperature=t, min_p=min_p, uniform=u / 400)]).item()
                         for u in range(400)}
                allowed = set(kept[i].nonzero().flatten().tolist())
                assert drawn <= allowed, (kind, min_p, i)
                # the least likely kept tokens may hold under 1/400 of the mass
                assert len(drawn) >= min(len(allowed), 2), (kind, min_p, i)


def test_greedy_rows_take_the_penalized_argmax_and_the_logits_stay_as_they_were():
    x = torch.tensor([[1.0, 3.0, 2.9, -1.0], [0.5, 0.5, 0.1, 0.0], [2.0, -3.0, 1.0, 1.9]])
    before = x.clone()
    pen = Penalties(rep_rows=[0, 2], rep_tokens=[1, 0], rep_factor=[2.0, 2.0],
                    sub_rows=[1], sub_tokens=[0], sub_amount=[0.25])
    # row 0: 3.0 / 2 = 1.5 < 2.9; row 1: ties go to the first; 0.5 - 0.25 < 0.5; row 2: 2.0 / 2 < 1.9
    assert draw(x, [Shape(greedy=True)] * 3, pen).tolist() == [2, 1, 3]
    assert torch.equal(x, before)
    # a negative logit under the repetition penalty moves further down: x * f
    y = torch.tensor([[-1.0, -1.5]])
    assert draw(y, [Shape(greedy=True)], Penalties([0], [0], [2.0], [], [], [])).tolist() == [1]


def test_a_row_draws_the_same_alone_and_in_any_batch():
    V = 200
    x = rows_of("peaked", 12, V, 5)
    rng = random.Random(3)
    shapes = [Shape(greedy=i == 4, uniform=rng.random(), **SETTINGS[i % len(SETTINGS)]) for i in range(12)]
    together = draw(x, shapes).tolist()
    alone = [draw(x[i:i + 1], [shapes[i]]).item() for i in range(12)]
    assert together == alone
    perm = list(reversed(range(12)))
    assert draw(x[perm], [shapes[i] for i in perm]).tolist() == [together[i] for i in perm]


def test_a_batch_larger_than_a_cpu_block_draws_as_its_rows_alone():
    """A CPU draws CPU_BLOCK_ROWS rows at a time (cache-sized); the penalties still land
    on their own rows, a block of only ranked rows (the chat's defaults) included."""
    from engine.model.draw import CPU_BLOCK_ROWS

    n, V = 2 * CPU_BLOCK_ROWS + 8, 200
    x = rows_of("peaked", n, V, 9)
    rng = random.Random(4)
    shapes = [Shape(greedy=False, temperature=0.7, top_p=0.9, uniform=rng.random())
              if CPU_BLOCK_ROWS <= i < 2 * CPU_BLOCK_ROWS else
              Shape(greedy=i % 7 == 0, uniform=rng.random(), **SETTINGS[i % len(SETTINGS)]) for i in range(n)]
    rows = [3, CPU_BLOCK_ROWS + 2, n - 1]
    top = x.argmax(-1)
    pen = Penalties(rows, [int(top[r]) for r in rows], [3.0] * 3, rows, [int(top[r]) for r in rows], [2.0] * 3)
    together = draw(x, shapes, pen).tolist()
    alone = [draw(x[i:i + 1], [shapes[i]], Penalties([0], [int(top[i])], [3.0], [0], [int(top[i])], [2.0])
                  if i in rows else None).item() for i in range(n)]
    assert together == alone
    assert draw(x, shapes).tolist() != together     # the penalties did move some rows


def test_the_uniform_decides_and_covers_the_distribution():
    """Uniforms across [0, 1) reach every token of the nucleus in proportion: the draw is
    a real sample, not a fixed pick."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    s = Shape(greedy=False, temperature=1.0, top_p=0.9)
    counts = [0] * 5
    for k in range(1000):
        counts[draw(x, [Shape(False, s.temperature, 0, s.top_p, (k + 0.5) / 1000)]).item()] += 1
    p = torch.softmax(x[0], -1).tolist()
    # the nucleus of 0.9: tokens 0, 1, 2 (0.66 + 0.24 < 0.9 before token 2), renormalised
    nucleus = sum(p[:3])
    assert counts[3] == counts[4] == 0
    for j in range(3):
        assert abs(counts[j] / 1000 - p[j] / nucleus) < 0.002


def test_the_sampler_draws_a_seeded_reply_whatever_the_candidates(monkeypatch):
    """The chat's defaults (temperature 0.7, top-p 0.9, repetition penalty 1.1) through
    the Sampler: the CPU's shortcut and the full sort give one reply."""
    import engine.model.draw as d

    p = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=99)

    def reply():
        s = Sampler()
        s.open(0, p, [1, 2, 3])
        return [s.sample([0], rows_of("peaked", 1, 400, 50 + t))[0] for t in range(30)]

    short = reply()
    monkeypatch.setattr(d, "CPU_CANDIDATES", 1 << 20)
    assert reply() == short and len(set(short)) > 3


def test_a_masked_out_token_is_never_drawn_even_at_the_top_of_the_uniform():
    """A grammar's mask (-inf) or top-k leaves the last columns out; a uniform just under
    1 whose share of the total rounds up to it still draws a token that may be drawn."""
    x = torch.full((4, 64), float("-inf"))
    x[:, 3] = 0.0
    x[:, 10] = 0.5
    top = 1.0 - 2.0 ** -40
    for kw in (dict(), dict(top_k=50), dict(top_p=0.99), dict(top_k=63, top_p=0.999999)):
        for c in (8, 64):
            got = draw(x, [Shape(False, 1.0, uniform=top, **kw)] * 4, candidates=c).tolist()
            assert set(got) <= {3, 10}, (kw, c, got)


@pytest.mark.gpu
def test_on_a_gpu_only_token_ids_leave_the_device_and_they_are_the_cpu_ones():
    from torch.profiler import ProfilerActivity, profile

    V, n = 32000, 16
    x = rows_of("peaked", n, V, 9)
    rng = random.Random(5)
    shapes = [Shape(greedy=i % 5 == 0, uniform=rng.random(), **SETTINGS[i % len(SETTINGS)]) for i in range(n)]
    pen = Penalties(list(range(n)), [7] * n, [1.1] * n, list(range(n)), [9] * n, [0.5] * n)
    cpu = draw(x, shapes, pen).tolist()
    xc = x.cuda()
    draw(xc, shapes, pen).tolist()   # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = draw(xc, shapes, pen).tolist()
        torch.cuda.synchronize()
    # the same tokens as the CPU's, but where a GPU's sums may round across a boundary
    y = x.clone()
    penalize(y, pen)
    sure = [i for i, s in enumerate(shapes) if not reference(y[i].tolist(), s, eps=1e-4)[1]]
    assert len(sure) >= n // 2 and [got[i] for i in sure] == [cpu[i] for i in sure]
    dtoh = [e for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name]
    assert len(dtoh) <= 1, [e.name for e in dtoh]
    # the rows' settings and penalties go up from pinned memory: a copy from pageable
    # memory may wait for the device's queue to drain (engine/model/draw.py to_device)
    pageable = [e.name for e in prof.events() if "Pageable -> Device" in e.name]
    assert not pageable, pageable
