"""OpenAI-compatible HTTP API on the head (aiohttp).

POST /v1/chat/completions, POST /v1/completions (streaming SSE or not; a list of
prompts gives n choices each), GET /v1/models[/{id}], and GET /v1/potluck/status for
the app. `presence_penalty` and `frequency_penalty` (OpenAI's, -2..2) shape each
choice's logits by the tokens it generated (the last stage's sampler, engine/model/
sampler.py). A prompt's `n` choices share its prefill; `logprobs` (and chat's
`top_logprobs`) come from the last stage, in OpenAI's shapes; `response_format`
(json_object, json_schema) holds the reply to a JSON schema by a token mask on the last
stage (engine/model/grammar.py); `tools` are rendered by the chat template (or explained
in the system message where it knows none) and the reply's calls read back as
`tool_calls` (engine/core/tool_calls.py), a required or named call forced by the same
schema mask. Errors use OpenAI's shape: {"error": {"message",
"type", "param", "code"}}.

Bound to loopback unless told otherwise; beyond loopback an API key is required
(`Authorization: Bearer <key>`, 401 without it). A field OpenAI defines that this server
does not implement yet is refused with a 400 naming it (a client relying on it would
otherwise get a plausible but wrong answer); fields nobody defines are ignored, as
OpenAI-compatible servers do.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import ssl
import time
import uuid

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from engine.pipeline.api_cors import Cors
from engine.pipeline.api_errors import ApiError
from engine.pipeline.api_errors import field as _field
from engine.pipeline.api_errors import number as _number
from engine.pipeline.api_messages import chat_messages
from engine.pipeline.api_replies import Reply, Tools, usage
from engine.pipeline.head import Head
from engine.pipeline.requests import Delta, Done, PipelineError
from engine.core.sampling import (MAX_CHOICES, MAX_SCHEMA_CHARS, MAX_TOP_LOGPROBS, PENALTIES, SWITCHING,
                                  SamplingError, SamplingParams)
from engine.core.conversation_fit import OVERFLOW_CHOICES, fitted_prompt
from engine.core.tool_calls import StreamSplitter, ToolError, check_tools, forced_call_schema
from engine.model.detok import TokenPieces
from engine.model.grammar import compile_schema, schema_of
from engine.model.sources import DEFAULT_HUB_ID, DEFAULT_MODEL
from engine.wire.quiet_http import quiet_bad_requests

log = logging.getLogger("potluck.api")

MAX_BODY = 8 << 20
# A client that opens connections and never finishes a request would otherwise hold
# each for aiohttp's hour: headers must be in within IDLE_SECONDS of the connection
# (or of its last reply), a body within BODY_SECONDS of its headers.
IDLE_SECONDS = 75.0
BODY_SECONDS = 60.0
DEFAULT_MAX_TOKENS = 256
MAX_PROMPTS = 64   # per /v1/completions request
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


# an SSE comment after this long without a token: the pipeline may be rearranging after
# a friend's machine left, and clients and proxies drop streams silent for ~30-60 s
KEEPALIVE_S = 10.0

# fields OpenAI defines that are not implemented yet -> the value that asks for nothing
# (sent by some clients as a matter of course, and accepted); anything else is a 400
# naming the field: a reply without the audio, or at the speed, they asked for would
# look like an answer to their request
NOT_YET = {"functions": ([], None), "function_call": ("none", None), "logit_bias": ({}, None),
           "best_of": (1, None), "echo": (False, None), "suffix": ("", None),
           "modalities": (["text"], None), "audio": (None,), "prediction": (None,)}



async def _request_id(request, response):
    """Every answer names itself as OpenAI's do (x-request-id): the clients keep it on each
    result (`_request_id`) for a user's bug report and their logs, and it was None here."""
    response.headers.setdefault("x-request-id", "req_" + uuid.uuid4().hex)

class Api:
    def __init__(self, head: Head, api_key: str | None = None, body_seconds: float = BODY_SECONDS):
        self.head = head
        self.body_seconds = body_seconds
        self.names = {head.source.name, head.source.spec, "default", "potluck"}
        if head.source.spec == DEFAULT_MODEL:
            self.names.add(DEFAULT_HUB_ID)
        self.api_key = api_key
        self.created = int(time.time())   # the model's "created": when this server took it up
        self.pieces = TokenPieces(head.tokenizer)   # token ids -> the text and bytes logprobs report

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors, self._auth])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)   # a hub id holds a slash
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/potluck/status", self.status)
        app.router.add_get("/", self.root)
        app.on_response_prepare.append(_request_id)
        return app

    async def root(self, request):
        """A person who opens the address in a browser learns what is here (a bare
        "Not Found" read as a broken server)."""
        return web.json_response({"object": "potluck", "message": "Potluck's OpenAI-compatible API: point a "
                                  "client's base URL at /v1 (GET /v1/models lists the model)",
                                  "base_url": "/v1", "model": self.head.source.name})

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status >= 400:
                reason = (f"the request body is larger than this API takes ({MAX_BODY >> 20} MiB)"
                          if isinstance(exc, web.HTTPRequestEntityTooLarge) else
                          f"no endpoint {request.method} {request.path[:200]}: this API serves POST "
                          "/v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, "
                          "GET /v1/potluck/status and GET /"
                          if isinstance(exc, web.HTTPNotFound) else exc.reason)
                resp = ApiError(reason, code=str(exc.status), status=exc.status).response()
                if isinstance(exc, web.HTTPMethodNotAllowed):   # HTTP asks a 405 to say what is allowed
                    resp.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
                return resp
            raise
        except Exception:
            # a request no check foresaw: said once in the log, answered in OpenAI's shape
            # (a client reads its message), and the server carries on
            log.exception("request %s %s failed", request.method, request.path)
            return ApiError("the server failed on this request (its log says why)", type_="server_error",
                            status=500).response()

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key is not None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            # a header's bytes that are not UTF-8 arrive as surrogates: compared as the bytes they were
            if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.api_key.encode()):
                raise ApiError("Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key "
                               "this server was started with", code="invalid_api_key", status=401)
        return await handler(request)

    # ---- endpoints ----------------------------------------------------------
    def _model_object(self) -> dict:
        # sampling_defaults: what a request that names no sampling field gets; a client that
        # changes one setting (the app's temperature) sends the rest from here, as the
        # terminal chat keeps them (one naming any gets the others neutral, as OpenAI's does)
        return {"id": self.head.source.name, "object": "model", "created": self.created, "owned_by": "potluck",
                "sampling_defaults": dict(self.head.sampling_defaults)}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request):
        name = request.match_info["model"]
        if name not in self.names:
            raise ApiError(f"The model '{name}' does not exist; this server serves '{self.head.source.name}'",
                           param="model", code="model_not_found", status=404)
        return web.json_response(self._model_object())

    async def status(self, request):
        return web.json_response(self.head.info())

    async def chat(self, request):
        body = await self._body(request)
        if body.get("messages") is None:
            raise ApiError("'messages' is required: a list of {role, content}", param="messages",
                           code="missing_required_parameter")
        messages = _field(body, "messages", list, allow_none=False)
        if not messages:
            raise ApiError("'messages' must not be empty", param="messages")
        fns, tool_choice = self._tools(body)
        clean = chat_messages(messages)
        overflow = _field(body, "context_overflow", str, "error")
        if overflow not in OVERFLOW_CHOICES:
            raise ApiError(f"'context_overflow' must be one of {', '.join(OVERFLOW_CHOICES)}",
                           param="context_overflow", code="invalid_value")
        listed = fns if tool_choice != "none" else None
        dropped = 0
        try:
            # templating and tokenizing take seconds for a body of megabytes: on a thread,
            # so the replies streaming meanwhile (and every other request) go on
            if overflow == "drop_oldest":
                # the oldest turns left out where the window would overflow; the reply's
                # X-Potluck-Dropped-Messages header says how many
                prompt, dropped = await asyncio.to_thread(
                    fitted_prompt, lambda ms: self.head.chat_prompt(ms, tools=listed), clean,
                    self.head.context_length, self._max_tokens(body))
            else:
                prompt = await asyncio.to_thread(self.head.chat_prompt, clean, tools=listed)
        except Exception as exc:  # a template that refuses this conversation
            raise ApiError(f"the chat template rejected these messages: {exc}", param="messages") from None
        tools = None
        if tool_choice != "none":
            forced = None
            if tool_choice != "auto":   # required, or a named function: decoding makes a call
                if body.get("response_format") not in (None, {"type": "text"}):
                    raise ApiError("a required tool call and response_format cannot be combined",
                                   param="tool_choice", code="invalid_value")
                try:
                    forced = json.dumps(forced_call_schema(fns, tool_choice))
                except (ValueError, RecursionError):
                    raise ApiError("a function's parameters are not a JSON schema this server can read",
                                   param="tools", code="invalid_value") from None
            parallel = _field(body, "parallel_tool_calls", bool, True)
            tools = Tools({f["name"] for f in fns}, forced, parallel)
        return await self._generate(request, body, [prompt], chat=True, tools=tools,
                                    headers={"X-Potluck-Dropped-Messages": str(dropped)} if dropped else None)

    @staticmethod
    def _tools(body: dict) -> tuple[list[dict], str]:
        try:
            return check_tools(body.get("tools"), body.get("tool_choice"))
        except ToolError as exc:
            param = "tool_choice" if "tool_choice" in str(exc) else "tools"
            raise ApiError(str(exc), param=param, code="invalid_value") from None

    async def completions(self, request):
        body = await self._body(request)
        prompt = body.get("prompt")
        # one prompt (a string, or token ids) or a list of them: one choice each
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and
                                                                                  _is_ids(p)) for p in prompt):
            prompts = prompt
        else:
            raise ApiError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        vocab = self.head.config.vocab_size
        if any(not isinstance(p, str) and any(not (0 <= t < vocab) for t in p) for p in prompts):
            raise ApiError("prompt token ids must be within the vocabulary", param="prompt")

        def tokenized() -> list[list[int]]:   # on a thread, as a chat's template is
            return [list(self.head.tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str)
                    else list(p) for p in prompts]

        ids = await asyncio.to_thread(tokenized)
        if not all(ids):   # "" where the model adds no beginning-of-text token: nothing to go on from
            raise ApiError("'prompt' is empty: give it some text", param="prompt")
        return await self._generate(request, body, ids, chat=False)

    # ---- shared -------------------------------------------------------------
    async def _body(self, request) -> dict:
        try:
            async with asyncio.timeout(self.body_seconds):
                body = await request.json()
        except TimeoutError:
            raise ApiError(f"the request body did not arrive within {self.body_seconds:g} s",
                           code="request_timeout", status=408) from None
        except LookupError:   # Content-Type names a charset Python does not know
            raise ApiError(f"the request's charset '{request.charset}' is unknown: send UTF-8 JSON",
                           code="invalid_json") from None
        except RequestPayloadError as exc:   # a Content-Encoding its body does not decode by
            raise ApiError(f"the request body could not be read: {exc}", code="invalid_body") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError("the request body is not valid JSON", code="invalid_json") from None
        except ValueError:   # Python reads no integer of more than 4300 digits; no field takes one
            raise ApiError("the request body is not valid JSON, or holds a number too long to read",
                           code="invalid_json") from None
        except RecursionError:  # valid JSON nested deeper than the parser goes: no request needs it
            raise ApiError("the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object", code="invalid_json")
        try:
            # JSON may escape half of a UTF-16 pair ("\\ud800"): text no tokenizer can read
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError("the request holds text that is not valid Unicode (half of a surrogate pair)",
                           code="invalid_value") from None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError("'model' must be a string", param="model", code="invalid_type")
        if model is not None and model not in self.names:
            raise ApiError(f"The model '{model}' does not exist; this server serves '{self.head.source.name}'",
                           param="model", code="model_not_found", status=404)
        for name, fine in NOT_YET.items():
            if name in body and body[name] not in fine:
                raise ApiError(f"'{name}' is not supported by this server yet", param=name, code="unsupported")
        return body

    @staticmethod
    def _max_tokens(body: dict) -> int:
        """What a request asks its reply to hold at most, for sizing: the default when it
        names none or names it wrongly (_params says what is wrong)."""
        v = body.get("max_completion_tokens")
        if v is None:
            v = body.get("max_tokens")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else DEFAULT_MAX_TOKENS

    def _params(self, body: dict) -> SamplingParams:
        name = "max_completion_tokens"
        max_tokens = body.get(name)
        old = body.get("max_tokens")
        if max_tokens is not None and old is not None and old != max_tokens:
            # OpenAI's refusal too; the same number under both names (some clients send
            # it so, for servers that know one name only) is one request
            raise ApiError("Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported "
                           "(unless they are equal)", param="max_tokens", code="invalid_parameter_combination")
        if max_tokens is None:  # absent or null: the older name
            name = "max_tokens"
            max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise ApiError(f"'{name}' must be an integer", param=name, code="invalid_type")
        if max_tokens < 1:
            raise ApiError(f"'{name}' must be at least 1", param=name, code="invalid_value")
        if max_tokens > self.head.context_length:
            raise ApiError(f"'{name}' is {max_tokens} but the context window is {self.head.context_length}",
                           param=name, code="invalid_value")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
        # A request that names no sampling field gets the model's defaults (its
        # generation_config), else ours for chat (core/sampling.py), as the chat window and
        # `potluck chat` do; one that names any of SWITCHING gets exactly what it names
        # (temperature 0 stays plain greedy decoding), the others neutral. The chat window
        # names them all (GET /v1/models/{id}'s sampling_defaults beside its temperature),
        # so its temperature 0 keeps the repetition penalty, as `potluck chat`'s does. min_p
        # and the presence and frequency penalties change none of the others when named
        # (front-ends send them as a matter of course, often as 0): min_p is the model's
        # own unless named, the penalties 0.
        d = NEUTRAL if any(body.get(k) is not None for k in SWITCHING) else self.head.sampling_defaults
        try:
            p = SamplingParams(
                temperature=_number(body, "temperature", d["temperature"]),
                top_p=_number(body, "top_p", d["top_p"]),
                top_k=_field(body, "top_k", int, d["top_k"]),
                min_p=_number(body, "min_p", self.head.sampling_defaults["min_p"]),
                repetition_penalty=_number(body, "repetition_penalty", d["repetition_penalty"]),
                **{k: _number(body, k, 0.0) for k in PENALTIES},
                seed=_field(body, "seed", int, None),
                max_tokens=max_tokens,
                stop=[s for s in (stop or []) if s],
            )
            p.validate()
        except SamplingError as exc:
            raise ApiError(str(exc), param=exc.param, code="invalid_value") from None
        return p

    async def _generate(self, request, body, prompts: list[list[int]], chat: bool, tools: "Tools | None" = None,
                        headers: dict | None = None):
        """Every prompt's n choices (choice index: prompt * n + j), submitted at once so
        they batch together; a prompt's choices share its prefill (Head.submit_n).
        tools: a chat request's functions, whose calls are read back out of the reply."""
        n, k = self._choices(body, chat)
        if tools is not None and tools.forced:
            schema = self._compiled(tools.forced, "tools")
        else:
            schema = self._schema(body)
        if len(prompts) * n > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} choices per request (prompts times n)", param="n",
                           code="invalid_value")
        stream = _field(body, "stream", bool, False)
        opts = _field(body, "stream_options", dict, {}) or {}
        if body.get("stream_options") is not None and not stream:
            raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options",
                           code="invalid_value")
        include_usage = _field(opts, "include_usage", bool, False)
        for p in prompts:
            if len(p) >= self.head.context_length:
                raise ApiError(f"the prompt is {len(p)} tokens; the context window is {self.head.context_length}",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        handles = []
        try:
            for p in prompts:
                params = self._params(body)   # per prompt: the head trims max_tokens to its window
                params.logprobs, params.top_logprobs = k is not None, k or 0
                params.json_schema = schema
                handles.extend(self._submit(p, params, n))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        prompt_tokens = sum(len(p) for p in prompts)
        reply = Reply(self.head.source.name, self.pieces, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                      chat, k, tools)
        try:
            if stream:
                return await self._stream(request, handles, reply, prompt_tokens, include_usage, headers)
            results = await asyncio.gather(*(_collect(h) for h in handles))
        except BaseException:  # the client went away (handler cancellation), or a choice failed
            for h in handles:
                h.cancel()
            raise
        choices = []
        for i, (text, done, lps) in enumerate(results):
            if done.finish_reason == "error":
                raise ApiError(f"generation failed: {done.error}", status=500, type_="server_error")
            choices.append(reply.choice(i, text, done.finish_reason, lps))   # (its tool calls, if any)
        return web.json_response({**reply.envelope(final=True), "choices": choices,
                                  "usage": usage(prompt_tokens, [d for _, d, _ in results])}, headers=headers)

    def _choices(self, body: dict, chat: bool) -> tuple[int, int | None]:
        """n, and how many top tokens each token's logprobs lists (None: no logprobs).
        Chat asks with logprobs: true and top_logprobs: 0..20; completions with
        logprobs: 0..20 (the legacy field is the count)."""
        n = _field(body, "n", int, 1)
        if not 1 <= n <= MAX_CHOICES:
            raise ApiError(f"'n' must be between 1 and {MAX_CHOICES}", param="n", code="invalid_value")
        if chat:
            want = _field(body, "logprobs", bool, False)
            top = _field(body, "top_logprobs", int, None)
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ApiError(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs",
                               code="invalid_value")
            if top and not want:
                raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
            return n, (top or 0) if want else None
        if body.get("logprobs") is False:   # what some clients send for "none"
            return n, None
        k = _field(body, "logprobs", int, None)
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs",
                           code="invalid_value")
        return n, k

    @classmethod
    def _schema(cls, body: dict) -> str | None:
        """response_format as the JSON schema the last stage holds the reply to (JSON
        text), checked here: a schema llguidance cannot compile is the client's 400."""
        try:
            schema = schema_of(body.get("response_format"))
        except (ValueError, RecursionError) as exc:
            msg = "the JSON schema is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ApiError(msg, param="response_format", code="invalid_value") from None
        return None if schema is None else cls._compiled(schema, "response_format")

    @staticmethod
    def _compiled(schema: str, param: str) -> str:
        """schema, once llguidance has compiled it (a forced tool call's schema holds the
        request's function parameters: the client's 400 too when it cannot)."""
        try:
            if len(schema) > MAX_SCHEMA_CHARS:
                raise ValueError(f"the JSON schema is {len(schema)} characters; at most {MAX_SCHEMA_CHARS}")
            compile_schema(schema)
        except (ValueError, RecursionError) as exc:   # grammar.GrammarError is a ValueError
            msg = "the JSON schema is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ApiError(msg, param=param, code="invalid_value") from None
        return schema

    def _submit(self, prompt: list[int], params: SamplingParams, n: int = 1):
        try:
            return self.head.submit_n(prompt, params, n)
        except PipelineError as exc:
            raise ApiError(f"the pipeline is not serving: {exc}", status=503, type_="server_error") from None
        except ValueError as exc:
            raise ApiError(str(exc), code="invalid_value") from None

    async def _stream(self, request, handles, reply: Reply, prompt_tokens: int, include_usage: bool,
                      headers: dict | None = None):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **(headers or {})})
        await resp.prepare(request)

        async def send(obj_):
            if include_usage and "choices" in obj_:
                obj_.setdefault("usage", None)   # as OpenAI's: every chunk but the last has usage null
            await resp.write(b"data: " + json.dumps(obj_).encode() + b"\n\n")

        # each choice's events into one queue, tagged with its index: chunks go out in the
        # order the tokens arrive, whichever choice they belong to
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            while True:
                ev = await h.next_event(None)
                events.put_nowait((i, ev))
                if isinstance(ev, Done):
                    return

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        # with tools, a call is held back until it is complete, then sent as tool_calls
        splitters = [StreamSplitter(reply.tools.names) if reply.tools else None for _ in handles]
        offsets = [0] * len(handles)   # characters each choice has streamed (text_offset)
        dones: list[Done] = []
        try:
            if reply.chat:
                for i in range(len(handles)):
                    await send(reply.chunk(i, first=True))
            while len(dones) < len(handles):
                try:
                    i, ev = await asyncio.wait_for(events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    # nothing to say yet (the pipeline rearranging after a friend left, a
                    # long prompt): an SSE comment keeps clients and proxies from timing out
                    await resp.write(b": keep-alive\n\n")
                    continue
                if isinstance(ev, Delta):
                    lps = [(lp, offsets[i]) for lp in ev.logprobs or ()] if reply.k is not None else []
                    text = splitters[i].feed(ev.text) if splitters[i] else ev.text
                    if text or lps:
                        await send(reply.chunk(i, text, lps=lps))
                    offsets[i] += len(ev.text)
                    continue
                dones.append(ev)
                if ev.finish_reason == "error":
                    await send({"error": {"message": f"generation failed: {ev.error}", "type": "server_error",
                                          "param": None, "code": None}})
                    for h in handles:
                        h.cancel()   # the other choices of a reply that failed
                    break
                finish = ev.finish_reason
                if splitters[i] is not None:
                    rest, calls = splitters[i].finish()
                    calls = reply.tools.kept(calls)
                    cut = reply.tools.cut(rest, finish) if not calls else None
                    if cut is not None:      # a forced call cut short: a call still, not text
                        rest, calls = "", [cut]
                    if rest:
                        await send(reply.chunk(i, rest))
                    if calls:
                        await send(reply.chunk(i, calls=calls))
                        finish = "tool_calls" if cut is None else finish
                await send(reply.chunk(i, finish=finish))
            if include_usage:
                await send({**reply.envelope(), "choices": [], "usage": usage(prompt_tokens, dones)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except asyncio.CancelledError:
            for h in handles:
                h.cancel()  # the client went away (handler cancellation)
            raise
        except ConnectionResetError:
            # the client went away and a write noticed first: nobody to answer, nothing
            # to log; aiohttp treats the closed transport as a finished response
            for h in handles:
                h.cancel()
        finally:
            for t in pumps:
                t.cancel()
        return resp


async def _collect(handle) -> tuple[str, Done, list]:
    """A choice's whole text, its Done, and each token's logprobs with the text offset
    where that token's text starts."""
    parts, lps, length = [], [], 0
    async for ev in handle:
        if isinstance(ev, Done):
            return "".join(parts), ev, lps
        lps.extend((lp, length) for lp in ev.logprobs or ())
        parts.append(ev.text)
        length += len(ev.text)
    raise PipelineError("stream ended without a result")


def _is_ids(p: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("0.0.0.0", "::"): beyond this machine


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context from a PEM certificate (chain) and its key, for an API reached
    beyond the LAN: the API key then travels encrypted. ValueError saying what is wrong."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ValueError(f"TLS: {exc.filename or cert} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"TLS: cannot use the certificate {cert} with the key {key} ({exc}): give PEM "
                         "files, the key the one the certificate was made for") from None
    return ctx


async def serve_api(head: Head, host: str = "127.0.0.1", port: int = 8000,
                    api_key: str | None = None, tls: ssl.SSLContext | None = None,
                    idle_seconds: float = IDLE_SECONDS, body_seconds: float = BODY_SECONDS,
                    cors_origins=(), socks=()) -> web.AppRunner:
    """Serve the API on host:port (HTTPS with `tls`). Beyond loopback an API key is
    required: anyone on the network could otherwise run work on every machine of the
    pipeline."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"the API would listen on {host}, beyond this machine, without an API key: give one "
                         "(--api-key or POTLUCK_API_KEY), or keep the API on 127.0.0.1")
    # handler_cancellation: a client that disconnects cancels its handler, which
    # cancels its generation -- otherwise a non-streaming request whose client gave
    # up keeps its KV and its place in the pipeline until max_tokens.
    app = Api(head, api_key or None, body_seconds).app()
    Cors(cors_origins, api_key or None, loopback=is_loopback(host)).install(app)   # web pages: only those named
    quiet_bad_requests()   # a malformed request is one line in the log, not a traceback
    runner = web.AppRunner(app, access_log=None,
                           handler_cancellation=True, keepalive_timeout=idle_seconds)
    await runner.setup()
    if socks:       # bound before the model loaded (control_basics.hold_port)
        for sock in socks:
            await web.SockSite(runner, sock, ssl_context=tls).start()
    else:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
    return runner
