"""The decode step over fixed buffers (engine/model/static_decode.py): what a CUDA graph
captures on a GPU, run eagerly here.

* every family decodes through it token for token what the eager step gives, batched
  rows of different lengths across three stages (the eager step is checked against
  transformers' generate in test_parity.py);
* a verification step of 1 + k tokens and the rollback of its rejected tail, too;
* two steps of one bucket -- other positions, slots and inputs -- run the same
  operators with the same sizes and scalars, and nothing reads a value back to the
  host: what lets one captured graph replay every step of its bucket;
* the padding rows of a bucket never write another sequence's cache.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.product_choice import ProductChoice
from engine.model.cpu_linear import use_small_batch_linear
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel
from engine.model.static_decode import HOST_BOUND, StaticDecoder, decode_path, unsupported
from testkit.graph_tape import TapeCuda
from testkit.tiny_models import ARCHS, STATIC_EAGER_ONLY as EAGER_ONLY, VOCAB

PROMPTS = [[5, 9, 14, 3, 77], [8, 1, 60, 33, 2, 90, 41, 17, 12, 6, 200], [4, 4, 150]]
NEW = 8


def stages(folder, n: int, static: bool) -> list[StageModel]:
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    cuts = [round(i * L / n) for i in range(n + 1)]
    out = [StageModel(source, a, b, dtype=torch.float32, device="cpu") for a, b in zip(cuts, cuts[1:])]
    if static:
        for s in out:
            s.static = StaticDecoder(s)
    return out


def forward(chain, batch: StageBatch, ids: list[int]) -> torch.Tensor:
    h = torch.tensor(ids)
    for s in chain:
        h = s.forward(batch, h)
    return h


def greedy(chain, prompts=PROMPTS, new=NEW):
    """Prompts prefilled together, then `new` decode steps of every row: tokens, logits."""
    rows = list(range(len(prompts)))
    out = forward(chain, StageBatch(rows, [0] * len(rows), [len(p) for p in prompts]), [t for p in prompts for t in p])
    toks, logits = [[int(out[r].argmax())] for r in rows], [[out[r]] for r in rows]
    pos = [len(p) for p in prompts]
    for _ in range(new - 1):
        out = forward(chain, StageBatch(rows, list(pos), [1] * len(rows)), [t[-1] for t in toks])
        for r in rows:
            toks[r].append(int(out[r].argmax()))
            logits[r].append(out[r])
            pos[r] += 1
    return toks, [torch.stack(x) for x in logits]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_decodes_through_fixed_buffers_as_the_eager_step_does(tiny_folder, arch):
    folder, _ = tiny_folder(arch)
    if arch in EAGER_ONLY:
        (s,) = stages(folder, 1, False)
        assert EAGER_ONLY[arch] in unsupported(s)
        with pytest.raises(ValueError, match=EAGER_ONLY[arch]):
            StaticDecoder(s)
        return
    want_toks, want_logits = greedy(stages(folder, 3, False))
    chain = stages(folder, 3, True)
    toks, logits = greedy(chain)
    assert toks == want_toks
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    # every decode step took the fixed-buffer path on every stage (3 rows: a bucket of 4)
    assert [s.static.steps for s in chain] == [NEW - 1] * 3


class OpTrace(TorchDispatchMode):
    """Every operator a step runs, with its tensors' sizes and its other arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def norm(a):
            if isinstance(a, torch.Tensor):
                return ("T", tuple(a.shape), a.dtype)
            if isinstance(a, (list, tuple)):
                return tuple(norm(x) for x in a)
            return a

        self.ops.append((str(func), norm(args), tuple(sorted((k, norm(v)) for k, v in kwargs.items()))))
        return func(*args, **kwargs)


def traced(chain) -> list[list]:
    """Each stage's `_run`, traced, as the stages go."""
    traces = []
    for s in chain:
        run = s.static._run

        def wrapped(*a, run=run):
            with OpTrace() as t:
                out = run(*a)
            traces.append(t.ops)
            return out

        s.static._run = wrapped
    return traces


# the operators that read a device value back to the host (a sync a graph cannot hold) or
# whose output size depends on the data
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "lift_fresh")


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in EAGER_ONLY or a in HOST_BOUND])
def test_two_steps_of_one_bucket_run_the_same_operators_and_read_nothing_back(tiny_folder, arch):
    """And the families static_decode.HOST_BOUND keeps eager still fail this (the day
    transformers changes that, the list should shrink)."""
    folder, _ = tiny_folder(arch)
    chain = stages(folder, 3, False)
    for s in chain:
        s.static = StaticDecoder(s, check=False)      # past the refusal, to show why it stands
        # one matrix product throughout: a CPU stage's first steps time both (cpu_linear.py),
        # which a GPU stage, the one that captures graphs, never does
        use_small_batch_linear(s.model, ProductChoice(fixed="rows"))
    rows = [0, 1, 2]
    forward(chain, StageBatch(rows, [0] * 3, [len(p) for p in PROMPTS]), [t for p in PROMPTS for t in p])
    # the first step grows the store to the bucket's keys (a graph's warm-up does that)
    forward(chain, StageBatch(rows, [len(p) for p in PROMPTS], [1] * 3), [7, 8, 9])
    traces = traced(chain)
    forward(chain, StageBatch(rows, [len(p) + 1 for p in PROMPTS], [1] * 3), [10, 11, 12])
    first = list(traces)
    traces.clear()
    # the next step: every position one on, other tokens
    forward(chain, StageBatch(rows, [len(p) + 2 for p in PROMPTS], [1] * 3), [200, 3, 41])
    assert len(first) == len(traces) == 3
    bad = [op for ops in first for op, *_ in ops if any(h in op for h in HOST_READS)]
    same = first == traces
    if arch in HOST_BOUND:
        assert bad or not same
    else:
        assert same and not bad, bad
        # and two verification steps of 1 + 3 tokens a row (padded to 5), the second inside
        # the first's draft: what a GPU stage captures at load for one user and replays
        at = [len(p) + 3 for p in PROMPTS]
        traces.clear()
        forward(chain, StageBatch(rows, at, [4] * 3, keep=[4] * 3), list(range(20, 32)))
        first = list(traces)
        traces.clear()
        forward(chain, StageBatch(rows, [a + 2 for a in at], [4] * 3, keep=[4] * 3), list(range(40, 52)))
        bad = [op for ops in first for op, *_ in ops if any(h in op for h in HOST_READS)]
        assert first == traces and not bad, bad


def test_rows_in_scattered_slots_gather_their_keys_and_match(tiny_folder):
    folder, _ = tiny_folder("qwen2")
    eager, static = stages(folder, 2, False), stages(folder, 2, True)
    for chain in (eager, static):
        forward(chain, StageBatch([0, 1, 2], [0, 0, 0], [len(p) for p in PROMPTS]), [t for p in PROMPTS for t in p])
        chain[0].free(1), chain[1].free(1)      # slot 1 free: rows 0 and 2 are not adjacent
    batch = StageBatch([2, 0], [3, 5], [1, 1])
    torch.testing.assert_close(forward(static, batch, [11, 12]), forward(eager, batch, [11, 12]), atol=1e-5, rtol=1e-5)
    assert static[0].static.steps == 1
    assert [s.lo for s in static[0].static.buffers] == [None]     # gathered, not a slice


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2_moe", "deepseek_v3", "gpt2"])
def test_verification_steps_and_their_rollback_match_the_eager_step(tiny_folder, arch):
    """A speculative draft of 4 verified (1 + 4 tokens a row, every position kept), the
    next step starting two tokens in (the rest rolled back), then plain decoding."""
    folder, _ = tiny_folder(arch)
    outs = {}
    for static in (False, True):
        chain = stages(folder, 3, static)
        got = [forward(chain, StageBatch([0, 1], [0, 0], [5, 11]), PROMPTS[0] + PROMPTS[1])]
        got.append(forward(chain, StageBatch([0, 1], [5, 11], [5, 5], keep=[5, 5]), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
        got.append(forward(chain, StageBatch([0, 1], [7, 13], [5, 5], keep=[5, 5]), [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]))
        got.append(forward(chain, StageBatch([0, 1], [9, 18], [1, 1]), [30, 31]))
        outs[static] = got
        if static:
            assert all(s.static.steps == 3 for s in chain)
    for a, b in zip(outs[True], outs[False]):
        assert a.shape == b.shape
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2_moe"])
def test_verification_steps_of_every_k_padded_to_their_bucket_match_the_eager_step(tiny_folder, arch):
    """1 + k tokens a row for k from 1 to 8, in four buckets (engine/core/graph_plan.py
    VERIFY_TOKENS): the padding positions' outputs go, and what they wrote past each
    row's length is overwritten by its next step, which starts inside the draft."""
    folder, _ = tiny_folder(arch)
    outs = {}
    for static in (False, True):
        chain = stages(folder, 3, static)
        got = [forward(chain, StageBatch([0, 1], [0, 0], [5, 11]), PROMPTS[0] + PROMPTS[1])]
        pos = [5, 11]
        for k in range(1, 9):
            n = 1 + k
            ids = [(7 * k + i) % 200 + 3 for i in range(2 * n)]
            got.append(forward(chain, StageBatch([0, 1], list(pos), [n, n], keep=[n, n]), ids))
            pos = [p + 1 + k // 2 for p in pos]          # half the draft stood
        got.append(forward(chain, StageBatch([0, 1], list(pos), [1, 1]), [30, 31]))
        outs[static] = got
        if static:
            assert all(s.static.steps == 9 for s in chain)
            assert {(b.rows, b.tokens) for b in chain[1].static.buffers} == {(2, 1), (2, 2), (2, 3), (2, 5), (2, 9)}
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.shape == b.shape
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_padding_rows_never_write_another_sequences_cache(tiny_folder):
    folder, _ = tiny_folder("llama")
    (stage,) = stages(folder, 1, True)
    prompts = PROMPTS + [[9, 9, 9, 9]]
    forward([stage], StageBatch([0, 1, 2, 3], [0] * 4, [len(p) for p in prompts]), [t for p in prompts for t in p])
    kv = stage.kv
    before = {li: (kv._k[li].clone(), kv._v[li].clone()) for li in kv._k}
    # rows 0-2 in slots 0-2: a bucket of 4, read as slots 0-3; sequence 3 in slot 3 is not in it
    forward([stage], StageBatch([0, 1, 2], [len(p) for p in PROMPTS], [1] * 3), [7, 8, 9])
    slot3 = kv.seqs[3].slot
    assert slot3 == 3 and kv.scratch_slot() not in (0, 1, 2, 3)
    for li, (k, v) in before.items():
        cap = k.shape[2]                 # the store grew to the bucket's keys: the rest is new
        for now, was in ((kv._k[li][slot3], k[slot3]), (kv._v[li][slot3], v[slot3])):
            assert torch.equal(now[:, :cap], was) and not now[:, cap:].any()
    # and sequence 3 decodes on as if nothing happened
    (ref,) = stages(folder, 1, False)
    forward([ref], StageBatch([3], [0], [4]), prompts[3])
    step = StageBatch([3], [4], [1])
    torch.testing.assert_close(forward([stage], step, [5]), forward([ref], step, [5]), atol=1e-5, rtol=1e-5)


def test_steps_outside_every_bucket_run_eagerly_and_say_why(tiny_folder):
    folder, _ = tiny_folder("llama")
    (stage,) = stages(folder, 1, True)
    forward([stage], StageBatch([0, 1], [0, 0], [5, 11]), PROMPTS[0] + PROMPTS[1])
    forward([stage], StageBatch([2, 3], [0, 0], [12, 12]), list(range(24)))
    assert stage.static.book.eager == {"rows of different lengths": 1, "rows of 12 tokens (a prompt)": 1}
    assert stage.static.steps == 0


def test_the_stage_takes_the_path_on_the_cpu_only_when_asked(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    (plain,) = stages(folder, 1, False)
    assert plain.static is None
    monkeypatch.setenv("POTLUCK_STATIC_DECODE", "1")
    decode_path(plain)
    assert isinstance(plain.static, StaticDecoder) and plain.static.runner is None
    (falcon,) = stages(tiny_folder("falcon_alibi")[0], 1, False)
    decode_path(falcon)
    assert falcon.static is None
    assert VOCAB == plain.vocab_size


def test_the_graph_runner_captures_once_replays_after_and_recaptures_when_the_store_moves(tiny_folder):
    from engine.model.cuda_graphs import WARMUP_RUNS, GraphRunner

    folder, _ = tiny_folder("llama")
    (stage,) = stages(folder, 1, False)
    cuda = TapeCuda()
    static = stage.static = StaticDecoder(stage)
    static.runner = GraphRunner(stage, static.book, cuda=cuda)
    calls = []
    run = static._run
    static._run = lambda *a: calls.append(1) or run(*a)
    forward([stage], StageBatch([0], [0], [5]), PROMPTS[0])
    forward([stage], StageBatch([0], [5], [1]), [7])
    assert len(calls) == WARMUP_RUNS + 1 and cuda.captures == 1
    forward([stage], StageBatch([0], [6], [1]), [8])
    assert len(calls) == WARMUP_RUNS + 1 and static.book.replays == 1     # replayed, not run
    stage.kv.generation += 1                                             # the store moved
    forward([stage], StageBatch([0], [7], [1]), [9])
    assert cuda.captures == 2 and static.book.captures == 2


def test_a_capture_that_raises_runs_the_step_eagerly_and_enough_failures_stop_capturing(tiny_folder, caplog):
    from engine.model.cuda_graphs import GraphRunner

    folder, _ = tiny_folder("llama")
    (stage,) = stages(folder, 1, False)
    (ref,) = stages(folder, 1, False)
    cuda = TapeCuda()

    def refuse(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    cuda.graph = refuse
    static = stage.static = StaticDecoder(stage)
    static.runner = GraphRunner(stage, static.book, cuda=cuda)
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    for chain in ([stage], [ref]):
        forward(chain, StageBatch([0, 1, 2, 3], [0] * 4, [4] * 4), [t for p in prompts for t in p])
    steps = []
    for rows in ([0], [0, 1], [0, 1, 2, 3], [0, 1], [0, 1, 2]):   # buckets of 1, 2, 4, 2 again, 4
        batch = StageBatch(rows, [stage.kv.length(r) for r in rows], [1] * len(rows))
        torch.testing.assert_close(forward([stage], batch, [50] * len(rows)), forward([ref], batch, [50] * len(rows)),
                                   atol=1e-5, rtol=1e-5)
        steps.append(static.steps)
    book = static.book
    assert book.disabled and "operation not permitted" in book.disabled
    assert book.eager.get("capture failed before", 0) >= 1
    # the allocator stopped recording into the pool the failed capture had opened
    assert cuda.pools_stopped and cuda.pools_stopped[0] is static.runner.pool
    # with no graph to replay, a step is the stage's own at the batch's size, not the
    # bucket's padded one run eagerly (3 rows padded to 4, keys to the bucket's floor)
    assert steps[-1] == steps[-2] == steps[-3], steps
    assert "runs without a CUDA graph" in caplog.text


def test_capturing_at_load_opens_only_scratch_sequences(tiny_folder):
    """The capture at load runs each bucket on sequences of its own and frees them: they
    must never be ids a request can hold (an id counted from the scratch slot was one:
    the second bucket's warm-up took ids 9..16 and freed them after)."""
    from engine.model.static_decode import use_graphs

    folder, _ = tiny_folder("llama")
    (stage,) = stages(folder, 1, False)
    opened = []
    open_ = stage.kv.open
    stage.kv.open = lambda seq_id: opened.append(seq_id) or open_(seq_id)
    use_graphs(stage, TapeCuda())
    assert stage.static.book.captures >= 2 and opened
    assert all(s < 0 for s in opened), sorted(set(opened))
    assert not stage.kv.seqs


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_a_steps_weight_bytes_leave_out_the_token_table_it_only_looks_up(tiny_folder, arch, tied):
    """What the graphs' key floors weigh the keys against (graph_plan.row_floors): a step
    reads one row of the token embedding per token, the whole LM head, every layer."""
    from engine.model.static_decode import step_read_bytes

    folder, _ = tiny_folder(arch)
    table = lambda s: sum(p.numel() * p.element_size() for p in s.model.get_input_embeddings().parameters())
    (whole,) = stages(folder, 1, False)
    assert whole._tied is tied
    # tied: the table is the LM head this stage reads whole
    assert step_read_bytes(whole) == whole.param_bytes() - (0 if tied else table(whole))
    first, middle, last = stages(folder, 3, False)
    assert step_read_bytes(first) == first.param_bytes() - table(first) < first.param_bytes()
    for s in (middle, last):
        assert step_read_bytes(s) == s.param_bytes()


class Clock:
    """A device whose attention walks its keys slowly (as one row's does on a GPU), or one
    whose clock fails."""

    def __init__(self, per_key: float, fail: bool = False, table=None):
        self.per_key, self.fail, self.timed, self.table = per_key, fail, {}, table or {}
        self.unused = None

    def choose(self, row_buckets, least):
        if self.fail:
            raise RuntimeError("no clock")
        return self.table

    def attention(self, rows, keys):
        t = 1e-6 + self.per_key * rows * keys
        self.timed[(rows, keys)] = (t, t / 2)
        return t

    def seconds_per_byte_read(self):
        return 1 / 3e12


def test_the_key_floors_come_down_where_the_attention_is_slower_than_its_bytes(tiny_folder):
    """static_decode._time_keys on a stage: the choice of products set on its model, its
    weights' read time and layer count weighed against the attention's; a clock that
    fails leaves the byte rule's floors and SDPA; the stage's own attention timed by
    KeyClock (the wall clock on a CPU) gives both ways' times for every count asked."""
    from engine.core.graph_plan import GraphPlan
    from engine.model.key_clock import KeyClock
    from engine.model.product_attention import ATTR
    from engine.model.static_decode import _time_keys

    folder, _ = tiny_folder("llama")
    (s,) = stages(folder, 1, False)
    floors, plan = ((1, 2048), (2, 1024)), GraphPlan()
    assert _time_keys(s, floors, plan, clock=Clock(0.0))[0] == floors
    got, costs = _time_keys(s, floors, plan, clock=Clock(1e-6, table={1: 1024}))
    assert got == () and costs["by_bytes"] == dict(floors) and costs["products_from"] == {1: 1024}
    assert getattr(s.model.config, ATTR) == {1: 1024}
    got, costs = _time_keys(s, floors, plan, clock=Clock(0.0, fail=True))
    assert got == floors and "no clock" in costs["untimed"] and getattr(s.model.config, ATTR) is None
    clock = KeyClock(s)
    got, costs = _time_keys(s, floors, GraphPlan(row_buckets=(1, 2)), clock=clock)
    assert set(got) <= set(floors) | {(1, 512), (1, 1024), (2, 512)}
    assert {(1, 256), (2, 256), (1, 8192)} <= set(clock.timed)
    assert all(a > 0 and b > 0 for a, b in clock.timed.values())
    assert costs["products_from"] == clock.table == (getattr(s.model.config, ATTR) or {})
    assert clock.seconds_per_byte_read() > 0


def test_products_that_fail_to_run_leave_sdpa_and_the_floors_timed(tiny_folder, monkeypatch):
    """A torch whose batched product lacks what the products need (out_dtype on an older
    CUDA build): SDPA stays, the floors are still weighed in its time."""
    import engine.model.key_clock as key_clock
    from engine.core.graph_plan import GraphPlan
    from engine.model.product_attention import ATTR
    from engine.model.static_decode import _time_keys

    def broken(*args, **kwargs):
        raise TypeError("bmm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(key_clock, "product_attention", broken)
    folder, _ = tiny_folder("llama")
    (s,) = stages(folder, 1, False)
    clock = key_clock.KeyClock(s)
    got, costs = _time_keys(s, ((1, 1024),), GraphPlan(row_buckets=(1,)), clock=clock)
    assert clock.table == {} and "out_dtype" in costs["products_from"] and getattr(s.model.config, ATTR) is None
    assert "untimed" not in costs and costs["attention_us"]["1x256"][0] > 0


@pytest.mark.gpu
def test_a_gpu_times_its_attention_and_copies_for_the_key_floors(tmp_path):
    from engine.model.key_clock import KeyClock
    from testkit.tiny_models import build_tiny_model

    build_tiny_model("llama", tmp_path)
    source = resolve(str(tmp_path))
    s = StageModel(source, 0, source.config().num_hidden_layers, device="cuda", serving=False)
    clock = KeyClock(s)
    per_byte = clock.seconds_per_byte_read()
    assert 1 / 20e12 < per_byte < 1 / 50e9          # between 50 GB/s and 20 TB/s
    short, long = clock.sdpa(1, 256), clock.sdpa(1, 8192)
    assert 0 < short < 1e-3 and short <= long * 1.5   # more keys never much faster
    assert clock.products(1, 8192) > 0
    for rows in (1, 4):                              # the products give SDPA's output here
        assert clock._agrees(rows, 2048), rows
    clock.choose((1, 16), 256)
    assert set(clock.table) <= {1, 16}


def test_products_switched_off_leave_sdpa_and_the_floors_timed(tiny_folder, monkeypatch):
    """POTLUCK_PRODUCT_ATTENTION=0 (how the GPU window measures without them when their GPU
    test fails): no choice is made, the floors are still weighed in SDPA's time."""
    from engine.core.graph_plan import GraphPlan
    from engine.model.product_attention import ATTR
    from engine.model.static_decode import _time_keys

    monkeypatch.setenv("POTLUCK_PRODUCT_ATTENTION", "0")
    folder, _ = tiny_folder("llama")
    (s,) = stages(folder, 1, False)
    clock = Clock(1e-6, table={1: 1024})
    got, costs = _time_keys(s, ((1, 2048), (2, 1024)), GraphPlan(), clock=clock)
    assert got == () and getattr(s.model.config, ATTR) is None
    assert "POTLUCK_PRODUCT_ATTENTION=0" in costs["products_from"] and costs["attention_us"]
