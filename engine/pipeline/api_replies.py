"""OpenAI's response shapes for the head's API (engine/pipeline/api.py): a reply's
envelope, a whole choice, a stream chunk, each token's logprobs in chat's and
completions' formats, the tool calls read back from a reply, and usage. Pure: fed the
texts, tokens and results, they return what goes out as JSON.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.tool_calls import cut_call, parse as parse_calls
from engine.model.detok import TokenPieces
from engine.pipeline.requests import Done


class Reply:
    """One response's shapes: its id and envelope, a choice, a stream chunk, and each
    token's logprobs in OpenAI's two formats (chat: content[] with token, logprob, bytes
    and top_logprobs; completions: tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, model: str, pieces: TokenPieces, rid: str, chat: bool, k: int | None,
                 tools: "Tools | None" = None):
        """model: the name replies carry; pieces: token ids -> text and bytes, for logprobs;
        k: the top logprobs asked for (None: no logprobs)."""
        self.model, self.pieces, self.rid, self.chat, self.k, self.tools = model, pieces, rid, chat, k, tools
        self.created = int(time.time())

    def envelope(self, final: bool = False) -> dict:
        obj = ("chat.completion" if final else "chat.completion.chunk") if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def choice(self, i: int, text: str, finish: str, lps: list) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.tools is not None:
                content, calls = parse_calls(text, self.tools.names)
                calls = self.tools.kept(calls)
                cut = self.tools.cut(text, finish) if not calls else None
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.to_openai() for c in calls]}
                    finish = "tool_calls"
                elif cut is not None:   # OpenAI's shape: the call, finish_reason "length"
                    message = {"role": "assistant", "content": None, "tool_calls": [cut.to_openai()]}
            return {"index": i, "message": message, "finish_reason": finish, "logprobs": self.logprobs(lps)}
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": self.logprobs(lps)}

    def chunk(self, i: int, text: str | None = None, finish: str | None = None, first: bool = False,
              lps: list = (), calls: list | None = None) -> dict:
        logprobs = self.logprobs(lps) if lps else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            if calls:
                delta = {"tool_calls": [c.to_openai(j) for j, c in enumerate(calls)]}
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return {**self.envelope(), "choices": [choice]}

    def logprobs(self, lps: list) -> dict | None:
        """lps: (TokenLogprob, the choice's text length before that token) per token."""
        if self.k is None:
            return None
        piece = self.pieces.get
        if self.chat:
            content = []
            for lp, _ in lps:
                text, raw = piece(lp.token)
                content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw),
                                "top_logprobs": [{"token": piece(t)[0], "logprob": v, "bytes": list(piece(t)[1])}
                                                 for t, v in lp.top]})
            return {"content": content, "refusal": None}
        # the legacy shape: the likeliest `logprobs` tokens and the sampled one ("up to
        # logprobs + 1" entries, as OpenAI's completions answer)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp, offset in lps:
            text = piece(lp.token)[0]
            top = {piece(t)[0]: v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
        return out


@dataclass
class Tools:
    """A chat request's tools: the functions' names (a call of anything else stays
    text), the schema that forces a call (tool_choice required or named), and whether
    several calls may come back at once."""
    names: set
    forced: str | None
    parallel: bool

    def kept(self, calls: list) -> list:
        return calls if self.parallel else calls[:1]

    def cut(self, text: str, finish: str):
        """A forced call the length limit cut short (core/tool_calls.cut_call), else None."""
        return cut_call(text, self.names) if self.forced and finish == "length" else None


def usage(prompt_tokens: int, dones: list[Done]) -> dict:
    """The prompt counts once however many choices it gave; every choice's tokens count."""
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}
