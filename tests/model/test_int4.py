"""`--weights int4` (engine/model/int4.py): 4-bit groups through torch's own kernels, on
the CPU here (its twin of the CUDA kernel), a GPU's in `-m gpu`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.core import precision
from engine.model.int4 import GROUP, Int4Linear, Int4Part, dequantize, join, quantize, quantize_layers
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel

# a Llama layer at int4: o and down alone, q/k/v and gate/up each one joined product
JOINED_PER_LAYER = {"Int4Linear": 4, "Int4Part": 5}


def four_bit(model: nn.Module) -> dict[str, int]:
    out = {}
    for m in model.modules():
        if isinstance(m, (Int4Linear, Int4Part)):
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def per_layer(counts: dict[str, int], L: int) -> dict[str, float]:
    return {k: v / L for k, v in counts.items()}


def test_a_group_spans_its_range_in_sixteen_levels():
    torch.manual_seed(0)
    w = torch.randn(32, 128) * torch.linspace(0.01, 3, 128)
    q, sz = quantize(w)
    assert q.dtype == torch.uint8 and int(q.min()) == 0 and int(q.max()) == 15
    assert sz.shape == (128 // GROUP, 32, 2) and sz.dtype == torch.bfloat16
    step = sz.float()[..., 0].t().repeat_interleave(GROUP, 1)      # each weight's group's scale
    err = (dequantize(q, sz) - w).abs()
    assert bool((err <= step * 0.5 + 1e-2 * step + 1e-6).all()), float((err / step).max())


def test_weights_already_in_four_bit_groups_keep_their_levels():
    """A GGUF's Q4_1 blocks (32 weights, a scale and a minimum): the default model's own
    layers keep their 4-bit levels, not a second rounding of them; only the group's zero
    (minimum + 8 scales) is held in bf16, as the kernel reads it."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    q[:, ::GROUP] = 0           # every group uses its whole range, as a block's min and max do
    q[:, 1::GROUP] = 15
    scale = (torch.rand(48, 96 // GROUP, 1) + 0.05).to(torch.bfloat16).float()
    low = torch.randn(48, 96 // GROUP, 1).to(torch.bfloat16).float()
    w = (q.reshape(48, -1, GROUP).float() * scale + low).reshape(48, 96)
    q2, sz = quantize(w)
    assert torch.equal(q2, q)
    zero = (low + 8 * scale).abs().repeat_interleave(GROUP, 1).reshape(48, 96)
    assert bool(((dequantize(q2, sz) - w).abs() <= zero * 2 ** -8 + 1e-6).all())


def test_the_kernel_computes_what_the_groups_hold():
    torch.manual_seed(2)
    lin = nn.Linear(96, 48)
    q, sz = quantize(lin.weight)
    m = Int4Linear(lin)
    m.to_device(torch.device("cpu"))
    x = torch.randn(3, 5, 96)
    want = nn.functional.linear(x.to(torch.bfloat16).float(), dequantize(q, sz), lin.bias)
    got = m(x)
    assert got.shape == (3, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert m.weight_bytes() == 48 * 96 // 2 + sz.numel() * 2


def test_layers_the_kernels_cannot_take_keep_their_own_product():
    block = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 24), nn.Linear(48, 32))  # 24 rows; 48 columns
    assert quantize_layers(block) == 1
    assert [type(m).__name__ for m in block] == ["Int4Linear", "Linear", "Linear"]


def test_projections_that_read_one_input_are_one_product_with_the_levels_each_had_alone():
    torch.manual_seed(1)
    members = [nn.Linear(96, n) for n in (64, 32, 32)]
    alone = [Int4Linear(m) for m in members]
    parts = join(members)
    whole = parts[0].whole
    assert torch.equal(whole.nibbles, torch.cat([a.nibbles for a in alone]))
    assert torch.equal(whole.scale_zero, torch.cat([a.scale_zero for a in alone], 1))
    for m in alone + [whole]:
        m.to_device(torch.device("cpu"))
    for rows in (1, 5):
        x = torch.randn(rows, 96)
        # the kernel sums each output as it would alone: bit for bit
        for part, a in zip(parts, alone):
            assert torch.equal(part(x), a(x))
        # one kernel call for the three (the first member computes it, the others take columns)
        y = whole(x)
        assert torch.equal(torch.cat([p(x) for p in parts], -1), y)
    # a member fed another input computes the product again, never hands out stale columns
    x1, x2 = torch.randn(1, 96), torch.randn(1, 96)
    assert torch.equal(parts[0](x1), alone[0](x1)) and torch.equal(parts[1](x2), alone[1](x2))


def test_an_int4_stage_joins_its_products_and_answers_as_one_that_does_not(tiny_folder, monkeypatch):
    """The same logits, prompt and decode, with 4 int4 kernel calls a layer where 7 were."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.core.product_choice import ProductChoice

    class Calls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.n += "int4pack_mm" in str(func)
            return func(*args, **(kwargs or {}))

    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    # one product for the LM head in both (a CPU stage's first steps time two, cpu_linear.py)
    rows = ProductChoice(fixed="rows")
    monkeypatch.setenv("POTLUCK_FUSED_PRODUCTS", "0")
    apart = StageModel(source, 0, L, device="cpu", weights="int4", products=rows)
    monkeypatch.delenv("POTLUCK_FUSED_PRODUCTS")
    joined = StageModel(source, 0, L, device="cpu", weights="int4", products=rows)
    assert four_bit(apart.model) == {"Int4Linear": 7 * L}
    prompt = [5, 9, 14, 3, 77, 8, 1, 60]
    outs, calls = [], []
    for s in (apart, joined):
        out = s.forward(StageBatch([0], [0], [len(prompt)]), torch.tensor(prompt))
        got = [out]
        Calls.n = 0
        for i in range(3):
            with Calls():
                out = s.forward(StageBatch([0], [len(prompt) + i], [1]), out.argmax(-1))
            got.append(out)
        outs.append(got)
        calls.append(Calls.n / 3)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert calls == [7 * L, 4 * L]


def test_int4_is_a_choice_of_its_own_that_auto_never_makes():
    assert "int4" in precision.CHOICES and "int4" not in precision.QUANTIZED
    assert precision.layer_bytes_per_param("int4", 4) == 0.625


def test_a_stage_at_int4_holds_its_layers_in_four_bits(tiny_folder):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    full = StageModel(source, 0, L, device="cpu")
    s = StageModel(source, 0, L, device="cpu", weights="int4")
    assert s.weights == "int4"
    assert per_layer(four_bit(s.model), L) == JOINED_PER_LAYER
    # the embeddings and LM head stay whole; the layers take about a sixth of float32's bytes
    layers_full = sum(p.numel() * p.element_size() for p in full._layers.parameters())
    assert s.param_bytes() < full.param_bytes() - 0.8 * layers_full
    prompt = [5, 9, 14, 3, 77, 8, 1, 60]
    out = s.forward(StageBatch([0], [0], [len(prompt)]), torch.tensor(prompt))
    for i in range(4):
        out = s.forward(StageBatch([0], [len(prompt) + i], [1]), out.argmax(-1))
        assert out.shape == (1, source.config().vocab_size) and bool(torch.isfinite(out).all())


def test_an_int4_stage_holds_one_layer_at_full_precision_at_a_time_while_loading(tiny_folder, monkeypatch):
    """A slice that fits its GPU only in 4 bits must not pass through it whole at 16."""
    import transformers.core_model_loading as loading
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    real, full_layers = loading.convert_and_load_state_dict_in_model, []

    def load(model, state, config, *args, **kwargs):
        out = real(model, state, config, *args, **kwargs)
        full_layers.append(sum(any(type(m) is nn.Linear and not m.weight.is_meta for m in layer.modules())
                               for layer in model.model.layers))
        return out

    monkeypatch.setattr(loading, "convert_and_load_state_dict_in_model", load)
    s = StageModel(source, 0, L, device="cpu", weights="int4")
    assert len(full_layers) == L + 1 and max(full_layers) == 1      # the embeddings, then each layer
    assert per_layer(four_bit(s.model), L) == JOINED_PER_LAYER


def test_int4_layers_kept_across_a_rearrangement_are_not_quantized_again(tiny_folder):
    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    old = StageModel(source, 0, L, device="cpu", weights="int4")
    held = [m for m in old.model.modules() if isinstance(m, Int4Linear)]
    kept = StageModel(source, 0, L // 2, device="cpu", weights="int4", reuse=old.hand_over())
    fresh = StageModel(source, 0, L // 2, device="cpu", weights="int4")
    mine = [m for m in kept.model.modules() if isinstance(m, Int4Linear)]
    assert kept.kept_layers == L // 2 and all(any(m is h for h in held) for m in mine) and len(mine) == 4 * (L // 2)
    prompt = torch.tensor([5, 9, 14, 3, 77, 8, 1, 60])
    batch = StageBatch([0], [0], [len(prompt)])
    assert torch.equal(kept.forward(batch, prompt), fresh.forward(batch, prompt))


def test_int4_decode_steps_replay_as_graphs_as_they_run_eagerly(tiny_folder):
    """The path a GPU stage takes (engine/model/static_decode.py), replayed through the
    tape that stands in for CUDA graphs here (testkit/graph_tape.py)."""
    from engine.model.static_decode import use_graphs
    from testkit.graph_tape import TapeCuda

    folder, _ = tiny_folder("llama")
    source = resolve(str(folder))
    L = source.config().num_hidden_layers
    eager = StageModel(source, 0, L, device="cpu", weights="int4")
    graphs = StageModel(source, 0, L, device="cpu", weights="int4")
    use_graphs(graphs, TapeCuda())
    prompt = [5, 9, 14, 3, 77, 8, 1, 60]
    outs = []
    for s in (eager, graphs):
        out = s.forward(StageBatch([0], [0], [len(prompt)]), torch.tensor(prompt))
        got = []
        for i in range(5):
            out = s.forward(StageBatch([0], [len(prompt) + i], [1]), out.argmax(-1))
            got.append(out)
        outs.append(got)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert graphs.static.book.replays == 5 and not graphs.static.book.failed


def test_the_default_model_at_int4_says_what_it_says_at_full_precision(default_source):
    """Its layers are Q4_1 blocks on disk: int4 holds them as they are (bench/quant.py:
    0.98 of next tokens agree, as computing in bf16 alone gives)."""
    L = default_source.config().num_hidden_layers
    tok = default_source.tokenizer()
    ids = tok("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and the Seine, "
              "and every year millions of visitors come to see them.")["input_ids"]
    x = torch.tensor([ids])
    agree = []
    for w in ("bf16", "int4"):
        s = StageModel(default_source, 0, L, device="cpu", weights=w)
        with torch.inference_mode():
            agree.append(s.model(input_ids=x, use_cache=False).logits[0].argmax(-1))
        del s
    assert float((agree[0] == agree[1]).float().mean()) >= 0.9


async def test_two_stage_processes_at_int4_answer_as_one(tiny_folder):
    """The precision crosses the wire: each stage process quantizes its own layers alike
    (threads as `potluck serve --weights int4` leaves them: its default). The settled
    precision also reaches on_weights as fields (the app's Host window shows them)."""
    from engine.core.sampling import SamplingParams
    from engine.pipeline.launch import PipelineConfig, launch
    from testkit.streams import tokens

    folder, _ = tiny_folder("llama")
    replies = []
    for stages in (1, 2):
        settled = []
        pipe = await launch(PipelineConfig(model=str(folder), stages=stages, device="cpu", weights="int4"),
                            on_weights=settled.append)
        try:
            head = pipe.head
            head.eos_ids = set()
            assert head.info()["weights"] == "int4"
            (chosen,) = settled
            assert (chosen.weights, chosen.label) == ("int4", "int4") and chosen.bytes > 0
            assert f"{stages} stage{'s' if stages != 1 else ''} (CPU)" in chosen.where
            toks, done = await tokens(head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=12)))
            assert done.error is None
            replies.append(toks)
        finally:
            await pipe.close()
    assert len(replies[0]) == 12 and replies[0] == replies[1]


@pytest.mark.gpu
def test_a_gpu_computes_what_the_cpu_does_at_int4():
    torch.manual_seed(3)
    lin = nn.Linear(256, 128)
    cpu, gpu = Int4Linear(lin), Int4Linear(lin)
    cpu.to_device(torch.device("cpu"))
    gpu.to_device(torch.device("cuda"))
    x = torch.randn(5, 256)
    want = cpu(x)
    got = gpu(x.cuda().to(torch.bfloat16)).float().cpu()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@pytest.mark.gpu
def test_a_gpu_computes_a_joined_product_as_its_members_alone():
    torch.manual_seed(4)
    members = [nn.Linear(256, n, bias=False) for n in (256, 64, 64)]
    alone = [Int4Linear(m) for m in members]
    parts = join(members)
    for m in alone + [parts[0].whole]:
        m.to_device(torch.device("cuda"))
    for rows in (1, 5, 16):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        for part, a in zip(parts, alone):
            torch.testing.assert_close(part(x), a(x), rtol=1e-2, atol=1e-2)
