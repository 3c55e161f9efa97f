"""Tool calls in model text (sans-I/O): how the families' chat templates ask a model to
call a function, how to read its calls back into OpenAI's `tool_calls`, and the JSON
schema that forces a call when the request requires one.

The formats, as the families' own templates define them:

  * Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, possibly after some text;
  * Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
  * Llama 3.1+: `<|python_tag|>{"name": ..., "parameters": {...}}`, or the bare JSON object
    as the whole reply (its template asks for exactly that).

A model whose template knows no tools (the default SmolLM2) is told the Hermes format in
a system message (`fallback_system_prompt`), and read the same way. A call forced by
constrained decoding is the bare object `{"name": ..., "arguments": {...}}`
(`forced_call_schema`), which `parse` reads too.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_HERMES = "<tool_call>"


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be used; str() says why."""


@dataclass
class ToolCall:
    name: str
    arguments: str                       # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def check_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """Validate the request's `tools` and `tool_choice`; returns (functions, choice) where
    choice is "none", "auto", "required" or the name of the function to call."""
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("'tools' must be a list of at most 128 tools")
    fns = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError("each tool must be {\"type\": \"function\", \"function\": {...}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError("a function's 'name' must be 1-64 letters, digits, _ . or -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"function {name}: 'parameters' must be a JSON schema object")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ToolError(f"function {name}: 'description' must be text")
        fns.append({"name": name, "description": desc, "parameters": params})
    if len({f["name"] for f in fns}) != len(fns):
        raise ToolError("two tools have the same name")
    if tool_choice is None:
        choice = "auto" if fns else "none"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        choice = tool_choice["function"].get("name")
        if not isinstance(choice, str) or choice not in {f["name"] for f in fns}:
            raise ToolError(f"tool_choice names {choice!r}, which is not among the tools")
    else:
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", ...}")
    if choice in ("auto", "required") and not fns:
        raise ToolError(f"tool_choice {choice!r} needs 'tools'")
    return fns, choice


def forced_call_schema(fns: list[dict], choice: str) -> dict:
    """The JSON schema of one call, for constrained decoding when a call is required
    (choice "required": any of the tools; a name: that one)."""
    chosen = [f for f in fns if choice == "required" or f["name"] == choice]
    variants = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": _declared_only(f["parameters"])},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _declared_only(params):
    """A function's parameters schema with only the arguments it declares, where it says
    nothing of others. JSON Schema allows any others by default, and a small model held
    to the schema token by token wandered into them ({"city": "Paris", "temperature": 25}
    for a function of a city): no caller wants an argument it did not declare. A schema
    that names additionalProperties itself keeps its own word."""
    if isinstance(params, dict) and isinstance(params.get("properties"), dict) \
            and "additionalProperties" not in params and params.get("type", "object") == "object":
        return {**params, "additionalProperties": False}
    return params


def fallback_system_prompt(fns: list[dict]) -> str:
    """For a template without tools: the Hermes format, which small models often follow."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in fns)
    return ("You can call functions. They are described in JSON below, between <tools> tags:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, reply with its name and arguments as a JSON object inside <tool_call> tags, "
            "for example:\n<tool_call>\n{\"name\": \"function_name\", \"arguments\": {\"arg\": \"value\"}}\n"
            "</tool_call>\nYou may call several, one block each. If no function is needed, answer normally.")


def _call_from(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or (names and name not in names):
        return None
    if isinstance(args, str):       # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_prefix(text: str):
    """The JSON value at the start of text (after blanks), or None."""
    text = text.lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
        return value
    except ValueError:
        return None


def _hermes_calls(text: str, names: set[str]) -> tuple[int, list[ToolCall]]:
    """Each <tool_call> that a call's JSON follows, and where the first of them starts.
    Every opener is tried on its own: a reply that names the tag in its prose first ("I
    will use <tool_call> tags:", echoing the instructions it was given) still has its
    call read, where one match from the first opener to the first closer swallowed it."""
    first, calls, i = len(text), [], text.find(_HERMES)
    while i >= 0:
        call = _call_from(_json_prefix(text[i + len(_HERMES):]), names)
        if call:
            first = min(first, i)
            calls.append(call)
        i = text.find(_HERMES, i + len(_HERMES))
    return first, calls


def parse(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split a finished reply into its content and its calls (by any family's format).
    names: the request's functions; a call of anything else is left as text."""
    names = names or set()
    if _HERMES in text:
        first, calls = _hermes_calls(text, names)
        if calls:
            return text[:first].strip(), calls
    if "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        value = _json_prefix(rest)
        items = value if isinstance(value, list) else [value]
        calls = [c for c in (_call_from(v, names) for v in items) if c]
        if calls:
            return head.strip(), calls
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    stripped = body.strip()
    if stripped.startswith(("{", "[")):
        value = _json_prefix(stripped)
        items = value if isinstance(value, list) else [value]
        calls = [c for c in (_call_from(v, names) for v in items) if c]
        if calls and len(calls) == len(items):
            return text.split("<|python_tag|>", 1)[0].strip() if "<|python_tag|>" in text else "", calls
    return text, []


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def cut_call(text: str, names: set[str]) -> ToolCall | None:
    """A forced call (its JSON: forced_call_schema) that the length limit cut short, as
    OpenAI returns one: a tool call whose arguments are what was written of them. Handed
    back as content, its raw JSON read as the reply's answer. None: not such a call."""
    if not text.lstrip().startswith("{"):
        return None
    m = _NAME.search(text)
    written = m.group(1) if m else ""
    # a name cut off is the one function it can be the start of, where there is one
    maybe = [n for n in sorted(names) if n.startswith(written)]
    name = written if written in names else maybe[0] if len(maybe) == 1 else written
    a = _ARGUMENTS.search(text)
    return ToolCall(name, text[a.end():] if a else "")


class StreamSplitter:
    """While a reply streams: text that cannot be the start of a call goes out at once;
    from the first sign of a call on (an opener, or a reply that starts with '{'), it is
    held until the end, when `finish` parses it."""

    def __init__(self, names: set[str] | None = None):
        self.names = names or set()
        self.held = ""
        self.sent = ""
        self.holding = False

    def feed(self, delta: str) -> str:
        """The part of delta that may go out now as content."""
        if self.holding:
            self.held += delta
            return ""
        text = self.held + delta
        if not self.sent and text.lstrip().startswith(("{", "[")):
            self.holding, self.held = True, text
            return ""
        for op in OPENERS:
            i = text.find(op)
            if i >= 0:
                self.holding, self.held = True, text[i:]
                out = text[:i]
                self.sent += out
                return out
        # keep back a tail that may be the beginning of an opener split across deltas
        keep = max((k for op in OPENERS for k in range(1, len(op)) if text.endswith(op[:k])), default=0)
        out, self.held = (text[:-keep], text[-keep:]) if keep else (text, "")
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls) once the reply has ended."""
        content, calls = parse(self.held, self.names)
        if calls:
            return content, calls
        return self.held, []


def without_tool_messages(messages: list[dict], fns: list[dict]) -> list[dict]:
    """A conversation with tools for a template that knows none: the tools explained in
    the system message, an assistant's calls written as <tool_call> blocks, and a tool's
    result given back as a user message in <tool_response> tags (the Hermes way)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                      "\n</tool_call>" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or ""] + blocks))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if not fns:        # no tools on offer this turn: only the earlier calls and results
        return out
    system = fallback_system_prompt(fns)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out
