"""Which stage holds which layers: proportional to speed, within each stage's memory."""

from __future__ import annotations

from engine.core.errors import ModelError


class NoRoom(ModelError):
    """The stages together cannot hold the model: another machine must join (a head
    that lost a stage waits for one rather than failing)."""

    def __init__(self, message: str, need: int, have: int):
        super().__init__(message)
        self.need, self.have = need, have


def layer_bytes_estimate(cfg, bytes_per_param: int) -> int:
    """Weights of one decoder layer, from the config (MoE: all experts count; grouped-
    query attention: keys and values at their own width)."""
    h = cfg.hidden_size
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    experts = (getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
               or getattr(cfg, "num_local_experts", None) or 0)  # Mixtral, JetMoE, Granite-MoE...
    moe_inter = getattr(cfg, "moe_intermediate_size", None) or inter
    mlp = 3 * h * inter if not experts else 3 * h * moe_inter * experts
    # queries and output are h x h; keys and values shrink with grouped-query attention
    heads = getattr(cfg, "num_attention_heads", None) or 1
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    return (attn + mlp) * bytes_per_param


def slice_bytes_estimate(cfg, start: int, end: int, bytes_per_param: int) -> int:
    """Weights of a stage holding layers [start, end): its layers, plus the embeddings on
    the first stage and the LM head on the last (one matrix when the two are tied and
    one stage holds both)."""
    vocab = cfg.vocab_size * cfg.hidden_size * bytes_per_param
    n = end - start
    total = layer_bytes_estimate(cfg, bytes_per_param) * n
    first, last = start == 0, end == cfg.num_hidden_layers
    tied = getattr(cfg, "tie_word_embeddings", False)
    if first:
        total += vocab
    if last and not (first and tied):
        total += vocab
    return total


def lm_head_layers_estimate(cfg) -> float:
    """The last stage's final norm + LM head, in decoder layers' worth of weights.

    Decode is bound by reading weights, so the LM head costs the last stage about as
    much as this many layers every step: 8 for SmolLM2-135M (a 49k x 576 head), 0.65
    for Llama-2-7B, 2.6 for Llama-3-8B's 128k vocabulary. An even split that ignores
    it leaves the last stage the pipeline's bottleneck (measured on the default model,
    2 stages, 4-sequence decode: the last stage's step took over half as long again as
    the first's, and moving layers to the first stage evened them; see bench/RESULTS.md).
    """
    vocab = getattr(cfg, "vocab_size", None) or 0
    per_layer = layer_bytes_estimate(cfg, 1)
    return vocab * cfg.hidden_size / per_layer if per_layer else 0.0


SAME_SPEED = 1.3


def shared_cpu_speeds(homes: list[list[int]]) -> list[float]:
    """Each process's speed when processes of one pipeline share this CPU (the stages
    stand in for speed probes, which would measure one another's load): its home
    cores, each split among the processes whose home it is. 3 processes on 2 cores
    (homes [0], [1], [0]) get 0.5, 1, 0.5; once the third has gone, the two left
    get 1 and 1 -- the speeds follow the processes there are, never an older count."""
    return [sum(1 / sum(c in h for h in homes) for c in home) for home in homes]


def partition(n_layers: int, speeds: list[float], capacities: list[int] | None = None,
              extra: list[float] | None = None) -> list[tuple[int, int]]:
    """Split n_layers into contiguous ranges, one per stage, in stage order.

    speeds: relative compute speed per stage (layers go in proportion);
    capacities: the most layers each stage can hold (memory), or None for no limit;
    extra: work each stage does besides its layers, in layers' worth (the LM head on
    the last stage: lm_head_layers_estimate), or None for none.
    Every stage gets at least one layer.
    """
    n = len(speeds)
    if n == 0:
        raise ModelError("a pipeline needs at least one stage")
    for name, per_stage in (("capacities", capacities), ("extra", extra)):
        if per_stage is not None and len(per_stage) != n:
            # a caller that kept one list from an older arrangement (a stage left since)
            raise ValueError(f"{len(per_stage)} {name} for {n} stages")
    if n > n_layers:
        raise ModelError(f"{n} stages for {n_layers} layers: every stage needs at least one layer")
    caps = list(capacities) if capacities is not None else [n_layers] * n
    if any(c < 1 for c in caps):
        raise NoRoom("a stage has no room for even one layer", n_layers, sum(max(0, c) for c in caps))
    if sum(caps) < n_layers:
        raise NoRoom(
            f"the model needs {n_layers} layers of room but the stages together hold {sum(caps)}: "
            "add a machine or choose a smaller model", n_layers, sum(caps))
    speeds = [max(float(s), 1e-9) for s in speeds]
    if max(speeds) < SAME_SPEED * min(speeds):
        # a short matmul probe is noisy (and stages on one machine measure each other's
        # load): differences this small are not worth an unequal split
        speeds = [1.0] * n
    extra = [max(0.0, float(e)) for e in extra] if extra is not None else [0.0] * n
    counts = [1] * n
    # hand out the remaining layers one at a time to the stage that would finish soonest
    for _ in range(n_layers - n):
        best = min(
            (i for i in range(n) if counts[i] < caps[i]),
            key=lambda i: ((counts[i] + 1 + extra[i]) / speeds[i], i),
        )
        counts[best] += 1
    ranges, a = [], 0
    for c in counts:
        ranges.append((a, a + c))
        a += c
    return ranges


def parse_layers(text: str, n_layers: int) -> list[tuple[int, int]]:
    """User override: '0:10,10:20,20:30' (ranges) or '10,10,10' (counts)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    counted = not all(":" in p for p in parts)
    try:
        if not counted:
            ranges = [tuple(int(x) for x in p.split(":")) for p in parts]
            if any(len(r) != 2 for r in ranges):
                raise ValueError("a range has the form start:end")
        else:
            counts = [int(p) for p in parts]
            ranges, a = [], 0
            for c in counts:
                ranges.append((a, a + c))
                a += c
    except ValueError:
        raise ModelError(f"cannot read layer split {text!r}: {_examples(n_layers)}") from None
    if counted and ranges and ranges[-1][1] != n_layers and all(b > a for a, b in ranges):
        # '10,10' on a model of 30: the counts, not a range's end, are what is off
        raise ModelError(f"the layer counts {text!r} add up to {ranges[-1][1]}, but the model has {n_layers} "
                         f"layers: {_examples(n_layers)}")
    check_partition(ranges, n_layers)
    return ranges


def _examples(n_layers: int) -> str:
    """The two ways to write a split, for this model ('10,10' failed on a model of 30)."""
    half = n_layers // 2
    return (f"for two stages of this {n_layers}-layer model, '0:{half},{half}:{n_layers}' (ranges of layers, "
            f"counted from 0) or '{half},{n_layers - half}' (layers per stage)")


def validate_range(start: int, end: int, n_layers: int) -> None:
    if not (0 <= start < end <= n_layers):
        # in --layers' own notation (start:end, from 0), as the user typed it
        raise ModelError(f"layer range {start}:{end} does not fit a model with {n_layers} layers "
                         f"(ranges go from 0:… to …:{n_layers})")


def check_partition(ranges: list[tuple[int, int]], n_layers: int) -> None:
    """Stage ranges must tile [0, n_layers) in order with no gap or overlap."""
    expect = 0
    for i, (a, b) in enumerate(ranges):
        validate_range(a, b, n_layers)
        if a != expect:
            kind = "a gap" if a > expect else "an overlap"
            # said in the split's own words: range i + 1 of those typed, where it should start
            raise ModelError(f"layer ranges leave {kind}: range {i + 1} ({a}:{b}) should start at {expect}, "
                             f"where the one before it ends")
        expect = b
    if expect != n_layers:
        raise ModelError(f"layer ranges end at {expect} but the model has {n_layers} layers: "
                         f"the last should end at {n_layers}")
