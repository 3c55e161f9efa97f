"""The chat window's temperature goes with the model's other sampling defaults
(app/client.py ChatStream): naming the temperature alone would leave the API's others
neutral, the repetition penalty off. Against a real API (engine/pipeline/api.py) over a
real socket, serving a tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtCore", reason="Qt's system libraries are missing: run `make qt-libs`")


def test_the_app_sends_the_fields_the_api_defaults_to():
    from app.client import SAMPLING_FIELDS
    from engine.core.sampling import TUNABLE

    assert set(SAMPLING_FIELDS) == set(TUNABLE) - {"temperature"}


async def test_a_temperature_set_in_the_app_keeps_the_models_other_defaults(tiny_chat_folder):
    import asyncio

    import aiohttp
    from PySide6.QtCore import Qt

    from app.client import AsyncWorker, ChatStream
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import PipelineConfig, launch

    pipe = await launch(PipelineConfig(model=str(tiny_chat_folder), stages=1, threads=1, device="cpu"))
    pipe.head.source.name = "tiny-org/tiny-chat"    # named as a hub model is: its id holds a slash
    runner = await serve_api(pipe.head, "127.0.0.1", 0)
    worker = AsyncWorker()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/models/{pipe.head.source.name}") as resp:
                said = (await resp.json())["sampling_defaults"]
        assert said == pipe.head.sampling_defaults
        convo = [{"role": "user", "content": "hi"}]
        for temperature, want in ((0.3, {**said, "temperature": 0.3}), (None, {})):
            stream = ChatStream(worker, url, pipe.head.source.name, convo, 4, temperature)
            done = []
            stream.finished.connect(done.append, Qt.DirectConnection)   # no Qt event loop here
            stream.start()
            await asyncio.wrap_future(stream._future)
            assert stream.sampling == want, temperature
            assert done and done[0]["error"] is None and done[0]["tokens"] > 0, done
    finally:
        worker.close()
        await runner.cleanup()
        await pipe.close()
