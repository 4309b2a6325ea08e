"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's `<think>...</think>` text goes to the
chat message's `reasoning_content` (DeepSeek's field name, as vLLM sends it) instead of its `content`.

- `qwen3` (Qwen3, QwQ): the output may open with `<think>`; what follows up to `</think>` is reasoning.
  With `chat_template_kwargs: {"enable_thinking": false}` the template closes the block in the prompt,
  so the output has no tag and is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills): the template opens `<think>` in the prompt, so the output
  starts as reasoning (an opening tag it writes anyway is dropped) and turns to content after `</think>`.

Both: a block never closed (cut by max_tokens) is all reasoning, whole and streamed alike. Streamed, text
goes out as generated except for a tail that could still be a tag. The content part then goes on to the
tool-call parser, if any (tool_calls.py).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of: {', '.join(PARSERS)}")
    return name


@dataclass(slots=True)
class ReasoningStream:
    """One choice's text, fed chunk by chunk: each feed returns (reasoning, content) to send now."""

    thinking: bool  # in the block (deepseek_r1: from the start)
    buffer: str = ""
    started: bool = False  # past where an opening tag could be
    done: bool = False  # past the block: everything is content

    @classmethod
    def for_parser(cls, name: str) -> ReasoningStream:
        return cls(thinking=name == "deepseek_r1")

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.buffer += text
        if self.done:
            out, self.buffer = self.buffer, ""
            return "", out
        if not self.started:
            head = self.buffer.lstrip()
            if not finished and len(head) < len(START) and START.startswith(head):
                return "", ""  # may still become the opening tag
            self.started = True
            if head.startswith(START):
                self.thinking, self.buffer = True, head[len(START):]
            elif not self.thinking:
                self.done = True
                out, self.buffer = self.buffer, ""
                return "", out
        at = self.buffer.find(END)
        if at >= 0:
            reasoning, content = self.buffer[:at], self.buffer[at + len(END):]
            self.buffer, self.done = "", True
            return reasoning, content
        keep = 0 if finished else _tag_prefix(self.buffer)
        reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, ""


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    reasoning, content = ReasoningStream.for_parser(parser).feed(text, finished=True)
    return reasoning or None, content


def _tag_prefix(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of END."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if text.endswith(END[:n]):
            return n
    return 0
