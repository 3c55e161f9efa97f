"""Does one seeded request, sent again and again to one server, read the same reply --
also while another program takes a core now and then?

Starts `potluck serve` as it starts (the default model, its own free port), sends the
same chat request (`n` choices, a seed, temperature 0.9) --sends times one after another,
and runs a busy program (a plain Python loop, as in bench/busy_cpu.py) during the sends
named by --busy. Prints each send's choices as short hashes and whether they match the
first send's. The first computes the prompt afresh; the sends after it take its kept
conversation start (engine/pipeline/kept_replies.py) and, being seeded, compute that
prompt's step again as the first did (core/kept_prefixes.py same_step).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/seeded_repeat.py --sends 10 --busy 3-6
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
        "quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.")


def ask(port: int, n: int, seed: int, tokens: int) -> list[str]:
    body = {"messages": [{"role": "user", "content": f"Repeat this text exactly, three times:\n\n{TEXT}"}],
            "max_tokens": tokens, "temperature": 0.9, "seed": seed, "n": n}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return [c["message"]["content"] for c in json.load(r)["choices"]]


def sends(spec: str) -> set[int]:
    """'3-6' or '3,5' -> the 1-based sends the busy program runs during."""
    out = set()
    for part in filter(None, spec.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sends", type=int, default=10)
    ap.add_argument("--busy", default="3-6", help="sends during which a busy program runs, e.g. 3-6 ('' for none)")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=80)
    args = ap.parse_args()
    busy_at = sends(args.busy)
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    serve = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    busy = None
    try:
        port = None
        for line in serve.stdout:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                port = int(m[1])
                break
        if port is None:
            print("potluck serve did not start", file=sys.stderr)
            return 1
        rows = []
        for i in range(1, args.sends + 1):
            if i in busy_at and busy is None:
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            elif i not in busy_at and busy is not None:
                busy.kill()
                busy = None
            t0 = time.monotonic()
            texts = ask(port, args.n, args.seed, args.tokens)
            rows.append((i, i in busy_at, [hashlib.md5(t.encode()).hexdigest()[:6] for t in texts],
                         time.monotonic() - t0))
        ref = rows[0][2]
        print(f"\nthe same request (n {args.n}, seed {args.seed}, temperature 0.9, {args.tokens} tokens) "
              f"sent {args.sends} times to one `potluck serve`\n")
        print("| send | busy program | choices (md5, 6 hex) | = send 1 | s |")
        print("|---:|---|---|---|---:|")
        for i, b, hashes, s in rows:
            print(f"| {i} | {'yes' if b else ''} | {' '.join(hashes)} | {'✓' if hashes == ref else 'differs'} | {s:.1f} |")
        later = rows[1:]
        same = sum(r[2] == ref for r in later)
        print(f"\nsends 2-{args.sends}: {same} of {len(later)} the same as send 1 "
              f"({'PASS' if same == len(later) else 'MISS'}: a seeded request reads one reply on one server)")
        return 0
    finally:
        if busy is not None:
            busy.kill()
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()


if __name__ == "__main__":
    raise SystemExit(main())
