"""The terminal chat: a client of the head, like the OpenAI API (api.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading

from engine.core.conversation_fit import fitted_prompt
from engine.core.sampling import PENALTIES, SamplingError, SamplingParams, choice_seed
from engine.pipeline.head import Head
from engine.pipeline.requests import CacheTooSmall, Delta, Done


def ask(head: Head, messages: list[dict], params: SamplingParams):
    """Submit the conversation; a ValueError says why it cannot be sent."""
    return head.submit(head.chat_prompt(messages), params)


def ask_fitted(head: Head, messages: list[dict], params: SamplingParams):
    """Submit the conversation, its oldest turns left out where it outgrew the model's
    window (engine/core/conversation_fit.py): (the reply's handle, messages left out)."""
    prompt, dropped = fitted_prompt(head.chat_prompt, messages, head.context_length, params.max_tokens)
    return head.submit(prompt, params), dropped


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


class CtrlCStopsReply:
    """While a reply streams, Ctrl+C stops that reply (what was written stays in the
    conversation) instead of ending the chat; a second Ctrl+C, or one at the prompt,
    leaves as before. Python's own handler, swapped in and back: the event loop's
    add_signal_handler does not exist on Windows."""

    def __init__(self, handle):
        self._handle = handle
        self._loop = asyncio.get_running_loop()
        self._old = None
        self.pressed = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        if self.pressed and callable(self._old):   # again: what Ctrl+C did before
            self._old(signum, frame)
            return
        self.pressed = True
        self._loop.call_soon_threadsafe(self._handle.cancel)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


class LineReader:
    """The chat's lines from stdin, each read on a daemon thread of its own: Ctrl+C at the
    prompt ends the chat at once (read on the loop's default executor, asyncio.run's exit
    waited for that thread, so the chat left only once Enter was pressed). A terminal's
    line goes through input() (line editing; it holds no lock a daemon thread could keep
    at exit); a pipe's is read from the file descriptor itself, for the same reason (a
    thread blocked in sys.stdin's buffer aborts the interpreter's exit). A line that is
    not UTF-8 comes with replacement characters, not as text no tokenizer reads."""

    def __init__(self):
        self.tty = sys.stdin.isatty()
        self._fd = sys.stdin.fileno()
        self._pending = b""
        self._ended = False

    def _raw_line(self) -> str:
        while b"\n" not in self._pending and not self._ended:
            chunk = os.read(self._fd, 65536)
            self._ended = not chunk
            self._pending += chunk
        if not self._pending:
            raise EOFError
        line, _, self._pending = self._pending.partition(b"\n")
        return line.rstrip(b"\r").decode("utf-8", "replace")

    def _read(self, prompt: str) -> str:
        if self.tty:
            return input(prompt).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        sys.stdout.write(prompt)
        sys.stdout.flush()
        return self._raw_line()

    async def line(self, prompt: str) -> str:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def settle(result, error):
            if not answer.done():
                answer.set_exception(error) if error is not None else answer.set_result(result)

        def work():
            try:
                result, error = self._read(prompt), None
            except BaseException as exc:   # EOFError at the input's end, or the read failed
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:   # the chat has ended meanwhile
                pass

        threading.Thread(target=work, name="chat-input", daemon=True).start()
        return await answer


def _write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def describe(sampling: dict) -> str:
    """The settings in words: greedy decoding names only the penalties that shape it, and
    the presence and frequency penalties are named when they are on."""
    rep = sampling["repetition_penalty"]
    if sampling["temperature"] == 0 or sampling["top_p"] == 0:   # top-p 0 keeps the likeliest token alone
        parts = ["greedy"] + ([f"repetition penalty {rep:g}"] if rep != 1.0 else [])
    else:
        top_k = sampling["top_k"] or "off"
        parts = [f"temperature {sampling['temperature']:g}", f"top-p {sampling['top_p']:g}", f"top-k {top_k}",
                 *([f"min-p {sampling['min_p']:g}"] if sampling.get("min_p") else []), f"repetition penalty {rep:g}"]
    parts += [f"{k.replace('_', ' ')} {sampling[k]:g}" for k in PENALTIES if sampling.get(k)]
    return ", ".join(parts)


def set_sampling(sampling: dict, line: str) -> str:
    """`/set NAME VALUE`: change one sampling setting; returns what to tell the user."""
    parts = line.split()
    if len(parts) != 3 or parts[1].replace("-", "_") not in sampling:
        return (f"usage: /set NAME VALUE, NAME one of {', '.join(k.replace('_', '-') for k in sampling)}; "
                f"now: {describe(sampling)}")
    name = parts[1].replace("-", "_")
    try:
        value = int(parts[2]) if name == "top_k" else float(parts[2])
    except ValueError:
        return f"cannot set {parts[1]}: {parts[2]!r} is not a {'whole ' if name == 'top_k' else ''}number"
    try:
        SamplingParams(**{**sampling, name: value}).validate()
    except (ValueError, SamplingError) as exc:   # in the words it was set with: top-p, not top_p
        return f"cannot set {parts[1]}: {str(exc).replace(name, parts[1])}"
    sampling[name] = value
    return f"sampling: {describe(sampling)}"


KNOWN = ("/quit", "/exit", "/reset", "/retry", "/set", "/help", "/?")
COMMANDS = "/reset clears the conversation, /retry draws the last reply again, /set NAME VALUE changes sampling, /quit leaves"


def chat_command(line: str) -> tuple[str, str] | None:
    """('/reset', '') for a line that is a command (its word in lower case, what follows
    it), None for a message: a line not starting with '/', one starting with '//' (the
    escape), or one whose first word is no command's shape ('/usr/bin is a path')."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    word, _, rest = line.partition(" ")
    if not re.fullmatch(r"/\w+|/\?", word):
        return None
    return word.lower(), rest.strip()


def command_refused(word: str, rest: str) -> str | None:
    """Why a command line is not run, or None: an unknown word is a typo, and words after
    a command that takes none were meant as something else ('/reset now' clears nothing
    unasked, '/quit extra' does not quit): either way it is said, never sent to the model."""
    if word not in KNOWN:
        return f"unknown command {word}: {COMMANDS}; start a message with // to send one that begins with /"
    if rest and word in ("/quit", "/exit", "/reset", "/retry"):
        return f"{word} takes nothing after it: type {word} alone, or start a message with // to send it"
    return None


def too_small_words(exc: CacheTooSmall, max_tokens: int, interactive: bool) -> str:
    """A message the cache cannot hold, with the flag that helps: --max-tokens where the
    reply's room is what does not fit, --kv-budget-tokens where the message alone does not
    (a lower --max-tokens cannot help then); /reset only where one can type it."""
    prompt = exc.need - max_tokens
    if prompt >= exc.capacity:
        fix = (f"the conversation alone is {prompt} tokens: start the chat with a larger --kv-budget-tokens "
               "(or without it: what memory holds)")
    else:
        fix = f"start the chat with --max-tokens {exc.capacity - prompt} or lower"
    return (f"this request needs {exc.need} tokens of KV cache but the pipeline holds at most {exc.capacity}; "
            + fix + (", or /reset to shorten the conversation" if interactive else ""))


async def chat_loop(head: Head, prompts: list[str] | None, max_tokens: int, sampling: dict | None = None,
                    seed: int | None = None) -> int:
    """Read messages from stdin (or send `prompts` and stop), print the replies as they
    stream. /reset clears the conversation, /retry draws the last reply again, /set
    changes sampling, /quit leaves.
    sampling: what the user chose (None: the head's defaults, as the API gives).
    Returns how many messages could not be sent or answered (a script's `--prompt` then
    exits non-zero)."""
    settings = {**head.sampling_defaults, **{k: 0.0 for k in PENALTIES},
                **{k: v for k, v in (sampling or {}).items() if v is not None}}
    print(f"Sampling: {describe(settings)}." + ("" if prompts else
          "\nType a message and press Enter. /reset clears the conversation, "
          "/retry draws the last reply again, /set temperature 0.2 (or top-p, top-k, min-p, repetition-penalty, "
          "presence-penalty, frequency-penalty) changes sampling, Ctrl+C stops a reply, /quit leaves.\n"),
          file=sys.stderr)
    if max_tokens > head.context_length:
        # taken, as the API does not (it refuses the request): a terminal user meant "long"
        print(f"(--max-tokens {max_tokens} is more than the model reads at once, {head.context_length} tokens: "
              f"a reply stops where the conversation fills that)", file=sys.stderr)
    # read from a pipe or file: the line is not echoed by a terminal, so it is written here
    echo_input = not prompts and not sys.stdin.isatty()
    messages: list[dict] = []
    shown_dropped = 0    # messages the model no longer sees, as last said
    retries = 0          # times the last reply was drawn again
    unsent = 0
    queued = list(prompts or [])
    reader = None if prompts else LineReader()
    while True:
        if queued:
            line = queued.pop(0)
            print(f"you> {line}")
        elif prompts:
            break
        else:
            try:
                line = await reader.line("you> ")
            except EOFError:
                print()     # the shell's prompt on a line of its own (Ctrl+D, or the input's end)
                break
            if echo_input:
                print(line)
        line = line.strip()
        if not line:
            if prompts:   # a script's --prompt "": said, and heard in the exit status
                print("(an empty message: nothing sent)")
                unsent += 1
            continue
        command = chat_command(line)
        word, rest = command or ("", "")
        if command and (refused := command_refused(word, rest)):
            print(f"({refused})")
            continue
        if word in ("/quit", "/exit"):
            break
        if word == "/reset":
            messages.clear()
            shown_dropped = 0
            print("(conversation cleared)")
            continue
        if word == "/set":
            print(f"({set_sampling(settings, line)})")
            continue
        if word in ("/help", "/?"):
            print(f"({COMMANDS}; start a message with // to send one that begins with /)")
            continue
        if line.startswith("//"):
            line = line[1:]
        retried = None
        if word == "/retry":   # the last reply out, the conversation before it sent again
            if not messages or messages[-1]["role"] != "assistant":
                print("(no reply to draw again yet)")
                continue
            if describe(settings).startswith("greedy"):
                print("(greedy sampling draws the same reply again: /set temperature 0.7 to draw another)")
            retried = messages.pop()
            retries += 1
        else:
            messages.append({"role": "user", "content": line})
            retries = 0
        # a seeded reply drawn again draws other numbers, as a request's next choice does
        draw_seed = seed if seed is None or not retries else choice_seed(seed, retries)
        params = SamplingParams(**settings, max_tokens=max_tokens, seed=draw_seed)
        try:
            handle, dropped = ask_fitted(head, messages, params)
            if dropped > shown_dropped:
                print(f"(the conversation has outgrown what the model reads at once: it no longer sees the "
                      f"first {dropped} message{'s' if dropped != 1 else ''}; /reset starts afresh)")
            shown_dropped = dropped
        except ValueError as exc:
            # the API's words ("lower max_tokens or n") are not the terminal's
            why = too_small_words(exc, max_tokens, interactive=not prompts) if isinstance(exc, CacheTooSmall) else exc
            print(f"(cannot send: {why})")
            unsent += 1
            if retried is not None:
                messages.append(retried)
            else:
                messages.pop()
            continue
        sys.stdout.write("bot> ")
        with CtrlCStopsReply(handle) as ctrl_c:
            text, done = await reply(handle, echo=_write)
        rate = done.completion_tokens / max(done.seconds - (done.ttft or 0), 1e-6)
        stopped = ", stopped" if ctrl_c.pressed and done.finish_reason == "cancelled" else ""
        if done.finish_reason == "length" and done.completion_tokens < max_tokens:
            stopped = ", stopped where the conversation filled what the model reads at once"
        print(f"\n     [{done.completion_tokens} tokens, first after {done.ttft or 0:.2f}s, "
              f"{rate:.1f} tok/s{', ' + done.error if done.error else ''}{stopped}]"
              + (f" {spec}" if (spec := head.speculation()["summary"]) else ""))
        messages.append({"role": "assistant", "content": text})
        unsent += bool(done.error)
    return unsent
