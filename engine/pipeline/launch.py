"""From a typed PipelineConfig to a running pipeline: stage processes on this machine
(or friends' stages at given addresses) and a head over them.

    pipe = await launch(PipelineConfig(model="default", stages=3), progress)
    handle = pipe.head.submit(...)
    await pipe.close()            # the head's connections, then the local stage processes

The CLI, the node (the tray's engine) and the tests all start pipelines here.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from engine.core.errors import ModelError
from engine.core.cpu_share import asked_threads
from engine.core.local_stages import local_stages
from engine.core.partition import parse_layers
from engine.model.device import compute_dtype, pick_device
from engine.model.sources import DEFAULT_MODEL, resolve
from engine.pipeline.head import Head
from engine.pipeline.local import LocalStages


def _prepare_head(source) -> None:
    """What the head needs before it can greet a stage (the config, transformers' tokenizer
    and model code: seconds of imports on a small CPU), done while the stage processes
    start instead of after. On one thread that finishes before the head is built, so no
    two threads import the same module at once."""
    from transformers import AutoTokenizer  # noqa: F401

    from engine.model.stage import import_model_code

    source.config()
    import_model_code()


@dataclass
class PipelineConfig:
    model: str = DEFAULT_MODEL            # 'default', a hub id, a folder or a .gguf
    # stage processes on this machine, head included (None: one, engine/core/local_stages.py)
    stages: int | None = None
    stage_addr: list[str] = field(default_factory=list)   # remote stages in order (replaces `stages`)
    # await hop(a, b): how the stage at address a reaches the one at b when that differs
    # from how the head reaches b (friends' stages behind tunnels: engine/node/homes.py)
    hop: Callable[[str, str], Awaitable[str]] | None = None
    layers: str | None = None             # '0:10,10:30' or '10,20' (None: split by speed and memory)
    micro_batches: int | None = None      # None: the head picks (and re-picks) the count
    device: str = "auto"                  # auto (the GPU if torch sees one) | cpu | cuda | cuda:N
    dtype: str = "auto"                   # auto: bf16 on a GPU, float32 on the CPU
    weights: str = "auto"                 # auto | bf16 | int8 | nf4 (engine/core/precision.py)
    threads: int | None = None            # torch threads per process (None: split this CPU's cores)
    kv_budget_tokens: int | None = None   # per stage (None: from free memory)
    link: str = "jit"                     # jit | fixed | fifo (engine/core/link_scheduler.py)
    prompt_chunk: int | str | None = "auto"
    compress: str = "off"                 # off | auto | prefill | all (engine/core/compression.py)
    compute: str = "in-order"             # in-order | decode-first (engine/core/step_gate.py)
    speculate: str | None = None          # auto | off (None: POTLUCK_SPECULATE, else auto; pipeline/head.py)
    draft: str | None = None              # a draft model 'MODEL[@WEIGHTS]' beside stage 0 (engine/model/draft.py)
    pipeline: str = "local"               # the name stages check at hello
    memory_cap_mb: float | None = None    # the most memory the head's own stage may use (None: what is free)
    # ended replies kept cached for their follow-ups (None: pipeline/kept_replies.py's default, 0: none)
    keep_replies: int | None = None
    # when a stage leaves and the ones left cannot hold the model: how long requests wait
    # for a machine to join (or come back) before they fail
    wait_timeout: float = 300.0


@dataclass
class Pipeline:
    """A running head and the local stage processes it owns (if any)."""
    head: Head
    local: LocalStages | None = None

    async def close(self, why: str = "the pipeline was stopped"):
        await self.head.close(why)
        if self.local is not None:
            await self.local.stop()

    async def __aenter__(self) -> "Pipeline":
        return self

    async def __aexit__(self, *exc):
        await self.close()


async def launch(cfg: PipelineConfig, progress=None, say=None, on_weights=None) -> Pipeline:
    """Start local stage processes (or reach remote ones) and a head over them.

    progress(stage, done, total, what) follows the loading; say(text) gets what a
    user should read before it (the memory each weight precision needs); on_weights(chosen)
    the precision settled, as a core/precision.Chosen."""
    device = pick_device(cfg.device)        # a GPU that is not there is said before anything starts
    dtype = compute_dtype(device) if cfg.dtype == "auto" else cfg.dtype
    source = resolve(cfg.model)
    # a bad split is reported before any stage process starts
    layers = parse_layers(cfg.layers, source.config().num_hidden_layers) if cfg.layers else None
    local = None
    addrs = list(cfg.stage_addr)
    threads = cfg.threads
    if threads:
        threads, note = asked_threads(threads, os.cpu_count() or 1)
        if note and say is not None:
            say(note)
    cores = None
    # a split given alone says how many stages it has
    n_stages = local_stages(cfg.stages or (len(layers) if layers and not addrs else None), device)
    want = len(addrs) + 1 if addrs else n_stages
    if layers and len(layers) != want:
        # said before any stage process starts (the head says it too, once they had)
        raise ModelError(f"--layers gives {len(layers)} layer range{'s' if len(layers) != 1 else ''} for {want} "
                         "stages: give one range per stage (or leave --stages out)")
    if not addrs and n_stages > 1:
        # Stage processes on one machine split its cores: OpenMP threads that outnumber
        # cores stall each other at every barrier. Unless `threads` fixes it, each
        # process owns its share and borrows idle cores for big steps (engine/model/cores.py).
        local = LocalStages(n_stages - 1, threads=threads, share_cores=not threads, device=device)
        prepared = asyncio.get_running_loop().run_in_executor(None, _prepare_head, source)
        try:
            addrs = await local.start()
        finally:
            # waited for either way: it must not still be importing while the head is built
            done = await asyncio.gather(prepared, return_exceptions=True)
        if isinstance(done[0], BaseException):
            await local.stop()
            raise done[0]
        cores = local.head_cores
        threads = threads or max(1, (os.cpu_count() or 1) // n_stages)
    if threads:
        import torch

        torch.set_num_threads(threads)
    head = Head(source, addrs, layers=layers, micro_batches=cfg.micro_batches, dtype=dtype, device=device,
                kv_budget_tokens=cfg.kv_budget_tokens, progress=progress, link_mode=cfg.link,
                compress=cfg.compress, prefill_chunk=cfg.prompt_chunk, compute=cfg.compute,
                pipeline=cfg.pipeline, cores=cores, cpu_homes=local.homes if cores else None,
                solo_cores=local is None and not threads,
                hop=cfg.hop, weights=cfg.weights, say=say, on_weights=on_weights, same_machine=local is not None,
                memory_cap=None if cfg.memory_cap_mb is None else int(cfg.memory_cap_mb * 2**20),
                wait_timeout=cfg.wait_timeout, speculate=cfg.speculate, draft=cfg.draft,
                keep_replies=cfg.keep_replies)
    try:
        await head.start()
    except BaseException:
        await head.close()  # its connections to the stages and its compute thread
        if local:
            await local.stop()
        raise
    return Pipeline(head, local)
