"""Shared fixtures for the integration tests: real stage processes, real sockets.

`pipeline` is one head (stage 0, in this process) over two local stage processes on
the default model, shared by the whole session: starting processes and loading weights
is the slow part, so every test that can reuses it. `api_url` serves the OpenAI API
over that pipeline on a free loopback port. Every process runs one torch thread: three
stages (plus a reference model) on two cores would otherwise oversubscribe them.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TQDM_DISABLE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# the public STUN servers are on the internet, which tests never reach: a test that
# needs one starts its own (testkit/homenet.py) and names it
os.environ.setdefault("POTLUCK_STUN", "")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # GUI tests (pytest-qt): no display needed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402

THREADS = 1
torch.set_num_threads(THREADS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipeline_config(**over):
    """The test pipeline: three stages of the default model, one torch thread each."""
    from engine.pipeline.launch import PipelineConfig

    return PipelineConfig(**{"model": "default", "stages": 3, "threads": THREADS, **over})


@pytest.fixture(scope="session")
async def shared_pipeline():
    from engine.pipeline.launch import launch

    pipe = await launch(pipeline_config())
    procs = list(pipe.local.procs)
    try:
        yield pipe.head
    finally:
        await pipe.close()
        assert all(p.returncode is not None for p in procs), "a stage process outlived the session"


# The session's loop runs only during async tests. Between them (a long file of plain
# tests) the stage processes hear nothing from the head, and after their 60 s keepalive
# they let it go, as they would a head that vanished; the head re-forms when its loop
# runs again. A test that begins after such a pause waits for that first.
IDLE_S = 30.0
_last_used = [0.0]


async def settled(head):
    import asyncio
    import time

    from testkit.streams import until

    if _last_used[0] and time.monotonic() - _last_used[0] > IDLE_S:
        await asyncio.sleep(0.5)          # the closes waiting in the sockets are read
        await until(lambda: not head.recovering, timeout=180)
    return head


@pytest.fixture
async def pipeline(shared_pipeline):
    import time

    yield await settled(shared_pipeline)
    _last_used[0] = time.monotonic()


@pytest.fixture(scope="session")
async def api_url(shared_pipeline):
    from engine.pipeline.api import serve_api

    port = free_port()
    runner = await serve_api(shared_pipeline, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


@pytest.fixture
async def client(api_url, pipeline):
    """The openai package's client on the session's API: what users' programs use."""
    from openai import AsyncOpenAI

    # generous: a forced tool call's grammar and a loaded machine can take minutes
    c = AsyncOpenAI(base_url=api_url, api_key="x", max_retries=0, timeout=300)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(scope="session")
def default_source():
    from engine.model.sources import resolve

    return resolve("default")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, default_source):
    """Builds each tiny checkpoint once: tiny_folder(arch, seed=0) -> (folder, model).

    The tiny checkpoints carry no tokenizer; the head needs one to decode, so each gets
    a copy of the default model's (its ids cover the tiny 256-token vocabulary).
    Tests submit token ids and clear the head's end-of-sequence ids.
    """
    from testkit.tiny_models import build_tiny_model

    cache: dict[tuple[str, int], tuple[Path, object]] = {}

    def get(arch: str, seed: int = 0):
        key = (arch, seed)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{arch}_{seed}")
            model = build_tiny_model(arch, root, seed=seed)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(default_source.root / name, root / name)
            cache[key] = (root, model)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory, default_source):
    """A tiny random-weight Llama that takes chat text: the default model's tokenizer and
    its whole vocabulary, a 256-token window (a conversation outgrows it in a few turns)."""
    from transformers import AutoTokenizer

    from testkit.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_chat")
    vocab = len(AutoTokenizer.from_pretrained(str(default_source.root)))
    build_tiny_model("llama", root, vocab=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_source.root / name, root / name)
    return root


@pytest.fixture(scope="session")
async def spare_stages():
    """Two more stage processes that tests configure with their own heads, one at a time."""
    from engine.pipeline.local import LocalStages

    local = LocalStages(2, threads=THREADS)
    try:
        yield await local.start()
    finally:
        await local.stop()


# Long synchronous tests (the desktop app's, the node's: real processes, Qt's event loop)
# run after everything that uses the session's asyncio loop. While no async test runs
# that loop is idle, so the shared pipeline's head cannot answer its stages' WebSocket
# pings; a few idle minutes in the middle of the session and the stages hang up on it.
# In one process they go last. Parallel workers (pytest-xdist) take files in an order of
# their own, so there `make test` runs them as a second session: `--late skip`, then
# `--late only` (test_gpu_dialog, run after test_app_gui and then test_draft in one process,
# lost every cross-thread signal: reproduced serially, not yet understood).
LATE_MODULES = ("test_app_gui", "test_node")

# The modules that run for minutes, longest first, start the run. A worker takes whole
# files (--dist loadfile) in queue order, and xdist's own order (most tests first) put
# the five-minute chaos run, a single test, near the end: the other worker sat idle
# for most of it (about a tenth of the run's wall clock).
FIRST_MODULES = ("test_chaos", "test_failover", "test_home_paths", "test_pipeline", "test_penalties")


def pytest_configure(config):
    # the queue is this collection's order (pytest_collection_modifyitems), not xdist's
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_addoption(parser):
    parser.addoption("--late", choices=("last", "skip", "only"), default="last",
                     help="the long synchronous modules (LATE_MODULES): last (one process), "
                          "skip them, or only them (parallel workers: two sessions)")


def pytest_collection_modifyitems(config, items):
    counts = Counter(i.path for i in items)

    def rank(item):   # the long modules first; then, as xdist would, the most tests first
        name = item.module.__name__.rsplit(".", 1)[-1]
        return (FIRST_MODULES.index(name), 0) if name in FIRST_MODULES else (len(FIRST_MODULES), -counts[item.path])

    items.sort(key=rank)   # stable: each file's tests stay together, in their order
    late = [i for i in items if i.module.__name__.rsplit(".", 1)[-1] in LATE_MODULES]
    how = config.getoption("--late")
    if how == "skip":
        items[:] = [i for i in items if i not in late]
    elif how == "only":
        items[:] = late
    elif late:
        items[:] = [i for i in items if i not in late] + late
    # `gpu` tests need CUDA: skipped here, run on a lent GPU with `pytest -m gpu`
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on a machine that has one)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
