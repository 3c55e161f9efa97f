"""A chat request's messages, checked and made what the chat template reads (the API's
/v1/chat/completions; engine/pipeline/api.py). What OpenAI refuses is refused here in its
words too: a client that works against one works against the other, and a conversation
the template would misread (a tool's result answering no call) is said, not guessed at."""

from __future__ import annotations

import json

from engine.pipeline.api_errors import ApiError, json_kind

ROLES = ("system", "user", "assistant", "developer", "tool")


def chat_messages(messages: list) -> list[dict]:
    """The messages as the template reads them: content as text, `developer` as `system`,
    an assistant's tool calls with their arguments as objects, a tool message with the
    call it answers. ApiError naming the first message that is not one."""
    clean = []
    called: set[str] | None = None   # the ids of the calls tool messages may answer (None: no call yet)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object such as {{\"role\": \"user\", \"content\": "
                           f"\"...\"}}, not {json_kind(m)}", param="messages", code="invalid_type")
        if m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] needs a role of system, developer, user, assistant or tool",
                           param="messages")
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):
            # (OpenAI's too: a message with no content is a client's mistake, not "")
            raise ApiError(f"messages[{i}] has no 'content'", param="messages")
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                # an assistant's earlier refusal comes back as a part of its own (OpenAI's)
                kind = "refusal" if m["role"] == "assistant" and isinstance(part, dict) \
                    and part.get("type") == "refusal" else "text"
                if not (isinstance(part, dict) and part.get("type") == kind and isinstance(part.get(kind), str)):
                    raise ApiError(f"messages[{i}]: only text content is supported", param="messages")
                texts.append(part[kind])
            content = "".join(texts)
        if content is None and m["role"] == "assistant":   # a turn of tool calls only
            content = ""
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(f"messages[{i}].name must be a string, not {json_kind(m['name'])}",
                           param="messages", code="invalid_type")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _calls_of(m["tool_calls"], i)
            called = {c["id"] for c in msg["tool_calls"]}
        if role == "tool":   # a call's result: which call it answers
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ApiError(f"messages[{i}]: a tool message needs its 'tool_call_id'", param="messages")
            # the template writes a result under the call it answers; one that answers
            # nothing would read as the model's own call (OpenAI refuses it too). A call
            # sent without an id ("") may be answered by any
            if called is None:
                raise ApiError(f"messages[{i}]: a tool message must answer a call of an earlier assistant "
                               "message (its 'tool_calls')", param="messages")
            if call_id not in called and "" not in called:
                raise ApiError(f"messages[{i}]: tool_call_id {call_id[:64]!r} answers no call of the assistant "
                               "message before it", param="messages")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        clean.append(msg)
    return clean


def _calls_of(raw, i: int) -> list[dict]:
    """An assistant message's tool_calls, for the chat template: arguments as an object
    (the templates write them with tojson)."""
    if not isinstance(raw, list) or len(raw) > 128:
        raise ApiError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for c in raw:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ApiError(f"messages[{i}].tool_calls: each needs function.name", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ApiError(f"messages[{i}].tool_calls: arguments must be JSON", param="messages") from None
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else "", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out
