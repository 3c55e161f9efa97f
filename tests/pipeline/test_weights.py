"""`--weights`: the head settles the precision against the pool and every stage
process loads its layers at it; the user reads what each precision needs first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def chat(*args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "engine", "chat", "--stages", "2", "--max-tokens", "12",
                           "--temperature", "0",
                           "--prompt", "What is the capital of France?", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_two_stage_processes_answer_with_quantized_weights(weights):
    pytest.importorskip("bitsandbytes")
    r = chat("--weights", weights)
    assert r.returncode == 0, r.stderr[-3000:]
    table = [line for line in r.stderr.splitlines() if line.startswith("  ") and " GB" in line or " MB" in line]
    assert any(line.split()[0] == weights and line.rstrip().endswith("<- chosen") for line in table), r.stderr
    answer = r.stdout.split("bot>", 1)[1].strip()
    assert len(answer.split()) >= 3, r.stdout


def test_auto_takes_full_precision_when_the_model_fits():
    r = chat()
    assert r.returncode == 0, r.stderr[-3000:]
    chosen = [line for line in r.stderr.splitlines() if line.rstrip().endswith("<- chosen")]
    # unquantized: "bf16" where the pipeline computes in bfloat16, "full (float32)" on a CPU
    assert len(chosen) == 1 and chosen[0].split()[0] in ("bf16", "full"), r.stderr
    assert "bf16 (float32)" not in r.stderr and " your " not in r.stderr, r.stderr
    assert "Paris" in r.stdout, r.stdout
