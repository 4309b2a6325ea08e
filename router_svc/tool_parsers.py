"""Tool-call parsers for tool_choice "auto": the calls a model wrote in its own format, read out of its
free text (vLLM's --tool-call-parser; the router's `--tool-call-parser NAME` turns "auto" on).

- `hermes` (Hermes 2/3, Qwen2.5 / Qwen3 and the templates that copy them): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a last one possibly unclosed at the end.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): an answer that opens with `{` (or with the
  `<|python_tag|>` token) is a call `{"name": ..., "parameters": {...}}` naming one of the request's tools,
  or several joined by `;`. Such an answer is held back until it ends; if it is not calls after all (any
  other JSON, a name that is no tool), it is sent as content.
- `mistral` (Mistral / Mixtral instruct): text, then `[TOOL_CALLS]` and either a JSON array of
  `{"name", "arguments"}` objects (tokenizers before v11) or `name[ARGS]{...}` calls, each after its own
  `[TOOL_CALLS]` (v11 on). Content streams until the tag; what follows is held until the end and is
  calls if every one names a request's tool, else content as written.
- `pythonic` (Llama 3.2 / 4 and others' Python-list calls): an answer that opens with `[` (or
  `<|python_start|>`) and is a Python list of calls with keyword arguments of literal values,
  `[get_weather(city="Oslo"), get_time(zone=1)]`, each naming a request's tool, is calls; held back
  until it ends, like llama3_json.

The text outside the calls is the message's content (None when there are calls and it is only
whitespace). A span between the tags that is not a call ({"name": str, "arguments": object}) stays in
the content as the model wrote it, so a whole answer and a streamed one say the same thing: streamed,
content goes out as it is generated except for a tail that could still become an opening tag (and
leading whitespace, until something else follows), and each call goes out whole once its closing tag
(or the end of the output) arrives.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"  # mistral
PY_START, PY_END = "<|python_start|>", "<|python_end|>"  # pythonic, as Llama 4 wraps its calls


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of: {', '.join(PARSERS)}")
    return name


def reader(name: str, tools: tuple[str, ...] = ()) -> HermesStream | Llama3JsonStream | MistralStream:
    """A fresh streamed reader of parser `name`: feed(text, finished) -> deltas; `.calls` so far.
    `tools`: the request's function names (llama3_json, mistral and pythonic take calls only if they name them)."""
    if name == "llama3_json":
        return Llama3JsonStream(tools=tools)
    if name == "pythonic":
        return Llama3JsonStream(tools=tools, opens=(PY_START, "["), parse=_pythonic_calls)
    return MistralStream(tools=tools) if name == "mistral" else HermesStream()


def parse_calls(text: str, name: str = "hermes", tools: tuple[str, ...] = ()
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls in OpenAI's shape) of a whole output."""
    stream = reader(name, tools)
    deltas = stream.feed(text, finished=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", ())]
    return content or None, calls


@dataclass(slots=True)
class HermesStream:
    """One streamed choice: `feed` each chunk of text, get the deltas to send. Whitespace before any other
    content is held back: dropped if the answer turns out to be calls only (a whole answer's content is
    then None), sent with what follows otherwise."""

    buffer: str = ""
    in_call: bool = False
    calls: int = 0
    held: str = ""  # whitespace not sent yet (nothing else was)
    said: bool = False  # some content was sent

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(OPEN)
                if at < 0:  # hold back a tail that may be the start of an opening tag
                    keep = 0 if finished else _open_prefix(self.buffer)
                    self._say(out, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    if finished and self.held and not self.calls:
                        out.append({"content": self.held})
                    return out
                self._say(out, self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at + len(OPEN):], True
                continue
            end = self.buffer.find(CLOSE)
            if end < 0 and not finished:
                return out
            body, closed = (self.buffer[:end], True) if end >= 0 else (self.buffer, False)
            self.buffer, self.in_call = (self.buffer[end + len(CLOSE):] if closed else ""), False
            call = _call(body)
            if call is None:  # not a call: the model's text, as written
                self._say(out, OPEN + body + (CLOSE if closed else ""))
            else:
                out.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1

    def _say(self, out: list[dict[str, Any]], text: str) -> None:
        if not text:
            return
        if not self.said and not text.strip():
            self.held += text
            return
        out.append({"content": self.held + text})
        self.held, self.said = "", True


def _llama3_json_calls(text: str) -> list[dict[str, Any]] | None:
    return _json_calls(text.lstrip().removeprefix(PYTHON_TAG))


@dataclass(slots=True)
class Llama3JsonStream:
    """An answer that is calls or prose, told by how it opens (llama3_json: `{` or <|python_tag|>;
    pythonic: `[` or <|python_start|>): prose streams as generated, calls wait for the end."""

    tools: tuple[str, ...] = ()  # the request's function names: an answer naming none is content
    opens: tuple[str, str] = (PYTHON_TAG, "{")  # (the tag a call may open with, the character it may)
    parse: Any = _llama3_json_calls  # the whole answer -> its calls, or None
    buffer: str = ""
    mode: str = ""  # "" undecided, "content", "call"
    calls: int = 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        self.buffer += text
        if not self.mode:
            head = self.buffer.lstrip()
            if not finished and self.opens[0].startswith(head):
                return []  # only whitespace, or the start of the tag: not decided yet
            self.mode = "call" if head.startswith(self.opens) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return [{"content": out}] if out else []
        if not finished:
            return []
        found = self.parse(self.buffer)
        if found is None or any(c["function"]["name"] not in self.tools for c in found):  # not calls after all
            return [{"content": self.buffer}] if self.buffer else []
        self.calls = len(found)
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(found)]


@dataclass(slots=True)
class MistralStream:
    """mistral: content streams until [TOOL_CALLS] (a tail that could be its start held back); from the tag
    on everything waits for the end, then is calls if it parses and names the request's tools, else content."""

    tools: tuple[str, ...] = ()
    buffer: str = ""
    in_calls: bool = False
    calls: int = 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        if not self.in_calls:
            at = self.buffer.find(TOOL_CALLS)
            cut = at if at >= 0 else len(self.buffer) - (0 if finished else _open_prefix(self.buffer, TOOL_CALLS))
            if cut:
                out.append({"content": self.buffer[:cut]})
            self.buffer, self.in_calls = self.buffer[cut:], at >= 0
        if not (self.in_calls and finished):
            return out
        found = _mistral_calls(self.buffer[len(TOOL_CALLS):])
        if found is None or any(c["function"]["name"] not in self.tools for c in found):
            return out + [{"content": self.buffer}]
        self.calls = len(found)
        return out + [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(found)]


def _mistral_calls(text: str) -> list[dict[str, Any]] | None:
    """After [TOOL_CALLS]: a JSON array of call objects, or `name[ARGS]{...}` calls each after its own tag."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return None
        calls = [_as_call(item) for item in items] if isinstance(items, list) else []
        return [c for c in calls if c is not None] if calls and None not in calls else None
    found: list[dict[str, Any]] = []
    for part in text.split(TOOL_CALLS):
        name, sep, args = part.partition(ARGS)
        try:
            call = _as_call({"name": name.strip(), "arguments": json.loads(args)}) if sep else None
        except (ValueError, RecursionError):
            return None
        if call is None:
            return None
        found.append(call)
    return found


def _pythonic_calls(text: str) -> list[dict[str, Any]] | None:
    """A Python list of calls with keyword arguments of literals (ast, never eval), as OpenAI calls."""
    text = text.strip().removeprefix(PY_START).removesuffix(PY_END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    found: list[dict[str, Any]] = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or any(
                kw.arg is None for kw in node.keywords):
            return None
        try:
            call = _as_call({"name": node.func.id, "arguments": {kw.arg: ast.literal_eval(kw.value)
                                                                  for kw in node.keywords}})
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set, bytes)
            return None
        if call is None:
            return None
        found.append(call)
    return found


def _json_calls(text: str) -> list[dict[str, Any]] | None:
    """One or more call objects, joined by ';' (and whitespace); None unless the whole text is that."""
    decoder, at, found = json.JSONDecoder(), 0, list[dict[str, Any]]()
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return found or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = _as_call(obj)
        if call is None:
            return None
        found.append(call)


def _open_prefix(text: str, tag: str = OPEN) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(body: str) -> dict[str, Any] | None:
    try:
        return _as_call(json.loads(body))
    except (ValueError, RecursionError):
        return None


def _as_call(obj: Any) -> dict[str, Any] | None:
    """{"name": str, "arguments" or "parameters": object} in OpenAI's tool-call shape, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")  # one of them must be there
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
