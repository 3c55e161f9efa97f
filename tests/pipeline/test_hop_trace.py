"""Where a decode round's time goes (engine/pipeline/hop_trace.py, bench/hop_trace.py):
marks cost nothing when off, and a real two-process pipeline's marks line up into rounds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hop_trace as analysis  # noqa: E402

from engine.core.sampling import SamplingParams  # noqa: E402
from engine.pipeline.hop_trace import ENV, HopTrace  # noqa: E402
from engine.pipeline.launch import PipelineConfig, launch  # noqa: E402
from engine.pipeline.requests import Done  # noqa: E402


def test_off_it_writes_nothing_and_on_it_keeps_every_mark_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    off = HopTrace.from_env("head")
    off("launch")
    off.flush()
    assert not off.on and list(tmp_path.iterdir()) == []
    on = HopTrace(tmp_path / "t", "stage")
    for i in range(1200):   # past two batches of lines, then the rest on flush
        on(f"m{i}")
    on.flush()
    (path,) = (tmp_path / "t").glob("stage-*.trace")
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [t for _, t in lines] == [f"m{i}" for i in range(1200)]
    stamps = [int(ns) for ns, _ in lines]
    assert stamps == sorted(stamps)
    # a folder it cannot write: tracing is off, the pipeline is not stopped
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad = HopTrace(blocker / "t", "head")
    bad("launch")
    bad.flush()
    assert not bad.on


def write(folder: Path, name: str, marks: list[tuple[int, str]]):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(f"{ns} {tag}\n" for ns, tag in marks))


def test_a_running_pipelines_marks_reach_the_disk_within_a_second(tmp_path):
    """A few requests mark fewer than a batch of lines: the files stayed empty until the
    pipeline stopped, and bench/hop_trace.py said the trace was off."""
    import time

    on = HopTrace(tmp_path, "stage")
    on("a")
    (path,) = tmp_path.glob("stage-*.trace")
    time.sleep(1.05)
    on("b")          # a mark a second after the last write writes what is held
    assert [line.split()[1] for line in path.read_text().splitlines()] == ["a", "b"]


def test_rounds_line_up_across_the_processes_files(tmp_path):
    # two rounds of 1000 ns a segment on the head and the stage, and a third the next
    # launch overtook (its stage never answered): dropped
    head, stage, t = [], [], 0
    for _ in range(2):
        for tag in analysis.HEAD:
            head.append((t, tag))
            t += 1000
        for tag in analysis.STAGE_IN + ("out",):
            stage.append((t, tag))
            t += 1000
        head.append((t, "tokens"))
        t += 3000
    head += [(t, "launch"), (t + 500, "compute")]
    head += [(t + 900, "launch")]
    write(tmp_path, "head-1.trace", head)
    write(tmp_path, "stage-2.trace", stage)
    marks, stages = analysis.read(tmp_path)
    assert stages == ["stage1"]
    done = analysis.rounds(marks, analysis.order(stages))
    assert len(done) == 2 and done[1][-1] == t   # the second round's next launch
    text = analysis.table(tmp_path)
    assert "2 rounds, 1 stage process(es); median round 17 us" in text, text
    assert "| head.tokens | head.launch (next) | 3 |" in text, text
    assert "| stage1.compute | stage1.forwarded | 1 |" in text, text
    # each round: 17 us, of which the head's and the stage's compute -> computed take 2 each
    assert analysis.summary(tmp_path) == {"rounds": 2, "round_us": 17.0, "steps_us": 4.0, "rest_us": 13.0}


async def test_a_two_process_pipeline_marks_whole_rounds(tiny_folder, tmp_path, monkeypatch):
    folder, _ = tiny_folder("llama")
    monkeypatch.setenv(ENV, str(tmp_path / "hops"))   # the stage process inherits it
    p = await launch(PipelineConfig(model=str(folder), stages=2, threads=1, device="cpu", speculate="off"))
    try:
        p.head.eos_ids = set()
        h = p.head.submit(list(range(5, 25)), SamplingParams(greedy=True, max_tokens=24))
        async for ev in h:
            if isinstance(ev, Done):
                assert ev.error is None, ev
    finally:
        await p.close()
    marks, stages = analysis.read(tmp_path / "hops")
    assert stages == ["stage1"], list((tmp_path / "hops").iterdir())
    done = analysis.rounds(marks, analysis.order(stages))
    # the prompt's round and every decode round but the last (no launch after it)
    assert len(done) >= 20, len(done)
    assert all(b >= a for r in done for a, b in zip(r, r[1:]) if b is not None)
