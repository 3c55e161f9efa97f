"""What a request is to the head: Sequence, RequestHandle, its events (Delta, Done, TokenLogprob),
PipelineError; and how one comes in: RequestIntake (a mixin of Head: chat_prompt, submit, cancel).

A request's choices become Sequences (core Seq plus what the head streams); the handle reads
their queue. engine/pipeline/head.py re-exports the request-facing names.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.core.stop_text import StopText
from engine.model.detok import Detokenizer
from engine.model.sampler import speculable
from engine.core.sampling import MAX_CHOICES, SamplingParams, choice_seed
from engine.core.scheduler import Seq
from engine.core.tool_calls import without_tool_messages
from engine.core.drafts import PromptLookup
from engine.core.literal_text import literal_chat_ids

if TYPE_CHECKING:
    from engine.pipeline.head import Head


class PipelineError(RuntimeError):
    """The pipeline cannot serve (a stage refused, died, or holds another model)."""


class CacheTooSmall(ValueError):
    """A request whose prompt and longest reply the pipeline's KV cache could never hold.
    str() is the API's words (its fields); the terminal chat words it with its own flags."""

    def __init__(self, need: int, capacity: int):
        self.need, self.capacity = need, capacity
        super().__init__(f"this request needs {need} tokens of KV cache but the pipeline holds at most "
                         f"{capacity}; lower max_tokens or n, or shorten the prompt")


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the likeliest tokens' at its position, as
    the last stage computed them (engine/model/sampler.py: from the raw logits)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None   # one per token, when the request asked


@dataclass
class Done:
    finish_reason: str          # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    ttft: float | None = None   # seconds from submit to first token
    seconds: float = 0.0


@dataclass(eq=False)
class Sequence(Seq):
    """A request: the scheduler's view of it (core Seq) and what the head streams."""
    prompt: list[int] = field(kw_only=True)
    params: SamplingParams = field(kw_only=True)
    queue: asyncio.Queue = field(kw_only=True)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    needs_free: bool = False     # finished while a step was in flight: free when it returns
    detok: Detokenizer | None = None
    stop_text: StopText | None = None    # the reply's text, released clear of its stop sequences
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    # after a stage left: prompt + tokens generated so far, prefilled on the new stages
    # so decoding goes on where it was (None: the prompt is what the stages are sent)
    replay: list[int] | None = None
    # speculative decoding (issue 34): whether its requests' settings allow it, its prompt
    # lookup (fed the prompt and every emitted token, never a rejected guess), and the
    # draft its step now in flight carries after its last token
    spec: bool = False
    lookup: PromptLookup | None = None
    draft: list[int] = field(default_factory=list)
    # the draft model has yet to read this sequence's context: read it while its step is
    # in flight (Head._draft_on), draft from the round after
    draft_unread: bool = False
    # an ended reply's sequence this one took over (core/kept_prefixes.py): the first
    # `rewind_to` tokens of its prompt are cached on every stage already, and its first
    # frame tells each stage to cut that KV back to them (None: nothing taken, or told)
    rewind_to: int | None = None
    finish: str = ""     # how it ended (Done's finish_reason), once it has
    # kept replies let go for room while this one waited: its first frame tells every
    # stage, ahead of its step (their free on the control connection could arrive after it)
    drops: list[int] = field(default_factory=list)

    @property
    def source_tokens(self) -> list[int]:
        """What a step that opens this sequence sends: its prompt, or its replay."""
        return self.replay if self.replay is not None else self.prompt

    def rewind(self) -> None:
        """Back to the queue as a new prompt: its whole history, to be prefilled again."""
        self.replay = self.prompt + self.generated
        self.prompt_len = len(self.replay)
        self.max_tokens = self.params.max_tokens - len(self.generated)
        self.pos = self.in_flight = 0
        self.opened = self.needs_free = False
        self.draft = []   # a verification in flight on the old stages: its answer never comes
        self.rewind_to, self.drops = None, []   # the new stages hold nothing kept
        # a choice still waiting for its parent's prompt replays as a prompt of its own
        self.forks, self.parent = [], None


class RequestHandle:
    def __init__(self, head: "Head", seq: Sequence):
        self._head, self.seq = head, seq

    def __aiter__(self):
        return self._events()

    async def _events(self):
        while True:
            ev = await self.seq.queue.get()
            yield ev
            if isinstance(ev, Done):
                return

    async def next_event(self, timeout: float | None = None):
        """The next Delta or Done, or None when `timeout` passes first (nothing is lost:
        a caller that keeps a stream alive while the pipeline rearranges asks again)."""
        try:
            return await asyncio.wait_for(self.seq.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def cancel(self):
        self._head.cancel(self.seq.id)

    async def text(self) -> tuple[str, Done]:
        parts = []
        async for ev in self:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            else:
                return "".join(parts), ev
        raise PipelineError("stream ended without a result")


class RequestIntake:
    """Head's requests in: the chat prompt, submitting n choices, cancelling (a mixin of Head)."""

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation as token ids, by the model's chat template. tools: OpenAI
        function specs ({name, description, parameters}); a template that knows tools
        renders them itself, for one that does not they are explained in the system
        message and the calls and results written as text (core/tool_calls.py)."""
        kwargs = {}
        template = self.tokenizer.chat_template or ""
        knows_tools = "tools" in (template if isinstance(template, str) else json.dumps(template))
        if knows_tools and tools:
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools]
        elif not knows_tools and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
            # calls and results are written as text, even when this turn offers no tools
            messages = without_tool_messages(messages, tools or [])
        literal = literal_chat_ids(
            messages, self._control_markers(),
            lambda msgs: self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                            **kwargs),
            lambda text, split: list(self.tokenizer(text, add_special_tokens=False,
                                                    split_special_tokens=split)["input_ids"]))
        if literal is not None:
            return literal
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _control_markers(self) -> list[str]:
        """The tokenizer's special tokens as text ("<|im_end|>"): written in a message, they
        are read as characters (core/literal_text.py)."""
        markers = getattr(self, "_markers", None)
        if markers is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            found = {t.content for t in added.values() if getattr(t, "special", False)}
            found.update(getattr(self.tokenizer, "all_special_tokens", []) or [])
            markers = self._markers = sorted(m for m in found if m)
        return markers

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        return self.submit_n(prompt, params, 1)[0]

    def submit_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[RequestHandle]:
        """n choices of one prompt (OpenAI's n): the prompt is computed once, and each
        stage copies its KV to the other choices at the step that completes it (a fork,
        core/scheduler.py); from there on they decode as sequences of their own. Choice
        i > 0 draws with a seed derived from the request's (core/sampling.py choice_seed)."""
        if isinstance(n, bool) or not isinstance(n, int) or not (1 <= n <= MAX_CHOICES):
            raise ValueError(f"n must be a whole number from 1 to {MAX_CHOICES}")
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context window is "
                             f"{self.context_length}")
        if self.error:
            raise PipelineError(self.error)
        # never reserve beyond the context window: generation stops there anyway
        params.max_tokens = min(params.max_tokens, self.context_length - len(prompt))
        choices = [params] + [replace(params, stop=list(params.stop),
                                      seed=None if params.seed is None else choice_seed(params.seed, i))
                              for i in range(1, n)]
        seqs = [Sequence(next(self._ids), len(prompt), p.max_tokens, prompt=list(prompt), params=p,
                         queue=asyncio.Queue()) for p in choices]
        seq, seq.forks = seqs[0], seqs[1:]
        if seq.need > self.capacity:
            raise CacheTooSmall(seq.need, self.capacity)
        self._take_kept(seq)
        for s in seqs:
            self.seqs[s.id] = s
            # n > 1 choices decode side by side already; logprobs and grammars need each
            # token's own step (engine/model/sampler.py speculable; penalties verify)
            s.spec = n == 1 and speculable(s.params)
        self.sched.add(seq)
        # kick on the loop's next turn, once: requests submitted together (a burst, a
        # client's batch) then start in one step instead of the first alone and the
        # rest prefilling a step later alongside its decode
        if not self._kick_pending:
            self._kick_pending = True
            asyncio.get_running_loop().call_soon(self._deferred_kick)
        return [RequestHandle(self, s) for s in seqs]

    def _deferred_kick(self):
        self._kick_pending = False
        self._kick()

    def cancel(self, seq_id: int):
        seq = self.seqs.get(seq_id)
        if seq is None or seq.done:
            return
        seq.cancelled = True
        if self.sched.withdraw(seq):
            self._finish(seq, "cancelled", free=False)
        elif not seq.in_flight:
            self._finish(seq, "cancelled")
        # else: finished when its step comes back
