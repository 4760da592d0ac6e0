"""Tool calls (docs/OPENAI.md): the grammar that forces one (the schema vLLM's server builds), the conversation
written as Qwen2.5's chat template writes it, and the answer read back as OpenAI's `tool_calls` under each
tool_choice."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from pipeline.openai_format import ChatCompletionRequest, ChatMessage, chatml_prompt, parse_tool_calls
from pipeline.sampling import Sampling, tool_call_schema, tool_mode

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = (WEATHER, TIME)


def test_tool_modes_and_the_grammars_that_force_a_call() -> None:
    assert tool_mode(Sampling()) == "none"
    assert tool_mode(Sampling(tools=TOOLS, tool_choice="none")) == "none"
    assert tool_mode(Sampling(tools=TOOLS)) == tool_mode(Sampling(tools=TOOLS, tool_choice="auto")) == "auto"
    assert tool_call_schema(Sampling(tools=TOOLS)) is None
    named = Sampling(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_mode(named) == "named"
    assert tool_call_schema(named) == WEATHER["function"]["parameters"]
    # a function without parameters takes an empty object
    assert tool_call_schema(Sampling(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})) \
        == {"type": "object", "properties": {}}
    req = tool_call_schema(Sampling(tools=TOOLS, tool_choice="required"))
    assert req is not None and req["type"] == "array" and req["minItems"] == 1 and "maxItems" not in req
    assert [a["properties"]["name"]["enum"] for a in req["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    one = tool_call_schema(Sampling(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert one is not None and one["maxItems"] == 1


def test_the_answer_becomes_tool_calls_under_each_choice() -> None:
    named = Sampling(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_tool_calls('{"city": "Oslo"}', named, "0b6f-11")
    assert content == "" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = Sampling(tools=TOOLS, tool_choice="required")
    content, calls = parse_tool_calls('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                      '"parameters": {"city": "Rome"}}]', required, "r1")
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}
    assert len({c["id"] for c in calls}) == 2
    # cut by max_tokens before the JSON closed: the text, no call
    assert parse_tool_calls('{"city": "Os', named, "r2") == ('{"city": "Os', [])
    # auto: hermes blocks; the text before the first is the content; unknown functions and bad JSON stay text
    auto = Sampling(tools=TOOLS)
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n'
            '<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, auto, "r3")
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_tool_calls("no call here", auto, "r4") == ("no call here", [])
    # an unclosed last block (the answer ended inside it) still counts when its JSON is whole
    content, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', auto, "r5")
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_conversation_with_tools_is_written_as_qwen25s_template_writes_it() -> None:
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather in Oslo?"),
            ChatMessage(role="assistant", content=None, tool_calls=[{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
            ChatMessage(role="tool", content="4 C, rain", tool_call_id="call_1"),
            ChatMessage(role="tool", content="wind 10 m/s", tool_call_id="call_1")]
    p = chatml_prompt(msgs, list(TOOLS))
    assert p.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in p
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           "</tool_call><|im_end|>\n" in p
    # consecutive tool answers share one user turn
    assert ("<|im_start|>user\n<tool_response>\n4 C, rain\n</tool_response>\n<tool_response>\nwind 10 m/s\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in p
    # without tools the prompt is plain ChatML
    assert chatml_prompt(msgs[:2]) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Oslo?"
                                       "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(("extra", "says"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "get_weather"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "retrieval"}]}, "only function tools"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one"),
])
def test_bad_tools_are_refused_with_what_to_change(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    assert says in str(e.value)
