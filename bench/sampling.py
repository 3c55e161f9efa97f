"""What drawing a token costs the last stage at the chat's defaults: the batched draw
(engine/model/draw.py) against the per-row draw it replaced, side by side in one run.

The chat's defaults sample (temperature 0.7, top-p 0.9, repetition penalty 1.1), so
this is the path every user of the chat window and of `potluck chat` takes. A second
table decodes replies with the default model at those settings, both ways, the model's
step included: what a user of a one-stage chat sees. The logits
are the default model's own (a real prompt, decoded greedily by the same StageModel the
pipeline runs): a trained model's nucleus is what decides whether the CPU's candidate
shortcut holds. The 128k rows (Llama 3's vocabulary) are those rows widened with their
own tail. The per-row draw is kept here, as it was, as the baseline; the table also gives
the default model's decode step at batch 1 on this machine, for scale.

    .venv/bin/python bench/sampling.py [--device cuda] [--threads 1] [--json out.json]
    python3 bench/sampling.py --device cuda --synthetic    (a GPU machine without the model)

A third table draws a verification step of speculative decoding (1 + 4 positions a user)
position by position, as the last stage did before the frame carried the draft, and in
one draw. A fourth builds a step's repetition-penalty pairs from every history rebuilt
(as the sampler did) and from the distinct tokens it now keeps as they change.

What should hold: the batched draw at least 5x faster than the per-row one at every
batch and vocabulary on the CPU (and on a GPU), at batch 1 a small share of the default
model's step, a verification step's one draw at least 1.5x faster than its positions
drawn alone, and the kept penalty pairs at least 3x faster than the rebuilt ones from 4 users.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def per_row_before(row: torch.Tensor, hist: list[int], temperature: float, top_p: float, rep: float) -> int:
    """The draw before engine/model/draw.py, for comparison: each row copied to the CPU,
    penalized, sorted whole for top-p, and drawn by torch.multinomial."""
    row = row.detach().to("cpu", copy=True)
    if rep != 1.0 and hist:
        idx = torch.tensor(sorted(set(hist)), dtype=torch.long)
        vals = row[idx]
        row[idx] = torch.where(vals > 0, vals / rep, vals * rep)
    row = row / temperature
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > top_p
        row[order[drop]] = float("-inf")
    return int(torch.multinomial(row.softmax(-1), 1).item())


def load_default(device: str):
    """The default model whole, in one StageModel (what `potluck chat` runs with one
    stage), and the chat prompt's token ids."""
    from engine.model.sources import prepare_default
    from engine.model.stage import StageModel

    source = prepare_default(log=lambda *_: None)
    tok = source.tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return StageModel(source, 0, source.config().num_hidden_layers, device=device), list(ids)


def real_logits(stage, ids: list[int], steps: int, device: str) -> tuple[torch.Tensor, list[int], float]:
    """The default model's logits over a greedy reply to PROMPT: [steps, vocab], the
    prompt's and reply's token ids (the repetition penalty's history), and the median
    decode step in seconds."""
    from engine.model.stage import StageBatch

    rows, times = [], []
    with torch.inference_mode():
        out = stage.forward(StageBatch([0], [0], [len(ids)]), torch.tensor(ids, device=device))
        hist = list(ids)
        for _ in range(steps):
            rows.append(out[0].float())
            nxt = int(out[0].argmax())
            t0 = time.perf_counter()
            out = stage.forward(StageBatch([0], [len(hist)], [1]), torch.tensor([nxt], device=device))
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            hist.append(nxt)
    stage.free(0)
    return torch.stack(rows), hist, statistics.median(times)


def replies(stage, ids: list[int], batch: int, steps: int, batched: bool, params, device: str,
            first: int) -> float:
    """batch users' replies at the chat's defaults, decoded together for steps tokens: the
    seconds the decode steps took, the model's step and the draw together."""
    from engine.model.sampler import Sampler
    from engine.model.stage import StageBatch

    seqs = list(range(first, first + batch))
    s = Sampler()
    for q in seqs:
        s.open(q, params, ids)
    hist = {q: list(ids) for q in seqs}
    with torch.inference_mode():
        out = stage.forward(StageBatch(seqs, [0] * batch, [len(ids)] * batch),
                            torch.tensor(ids * batch, device=device))
        t0 = time.perf_counter()
        for n in range(steps):
            if batched:
                toks = s.sample(seqs, out)
            else:
                toks = [per_row_before(out[i], hist[q], params.temperature, params.top_p, params.repetition_penalty)
                        for i, q in enumerate(seqs)]
            for q, t in zip(seqs, toks):
                hist[q].append(t)
            out = stage.forward(StageBatch(seqs, [len(ids) + n] * batch, [1] * batch),
                                torch.tensor(toks, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    for q in seqs:
        stage.free(q)
    return seconds


def synthetic_logits(steps: int, vocab: int = 49152) -> tuple[torch.Tensor, list[int], None]:
    """Peaked random rows (a few hundred tokens well above the rest), for a machine that
    lacks the default model: a GPU sorts every row whole, so the logits' shape matters
    less there."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, vocab, generator=g) * 1.5
    x[:, torch.randint(0, vocab, (200,), generator=g)] += 7.0
    return x, torch.randint(0, vocab, (110,), generator=g).tolist(), None


def widen(rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows widened to `vocab` with their own lower half, shuffled: a bigger vocabulary's
    long tail, the same head."""
    n, V = rows.shape
    g = torch.Generator().manual_seed(0)
    extra = vocab - V
    tail = torch.sort(rows.cpu(), dim=-1).values[:, : V // 2]
    pick = torch.randint(0, V // 2, (n, extra), generator=g)
    return torch.cat([rows.cpu(), tail.gather(1, pick)], dim=1).to(rows.device)


def timed(fn, repeat: int, device: str) -> float:
    fn()
    out = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()   # both end by reading their tokens on the host: nothing is left queued
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


DRAFTED = 4
# on a CPU a row's own work dominates its draw, so one draw saves the fixed cost of the
# other k (about half); on a GPU each position drawn alone is also a wait on the device
VERIFY_TARGET = 1.5
# a step's repetition-penalty pairs from kept arrays against rebuilt lists, at least
PAIRS_TARGET = 3.0
# the candidates a GPU draw was tried with (engine/model/draw.py: it sorts whole now)
GPU_TRIED_CANDIDATES = 1024


def penalty_pairs_before(s, ids: list[int], device: str) -> list[torch.Tensor]:
    """The repetition penalty's (row, token, factor) tensors as the sampler built them
    before engine/model/token_history.py: each step a set of every row's whole history,
    Python lists of every pair, turned into tensors element by element."""
    rows, toks, factors = [], [], []
    for i, sid in enumerate(ids):
        seen = list(set(s._history[sid]))
        rows += [i] * len(seen)
        toks += seen
        factors += [s._params[sid].repetition_penalty] * len(seen)
    return [torch.tensor(rows, dtype=torch.long).to(device), torch.tensor(toks, dtype=torch.long).to(device),
            torch.tensor(factors, dtype=torch.float32).to(device)]


def penalty_pairs_now(s, ids: list[int], device: str) -> list[torch.Tensor]:
    pen = s._penalties(ids)
    return [torch.as_tensor(pen.rep_rows, dtype=torch.long).to(device),
            torch.as_tensor(pen.rep_tokens, dtype=torch.long).to(device),
            torch.as_tensor(pen.rep_factor, dtype=torch.float32).to(device)]


def penalty_pairs(params, B: int, repeat: int, device: str, vocab: int = 128256) -> tuple[float, float, bool]:
    """B users 128 prompt tokens and 64 drawn into: a step's repetition-penalty pairs, both
    ways, each followed by the token the step draws (kept arrays grow by it)."""
    import random

    from engine.model.sampler import Sampler

    rng = random.Random(B)
    s = Sampler()
    for u in range(B):
        s.open(u, params, [rng.randrange(vocab) for _ in range(128)])
        for _ in range(64):
            s._record(u, params, rng.randrange(vocab))
    ids = list(range(B))
    key = lambda ts: sorted(zip(ts[0].tolist(), ts[1].tolist(), ts[2].tolist()))  # noqa: E731
    same = key(penalty_pairs_before(s, ids, device)) == key(penalty_pairs_now(s, ids, device))

    def step(build):
        build(s, ids, device)
        for u in ids:
            s._record(u, params, rng.randrange(vocab))

    a = timed(lambda: step(penalty_pairs_before), repeat, device)
    b = timed(lambda: step(penalty_pairs_now), repeat, device)
    return a, b, same


def verification(logits: torch.Tensor, hist: list[int], params, B: int, repeat: int, device: str):
    """A verification step of B users, 1 + DRAFTED positions each: drawn position by
    position (each after the picks before it, one read of the token each: the draw
    before the frame carried the draft), and in one batched draw after the draft's tokens."""
    from engine.model.sampler import Sampler

    k = DRAFTED + 1
    rows = torch.cat([logits[(u * k + j) % logits.shape[0]].unsqueeze(0) for u in range(B) for j in range(k)])
    s = Sampler()
    for u in range(B):
        s.open(u, params, hist[: len(hist) - 32 + u % 32])
    start = {u: s._pos[u] for u in range(B)}
    drafts = {u: [hist[(u + j) % len(hist)] for j in range(DRAFTED)] for u in range(B)}

    def alone():
        for u in range(B):
            for j in range(k):
                s.sample([u], rows[u * k + j: u * k + j + 1])
            s._history[u].truncate(len(s._history[u]) - k)
            s._pos[u] = start[u]

    def together():
        s.step(list(range(B)), rows, keep=[k] * B, positions=[start[u] for u in range(B)], drafts=drafts)

    a = timed(alone, repeat, device)
    b = timed(together, repeat, device)
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a last stage's share of a home CPU)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--vocabs", default="native,128256")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="tokens a user in the whole-step table")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each draw per cell of the whole-step table")
    ap.add_argument("--synthetic", action="store_true", help="peaked random logits, not the default model's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.core.sampling import SamplingParams
    from engine.model.sampler import Sampler

    stage = ids = None
    if args.synthetic:
        logits, hist, step_s = synthetic_logits(32)
    else:
        stage, ids = load_default(args.device)
        logits, hist, step_s = real_logits(stage, ids, 32, args.device)
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    if step_s is not None:
        print(f"default model's decode step at batch 1 on {args.device}: {step_s * 1e3:.1f} ms "
              f"({torch.get_num_threads()} torch threads)")
    else:
        print(f"synthetic logits on {args.device} ({torch.get_num_threads()} torch threads)")
    print(f"chat defaults: temperature {params.temperature}, top-p {params.top_p}, "
          f"repetition penalty {params.repetition_penalty}; history {len(hist)} tokens\n")
    head = f"{'vocab':>7} {'batch':>5} {'per row ms':>11} {'batched ms':>11} {'speed-up':>9} {'verdict':>7}"
    print(head)
    print("-" * len(head))
    results, ok = [], True
    for vname in args.vocabs.split(","):
        rows = logits if vname == "native" else widen(logits, int(vname))
        V = rows.shape[1]
        for B in (int(b) for b in args.batches.split(",")):
            batch = torch.stack([rows[i % rows.shape[0]] for i in range(B)]).to(args.device)
            s = Sampler()
            for i in range(B):
                s.open(i, params, hist[: len(hist) - 32 + i % 32])
            ids = list(range(B))

            def before():
                for i in range(B):
                    per_row_before(batch[i], s._history[i], params.temperature, params.top_p,
                                   params.repetition_penalty)

            def after():
                s.sample(ids, batch)
                for i in ids:   # the same history every round: what before() sees
                    s._history[i].truncate(len(s._history[i]) - 1)
                    s._pos[i] -= 1

            a = timed(before, args.repeat, args.device)
            b = timed(after, args.repeat, args.device)
            verdict = "PASS" if a / b >= 5 else "MISS"
            ok &= verdict == "PASS"
            print(f"{V:>7} {B:>5} {a * 1e3:>11.2f} {b * 1e3:>11.2f} {a / b:>8.1f}x {verdict:>7}")
            results.append(dict(vocab=V, batch=B, per_row_s=a, batched_s=b))
    from engine.model.draw import CPU_CANDIDATES, Shape, draw

    # the batched draw's ranking: every row sorted whole against candidates first (a row
    # whose nucleus ends past them still sorted whole), the same tokens. A CPU's draw ranks
    # from its candidates; a GPU's sorts whole (an H200 ranked from 1024 at 0.6-0.7x the
    # speed), and this table keeps showing why
    cand = CPU_CANDIDATES if args.device == "cpu" else GPU_TRIED_CANDIDATES
    print(f"\nthe batched draw, every row sorted whole against its {cand} likeliest tokens first")
    head2 = f"{'vocab':>7} {'batch':>5} {'whole ms':>9} {'candidates ms':>14} {'speed-up':>9} {'same':>5}"
    print(head2)
    print("-" * len(head2))
    for vname in args.vocabs.split(","):
        rows = logits if vname == "native" else widen(logits, int(vname))
        V = rows.shape[1]
        for B in (int(b) for b in args.batches.split(",")):
            batch = torch.stack([rows[i % rows.shape[0]] for i in range(B)]).to(args.device) / params.temperature
            shapes = [Shape(False, 1.0, top_p=params.top_p, uniform=(i * 0.37) % 1.0) for i in range(B)]
            same = torch.equal(draw(batch, shapes, candidates=V), draw(batch, shapes, candidates=cand))
            w = timed(lambda: draw(batch, shapes, candidates=V), args.repeat, args.device)
            c = timed(lambda: draw(batch, shapes, candidates=cand), args.repeat, args.device)
            print(f"{V:>7} {B:>5} {w * 1e3:>9.2f} {c * 1e3:>14.2f} {w / c:>8.1f}x {'yes' if same else 'NO':>5}")
            results.append(dict(ranked_vocab=V, ranked_batch=B, whole_sort_s=w, candidates_s=c, candidates=cand,
                                same=same))
    if step_s is not None:
        print(f"\nbatched draw at batch 1, default vocabulary: "
              f"{results[0]['batched_s'] / step_s:.1%} of the model's decode step (per row: "
              f"{results[0]['per_row_s'] / step_s:.1%})")
    print(f"\nverification steps of speculative decoding (1 + {DRAFTED} positions a user) at the chat's "
          "defaults: each position drawn alone (before drafts reached the last stage) against one draw")
    head = f"{'users':>5} {'alone ms':>9} {'one draw ms':>12} {'speed-up':>9} {'verdict':>7}"
    print(head)
    print("-" * len(head))
    for B in (int(b) for b in args.batches.split(",")):
        a, b = verification(logits.to(args.device), hist, params, B, args.repeat, args.device)
        verdict = "PASS" if a / b >= VERIFY_TARGET else "MISS"
        ok &= verdict == "PASS"
        print(f"{B:>5} {a * 1e3:>9.2f} {b * 1e3:>12.2f} {a / b:>8.1f}x {verdict:>7}")
        results.append(dict(verify_users=B, alone_s=a, one_draw_s=b))
    print("\nthe repetition penalty's pairs of a step (users 128 prompt tokens and 64 drawn into, "
          f"vocabulary 128256): each history's set and lists rebuilt every step (before) against the "
          "distinct tokens kept as they change (engine/model/token_history.py)")
    head = f"{'users':>5} {'rebuilt ms':>11} {'kept ms':>9} {'speed-up':>9} {'same':>5} {'verdict':>7}"
    print(head)
    print("-" * len(head))
    for B in (int(b) for b in args.batches.split(",")):
        a, b, same = penalty_pairs(params, B, max(args.repeat, 20), args.device)
        # one user's history is a few dozen pairs: both ways cost microseconds, judged from 4
        verdict = ("PASS" if a / b >= PAIRS_TARGET and same else "MISS") if B >= 4 or not same else "-"
        ok &= verdict != "MISS"
        print(f"{B:>5} {a * 1e3:>11.3f} {b * 1e3:>9.3f} {a / b:>8.1f}x {'yes' if same else 'NO':>5} {verdict:>7}")
        results.append(dict(pairs_users=B, rebuilt_s=a, kept_s=b, same=same))
    if stage is not None:
        print(f"\nthe default model decoding at the chat's defaults, {args.steps} tokens a user: "
              "the whole step, the model's and the draw")
        head = f"{'users':>5} {'per row tok/s':>14} {'batched tok/s':>14} {'ratio':>7}"
        print(head)
        print("-" * len(head))
        first = 1000
        for B in (int(b) for b in args.batches.split(",")):
            cell = {}
            for r in range(args.rounds):   # alternated, so drift on a noisy machine falls on both
                for batched in ((False, True) if r % 2 == 0 else (True, False)):
                    t = replies(stage, ids, B, args.steps, batched, params, args.device, first)
                    first += B
                    cell.setdefault(batched, []).append(B * args.steps / t)
            a, b = statistics.median(cell[False]), statistics.median(cell[True])
            print(f"{B:>5} {a:>14.1f} {b:>14.1f} {b / a:>6.2f}x")
            results.append(dict(users=B, per_row_tok_s=a, batched_tok_s=b))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=args.device, threads=torch.get_num_threads(),
                                                   step_s=step_s, rows=results), indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
