"""A head that computes alone on its CPU (its stages are friends' machines, or none)
leases this machine's cores (engine/model/cores.py CoreLease.solo): its stage's steps run
on no more threads than other programs leave free, and the lease goes with the pipeline."""

from __future__ import annotations

import os

from engine.core.sampling import SamplingParams


async def test_a_lone_head_leases_its_cores_and_answers_through_them(tiny_folder):
    from engine.pipeline.launch import PipelineConfig, launch

    folder, _ = tiny_folder("llama", seed=0)
    pipe = await launch(PipelineConfig(model=str(folder), stages=1, device="cpu"))
    try:
        head = pipe.head
        lease = head.own_cores
        assert lease is not None and head.stage0.cores is lease and head.cores is None
        directory = lease._own_dir
        head.eos_ids = set()
        handle = head.submit(list(range(5, 15)), SamplingParams(greedy=True, max_tokens=6))
        async for _ in handle:
            pass
        assert len(handle.seq.generated) == 6
    finally:
        await pipe.close()
    assert not os.path.exists(directory)


async def test_a_fixed_thread_count_takes_no_lease(tiny_folder):
    from engine.pipeline.launch import PipelineConfig, launch

    folder, _ = tiny_folder("llama", seed=0)
    pipe = await launch(PipelineConfig(model=str(folder), stages=1, threads=1, device="cpu"))
    try:
        assert pipe.head.own_cores is None and pipe.head.stage0.cores is None
    finally:
        await pipe.close()
