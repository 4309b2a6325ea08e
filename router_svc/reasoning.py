"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's `<think>...</think>` text goes to the
chat message's `reasoning_content` (DeepSeek's field name, as vLLM sends it) instead of its `content`.

Where the output starts is read from the rendered prompt's end (`reasoning_for`), since templates differ:
- `qwen3` (Qwen3, QwQ, Qwen3-*-Thinking): reasoning from the start if the prompt ends inside an open
  `<think>` (QwQ's and the Thinking models' templates open it), else only if the output opens with
  `<think>`; `chat_template_kwargs: {"enable_thinking": false}` makes Qwen3's template close the block in
  the prompt, so the output is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills): reasoning from the start (R1's template opens `<think>`;
  an opening tag the model writes anyway is dropped) unless the prompt ends after a closed block.
In the block, text up to `</think>` is reasoning; the rest is content.

Both: a block never closed (cut by max_tokens) is all reasoning, whole and streamed alike. A request
with a grammar (response_format, structured_outputs, a forced tool call) gets it after the block
(`grammar_block`, the engine's structured_outputs.reasoning_block), as vLLM applies it after the
reasoning ends: the thinking stays free, the answer follows the grammar. Streamed, text
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


@dataclass(frozen=True, slots=True)
class Reasoning:
    """One chat request's split: its parser, and whether its output starts inside the block."""

    parser: str
    thinking: bool
    closed: bool = False  # the prompt closed the block (e.g. Qwen3's enable_thinking: false): all content

    @property
    def grammar_block(self) -> str | None:
        """Where a grammar starts: after the block the output is in ("open"), or after one it may open
        first ("optional"), or at once (None: the prompt closed the block)."""
        return "open" if self.thinking else None if self.closed else "optional"

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.thinking)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        reasoning, content = self.stream().feed(text, finished=True)
        return reasoning or None, content


def reasoning_for(parser: str, prompt_tail: str) -> Reasoning:
    """The split for a prompt that ends with `prompt_tail` (its last tokens' text, special tokens kept)."""
    opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
    return Reasoning(parser, opened > closed if parser == "qwen3" else not closed > opened, closed > opened)


@dataclass(slots=True)
class ReasoningStream:
    """One choice's text, fed chunk by chunk: each feed returns (reasoning, content) to send now."""

    thinking: bool  # in the block (from the start: the prompt opened it)
    buffer: str = ""
    started: bool = False  # past where an opening tag could be
    done: bool = False  # past the block: everything is content

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


def _tag_prefix(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of END."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if text.endswith(END[:n]):
            return n
    return 0
