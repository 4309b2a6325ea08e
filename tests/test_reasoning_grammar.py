"""A grammar behind a thinking model's `<think>` block (structured_outputs.reasoning_block, set by the
router's reasoning parser): the block is free text up to the first `</think>` — matched as the special
token where the tokenizer has one, else as text — then at most 3 whitespace characters, then the grammar,
for every kind of spec; "optional" lets the output open the block or answer at once. Checked on the
shipped tokenizer and on a copy whose tags are special tokens, by feeding llguidance the tokens a model
would sample. Through the front door (P/D, the `openai` client, a model trained to think): test_tool_parser.py."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tandem.default_model import ASSETS_DIR, TARGET_NAME
from tandem.engine.grammar_text import spec_key
from tandem.engine.structured import Grammars
from tandem.sampling_params import SamplingParams

TARGET = ASSETS_DIR / TARGET_NAME
SCHEMA = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                   "additionalProperties": False}}


def _grammars(special_tags: bool) -> tuple[Grammars, Tokenizer]:
    tok = Tokenizer.from_str((TARGET / "tokenizer.json").read_text())
    if special_tags:
        tok.add_special_tokens(["<think>", "</think>"])
    return Grammars(tok.to_str(), tok.get_vocab_size(), [1]), tok


@pytest.fixture(scope="module", params=[False, True], ids=["text-tags", "special-tags"])
def grammars(request) -> tuple[Grammars, Tokenizer]:
    return _grammars(request.param)


def accepts(grammars: Grammars, tok: Tokenizer, spec: dict, text: str) -> bool:
    """Every token of `text` allowed in turn, and the grammar complete after the last."""
    state = grammars.state(spec)
    for t in tok.encode(text, add_special_tokens=False).ids:
        if not state.allows(t):
            return False
        state.matcher.consume_token(t)
    return state.matcher.is_accepting()


def test_the_grammar_applies_after_the_block(grammars):
    g, tok = grammars
    opened = {**SCHEMA, "reasoning_block": "open"}
    assert accepts(g, tok, opened, 'thinking {not json} <b>\n</think>\n\n{"a":1}')
    assert accepts(g, tok, opened, '</think>{"a":22}')  # an empty block
    assert not accepts(g, tok, opened, 'x</think>{"b":1}')  # the answer still follows the schema
    assert not accepts(g, tok, opened, 'x</think>    {"a":1}')  # 4 spaces: a model cannot loop on them
    assert not accepts(g, tok, opened, 'x</think>{"a":1}</think>')  # the block ends at the first </think>
    assert not accepts(g, tok, opened, '{"a":1}')  # "open": the output is inside the block
    optional = {**SCHEMA, "reasoning_block": "optional"}
    assert accepts(g, tok, optional, '<think>plan</think>{"a":1}') and accepts(g, tok, optional, '{"a":1}')
    assert accepts(g, tok, optional, '\n<think>plan</think>\n{"a":1}')
    assert not accepts(g, tok, optional, 'plan</think>{"a":1}')  # text before the answer needs the tag
    assert not accepts(g, tok, SCHEMA, '<think>plan</think>{"a":1}')  # without a block: from the first token


@pytest.mark.parametrize("spec,answer,wrong", [({"regex": "[a-z]+"}, "abc", "ab1"),
                                               ({"choice": ["yes", "no"]}, "no", "maybe"),
                                               ({"grammar": 'start: "a"+ "!"'}, "aaa!", "aab"),
                                               ({"json_object": True}, '{"k":[1]}', "[1]")])
def test_every_kind_of_spec_follows_a_block(grammars, spec, answer, wrong):
    g, tok = grammars
    spec = {**spec, "reasoning_block": "open"}
    assert accepts(g, tok, spec, f"some thought 123</think>{answer}")
    assert not accepts(g, tok, spec, f"some thought</think>{wrong}")


def test_the_tags_are_the_special_tokens_when_the_tokenizer_has_them():
    g, tok = _grammars(special_tags=True)
    assert set(g.think_tags) == {"<think>", "</think>"}
    end = tok.token_to_id("</think>")
    state = g.state({**SCHEMA, "reasoning_block": "open"})
    for t in tok.encode("plan", add_special_tokens=False).ids:
        state.matcher.consume_token(t)
    assert state.allows(end)  # the model's own end-of-thinking token
    assert not _grammars(special_tags=False)[0].think_tags  # the shipped tokenizer: the text


def test_specs_with_and_without_a_block_are_cached_apart_and_bad_values_named():
    assert spec_key({**SCHEMA, "reasoning_block": "open"}) != spec_key(SCHEMA)
    with pytest.raises(ValueError, match="structured_outputs.reasoning_block must be one of"):
        SamplingParams(structured_outputs={**SCHEMA, "reasoning_block": "closed"})
    assert json.loads(spec_key({**SCHEMA, "reasoning_block": "optional"}))["reasoning_block"] == "optional"
