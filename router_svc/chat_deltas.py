"""A streamed chat choice whose text is parsed on its way out: reasoning (reasoning.py) split from the
content, and the content read for tool calls (tool_calls.py) — the delta objects to send per chunk, and
the whole message for a non-streamed answer, so the two always agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router_svc.reasoning import Reasoning, ReasoningStream
from router_svc.tool_calls import ToolPlan, ToolStream


@dataclass(slots=True)
class ChoiceDeltas:
    reasoning: ReasoningStream | None
    tools: ToolStream | None

    @classmethod
    def make(cls, reasoning: Reasoning | None, tools: ToolPlan | None) -> ChoiceDeltas:
        return cls(None if reasoning is None else reasoning.stream(), None if tools is None else ToolStream(tools))

    def feed(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(deltas for this chunk, the finish_reason to send when `finished`)."""
        out: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            thought, content = self.reasoning.feed(text, finished)
            if thought:
                out.append({"reasoning_content": thought})
        if self.tools is not None:
            deltas, finish_reason = self.tools.deltas(content, finished, finish_reason)
            return out + deltas, finish_reason
        if content:
            out.append({"content": content})
        return out, finish_reason


def whole_message(text: str, finish_reason: str | None, reasoning: Reasoning | None,
                  tools: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """A non-streamed answer's chat message and finish_reason."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text)
    if tools is not None:
        message, finish_reason = tools.message(text, finish_reason)
    else:
        message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = thought
        if thought is not None and not message.get("content") and not message.get("tool_calls"):
            message["content"] = None  # cut short while thinking: no answer yet
    return message, finish_reason
