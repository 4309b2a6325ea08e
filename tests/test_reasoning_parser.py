"""The reasoning parsers alone (router_svc/reasoning.py, with the tool-call parser after them): a streamed
answer, split anywhere into three chunks, says what the whole one says — reasoning and content, and the
calls read from the content. Through the front door: tests/test_tool_parser.py."""

from __future__ import annotations

import pytest

from router_svc.chat_deltas import ChoiceDeltas, whole_message
from router_svc.reasoning import split_reasoning
from router_svc.tool_calls import ToolPlan

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
SAMPLES = ["<think>\nplan\n</think>\n\nAnswer", "no thinking here", "plan</think>answer", "<think>cut off",
           "  <think>x</think>y", "<th", "", f"<think>a</think>x{CALL}", "<think>a</thi", "</think>"]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_split_anywhere_equals_whole(parser):
    for tools in (None, ToolPlan(None, parser="hermes")):
        for text in SAMPLES:
            message, reason = whole_message(text, "stop", parser, tools)
            for cut in range(len(text) + 1):
                for second in range(cut, len(text) + 1):
                    stream = ChoiceDeltas.make(parser, tools)
                    deltas = []
                    for part, last in ((text[:cut], False), (text[cut:second], False), (text[second:], True)):
                        out, end = stream.feed(part, last, "stop")
                        deltas += out
                    thought = "".join(d.get("reasoning_content", "") for d in deltas)
                    content = "".join(d.get("content", "") for d in deltas)
                    calls = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ())]
                    assert (thought or None) == message["reasoning_content"], (parser, text, cut, second)
                    assert content == (message["content"] or ""), (parser, text, cut, second)
                    assert calls == [c["function"]["name"] for c in message.get("tool_calls") or []]
                    assert end == reason


def test_the_two_parsers_read_the_same_text_differently():
    assert split_reasoning("<think>\nplan\n</think>\n\nAnswer", "qwen3") == ("\nplan\n", "\n\nAnswer")
    assert split_reasoning("plan</think>answer", "qwen3") == (None, "plan</think>answer")  # no opening tag
    assert split_reasoning("plan</think>answer", "deepseek_r1") == ("plan", "answer")  # the prompt opened it
    assert split_reasoning("<think>plan</think>answer", "deepseek_r1") == ("plan", "answer")
    assert split_reasoning("<think>cut off", "qwen3") == ("cut off", "")  # never closed: all reasoning
    assert split_reasoning("just an answer", "deepseek_r1") == ("just an answer", "")
    message, reason = whole_message(f"<think>a</think>\n{CALL}", "stop", "qwen3", ToolPlan(None, parser="hermes"))
    assert message["reasoning_content"] == "a" and message["content"] is None and reason == "tool_calls"
    assert whole_message("<think>still thinking", "length", "qwen3", None)[0] == {
        "role": "assistant", "content": None, "reasoning_content": "still thinking"}
