"""What folding a grouped-query model's query heads saves a step of several new tokens
(engine/model/gqa_attention.py): the same stage with transformers' SDPA path (which
copies every key and value once per query head first) and with the folded one, side by
side in one run, at growing context.

Steps timed, one user, the default model (SmolLM2-135M: 9 query heads over 3 key/value
heads) unless --model says otherwise:
* a verification step of 1 + 4 tokens (what speculation checks each round), after a
  context of N tokens;
* a 1-token decode step beside it, for scale (both ways take the same path there).
The two stages alternate step by step, so a busy moment of the machine falls on both.

    .venv/bin/python bench/gqa_steps.py [--contexts 64,512,1536] [--steps 30] [--device auto]

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


def build(source, device, packed: bool):
    from engine.core.product_choice import ProductChoice
    from engine.model.stage import StageModel

    os.environ["POTLUCK_PACKED_GQA"] = "1" if packed else "0"
    try:
        n = source.config().num_hidden_layers
        return StageModel(source, 0, n, device=device, products=ProductChoice(fixed="rows"))
    finally:
        del os.environ["POTLUCK_PACKED_GQA"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ways = {"transformers' SDPA": build(source, device, False), "folded": build(source, device, True)}
    assert ways["folded"].packed_gqa, "this model's attention is not folded (not grouped-query, or asks for SDPA)"
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

    names = list(ways)
    print("| context | 1-token step ms | 1 + 4 tokens, " + " ms | 1 + 4 tokens, ".join(names)
          + " ms | folded / SDPA | verify / 1-token, SDPA | verify / 1-token, folded |")
    print("|---:|---:|" + "---:|" * (len(names) + 3))
    for n, med in rows:
        plain, folded = med[names[0]], med[names[1]]
        print(f"| {n} | {folded['decode']:.1f} | {plain['verify']:.1f} | {folded['verify']:.1f} "
              f"| {folded['verify'] / plain['verify']:.2f} | {plain['verify'] / plain['decode']:.2f} "
              f"| {folded['verify'] / folded['decode']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
