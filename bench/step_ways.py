"""What one switch of a stage saves its steps: the same stage built both ways, side by
side in one run, at growing context, the two alternating step by step (a busy moment of
the machine falls on both).

`--compare gqa` (the default): a grouped-query model's steps of several new tokens with
transformers' SDPA path, which copies every key and value once per query head first,
and folded (engine/model/gqa_attention.py; POTLUCK_PACKED_GQA).
`--compare int4-join`: `--weights int4` with q/k/v and gate/up as separate 4-bit
products, and joined into one each (engine/model/int4.py `join`; POTLUCK_FUSED_PRODUCTS).
`--compare rotary`: transformers' rotary embeddings, and three kernels a layer
(engine/model/fused_rotary.py; POTLUCK_FUSED_ROTARY). `--compare products`: a CPU
stage's decode attention by SDPA, and as the two products it takes by default
(engine/model/product_attention.py; POTLUCK_PRODUCT_ATTENTION). A GPU stage's switch: on the CPU
this script switches it by hand, with q/k/v joined on both sides as a GPU's are.

Steps timed, one user, the default model (SmolLM2-135M: 9 query heads over 3 key/value
heads) unless --model says otherwise:
* a verification step of 1 + 4 tokens (what speculation checks each round), after a
  context of N tokens;
* a 1-token decode step.

    .venv/bin/python bench/step_ways.py [--compare gqa|int4-join|rotary|products] [--contexts 64,512,1536] [--steps 30]

On a GPU (`--device cuda`) both stages replay their decode and verification steps as
CUDA graphs, as a served stage does; bench/gpu.py's ours1 / ours1n rows time the 8B shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


# each comparison: the switch, its two settings (before, after), their names, the weights
COMPARE = {
    "gqa": ("POTLUCK_PACKED_GQA", ("0", "1"), ("transformers' SDPA", "folded"), "auto"),
    "int4-join": ("POTLUCK_FUSED_PRODUCTS", ("0", "1"), ("int4 apart", "int4 joined"), "int4"),
    "rotary": ("POTLUCK_FUSED_ROTARY", ("0", "1"), ("transformers' rotary", "fused rotary"), "auto"),
    # a CPU stage's decode attention: SDPA, or the two products it takes for their bits
    # (engine/model/product_attention.py EVERY_ROW); the 1-token column is the one it changes
    "products": ("POTLUCK_PRODUCT_ATTENTION", ("0", "1"), ("SDPA", "two products"), "auto"),
}


def as_on_a_gpu(stage, rotary: bool) -> None:
    """A CPU stage given what a GPU stage's switches give it: transformers' Linears with
    q/k/v and gate/up joined, and, when asked, the fused rotary."""
    from torch import nn

    from engine.model.fused_products import fuse_products
    from engine.model.fused_rotary import fuse_rotary

    for m in stage.model.modules():
        if type(m).__module__.startswith("engine.model.cpu_linear"):
            m.__class__ = nn.Linear
    fuse_products(stage.model)
    if rotary:
        assert fuse_rotary(stage.model) > 0, "this model's rotary embeddings are not switched"


def build(source, device, env: str, value: str, weights: str):
    from engine.core.product_choice import ProductChoice
    from engine.model.stage import StageModel

    old = os.environ.get(env)
    os.environ[env] = value
    try:
        n = source.config().num_hidden_layers
        return StageModel(source, 0, n, device=device, weights=weights, products=ProductChoice(fixed="rows"))
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default="gqa", choices=sorted(COMPARE))
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--contexts", default="64,512,1536", help="tokens of context before the steps")
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each kind and way, median kept")
    a = ap.parse_args(argv)

    import torch

    from engine.model.device import pick_device
    from engine.model.sources import resolve
    from engine.model.stage import StageBatch

    device = pick_device(a.device)
    source = resolve(a.model)
    cfg = source.config()
    env, values, names, weights = COMPARE[a.compare]
    ways = {name: build(source, device, env, value, weights) for name, value in zip(names, values)}
    if a.compare == "rotary" and str(device) == "cpu":
        for name, s in ways.items():
            as_on_a_gpu(s, rotary=name == names[1])
    if a.compare == "gqa":
        assert ways[names[1]].packed_gqa, "this model's attention is not folded (not grouped-query, or asks for SDPA)"
    print(f"\n{source.name} on {device}: {cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} "
          f"key/value heads, {cfg.num_hidden_layers} layers, {torch.get_num_threads()} threads\n")

    def timed(stage, batch, ids) -> float:
        t0 = time.perf_counter()
        out = stage.forward(batch, torch.tensor(ids))
        if out.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in [int(x) for x in a.contexts.split(",") if x]:
        prompt = torch.randint(10, cfg.vocab_size - 10, (n,), generator=gen).tolist()
        times = {w: {"verify": [], "decode": []} for w in ways}
        for w, s in ways.items():
            s.forward(StageBatch([0], [0], [n]), torch.tensor(prompt))
        for i in range(a.steps + 2):                      # the first two are warm-up
            for w, s in ways.items():
                # 1 + 4 tokens at position n, then the 4 rejected (the length back to n + 1),
                # then one decode token (the length back to n): each step at the same context
                v = timed(s, StageBatch([0], [n], [5], keep=[5]), prompt[:5])
                s.kv.truncate(0, n)
                d = timed(s, StageBatch([0], [n], [1]), prompt[:1])
                s.kv.truncate(0, n)
                if i >= 2:
                    times[w]["verify"].append(v)
                    times[w]["decode"].append(d)
        for s in ways.values():
            s.free(0)
        med = {w: {k: statistics.median(v) * 1e3 for k, v in t.items()} for w, t in times.items()}
        rows.append((n, med))

    before, after = names
    print(f"| context | 1-token step ms, {before} | {after} | ratio | 1 + 4 tokens ms, {before} | {after} | ratio "
          f"| 1 + 4 / 1-token, {before} | {after} |")
    print("|---:|" + "---:|" * 8)
    for n, med in rows:
        b, f = med[before], med[after]
        print(f"| {n} | {b['decode']:.1f} | {f['decode']:.1f} | {f['decode'] / b['decode']:.2f} "
              f"| {b['verify']:.1f} | {f['verify']:.1f} | {f['verify'] / b['verify']:.2f} "
              f"| {b['verify'] / b['decode']:.2f} | {f['verify'] / f['decode']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
