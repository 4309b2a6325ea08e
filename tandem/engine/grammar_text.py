"""A structured-outputs spec as llguidance grammar text (tandem/engine/structured.py compiles it).

`spec_key` names a spec for the compile cache. JSON is compiled without free whitespace (only the
separators), so a model cannot loop on spaces. A thinking model's answer (`reasoning_block`) gets the
grammar after its `<think>` block (after_reasoning).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from tandem.sampling_params import STRUCTURED_KINDS as KINDS

_JSON_OPTIONS = {"whitespace_flexible": False}


def spec_key(spec: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in spec.items() if k in KINDS or k == "reasoning_block"}, sort_keys=True,
                      separators=(",", ":"))


def grammar_text(spec: dict[str, Any], think_tags: dict[str, int]) -> str:
    grammar = _kind_text(spec)
    block = spec.get("reasoning_block")
    return grammar if block is None else after_reasoning(grammar, block, think_tags)


def after_reasoning(grammar: str, block: str, think_tags: dict[str, int]) -> str:
    """`grammar` behind a `<think>` block that the output starts inside ("open") or may open first
    ("optional"). llguidance takes a list of grammars, the first the start one, `@name` one nested in
    another; the tags are matched as the special tokens they are where the tokenizer has them so
    (`think_tags`: text -> id), else as text. The block's text is lazy: it ends at the first `</think>`."""
    inner = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer = {**inner[0], "name": inner[0].get("name") or "answer"}
    end, start = think_tags.get("</think>"), think_tags.get("<think>")
    think = (f"think: THINK <[{end}]>\nTHINK: /(?s:.*)/" if end is not None  # text never spans a special token
             else "think[lazy]: /(?s:.*)<\\/think>/")
    opener = f"<[{start}]>" if start is not None else '"<think>"'
    top = "think WS" if block == "open" else f"(WS {opener} think)? WS"
    lark = f"start: {top} @{answer['name']}\n{think}\nWS: /[ \\t\\r\\n]{{0,3}}/\n"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, answer, *inner[1:]]})


def _kind_text(spec: dict[str, Any]) -> str:
    kind, value = next((k, v) for k, v in spec.items() if k in KINDS)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in value))
        return llguidance.LLMatcher.grammar_from_lark(value)
    except ValueError as exc:  # e.g. a schema that is not a JSON object
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None
