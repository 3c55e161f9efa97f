"""Turns of a chat, behind the real API over real sockets, on a tiny model with a
256-token window and the default model's tokenizer.

A conversation that outgrows the window (engine/core/conversation_fit.py): refused by
default, as OpenAI's API refuses it; with `context_overflow: "drop_oldest"` (what the
chat window sends) and in `potluck chat`, its oldest turns are left out and the user is
told. And a reply drawn again (`/retry` in `potluck chat`)."""

from __future__ import annotations

import aiohttp
import pytest

from engine.core.conversation_fit import prompt_budget

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def served(tiny_chat_folder):
    from engine.pipeline.api import serve_api
    from engine.pipeline.launch import PipelineConfig, launch

    pipe = await launch(PipelineConfig(model=str(tiny_chat_folder), stages=1, threads=1, device="cpu"))
    pipe.head.eos_ids = set()
    runner = await serve_api(pipe.head, "127.0.0.1", 0)
    try:
        yield pipe.head, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()
        await pipe.close()


def conversation(turns: int) -> list[dict]:
    msgs = []
    for i in range(turns):    # ~30 tokens a turn
        msgs += [{"role": "user", "content": f"Note {i}: " + "apples " * 20}, {"role": "assistant", "content": "Noted."}]
    return msgs + [{"role": "user", "content": "What is the capital of France?"}]


async def test_the_api_leaves_out_the_oldest_turns_only_when_asked(served):
    head, url = served
    msgs = conversation(12)
    assert len(head.chat_prompt(msgs)) > head.context_length
    body = {"model": head.source.name, "messages": msgs, "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/chat/completions", json=body) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        async with s.post(url + "/chat/completions", json={**body, "context_overflow": "drop_oldest"}) as r:
            assert r.status == 200, await r.text()
            dropped, out = int(r.headers["X-Potluck-Dropped-Messages"]), await r.json()
        budget = prompt_budget(head.context_length, 8)
        assert dropped % 2 == 0 and 0 < dropped < len(msgs) - 1
        assert out["usage"]["prompt_tokens"] == len(head.chat_prompt(msgs[dropped:])) <= budget
        assert len(head.chat_prompt(msgs[dropped - 2:])) > budget          # no more left out than needed
        assert out["usage"]["completion_tokens"] == 8
        stream = {**body, "stream": True, "context_overflow": "drop_oldest"}
        async with s.post(url + "/chat/completions", json=stream) as r:
            assert r.status == 200 and r.headers["X-Potluck-Dropped-Messages"] == str(dropped)
            assert (await r.read()).rstrip().endswith(b"[DONE]")
        short = {**body, "messages": conversation(1), "context_overflow": "drop_oldest"}
        async with s.post(url + "/chat/completions", json=short) as r:
            assert r.status == 200 and "X-Potluck-Dropped-Messages" not in r.headers
        alone = [*msgs[:-1], {"role": "user", "content": "pears " * 400}]    # the newest turn alone overflows
        async with s.post(url + "/chat/completions", json={**body, "messages": alone,
                                                           "context_overflow": "drop_oldest"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        async with s.post(url + "/chat/completions", json={**body, "context_overflow": "wrap"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "context_overflow"


async def test_the_terminal_chat_goes_on_and_says_what_the_model_no_longer_sees(served, capsys):
    from engine.pipeline.terminal import chat_loop

    head, _ = served
    prompts = [f"Note {i}: " + "apples " * 20 for i in range(10)]
    await chat_loop(head, prompts, 8, sampling={"temperature": 0.0})
    out = capsys.readouterr().out
    assert out.count("bot> ") == 10 and "cannot send" not in out
    assert "it no longer sees the first" in out and "/reset" in out


async def test_the_chat_window_asks_for_it_and_hears_how_many(served):
    import asyncio

    pytest.importorskip("PySide6.QtCore", reason="Qt's system libraries are missing: run `make qt-libs`")
    from PySide6.QtCore import Qt

    from app.client import AsyncWorker, ChatStream

    head, url = served
    worker = AsyncWorker()
    try:
        for msgs, want in ((conversation(12), True), (conversation(1), False)):
            stream = ChatStream(worker, url, head.source.name, msgs, 8, None)
            done = []
            stream.finished.connect(done.append, Qt.DirectConnection)   # no Qt event loop here
            stream.start()
            await asyncio.wrap_future(stream._future)
            assert done and done[0]["error"] is None and done[0]["tokens"] > 0, done
            assert (done[0]["dropped"] > 0) == want
    finally:
        worker.close()


async def test_the_terminal_chat_draws_the_last_reply_again(served, capsys):
    """/retry sends the conversation before the last reply: greedy, the same reply comes
    back (it would not, were the old reply still in what is sent)."""
    from engine.pipeline.terminal import chat_loop

    head, _ = served
    def replies(out: str) -> list[str]:
        return [line.split("bot> ", 1)[1] for line in out.splitlines() if line.startswith("bot> ")]

    await chat_loop(head, ["/retry", "Name three fruits.", "/retry", "/retry"], 12, sampling={"temperature": 0.0})
    out = capsys.readouterr().out
    assert "no reply to draw again yet" in out
    got = replies(out)
    assert len(got) == 3 and got[0] and len(set(got)) == 1, got
    # seeded and sampled: a retry draws other numbers (the same seed would give the same reply)
    await chat_loop(head, ["Name three fruits.", "/retry", "/retry"], 12, sampling={"temperature": 1.5}, seed=7)
    got = replies(capsys.readouterr().out)
    assert len(got) == 3 and len(set(got)) == 3, got


async def test_the_terminal_chat_says_a_longest_reply_past_the_window_stops_at_it(served, capsys):
    """The API refuses a max_tokens past the window; the terminal takes it (the user
    meant "long") and says where a reply stops: there, not one token later."""
    from engine.pipeline.terminal import chat_loop

    head, _ = served
    await chat_loop(head, ["Hi"], head.context_length + 100, sampling={"temperature": 0.0})
    out = capsys.readouterr()
    assert f"--max-tokens {head.context_length + 100} is more than the model reads at once" in out.err
    prompt = len(head.chat_prompt([{"role": "user", "content": "Hi"}]))
    line = out.out.rsplit("[", 1)[1]
    assert line.startswith(f"{head.context_length - prompt} tokens,") and "filled what the model reads" in line, line
