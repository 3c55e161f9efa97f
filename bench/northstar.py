"""The north star on paper (issue 34): one person, and sixteen, chatting with Llama-3.1-70B
at NF4 split over three friends' 24 GB consumer GPUs in three homes, 100 Mbit/s and 30 ms
one way between them -- with and without speculative decoding.

Nothing here runs a model: bench/simulator.py runs the engine's own decision code (the
head's Scheduler, the LinkScheduler, and engine/core/speculation.py's SpecPolicy, which
picks k per sequence from what it measures) on a simulated clock, fed stage profiles
built from measured parts and stated assumptions:

The model (Llama-3.1-70B, from its published config): 80 layers, hidden 8192, MLP 28672,
64 query / 8 KV heads of 128, vocabulary 128256: 855.6 M Linear parameters a layer.
NF4 as the engine stores it (bitsandbytes through transformers, engine/model/quant.py):
4 bits a weight plus a float32 absmax per 64 = 0.5625 bytes a parameter, embeddings and
LM head in bf16 -- the bytes bench/gpu.py measured on the H200 for the Llama-3.1-8B
shape (5.59 GB of weights, 6.03 GB with scales: bench/RESULTS.md, 2026-11-26). Split
27 / 27 / 26 layers; the embedding (read a row a token) on stage 0, the LM head
(2.1 GB, read whole every step) on the last stage. Activations cross a link as bf16:
16 KiB a token.

The GPUs: RTX 4090-class, 24 GB, 1008 GB/s, 150 TFLOP/s dense bf16 (bench/simulator.py's
llama70b() assumption). A decode step of n tokens on a stage, three ways:

  roofline       max(weight bytes / (bandwidth x 0.6), 2 x params x n / FLOP/s) + KV reads,
                 i.e. fused 4-bit kernels that read the packed weights once per step
                 whatever n is (llama.cpp / exllama / Marlin-class). 0.6 of the memory
                 bandwidth is an ASSUMPTION (bench/gpu.py's own target), not measured here.
  roofline+bnb   the same for one token; but bitsandbytes' 4-bit matmul has a fused kernel
                 only for a single token (gemv_4bit): a step of n > 1 tokens -- which every
                 verification of a draft is -- dequantizes each weight to bf16 first
                 (read 0.5625 + write 2 bytes a parameter) and multiplies that (read 2):
                 ~8x the memory traffic of a one-token step. What the engine's NF4 path
                 does today.
  as measured    the engine as bench/gpu.py measured it on the lent H200 with its decode
                 steps replayed as CUDA graphs (RESULTS.md, 2026-12-04, one process, 32
                 layers of the Llama-3.1-8B shape), split in two parts. What does not
                 scale with the weights -- norms, rotary, KV writes, attention, the
                 launch and the host between steps -- is the bf16 step's 7.59 ms less its
                 matrix kernels' 4.50 ms (the step's profile): 0.097 ms a layer, kept as
                 it is (a 70B layer's small kernels are as latency-bound). The weights'
                 part: bf16's matrix kernels read at 0.83 of the copy bandwidth (the LM
                 head here); nf4's, the 7.41 ms nf4 step less the same fixed part, at
                 0.33 (bitsandbytes' 4-bit kernels), and an n-token step multiplies that
                 part by what the H200 measured (2.59 at 1 + 4 tokens, 3.09 at 16 rows,
                 linear between, per row beyond). All these fractions carry over to the
                 4090's bandwidth: an assumption.

The draft: Llama-3.2-1B (1.24 B parameters, 16 layers, same tokenizer), bf16 on the host's
GPU beside stage 0 (2.5 GB), drafting one token per forward: 2.47 GB / (1008 GB/s x 0.6)
= 4.1 ms a drafted token on the roofline; as measured, 16 layers' fixed part and
its weights at the bf16 matrix kernels' 0.83: 1.6 + 3.0 = 4.5 ms.
It runs on the head's compute, before the step it drafts for (the simulator's Spec.draft).

Acceptance: per-token acceptance alpha (each drafted token stands with probability alpha
given the ones before it stood; drawn per round from a seeded truncated geometric). No
published alpha for exactly Llama-3.2-1B drafting for Llama-3.1-70B was at hand offline;
the figure used is alpha = 0.71, Leviathan, Kalman & Matias, "Fast Inference from
Transformers via Speculative Decoding", ICML 2023 (arXiv:2211.17192), Table 3: LaMDA 137B
target, LaMDA 2B draft, dialog -- a draft 1.5% of its target's size on chat, as 1B is of
70B. Bracketed by 0.61 (their LaMDA 100M draft) and 0.80 (a stronger pair, e.g. their
T5-XXL/T5-base on translation: 0.80). Cross-check: a llama.cpp run of Llama-3-70B
Q4_K_M with a Llama-3-8B Q4_K_M draft on 2x RTX 3090 + RTX 4080 reported 58.7% of drafted
tokens accepted at a draft length of 8 (https://devquasar.com/uncategorized/speculative-
decoding-tradeoffs-gpu-with-large-models-llama-70b-8b/), which is alpha ~0.88 if every
round drafted all 8 (llama.cpp stops a draft early when the draft is unsure, so less).
The Table 3 figures are quoted from the paper as remembered here (no network to re-check
them when this was written): re-check before quoting them further.

Workloads: one user -- a 512-token prompt, a 256-token reply; sixteen users -- sixteen
requests at once, lengths drawn (seeded) from bench/simulator.py's Azure-conversation-like
lognormals. The head's defaults: just-in-time link scheduling, dynamic micro-batch count,
link-sized prompt chunks. Speculation "auto": the engine's SpecPolicy (k <= 8, off above 4
decoding sequences in a step, off where it does not pay by 5%).

    .venv/bin/python bench/northstar.py
    .venv/bin/python bench/northstar.py --accept 0.6 0.71 0.8 --mbits 100 --delay-ms 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import simulator as sim  # noqa: E402

# Llama-3.1-70B (config.json of meta-llama/Llama-3.1-70B)
LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 80, 8192, 28672, 64, 8, 128, 128256
LAYER_PARAMS = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2 + 3 * HIDDEN * MLP
NF4_BYTES = 0.5625          # 4 bits + a float32 absmax per 64 weights (bitsandbytes NF4 as measured)
BF16 = 2
SPLIT = (27, 27, 26)
GPU_MEM = 24e9
# the GPU (bench/simulator.py llama70b's 4090-class assumption)
MEM_BW, FLOPS, FRACTION = 1008e9, 150e12, 0.6
# the engine as measured on the H200 with decode graphs (bench/RESULTS.md 2026-12-04,
# bench/gpu.py, ours1, 32 layers): steps, the bf16 step's matrix kernels (its profile)
H200_BW, H200_LAYERS = 4.29e12, 32
H200_BF16_BYTES, H200_NF4_BYTES = 16.06e9, 6.03e9
H200_BF16_ONE_S, H200_NF4_ONE_S, H200_BF16_MATMUL_S = 7.59e-3, 7.41e-3, 4.50e-3
FIXED_PER_LAYER_S = (H200_BF16_ONE_S - H200_BF16_MATMUL_S) / H200_LAYERS       # ~0.097 ms
_FIXED = FIXED_PER_LAYER_S * H200_LAYERS
BF16_FRACTION = H200_BF16_BYTES / H200_BW / H200_BF16_MATMUL_S                   # ~0.83
NF4_FRACTION = H200_NF4_BYTES / H200_BW / (H200_NF4_ONE_S - _FIXED)             # ~0.33
# nf4: an n-token step's weight part over a 1-token step's (verification 1 + 4: 14.27 ms;
# 16 rows: 60.8 tok/s a sequence)
NF4_STEP_SCALE = ((1, 1.0), (5, (14.27e-3 - _FIXED) / (H200_NF4_ONE_S - _FIXED)),
                  (16, (1 / 60.8 - _FIXED) / (H200_NF4_ONE_S - _FIXED)))
# the draft: Llama-3.2-1B, bf16
DRAFT_PARAMS, DRAFT_LAYERS = 1.24e9, 16
ACCEPT = 0.71               # Leviathan et al. 2023, Table 3 (LaMDA 2B -> 137B, dialog)
CONTEXT = 1024              # tokens each decode row's KV read covers (the profile's)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
PROMPT = (16, 64, 256, 512, 1024, 2048, 4096)


def measured_scale(n: float) -> float:
    """An n-token step's weight part over a 1-token step's, from the H200's nf4 figures,
    linear between them and per row past the last."""
    pts = NF4_STEP_SCALE
    if n >= pts[-1][0]:
        return pts[-1][1] * n / pts[-1][0]
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if n <= b:
            return ta + (tb - ta) * (max(n, a) - a) / (b - a)
    return pts[0][1]


def stage_profile(layers: int, lm_head: bool, kind: str) -> dict:
    params = layers * LAYER_PARAMS
    packed = params * NF4_BYTES
    head_bytes = VOCAB * HIDDEN * BF16 if lm_head else 0
    kv_row = layers * 2 * KV_HEADS * HEAD_DIM * BF16 * CONTEXT
    bw = MEM_BW * FRACTION
    flop_tok = 2 * (params + (VOCAB * HIDDEN if lm_head else 0))

    def gpu(n: int, prompt: bool = False) -> float:
        if kind == "roofline" or n == 1:
            weights = packed
        else:   # bitsandbytes: dequantize to bf16, then a bf16 matmul
            weights = params * (NF4_BYTES + 2 * BF16)
        t = max((weights + head_bytes) / bw, flop_tok * n / FLOPS)
        return t + (0 if prompt else n * kv_row / bw)

    def step(n: int, prompt: bool = False) -> float:
        if kind == "measured":
            weights = packed / (MEM_BW * NF4_FRACTION) * measured_scale(n) + head_bytes / (MEM_BW * BF16_FRACTION)
            t = max(layers * FIXED_PER_LAYER_S + weights, flop_tok * n / FLOPS)
            return t + (0 if prompt else n * kv_row / bw)
        return gpu(n, prompt)

    return {"decode": [[n, step(n)] for n in ROWS], "prefill": [[n, step(n, True)] for n in PROMPT]}


def draft_seconds(kind: str) -> float:
    if kind == "measured":
        return DRAFT_LAYERS * FIXED_PER_LAYER_S + DRAFT_PARAMS * BF16 / (MEM_BW * BF16_FRACTION)
    return DRAFT_PARAMS * BF16 / (MEM_BW * FRACTION)


def pipeline(kind: str, mbits: float, delay_s: float) -> sim.Pipeline:
    profs = [stage_profile(n, i == len(SPLIT) - 1, kind) for i, n in enumerate(SPLIT)]
    return sim.Pipeline(profs, mbits * 1e6 / 8, delay_s, hidden_bytes=HIDDEN * BF16, dtype_bytes=BF16,
                        kv_capacity=1 << 17)


def memory_gb() -> list[float]:
    out = []
    for i, n in enumerate(SPLIT):
        b = n * LAYER_PARAMS * NF4_BYTES + (VOCAB * HIDDEN * BF16 if i in (0, len(SPLIT) - 1) else 0)
        b += DRAFT_PARAMS * BF16 if i == 0 else 0
        out.append(b / 1e9)
    return out


HEAD_DEFAULTS = sim.Policy("jit", prompt_chunk="auto", dynamic=True)


def one_user(pipe, spec, n_in=512, n_out=256) -> dict:
    r = sim.simulate(pipe, HEAD_DEFAULTS, [(0.0, n_in, n_out)], spec=spec)
    r["decode_tps"] = 1.0 / r["tpot_mean"]
    return r


def users(pipe, spec, n=16, seed=0) -> dict:
    reqs = [(i * 1e-3, a, b) for i, (_, a, b) in enumerate(sim.workload(1.0, n, seed=seed))]
    return sim.simulate(pipe, HEAD_DEFAULTS, reqs, spec=spec)


def table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def fmt(cells):
        return "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    return "\n".join([fmt(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accept", type=float, nargs="+", default=[0.61, ACCEPT, 0.80],
                    help="per-token acceptance(s) of the draft (default: 0.61 0.71 0.80; 0.71 is the headline)")
    ap.add_argument("--mbits", type=float, default=100.0)
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    delay = a.delay_ms / 1e3
    print(f"Llama-3.1-70B, NF4 ({NF4_BYTES} B/param + bf16 embeddings/LM head), layers {'/'.join(map(str, SPLIT))} "
          f"on 3 x 24 GB RTX 4090-class GPUs ({MEM_BW / 1e9:.0f} GB/s, {FLOPS / 1e12:.0f} TFLOP/s), "
          f"{a.mbits:g} Mbit/s and {a.delay_ms:g} ms one way between homes; draft Llama-3.2-1B bf16 on the host's GPU")
    print("GPU memory for weights per stage (GB, draft included on stage 0): "
          + ", ".join(f"{x:.1f}" for x in memory_gb()) + f" of {GPU_MEM / 1e9:.0f} (the rest: KV, activations, CUDA)")
    print(f"acceptance: alpha = {ACCEPT} per drafted token (Leviathan, Kalman & Matias, ICML 2023, arXiv:2211.17192, "
          "Table 3: LaMDA 2B drafting for LaMDA 137B on dialog; no published figure for Llama-3.2-1B -> "
          "Llama-3.1-70B was at hand offline), bracketed by 0.61 and 0.80\n")
    kinds = [("roofline", "roofline, fused 4-bit kernels (0.6 of bandwidth: assumed)"),
             ("bnb", "roofline + bitsandbytes (n > 1 tokens dequantize to bf16)"),
             ("measured", "as measured on the H200 with decode graphs (bnb nf4 kernels)")]
    rows, urows, head = [], [], {}
    for kind, label in kinds:
        pipe = pipeline(kind, a.mbits, delay)
        d = pipe.profiles[0]["decode"]
        base = one_user(pipe, None)
        many = users(pipe, None, a.users, a.seed)
        steps = f"{d[0][1] * 1e3:.1f} / {sim.interp(d, 5) * 1e3:.1f}"
        rows.append([label, steps, f"{draft_seconds(kind) * 1e3:.1f}", "off", "-", f"{base['decode_tps']:.2f}",
                     "1.00", "-", "1.00x"])
        urows.append([label, "off", "-", f"{many['throughput']:.1f}", f"{1 / many['tpot_mean']:.2f}", "1.00", "1.00x"])
        for acc in a.accept:
            spec = sim.Spec(accept=acc, draft=draft_seconds(kind), seed=a.seed)
            r = one_user(pipe, spec)
            if acc == ACCEPT:
                head[kind] = (base["decode_tps"], r["decode_tps"])
            rows.append(["", "", "", "auto", f"{acc:.2f}", f"{r['decode_tps']:.2f}",
                         f"{r['tokens_per_trip']:.2f}", f"{(r['trip'] or 0) * 1e3:.0f}",
                         f"{r['decode_tps'] / base['decode_tps']:.2f}x"])
            m = users(pipe, spec, a.users, a.seed)
            if acc == ACCEPT:
                head[kind] += (many["throughput"], m["throughput"])
            urows.append(["", "auto", f"{acc:.2f}", f"{m['throughput']:.1f}", f"{1 / m['tpot_mean']:.2f}",
                          f"{m['tokens_per_trip']:.2f}", f"{m['throughput'] / many['throughput']:.2f}x"])
    print("One user (512-token prompt, 256-token reply): decode tok/s\n")
    print(table(["stage profile", "stage step ms, 1 / 5 tok", "draft ms/tok", "speculation", "alpha",
                 "decode tok/s", "tok/trip", "trip ms", "vs off"], rows))
    print("(trip: the plain decode trip the policy measured, head to head: three hops and three stage steps)\n")
    print(f"{a.users} users at once (Azure-conversation-like lengths, seed {a.seed}): aggregate tok/s = output "
          "tokens / (last token - first arrival)\n")
    print(table(["stage profile", "speculation", "alpha", "aggregate tok/s", "per-user decode tok/s", "tok/trip",
                 "vs off"], urows))
    print(f"\nHeadline, alpha = {ACCEPT} (Leviathan et al. 2023):")
    for kind, label in kinds:
        if kind in head:
            a1, b1, a16, b16 = head[kind]
            print(f"  {label}: one user {a1:.1f} -> {b1:.1f} tok/s ({b1 / a1:.2f}x); "
                  f"{a.users} users {a16:.1f} -> {b16:.1f} tok/s aggregate ({b16 / a16:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
