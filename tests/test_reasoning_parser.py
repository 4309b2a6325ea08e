"""The reasoning parsers alone (router_svc/reasoning.py, with the tool-call parser after them): a streamed
answer, split anywhere into three chunks, says what the whole one says — reasoning and content, and the
calls read from the content. Through the front door: tests/test_tool_parser.py."""

from __future__ import annotations

import pytest
from tiny_models import make_checkpoint, set_chat_template

from router_svc.chat_deltas import ChoiceDeltas, whole_message
from router_svc.reasoning import Reasoning, reasoning_for
from router_svc.tool_calls import ToolPlan

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
SAMPLES = ["<think>\nplan\n</think>\n\nAnswer", "no thinking here", "plan</think>answer", "<think>cut off",
           "  <think>x</think>y", "<th", "", f"<think>a</think>x{CALL}", "<think>a</thi", "</think>"]


@pytest.mark.parametrize("parser", [Reasoning("qwen3", False), Reasoning("qwen3", True),
                                    Reasoning("deepseek_r1", True)])
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


def test_where_the_output_starts_is_read_from_the_prompt():
    assert not reasoning_for("qwen3", "<|im_start|>assistant\n").thinking  # Qwen3: the output opens it, or not
    assert reasoning_for("qwen3", "<|im_start|>assistant\n<think>\n").thinking  # QwQ, Qwen3-*-Thinking
    assert not reasoning_for("qwen3", "<think>\n\n</think>\n\n").thinking  # enable_thinking: false
    assert reasoning_for("deepseek_r1", "<｜Assistant｜>").thinking  # R1 thinks from the start
    assert reasoning_for("deepseek_r1", "<｜Assistant｜><think>\n").thinking
    assert not reasoning_for("deepseek_r1", "<think>\n\n</think>").thinking  # a closed block: thinking is off
    # where a grammar starts (structured_outputs.reasoning_block)
    assert reasoning_for("qwen3", "<|im_start|>assistant\n").grammar_block == "optional"
    assert reasoning_for("qwen3", "assistant\n<think>\n").grammar_block == "open"
    assert reasoning_for("qwen3", "<think>\n\n</think>\n\n").grammar_block is None
    assert reasoning_for("deepseek_r1", "<｜Assistant｜>").grammar_block == "open"
    assert reasoning_for("deepseek_r1", "<think>\n\n</think>").grammar_block is None
    opened, plain = Reasoning("qwen3", True), Reasoning("qwen3", False)
    assert plain.split("<think>\nplan\n</think>\n\nAnswer") == ("\nplan\n", "\n\nAnswer")
    assert plain.split("plan</think>answer") == (None, "plan</think>answer")  # nothing opened it
    assert opened.split("plan</think>answer") == ("plan", "answer")  # the prompt opened it
    assert opened.split("<think>plan</think>answer") == ("plan", "answer")  # a repeated opening tag is dropped
    assert plain.split("<think>cut off") == ("cut off", "")  # never closed: all reasoning
    assert opened.split("just an answer") == ("just an answer", "")
    message, reason = whole_message(f"<think>a</think>\n{CALL}", "stop", plain, ToolPlan(None, parser="hermes"))
    assert message["reasoning_content"] == "a" and message["content"] is None and reason == "tool_calls"
    assert whole_message("<think>still thinking", "length", plain, None)[0] == {
        "role": "assistant", "content": None, "reasoning_content": "still thinking"}


def test_a_chat_request_gets_the_split_its_prompt_calls_for(tmp_path):
    """The router reads its own rendered prompt: a template that opens the block makes the output start as
    reasoning; a grammar starts after the block (structured_outputs.reasoning_block: "open" where the prompt
    opened it, "optional" where the output may); beam search answers are split too."""
    from router_svc.openai_api import parse_chat
    from router_svc.prompts import ServedModel

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% if think %}<think>\n{% endif %}{% endif %}")
    path = set_chat_template(make_checkpoint(str(tmp_path / "ckpt")), template)
    model = ServedModel(path, reasoning_parser="qwen3")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body, model).reasoning == Reasoning("qwen3", False)
    assert parse_chat({**body, "chat_template_kwargs": {"think": True}}, model).reasoning == Reasoning("qwen3", True)
    asked = {**body, "response_format": {"type": "json_object"}}
    assert parse_chat(asked, model).reasoning == Reasoning("qwen3", False)
    assert parse_chat(asked, model).params[0].structured_outputs == {"json_object": True, "reasoning_block": "optional"}
    opened = parse_chat({**asked, "chat_template_kwargs": {"think": True}}, model).params[0].structured_outputs
    assert opened == {"json_object": True, "reasoning_block": "open"}
    assert parse_chat(asked, ServedModel(path)).params[0].structured_outputs == {"json_object": True}
    assert parse_chat({**body, "use_beam_search": True, "n": 2, "temperature": 0}, model).reasoning is not None
    assert parse_chat(body, ServedModel(path)).reasoning is None
