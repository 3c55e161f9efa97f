"""What int8 prefill activations cost in quality and save in time, on the default model.

Two stages in one process (layers 0-14 and 15-29). For each prompt the prefill
activations cross the stage boundary either exact or as blockwise int8 (what
`--compress auto|prefill` sends); decode stays exact, as it does in Potluck by default.
Prints greedy token agreement over the continuation, the logit error at the prompt's
last position, and the bytes and transfer time per prefill on home uplinks.

    .venv/bin/python bench/compression.py [--tokens 32] [--prompts 16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from engine.wire import frames
from engine.model.sources import resolve  # noqa: E402
from engine.model.stage import StageBatch, StageModel  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
    "Explain photosynthesis in one sentence.", "What is 17 times 3?", "Name a famous physicist.",
    "Give me a synonym for happy.", "Translate 'good morning' to Spanish.",
    "Why is the sky blue?", "Write a short greeting for a birthday card.",
    "What does a CPU do?", "Describe a cat in five words.", "What is the boiling point of water?",
    "Suggest a name for a pet fish.", "How many legs does a spider have?", "What is machine learning?",
]


def run(s0, s1, prompt, sid, q8, tokens):
    batch = StageBatch([sid], [0], [len(prompt)])
    h = s0.forward(batch, torch.tensor(prompt))
    if q8:
        h = frames.dequantize_q8(frames.quantize_q8(h))
    logits = s1.forward(batch, h)
    first_logits = logits[0].clone()
    out, pos = [int(logits.argmax(-1))], len(prompt)
    for _ in range(tokens - 1):
        b = StageBatch([sid], [pos], [1])
        logits = s1.forward(b, s0.forward(b, torch.tensor(out[-1:])))
        out.append(int(logits.argmax(-1)))
        pos += 1
    s0.free(sid)
    s1.free(sid)
    return first_logits, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    src = resolve("default")
    tok = src.tokenizer()
    s0, s1 = StageModel(src, 0, 15), StageModel(src, 15, 30)
    agree_first = agree_tokens = total_tokens = 0
    max_err, rel_errs = 0.0, []
    for i, text in enumerate(PROMPTS[: args.prompts]):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        la, ta = run(s0, s1, ids, 2 * i + 1, False, args.tokens)
        lb, tb = run(s0, s1, ids, 2 * i + 2, True, args.tokens)
        err = (la - lb).abs().max().item()
        max_err = max(max_err, err)
        rel_errs.append(err / la.abs().max().item())
        agree_first += ta[0] == tb[0]
        # tokens agree up to the first divergence; after it the texts simply differ
        same = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        agree_tokens += same
        total_tokens += len(ta)
    n = min(args.prompts, len(PROMPTS))
    hidden = s0.hidden_size
    print(f"\nint8 prefill activations on {src.name} ({n} chat prompts, {args.tokens} greedy tokens each)")
    print(f"  first token identical           {agree_first}/{n}")
    print(f"  tokens before first divergence  {agree_tokens}/{total_tokens} ({100 * agree_tokens / total_tokens:.1f}%)")
    print(f"  max |logit error| at prompt end {max_err:.4f} (max relative {max(rel_errs):.4%})")
    print("\nbytes per token per hop and a 1,000-token prefill's transfer time")
    print(f"  {'format':<10}{'B/token':>9}{'20 Mbit/s':>12}{'50 Mbit/s':>12}{'100 Mbit/s':>12}")
    q8 = hidden // frames.Q8_BLOCK * (frames.Q8_BLOCK + 4)
    for name, per in [("float32", 4 * hidden), ("bf16", 2 * hidden), ("int8+scale", q8)]:
        cells = "".join(f"{1000 * per * 8 / r:>11.2f}s" for r in (20e6, 50e6, 100e6))
        print(f"  {name:<10}{per:>9}{cells}")
    print(f"  int8 sends {q8 / (4 * hidden):.1%} of float32's bytes, {q8 / (2 * hidden):.1%} of bf16's")


if __name__ == "__main__":
    main()
