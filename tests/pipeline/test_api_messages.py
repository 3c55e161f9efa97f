"""A chat request's messages as the template gets them, and the ones refused in OpenAI's
words (engine/pipeline/api_messages.py)."""

from __future__ import annotations

import pytest

from engine.pipeline.api_errors import ApiError
from engine.pipeline.api_messages import chat_messages

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


def test_a_conversation_with_a_tool_call_reads_as_the_template_wants_it():
    got = chat_messages([{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
                         CALL, {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "4 C"}])
    assert got[0] == {"role": "system", "content": "Be brief."}
    assert got[1]["content"] == "Weather in Oslo?"
    assert got[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and got[2]["content"] == ""
    assert got[3] == {"role": "tool", "content": "4 C", "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize("messages, said", [
    # a tool's result answering no call read, to the template, as a call the model made
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}],
     "must answer a call of an earlier assistant message"),
    ([{"role": "user", "content": "hi"}, CALL, {"role": "tool", "tool_call_id": "call_9", "content": "4 C"}],
     "'call_9' answers no call"),
    ([{"role": "user", "content": "hi", "name": 7}], "messages[0].name must be a string, not a number"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "messages[1] needs a role"),
    ([{"role": "user"}], "has no 'content'"),
    (["hi"], "must be an object"),
])
def test_what_openai_refuses_is_refused_naming_the_message(messages, said):
    with pytest.raises(ApiError, match=said.replace("[", r"\[").replace("]", r"\]")) as e:
        chat_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages"


def test_a_call_sent_without_an_id_may_be_answered_by_any():
    call = {**CALL, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}]}
    got = chat_messages([{"role": "user", "content": "hi"}, call,
                         {"role": "tool", "tool_call_id": "x", "content": "4 C"}])
    assert got[-1]["tool_call_id"] == "x"
