"""OpenAI tool calling on /v1/chat/completions, built on structured outputs: a grammar makes the model
write a call, and this module turns the text into `tool_calls` (whole answers and streamed deltas).

`tool_choice` (with `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]):
- "none": an ordinary answer.
- {"type": "function", "function": {"name": N}}: the output is N's arguments, constrained by N's
  `parameters` JSON schema: one call, finish_reason "stop" (what OpenAI answers for a forced function).
  Streamed: the call's id and name first, then its arguments as they are generated.
- "required": the output is a JSON array of one or more {"name", "parameters"} objects, each under
  its own tool's schema (one at most with parallel_tool_calls false): that many calls, finish_reason
  "tool_calls". Streamed: the calls go out
  whole once the array is complete (steps before send empty deltas, so the client sees each one).
- "auto", OpenAI's default when tools are given: the model answers freely, and the calls it writes in
  its own format are read out of its text by the router's `--tool-call-parser` (tool_parsers.py):
  finish_reason "tool_calls" when it made any. Without a parser it is a 400 naming tool_choice, as
  vLLM answers without one.
The tools always go to the chat template as `tools`, as transformers' apply_chat_template passes
them; a history's assistant `tool_calls` (their JSON-string arguments as objects) and `tool`
results reach it too (router_svc/prompts.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from router_svc.errors import BadRequest
from router_svc.tool_parsers import PARSERS, parse_calls
from router_svc.tool_parsers import reader as make_reader

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ToolPlan:
    """What a request's tool_choice asks of the output: `named` (one function's arguments under its
    grammar), `required` (an array of calls under one grammar), or, with a `parser`, "auto" (calls read
    out of free text)."""

    structured: dict[str, Any] | None  # the grammar, as SamplingParams.structured_outputs
    named: str | None = None
    parser: str | None = None  # "auto": calls read out of free text by this parser (tool_parsers.py)
    tools: tuple[str, ...] = ()  # the request's function names (for the parser)

    @property
    def parsed(self) -> bool:
        return self.parser is not None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's chat message and finish_reason."""
        if self.parser is not None:
            content, found = parse_calls(text, self.parser, self.tools)
            if not found:
                return {"role": "assistant", "content": content or ""}, finish_reason
            return ({"role": "assistant", "content": content, "tool_calls": found},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
        calls = self.calls(text, finish_reason)
        if calls is None:  # cut short (max_tokens): the text as it is, which is not a complete call
            return {"role": "assistant", "content": text}, finish_reason
        reason = finish_reason if self.named else "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": calls}, reason

    def calls(self, text: str, finish_reason: str | None) -> list[dict[str, Any]] | None:
        if self.named is not None:
            return [_call(self.named, text)]
        if finish_reason != "stop":
            return None
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return None
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


@dataclass(slots=True)
class ToolStream:
    """One streamed choice: the `delta` objects to send for each chunk of its text."""

    plan: ToolPlan
    call_id: str = field(default_factory=lambda: _call_id())
    text: str = ""
    started: bool = False
    reader: Any = None  # tool_parsers' reader, for "auto"

    def __post_init__(self) -> None:
        if self.plan.parser is not None:
            self.reader = make_reader(self.plan.parser, self.plan.tools)

    def deltas(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(deltas for this chunk, the finish_reason to send when `finished`)."""
        if self.plan.parsed:
            out = self.reader.feed(text, finished)
            return out, "tool_calls" if self.reader.calls and finish_reason == "stop" else finish_reason
        if self.plan.named is not None:
            out = []
            if not self.started:
                self.started = True
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": self.plan.named, "arguments": ""}}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out, finish_reason
        self.text += text
        if not finished:
            return [], None
        calls = self.plan.calls(self.text, finish_reason)
        if calls is None:
            return [{"content": self.text}], finish_reason
        return [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}], "tool_calls"


def tool_plan(body: dict[str, Any], parser: str | None = None
              ) -> tuple[list[dict[str, Any]] | None, ToolPlan | None]:
    """(the tools for the chat template, the output plan or None) from a chat body, checked; `parser`:
    the server's --tool-call-parser (None: "auto" is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools: give the functions the model may call", param="tool_choice")
        return None, None
    functions = _check_tools(tools)
    if (choice is None or choice == "auto") and parser is not None:
        return tools, ToolPlan(None, parser=parser, tools=tuple(functions))
    if choice is None or choice == "auto":
        raise BadRequest('tool_choice "auto" (the default when tools are given) needs a tool-call parser for the '
                         f"model's own call format: start the router with --tool-call-parser ({', '.join(PARSERS)}), "
                         'or send tool_choice "required", "none", or {"type": "function", "function": {"name": ...}}',
                         param="tool_choice")
    if choice == "none":
        return tools, None
    if any(body.get(name) is not None for name in ("response_format", "structured_outputs", "guided_json",
                                                   "guided_regex", "guided_choice", "guided_grammar")):
        raise BadRequest("tool_choice constrains the output itself: drop response_format / structured_outputs",
                         param="tool_choice")
    if choice == "required":
        shared, items = _hoist_definitions(functions), []
        for function, schema in functions.items():
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"const": function},
                                         "parameters": {k: v for k, v in schema.items() if k not in _DEFS}}})
        one = items[0] if len(items) == 1 else {"anyOf": items}
        array = {"type": "array", "minItems": 1, "items": one, **shared}
        if body.get("parallel_tool_calls") is False:
            array["maxItems"] = 1
        return tools, ToolPlan({"json": array})
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(named, str):
        raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}', param="tool_choice")
    if named not in functions:
        raise BadRequest(f"tool_choice names {named!r}, which is not among the tools ({', '.join(functions)})",
                         param="tool_choice")
    return tools, ToolPlan({"json": functions[named]}, named=named)


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, or a 400 naming `tools`."""
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {'type': 'function', 'function': {...}} objects", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        name, schema = fn.get("name"), fn.get("parameters", _ANY_OBJECT)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                             param="tools")
        if name in out:
            raise BadRequest(f"tools[{i}]: the function name {name!r} is given twice", param="tools")
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out[name] = schema or _ANY_OBJECT
    return out


_DEFS = ("$defs", "definitions")  # where a schema keeps the parts its "$ref"s point at


def _hoist_definitions(functions: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's `$defs` / `definitions`, merged for the root of the `required` array's schema: a
    "#/$defs/X" inside a tool's parameters must resolve there (pydantic-made schemas use them). Two
    tools that define one name differently are a 400."""
    out: dict[str, dict[str, Any]] = {}
    for name, schema in functions.items():
        for key in _DEFS:
            defs = schema.get(key) or {}
            if not isinstance(defs, dict):
                raise BadRequest(f"tools: {name}'s parameters.{key} must be an object", param="tools")
            for ref, definition in defs.items():
                if out.setdefault(key, {}).setdefault(ref, definition) != definition:
                    raise BadRequest(f"tools: two functions define {key}/{ref} differently: rename one "
                                     f"(tool_choice 'required' puts every tool's definitions in one schema)",
                                     param="tools")
    return out


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
