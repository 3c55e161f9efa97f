"""Tool calling through the official `openai` client, on the real pipeline of the default
model: a required or named call is forced by the schema mask and comes back as
`tool_calls` (whole or streamed), the tool's result goes back in and the model answers,
and tool_choice "none" keeps tools out of the reply."""

from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
# as OpenAI's guide writes a tool: nothing said of other arguments (the forced call's
# schema admits only the declared ones: engine/core/tool_calls.py _declared_only)
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


async def test_a_named_call_is_forced_and_its_result_goes_back_in(client, pipeline):
    r = await client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)

    # the result goes back in: the rendered conversation carries the call and the result
    # (the default model's template knows no tools: they are written as text for it)
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 22, "sky": "sunny"}'}]
    r2 = await client.chat.completions.create(model="default", messages=turn, tools=[WEATHER, TIME],
                                              tool_choice="none", temperature=0, max_tokens=24)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason in ("stop", "length")
    history = [{"role": m["role"], "content": m.get("content") or "",
                **{k: m[k] for k in ("tool_calls", "tool_call_id") if k in m}} for m in turn]
    rendered = pipeline.tokenizer.decode(pipeline.chat_prompt(history, tools=[WEATHER["function"], TIME["function"]]))
    assert '"temperature_c": 22' in rendered and "get_weather" in rendered and "<tool_response>" in rendered
    # a turn that offers no tools still shows the model the earlier call and its result
    rendered = pipeline.tokenizer.decode(pipeline.chat_prompt(history))
    assert '"temperature_c": 22' in rendered and "<tool_call>" in rendered and "<tools>" not in rendered


async def streamed(stream) -> tuple[list, str | None, str]:
    """A streamed reply's tool-call deltas, its finish_reason and its content."""
    calls, finish, content = [], None, ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


async def test_a_required_call_streams_as_tool_call_deltas(client):
    calls, finish, content = await streamed(await client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
        max_tokens=80, stream=True))
    assert finish == "tool_calls" and content == ""
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name in ("get_weather", "get_time")
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"get_weather": {"city"}, "get_time": {"zone"}}[calls[0].function.name], args


async def test_a_forced_call_cut_by_the_length_limit_comes_back_as_a_call(client):
    """As OpenAI: a call, its arguments as far as they were written, finish_reason
    "length". It came back as the call's raw JSON in `content`, whole or streamed."""
    for max_tokens in (6, 12):
        r = await client.chat.completions.create(
            model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
            max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        assert r._request_id.startswith("req_")          # each answer named, as OpenAI's are
        (call,) = choice.message.tool_calls
        assert call.function.name.startswith("get_") and "{" not in call.function.name, call
        calls, finish, content = await streamed(await client.chat.completions.create(
            model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
            max_tokens=max_tokens, stream=True))
        assert finish == "length" and content == "" and [c.function.model_dump() for c in calls] == [
            call.function.model_dump()]


async def test_tool_choice_none_answers_in_text(client):
    r = await client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="none",
                                             temperature=0, max_tokens=16)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


# A Qwen2.5-style template that renders tools itself (written for this test: no tokenizer
# of such a family is available offline). SmolLM2 speaks ChatML too, so the model still
# reads the conversation; what is checked is that a template which knows tools is given
# them, and the earlier call and result, instead of the text fallback.
NATIVE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}"
    "\n\n# Tools\n\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "For each call, answer <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role != 'system' or not loop.first %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_a_template_that_knows_tools_renders_them_itself(client, pipeline):
    saved = pipeline.tokenizer.chat_template
    pipeline.tokenizer.chat_template = NATIVE
    try:
        r = await client.chat.completions.create(
            model="default", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
        assert set(json.loads(call.function.arguments)) == {"zone"}

        def turn(arguments):
            return ASK + [{"role": "assistant", "content": "", "tool_calls": [
                              {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
                          {"role": "tool", "tool_call_id": call.id, "content": "14:05"}]

        # what the template is handed (the API turns a call's JSON arguments into an object for it)
        prompt = pipeline.chat_prompt(turn({"zone": "CET"}), tools=[WEATHER["function"]])
        rendered = pipeline.tokenizer.decode(prompt)
        assert "# Tools" in rendered and '"name": "get_weather"' in rendered          # the template's own
        assert "You can call functions" not in rendered                               # not the fallback
        assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}' in rendered
        assert "<tool_response>\n14:05\n</tool_response>" in rendered

        # and the reply to that conversation goes on from the result, through the API
        r2 = await client.chat.completions.create(model="default", messages=turn('{"zone": "CET"}'), tools=[WEATHER],
                                                  temperature=0, max_tokens=16)
        assert r2.choices[0].message.content or r2.choices[0].message.tool_calls
    finally:
        pipeline.tokenizer.chat_template = saved
