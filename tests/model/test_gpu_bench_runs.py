"""The script a lent GPU window runs (bench/gpu_window.sh: `pytest -m gpu`, then
bench/gpu.py) still runs. A GPU is lent to some sessions only, for minutes: a script
broken since the last window would waste one. So here, on the CPU with a 2-layer model,
bench/gpu.py measures every system it compares (one process, two stage processes,
transformers' generate) and writes its rows and the issue's verdicts; the one-process
stage replays its decode steps as graphs (testkit/graph_tape.py), as on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_window_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_window.sh")]).returncode == 0


def test_the_gpu_bench_runs_here_on_a_tiny_model(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--cpu", "--tiny", "--tokens", "8",
                          "--prompt-len", "16", "--repeat", "1", "--weights", "bf16", "--batches", "1", "--tape",
                          "--json", str(out), "--out", str(tmp_path / "model")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    for system in ("ours1", "ours2", "hf"):
        row = got["rows"][f"{system}/bf16/1"]
        assert row["decode_seq"] > 0 and row["ttft"] > 0, (system, row)
    # the one-process stage timed its 1 + 4 token verification step against a 1-token one,
    # its decode steps replayed as graphs (through the tape: the path a GPU stage takes)
    ours1 = got["workers"]["ours1/bf16"]
    assert set(ours1["steps"]) >= {"one", "verify"}
    assert ours1["sampled"]["decode_agg"] > 0 and ours1["sampled"]["batch"] == 1
    assert ours1["graphs"]["captures"] >= 5 and ours1["graphs"]["replays"] > 0 and not ours1["graphs"]["failed"], ours1
    # the two-stage pipeline reports each stage's decode graphs (none on the CPU)
    assert [set(g) for g in got["workers"]["ours2/bf16"]["stage_graphs"]] == \
        [{"fixed_steps", "graph_replays", "graph_captures"}] * 2
    verdicts = {v[0]: v[3] for v in got["verdicts"]}
    assert verdicts["ours1 / HF generate, decode tok/s, batch 1, bf16"] in ("PASS", "MISS")
    assert verdicts["ours1 at the chat's sampled defaults / greedy, aggregate decode tok/s, batch 1, bf16"] \
        in ("PASS", "MISS")
    assert "ratio (issue 42 targets)" in run.stdout


def test_the_sampling_bench_runs_here(tmp_path):
    """bench/sampling.py, as the window runs it (synthetic logits: the device machine has
    no default model), writes a row per vocabulary and batch with both draws timed."""
    out = tmp_path / "sampling.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sampling.py"), "--synthetic", "--repeat", "1",
                          "--batches", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["vocab"], r["batch"]) for r in rows if "vocab" in r] == [(49152, 2), (128256, 2)]
    assert all(r["per_row_s"] > 0 and r["batched_s"] > 0 for r in rows if "vocab" in r)
    # the ranking: every row sorted whole against the device's candidates first, the same tokens
    assert [(r["ranked_vocab"], r["ranked_batch"], r["same"], r["whole_sort_s"] > 0, r["candidates_s"] > 0)
            for r in rows if "ranked_vocab" in r] == [(49152, 2, True, True, True), (128256, 2, True, True, True)]
    # the repetition penalty's pairs of a step, rebuilt and kept: the same pairs
    assert [(r["pairs_users"], r["same"], r["rebuilt_s"] > 0, r["kept_s"] > 0) for r in rows if "pairs_users" in r] \
        == [(2, True, True, True)]
    # the verification step, position by position and in one draw
    assert [(r["verify_users"], r["alone_s"] > 0, r["one_draw_s"] > 0) for r in rows if "verify_users" in r] \
        == [(2, True, True)]
