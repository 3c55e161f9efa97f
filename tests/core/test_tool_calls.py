"""Reading tool calls back out of each family's format, forcing one by schema, and
streaming around them (engine/core/tool_calls.py)."""

from __future__ import annotations

import json

import pytest

from engine.core.tool_calls import (StreamSplitter, ToolError, check_tools, fallback_system_prompt,
                                    forced_call_schema, parse)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text, content", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ""),        # Hermes/Qwen
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "Let me check."),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),                     # Mistral
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),                    # Llama 3.1
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),                                   # Llama 3.x bare
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', ""),                          # args as text
])
def test_each_familys_call_is_read_back(text, content):
    got_content, calls = parse(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and calls[0].to_openai(0)["function"]["name"] == "get_weather"


def test_several_calls_and_things_that_are_not_calls():
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [c.name for c in parse(two, NAMES)[1]] == ["get_weather", "get_time"]
    for text in ("The weather is nice.", '{"answer": 42}', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 "<tool_call>not json</tool_call>", '[TOOL_CALLS][{"name": 5}]'):
        content, calls = parse(text, NAMES)
        assert calls == [] and content == text


def test_a_call_after_the_tag_named_in_prose_is_read():
    """A small model echoes the instructions it was given ("inside <tool_call> tags")
    before it calls: the call after the mention is still a call, streamed or not."""
    text = ('I will use <tool_call> tags:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>')
    content, calls = parse(text, NAMES)
    assert content == "I will use <tool_call> tags:" and [c.name for c in calls] == ["get_weather"]
    s = StreamSplitter(NAMES)
    sent = "".join(s.feed(text[i:i + 7]) for i in range(0, len(text), 7))
    rest, streamed = s.finish()
    assert sent + rest == content and [c.name for c in streamed] == ["get_weather"]
    # a tag inside a call's own arguments is not a second call
    inner = '<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>{}"}}</tool_call>'
    assert [json.loads(c.arguments) for c in parse(inner, NAMES)[1]] == [{"city": "<tool_call>{}"}]


def test_tools_and_tool_choice_are_checked():
    fns, choice = check_tools([WEATHER, TIME], None)
    assert choice == "auto" and [f["name"] for f in fns] == ["get_weather", "get_time"]
    assert check_tools(None, None) == ([], "none")
    assert check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})[1] == "get_weather"
    for tools, choice, words in (([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
                                 ([], "required", "needs 'tools'"), ("x", None, "list"),
                                 ([{"type": "function", "function": {"name": "a b"}}], None, "name"),
                                 ([WEATHER, WEATHER], None, "same name"), ([WEATHER], "always", "tool_choice")):
        with pytest.raises(ToolError, match=words):
            check_tools(tools, choice)


def test_a_forced_call_schema_names_the_function_and_its_parameters():
    fns, _ = check_tools([WEATHER, TIME], None)
    one = forced_call_schema(fns, "get_weather")
    assert one["properties"]["name"] == {"const": "get_weather"}
    assert one["properties"]["arguments"]["required"] == ["city"]
    # only the arguments the function declares, unless its schema says otherwise
    assert one["properties"]["arguments"]["additionalProperties"] is False
    assert WEATHER["function"]["parameters"].get("additionalProperties") is None    # the request's own: untouched
    open_fn = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": {"type": "string"}}}}
    fns_open, _ = check_tools([open_fn], None)
    assert forced_call_schema(fns_open, "log")["properties"]["arguments"]["additionalProperties"] == {"type": "string"}
    anyof = forced_call_schema(fns, "required")["anyOf"]
    assert [v["properties"]["name"]["const"] for v in anyof] == ["get_weather", "get_time"]
    # what constrained decoding produces is read back as a call
    assert parse('{"name": "get_time", "arguments": {}}', NAMES)[1][0].name == "get_time"
    assert "get_weather" in fallback_system_prompt(fns) and "<tool_call>" in fallback_system_prompt(fns)


def test_a_forced_call_cut_by_the_length_limit_is_still_a_call():
    """It came back as content (the raw '{"name": "get_'), which a client shows as the answer."""
    from engine.core.tool_calls import cut_call

    call = cut_call('{"name": "get_weather", "arguments": {"city": "Par', NAMES)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Par')
    assert cut_call('{"name": "get_w', NAMES).name == "get_weather"       # the one it can be
    assert (cut_call('{"name": "get_', NAMES).name, cut_call('{"name": "get_', NAMES).arguments) == ("get_", "")
    assert cut_call('{"na', {"log"}).name == "log"
    assert cut_call("Sure, the weather", NAMES) is None


def test_streaming_sends_text_at_once_and_holds_a_call_until_it_is_complete():
    s = StreamSplitter(NAMES)
    out = [s.feed(d) for d in ("Let me ", "check.", " <tool", "_call>{\"name\": \"get_weather\", ",
                                "\"arguments\": {\"city\": \"Paris\"}}</tool_call>")]
    assert "".join(out) == "Let me check. " and out[2] == " "      # "<tool" is held: it may open a call
    content, calls = s.finish()
    assert content == "" and calls[0].name == "get_weather"

    s = StreamSplitter(NAMES)
    assert s.feed("A <") == "A " and s.feed("b> c") == "<b> c"      # held back only while it could be one
    assert s.finish() == ("", [])

    s = StreamSplitter(NAMES)                                           # a bare JSON reply (Llama 3.x)
    assert s.feed('{"name": "get_time", ') == "" and s.feed('"arguments": {}}') == ""
    assert s.finish()[1][0].name == "get_time"
    s = StreamSplitter(NAMES)
    assert s.feed("{not a call}") == "" and s.finish() == ("{not a call}", [])


def test_a_template_without_tools_gets_them_as_text():
    from engine.core.tool_calls import without_tool_messages

    fns, _ = check_tools([WEATHER], None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    out = without_tool_messages(msgs, fns)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert parse(out[2]["content"], NAMES)[1][0].name == "get_weather"      # the call, as the model would write it
    assert out[3]["content"] == "<tool_response>\n22 C\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)
    bare = without_tool_messages(msgs, [])          # no tools this turn: no instructions, same history
    assert bare[0] == msgs[0] and bare[3] == out[3]
