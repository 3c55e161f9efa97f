"""What the chat's sampling defaults give a user of the default model, side by side.

A request that names no sampling field gets engine/core/sampling.py's CHAT_DEFAULTS
(the default model's GGUF carries no generation_config). They were chosen against loops
(greedy decoding repeats one line of a haiku for all 256 tokens); SmolLM2's authors show
temperature 0.2, top-p 0.9; llama.cpp cuts the tail with min-p. This runs the default
model behind `potluck serve` over two sets of prompts at several settings (today's
defaults, with min-p 0.05 / 0.1 / 0.2, at temperature 0.2 with and without the
repetition penalty, greedy), each prompt drawn --seeds ways (one request, n choices),
and prints for each setting:

- **right**: short questions with one plain answer (a capital, a sum, a symbol), the
  share of replies that give it (a word match in the reply's first 200 characters);
- **loops**: open prompts (a story, a haiku, tips) answered at up to --tokens tokens,
  the share of replies in which some run of six words comes back three times or more;
- **distinct-3**: of those replies' word trigrams, the share that are distinct (mean);
- **ended**: the share of open replies that ended on their own before --tokens.

The head alone computes (`--stages 1`): the split does not change what is drawn.

    .venv/bin/python bench/sampling_defaults.py              # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from busy_cpu import free_port, stop, wait_ready  # noqa: E402

from engine.core.sampling import CHAT_DEFAULTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# (question, a regular expression its right answer matches, case-insensitive)
QUESTIONS = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What is the capital of Italy?", r"\brome\b"),
    ("What is 12 times 7?", r"\b84\b"),
    ("What is 5 plus 3?", r"\b(8|eight)\b"),
    ("What is 10 divided by 2?", r"\b(5|five)\b"),
    ("How many days are in a week?", r"\b(7|seven)\b"),
    ("How many hours are in a day?", r"\b(24|twenty-four)\b"),
    ("How many legs does a spider have?", r"\b(8|eight)\b"),
    ("How many continents are there?", r"\b(7|seven)\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("Which planet is known as the Red Planet?", r"\bmars\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("At what temperature in Celsius does water freeze?", r"\b(0|zero)\b"),
    ("At what temperature in Celsius does water boil?", r"\b100\b"),
    ("What gas do plants take in from the air?", r"(carbon dioxide|\bco2\b|co₂)"),
    ("What is the chemical symbol for gold?", r"\bau\b"),
    ("What language is spoken in Spain?", r"\bspanish\b"),
    ("What do bees make?", r"\bhoney\b"),
    ("Which animal is called the king of the jungle?", r"\blions?\b"),
    ("What is the tallest animal in the world?", r"\bgiraffes?\b"),
    ("What is the opposite of hot?", r"\bcold\b"),
    ("What is frozen water called?", r"\bice\b"),
]

OPEN = [
    "Write a haiku about the sea.",
    "Tell me a short story about a dragon who learns to cook.",
    "Give me three tips for staying focused while studying.",
    "Explain why the sky is blue to a child.",
    "Write a short poem about friends sharing a meal.",
    "Describe your perfect weekend.",
]


def settings() -> list[tuple[str, dict]]:
    d = CHAT_DEFAULTS
    today = {"temperature": d["temperature"], "top_p": d["top_p"], "min_p": d["min_p"],
             "repetition_penalty": d["repetition_penalty"]}
    return [
        (f"today's defaults (t {d['temperature']}, top-p {d['top_p']}, min-p {d['min_p']}, "
         f"rep {d['repetition_penalty']})", today),
        ("t 0.7, top-p 0.9, min-p 0.05, rep 1.1", {**today, "temperature": 0.7, "top_p": 0.9, "min_p": 0.05}),
        ("t 0.7, top-p 0.9, min-p 0.1, rep 1.1", {**today, "temperature": 0.7, "top_p": 0.9, "min_p": 0.1}),
        ("t 0.7, top-p 0.9, min-p 0.2, rep 1.1", {**today, "temperature": 0.7, "top_p": 0.9, "min_p": 0.2}),
        ("t 0.2, top-p 0.9, rep 1.1", {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}),
        ("authors' (t 0.2, top-p 0.9, rep 1.0)", {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.0}),
        ("greedy, rep 1.1", {"temperature": 0.0, "repetition_penalty": 1.1}),
    ]


def ask(port: int, prompt: str, params: dict, n: int, tokens: int, seed: int) -> list[tuple[str, str]]:
    """n replies to one prompt: (text, finish_reason) each."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}], "n": n,
                       "max_tokens": tokens, "seed": seed, **params}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    return [(c["message"]["content"] or "", c["finish_reason"]) for c in out["choices"]]


def loops(text: str, run: int = 6, times: int = 3) -> bool:
    words = re.findall(r"\w+", text.lower())
    seen: dict[tuple, int] = {}
    for i in range(len(words) - run + 1):
        k = tuple(words[i:i + run])
        seen[k] = seen.get(k, 0) + 1
        if seen[k] >= times:
            return True
    return False


def distinct3(text: str) -> float:
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    return len(set(grams)) / len(grams) if grams else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=4, help="replies drawn per prompt (one request, n choices)")
    ap.add_argument("--tokens", type=int, default=160, help="the open prompts' reply length bound")
    ap.add_argument("--show", action="store_true", help="print every open reply")
    ap.add_argument("--only", default="", help="the settings to run, by their row number from 1 (e.g. 1,2,5)")
    args = ap.parse_args()
    (ROOT / "build").mkdir(exist_ok=True)
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    log = open(ROOT / "build" / "sampling_defaults.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--stages", "1", "--port", str(port)],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    rows = []
    try:
        wait_ready(port, proc)
        print(f"the default model behind potluck serve --stages 1; {len(QUESTIONS)} questions and "
              f"{len(OPEN)} open prompts, {args.seeds} replies each", flush=True)
        rows_wanted = {int(x) for x in args.only.split(",") if x}
        for number, (name, params) in enumerate(settings(), 1):
            if rows_wanted and number not in rows_wanted:
                continue
            n = 1 if params["temperature"] == 0 else args.seeds
            with ThreadPoolExecutor(8) as pool:
                qa = list(pool.map(lambda q: ask(port, q[0], params, n, 48, 1), QUESTIONS))
                op = list(pool.map(lambda p: ask(port, p, params, n, args.tokens, 1), OPEN))
            right = [bool(re.search(rx, text[:200], re.I)) for (_, rx), replies in zip(QUESTIONS, qa)
                     for text, _ in replies]
            texts = [(p, t, f) for p, replies in zip(OPEN, op) for t, f in replies]
            row = (name, sum(right) / len(right), sum(loops(t) for _, t, _ in texts) / len(texts),
                   sum(distinct3(t) for _, t, _ in texts) / len(texts),
                   sum(f == "stop" for _, _, f in texts) / len(texts), len(right), len(texts))
            rows.append(row)
            print(f"  {name}: right {row[1]:.2f}, loops {row[2]:.2f}, distinct-3 {row[3]:.2f}, "
                  f"ended {row[4]:.2f}", flush=True)
            if args.show:
                for p, t, f in texts:
                    print(f"    [{p}] ({f}) {t!r}")
    finally:
        stop(proc)
        log.close()
    print()
    print("| setting | right (short questions) | loops (open prompts) | distinct-3 | ended by itself | replies |")
    print("|---|---|---|---|---|---|")
    for name, right, loop, d3, ended, nq, no in rows:
        print(f"| {name} | {right:.2f} | {loop:.2f} | {d3:.2f} | {ended:.2f} | {nq} + {no} |")


if __name__ == "__main__":
    main()
