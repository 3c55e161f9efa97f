"""Networking for the GUI: an asyncio loop in a worker thread, talking to widgets only
through Qt signals.

PySide6's QtAsyncio cannot carry aiohttp, so the loop runs in its own thread. Every
result comes back to the GUI thread as a queued signal; widgets are never touched
from the worker. `NodeClient.call()` runs one control-API request and hands the
result to a callback on the GUI thread; `ChatStream` streams one chat completion from
the head's OpenAI-compatible API and can be stopped (closing the HTTP stream makes the
head cancel the sequence and free its KV on every stage).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

from urllib.parse import quote

import aiohttp
from PySide6.QtCore import QObject, Signal, Slot

log = logging.getLogger("potluck.app")

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=15)
# the API's sampling settings a chat sends beside its temperature (engine/core/sampling.py's
# CHAT_DEFAULTS keys; the app does not import the engine)
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty")


class AsyncWorker:
    """One asyncio loop on a daemon thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="potluck-net")
        self.thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def close(self):
        async def shutdown():
            if self._session is not None:
                await self._session.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        try:
            self.submit(shutdown()).result(5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class NodeError(Exception):
    """The node answered with an error (message is the node's, meant for people)."""


class NodeClient(QObject):
    """The node's control API. Callbacks run on the GUI thread: cb(result, error)."""

    _done = Signal(object, object, object)

    def __init__(self, worker: AsyncWorker, parent=None):
        super().__init__(parent)
        self.worker = worker
        self.base: str | None = None
        self.token: str | None = None
        self._done.connect(self._deliver)

    def attach(self, base: str, token: str):
        self.base, self.token = base, token

    @Slot(object, object, object)
    def _deliver(self, cb, result, error):
        if cb is not None:
            cb(result, error)

    async def request(self, method: str, path: str, body: dict | None = None, timeout=CONTROL_TIMEOUT):
        if not self.base:
            raise NodeError("the Potluck engine is not running")
        session = await self.worker.session()
        try:
            async with session.request(method, self.base + path, json=body, timeout=timeout,
                                       headers={"Authorization": f"Bearer {self.token}"}) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    data = None
                if resp.status >= 400:
                    msg = data.get("error") if isinstance(data, dict) else None
                    raise NodeError(msg or f"the engine answered HTTP {resp.status}")
                return data
        except asyncio.TimeoutError:
            raise NodeError("the Potluck engine is not answering") from None
        except aiohttp.ClientConnectionError:
            raise NodeError("cannot reach the Potluck engine") from None

    def call(self, method: str, path: str, body: dict | None = None, cb=None, timeout=CONTROL_TIMEOUT):
        async def run():
            try:
                result = await self.request(method, path, body, timeout)
            except NodeError as exc:
                self._done.emit(cb, None, str(exc))
            except Exception:  # never lose a callback; the log keeps the engine's account
                log.exception("%s %s failed", method, path)
                self._done.emit(cb, None, "Something went wrong talking to the Potluck engine. Try again; if it "
                                          "keeps happening, choose Quit in the Potluck menu and start Potluck again.")
            else:
                self._done.emit(cb, result, None)

        return self.worker.submit(run())


def plain_error(status: int | None, message: str, alone: bool = False) -> str:
    """What the head said, in words for people. `alone`: the message was the chat's
    first, so there is no conversation to blame or to start afresh from. The head's own
    account (a stage's number and address, the pipeline's words) goes to the log."""
    low = message.lower()
    window = re.search(r"'max_(?:completion_)?tokens' is \d+ but the context window is (\d+)", message)
    if window:
        return (f"“Longest reply” is more than the model holds at once ({int(window.group(1)):,} tokens): lower "
                "it, below the chat.")
    if "context window" in low or "context_length" in low:
        sizes = re.search(r"prompt is (\d+) tokens; the context window is (\d+)", message)
        if sizes:
            n, window = (int(x) for x in sizes.groups())
            head = (f"This message is too long for the model: it reads at most {window:,} tokens at once (about "
                    f"{window * 3 // 4:,} words), and ")
            if alone:
                return head + f"this one is {n:,}. Shorten it or split it up."
            return head + f"with the conversation this one is {n:,}. Shorten it, split it up, or start a new chat."
        log.info("the head refused a message: %s", message)
        return ("This message is too long for the model. Shorten it or split it up"
                + ("." if alone else ", or start a new chat."))
    if "kv cache" in low:
        log.info("the head refused a message: %s", message)
        return ("This conversation and its reply need more room than the model has now: lower “Longest reply” "
                "(below the chat)" + (", or shorten the message." if alone else ", or start a new chat."))
    if "out of memory" in low:
        log.info("a step ran out of memory: %s", message)
        return ("The model ran out of memory writing this reply, so it stopped (the other conversations go on). "
                "Try a shorter message or a lower “Longest reply”, or host with smaller weights or with a friend.")
    if "disconnected" in low or "closed" in low or "link to stage" in low:
        log.info("the reply stopped: %s", message)
        return ("A computer running part of the model dropped out, so the reply stopped. Restart hosting from the "
                "Potluck menu (Host a model…) to continue.")
    if status == 503 or "not serving" in low:
        # the head refuses new messages only once it gave up on going on without a computer
        log.info("the head is not serving: %s", message)
        return ("The model stopped: a computer running part of it left and the others could not go on without "
                "it. Host again from the Potluck menu (Host a model…) to continue.")
    if low.startswith("generation failed") or "ws://" in low or "wss://" in low or re.search(r"\bstages? \d", low):
        # a reply that broke off, in the head's words (a stage's number, its address and secret)
        log.info("the reply stopped: %s", message)
        return ("The reply stopped: something went wrong on a computer running part of the model. Send the "
                "message again; if it keeps happening, host again from the Potluck menu (Host a model…).")
    return message


class ChatStream(QObject):
    """One streamed reply. Signals arrive on the GUI thread."""

    delta = Signal(str)
    finished = Signal(dict)   # {finish_reason, ttft, tokens, tokens_per_s, error, seconds}

    def __init__(self, worker: AsyncWorker, url: str, model: str, messages: list[dict],
                 max_tokens: int, temperature: float | None, parent=None, penalties: dict | None = None):
        super().__init__(parent)
        self.worker = worker
        self.url, self.model, self.messages = url, model, messages
        self.max_tokens, self.temperature = max_tokens, temperature
        self.penalties = dict(penalties or {})   # presence_penalty / frequency_penalty, when on
        self.sampling: dict = {}                 # the settings the request named (none: the API's defaults)
        self._future = None
        self._task: asyncio.Task | None = None
        self.stopped = False

    def start(self):
        self._future = self.worker.submit(self._main())

    def stop(self):
        """Close the stream: the head cancels the sequence and frees its KV everywhere."""
        self.stopped = True
        if self._task is not None:
            self.worker.loop.call_soon_threadsafe(self._task.cancel)

    async def _sampling_defaults(self, session) -> dict:
        """The served model's sampling defaults (GET /v1/models/{id}); none when the API
        does not say (then the temperature goes alone, the others neutral)."""
        try:
            async with session.get(f"{self.url.rstrip('/')}/models/{quote(self.model, safe='')}",
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                got = (await resp.json(content_type=None)).get("sampling_defaults") if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return {}
        if not isinstance(got, dict):
            return {}
        return {k: v for k, v in got.items() if k in SAMPLING_FIELDS and isinstance(v, (int, float))
                and not isinstance(v, bool)}

    async def _main(self):
        self._task = asyncio.current_task()
        if self.stopped:
            self.finished.emit({"finish_reason": "cancelled", "ttft": None, "tokens": 0, "tokens_per_s": None,
                                "error": None, "seconds": 0.0})
            return
        t0 = time.perf_counter()
        info = {"finish_reason": None, "ttft": None, "tokens": 0, "tokens_per_s": None, "error": None}
        t_first = None
        chunks = 0
        alone = sum(m.get("role") == "user" for m in self.messages) <= 1   # the chat's first message
        try:
            session = await self.worker.session()
            body = {"model": self.model, "messages": self.messages, "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": self.max_tokens}
            if self.temperature is not None:  # else the model's sampling defaults (the API's)
                # the rest as the model's defaults, as `potluck chat` keeps them: naming the
                # temperature alone would turn the repetition penalty off, and a small model
                # at 0.2 without it loops in four open replies of ten (bench/sampling_defaults.py)
                body.update(await self._sampling_defaults(session))
                body["temperature"] = self.temperature
            self.sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS or k == "temperature"}
            body.update(self.penalties)       # leaves the other settings as they were
            # a conversation that outgrew the model's window goes on without its oldest turns
            # (engine/core/conversation_fit.py); the reply's header says how many were left out
            body["context_overflow"] = "drop_oldest"
            async with session.post(self.url.rstrip("/") + "/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as resp:
                dropped = resp.headers.get("X-Potluck-Dropped-Messages", "0")
                info["dropped"] = int(dropped) if dropped.isdigit() else 0
                if resp.status >= 400:
                    try:
                        err = (await resp.json(content_type=None))["error"]["message"]
                    except Exception:
                        err = f"HTTP {resp.status}"
                    info.update(finish_reason="error", error=plain_error(resp.status, err, alone))
                    return
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        info.update(finish_reason="error",
                                    error=plain_error(None, obj["error"].get("message", ""), alone))
                        continue
                    if obj.get("usage"):
                        info["tokens"] = obj["usage"]["completion_tokens"]
                    for ch in obj.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content")
                        if text:
                            if t_first is None:
                                t_first = time.perf_counter()
                            chunks += 1
                            self.delta.emit(text)
                        if ch.get("finish_reason"):
                            info["finish_reason"] = ch["finish_reason"]
        except asyncio.CancelledError:
            info["finish_reason"] = "cancelled"
        except aiohttp.ClientConnectionError:
            info.update(finish_reason="error",
                        error="No model is running. Host one from the Potluck menu (Host a model…).")
        except Exception:
            log.exception("the reply stream failed")
            info.update(finish_reason="error", error="The reply broke off: the connection to the Potluck engine "
                                                     "was lost. Send the message again; the conversation is kept.")
        finally:
            t1 = time.perf_counter()
            info["tokens"] = info["tokens"] or chunks  # no usage line when stopped: one chunk per token
            if t_first is not None:
                info["ttft"] = t_first - t0
                if info["tokens"] and t1 > t_first and info["tokens"] > 1:
                    info["tokens_per_s"] = (info["tokens"] - 1) / (t1 - t_first)
            info["seconds"] = t1 - t0
            if info["finish_reason"] is None:
                info["finish_reason"] = "cancelled" if self.stopped else "stop"
            self.finished.emit(info)
