"""A stage process imports the model code while it waits for its head.

transformers' model base takes seconds to import on a small CPU; a stage that imported it
only at configure made every pipeline start wait for it after the head had asked for the
layers. `engine stage` calls warm_up() as soon as it listens. A fresh interpreter, since
this one imported transformers long ago.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, sys, threading
from engine.pipeline.stage_server import StageServer

BASE = "transformers.modeling_utils"

async def main():
    server = await StageServer("127.0.0.1", 0, pipeline="warm").start()
    before = BASE in sys.modules
    server.warm_up()
    # on the compute thread, where the configure that comes next will run behind it
    seen = server._exec.submit(lambda: (BASE in sys.modules, threading.current_thread().name)).result()
    await server.close()
    print("RESULT", before, seen[0], seen[1].startswith("compute"))

asyncio.run(main())
"""


def test_a_stage_imports_the_model_code_before_any_configure():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT False True True"], done.stdout + done.stderr[-2000:]


async def test_a_model_it_cannot_run_is_said_and_its_stage_processes_stop(tmp_path, monkeypatch):
    """The head reads the config while its stage processes start: a refusal found there
    reaches the user, and the processes started meanwhile do not outlive it."""
    import transformers

    from engine.model.sources import ModelError
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.local import LocalStages

    transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(str(tmp_path))
    procs = []
    start = LocalStages.start

    async def recorded(self):
        addresses = await start(self)
        procs.extend(self.procs)
        return addresses

    monkeypatch.setattr(LocalStages, "start", recorded)
    with pytest.raises(ModelError, match="'bert'"):
        await launch(PipelineConfig(model=str(tmp_path), stages=2))
    assert procs and all(proc.returncode is not None for proc in procs)
