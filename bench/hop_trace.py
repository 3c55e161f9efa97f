"""Where a decode round's time goes between the head and its stage processes, from the
marks they write with POTLUCK_HOP_TRACE=DIR (engine/pipeline/hop_trace.py).

Lines the processes' marks up into rounds -- the head builds a step, computes its layers,
frames the activations, hands them to the link; each stage receives them, checks them,
queues them, computes, and passes them on (the last sends the tokens back); the head
reads the tokens and launches the next step -- and prints each segment's median over the
rounds, with its share of the round. The stages are ordered by when they first received
anything. A round that another step overtook is dropped, so a prompt's chunks and a
reply's first steps weigh little beside a long decode.

    POTLUCK_HOP_TRACE=/tmp/hops .venv/bin/python -m engine chat --stages 2 --prompt "..." --max-tokens 200
    .venv/bin/python bench/hop_trace.py /tmp/hops

bench/gpu.py sets it for its two-process system when POTLUCK_BENCH_HOPS=DIR is set (the
GPU window does), one folder per system and precision.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# "forwarded": the step's forward returned -- on a GPU, its kernels launched (a graph
# replayed), so compute -> forwarded is the host's launch and forwarded -> computed the
# wait for the GPU (and at the last stage, the draw)
HEAD = ("launch", "compute", "forwarded", "computed", "framed", "link.sent")
STAGE_IN = ("arrived", "checked", "dequeued", "compute", "forwarded", "computed", "back")


def read(folder: Path) -> tuple[list[tuple[int, str, str]], list[str]]:
    """Every mark as (ns, who, tag), who 'head' or 'stage1', 'stage2'... in pipeline order."""
    marks, stages = [], []
    for path in sorted(folder.glob("*.trace")):
        who = path.name.split("-", 1)[0]
        rows = []
        for line in path.read_text().splitlines():
            ns, _, tag = line.partition(" ")
            if ns.isdigit() and tag:
                rows.append((int(ns), tag))
        if not rows:
            continue
        if who == "stage":
            first = min((ns for ns, tag in rows if tag == "arrived"), default=None)
            if first is None:
                continue
            stages.append((first, rows))
        else:
            marks += [(ns, "head", tag) for ns, tag in rows]
    names = []
    for i, (_, rows) in enumerate(sorted(stages, key=lambda s: s[0])):
        names.append(f"stage{i + 1}")
        marks += [(ns, names[-1], tag) for ns, tag in rows]
    marks.sort()
    return marks, names


def order(stages: list[str]) -> list[tuple[str, str]]:
    seq = [("head", t) for t in HEAD]
    for i, s in enumerate(stages):
        seq += [(s, t) for t in STAGE_IN] + [(s, "out" if i == len(stages) - 1 else "link.sent")]
    return seq + [("head", "tokens")]


def rounds(marks, seq) -> list[list[int]]:
    """Each complete round's times, one per point of `seq` plus the next launch (or None)."""
    out, cur = [], None
    for ns, who, tag in marks:
        if (who, tag) == seq[0]:
            if cur is not None and len(cur) == len(seq):
                out.append(cur + [ns])
            cur = [ns]
        elif cur is not None and len(cur) < len(seq) and (who, tag) == seq[len(cur)]:
            cur.append(ns)
    if cur is not None and len(cur) == len(seq):
        out.append(cur + [None])
    return out


def lined_up(folder: Path) -> tuple[list[str], list[tuple[str, str]], list[list[int]], int]:
    """A folder's marks as rounds: (stage names, the points of a round, the rounds, marks read)."""
    marks, stages = read(folder)
    seq = order(stages)
    return stages, seq, rounds(marks, seq) if stages else [], len(marks)


def summary(folder: Path) -> dict | None:
    """Medians over whole rounds: the round, the steps (each process's compute -> computed,
    summed) and the rest (hops, framing, queues, scheduling), in microseconds."""
    stages, seq, done, _ = lined_up(folder)
    spans = [(seq.index((w, "compute")), seq.index((w, "computed"))) for w in ["head"] + stages]
    whole = [r for r in done if r[-1] is not None]
    if not stages or not whole:
        return None
    rnd = [r[-1] - r[0] for r in whole]
    steps = [sum(r[b] - r[a] for a, b in spans) for r in whole]
    return {"rounds": len(whole), "round_us": statistics.median(rnd) / 1e3,
            "steps_us": statistics.median(steps) / 1e3,
            "rest_us": statistics.median(x - y for x, y in zip(rnd, steps)) / 1e3}


def table(folder: Path) -> str:
    stages, seq, done, n_marks = lined_up(folder)
    if not stages:
        return f"{folder}: no stage process wrote marks (one process, or the trace was off)"
    if not done:
        return f"{folder}: no complete round among {n_marks} marks"
    points = [f"{w}.{t}" for w, t in seq] + ["head.launch (next)"]
    total = [r[-1] - r[0] for r in done if r[-1] is not None]
    med_round = statistics.median(total) if total else None
    head = f"{folder.name}: {len(done)} rounds, {len(stages)} stage process(es)"
    if med_round:
        head += f"; median round {med_round / 1e3:.0f} us"
    lines = [head, "", "| from | to | median us | share of the round |", "|---|---|---:|---:|"]
    for i in range(len(points) - 1):
        d = [r[i + 1] - r[i] for r in done if r[i + 1] is not None]
        if not d:
            continue
        m = statistics.median(d)
        share = f"{m / med_round:.2f}" if med_round else "-"
        lines.append(f"| {points[i]} | {points[i + 1]} | {m / 1e3:.0f} | {share} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="POTLUCK_HOP_TRACE folders (or folders of them)")
    a = ap.parse_args(argv)
    for folder in a.folders:
        subs = [folder] if any(folder.glob("*.trace")) else sorted(p for p in folder.iterdir() if p.is_dir())
        for f in subs:
            print(table(f))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
