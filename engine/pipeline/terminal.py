"""The terminal chat: a client of the head, like the OpenAI API (api.py)."""

from __future__ import annotations

import asyncio
import sys

from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta, Done, Head


def ask(head: Head, messages: list[dict], params: SamplingParams):
    """Submit the conversation; a ValueError says why it cannot be sent."""
    return head.submit(head.chat_prompt(messages), params)


async def reply(handle, echo=None) -> tuple[str, Done]:
    """The answer, streamed to echo(text) as it comes."""
    parts = []
    done = None
    async for ev in handle:
        if isinstance(ev, Delta):
            parts.append(ev.text)
            if echo is not None:
                echo(ev.text)
        else:
            done = ev
    return "".join(parts), done


def _write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


async def chat_loop(head: Head, prompts: list[str] | None, temperature: float, max_tokens: int) -> None:
    """Read messages from stdin (or send `prompts` and stop), print the replies as they
    stream. /reset clears the conversation, /quit leaves."""
    print("Type a message and press Enter. /reset clears the conversation, /quit leaves.\n", file=sys.stderr)
    messages: list[dict] = []
    loop = asyncio.get_running_loop()
    queued = list(prompts or [])
    while True:
        if queued:
            line = queued.pop(0)
            print(f"you> {line}")
        elif prompts:
            break
        else:
            try:
                line = await loop.run_in_executor(None, lambda: input("you> "))
            except EOFError:
                break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            messages.clear()
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": line})
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, greedy=temperature == 0)
        try:
            handle = ask(head, messages, params)
        except ValueError as exc:
            print(f"(cannot send: {exc})")
            messages.pop()
            continue
        sys.stdout.write("bot> ")
        text, done = await reply(handle, echo=_write)
        rate = done.completion_tokens / max(done.seconds - (done.ttft or 0), 1e-6)
        print(f"\n     [{done.completion_tokens} tokens, first after {done.ttft or 0:.2f}s, "
              f"{rate:.1f} tok/s{', ' + done.error if done.error else ''}]")
        messages.append({"role": "assistant", "content": text})
