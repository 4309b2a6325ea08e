"""tool_choice "auto" with the router's `--tool-call-parser hermes` (and `--reasoning-parser qwen3`): the
parser alone (a streamed answer, split anywhere, says what the whole one says), then through P/D with the
`openai` client on a tiny model trained in the fixture to answer five questions word for word — one call
after some text, two calls, no call, reasoning then an answer, reasoning then a call — so the calls and the
reasoning come from a real model's greedy output (checked against transformers first)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from service_procs import start_serving, stop_all
from test_tool_calls import TOOLS, TOOLS_TEMPLATE
from tiny_models import make_checkpoint, set_chat_template

from router_svc.tool_parsers import HermesStream, parse_calls, reader

ANSWERS = {
    "weather in Oslo?": 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
                        "</tool_call>",
    "and the time?": '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>\n'
                     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}</tool_call>',
    "hello": "Hi there, no tools needed.",
    "think first": "<think>It is cold there.</think>It is -3 in Oslo.",
    "think, then call": '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": '
                        '{"city": "Oslo", "unit": "c"}}</tool_call>',
}
LLAMA = {  # answers in llama3_json's format, trained alongside
    "time in Tokyo?": '{"name": "get_time", "parameters": {"zone": 9}}',
    "tell a joke": "Why did the function return? It had a call.",
}
EXPECTED = {  # (reasoning, content, [(name, arguments)], finish_reason)
    "weather in Oslo?": (None, "Let me look.", [("get_weather", '{"city": "Oslo", "unit": "c"}')], "tool_calls"),
    "and the time?": (None, None, [("get_time", '{"zone": 1}'), ("get_weather", '{"city": "Rome", "unit": "f"}')],
                      "tool_calls"),
    "hello": (None, "Hi there, no tools needed.", [], "stop"),
    "think first": ("It is cold there.", "It is -3 in Oslo.", [], "stop"),
    "think, then call": ("I need the weather.", None, [("get_weather", '{"city": "Oslo", "unit": "c"}')],
                         "tool_calls"),
}


def _named(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_streamed_answer_split_anywhere_says_what_the_whole_one_says():
    text = ('Sure.<tool_call>{"name": "a", "arguments": {"x": [1, 2]}}</tool_call>\n<tool_call>not json</tool_call>'
            '<tool_call>{"name": "b", "parameters": {}}</tool_call> then <tool_c')
    content, calls = parse_calls(text)
    assert content == "Sure.\n<tool_call>not json</tool_call> then <tool_c"  # a span that is no call stays text
    assert _named(calls) == [("a", '{"x": [1, 2]}'), ("b", "{}")]
    call = '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    for sample in (text, f"\n{call}\n\n{call}\n", "  \n", f"A{call}\n", f" \n{call} B", ""):
        whole, calls = parse_calls(sample)
        for cut in range(len(sample) + 1):
            for second in range(cut, len(sample) + 1):
                stream = HermesStream()
                deltas = stream.feed(sample[:cut], False) + stream.feed(sample[cut:second], False) + stream.feed(
                    sample[second:], True)
                assert "".join(d.get("content", "") for d in deltas) == (whole or ""), (sample, cut, second)
                streamed = [c for d in deltas for c in d.get("tool_calls", ())]
                assert _named(streamed) == _named(calls) and [c["index"] for c in streamed] == list(range(len(calls)))
    assert parse_calls(f"\n{call}\n\n{call}\n")[0] is None  # calls and only whitespace: no content
    assert parse_calls("  \n") == ("  \n", []) and parse_calls(f"A{call}\n")[0] == "A\n"
    assert parse_calls('<tool_call>{"name": "c", "arguments": {"k": 1}}')[1][0]["function"]["name"] == "c"  # unclosed
    assert parse_calls("no calls here") == ("no calls here", [])


def test_auto_keeps_special_tokens_so_call_tags_that_are_special_reach_the_parser(tmp_path):
    from router_svc.openai_api import parse_chat
    from router_svc.prompts import ServedModel

    model = ServedModel(make_checkpoint(str(tmp_path / "ckpt")), tool_call_parser="hermes")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert parse_chat(body, model).params[0].skip_special_tokens is False
    assert parse_chat({**body, "skip_special_tokens": True}, model).params[0].skip_special_tokens is True
    assert parse_chat({**body, "tool_choice": "none"}, model).params[0].skip_special_tokens is True


def _memorizing_checkpoint(path: str) -> str:
    """A tiny Llama trained until its greedy answer to each question is ANSWERS' (then EOS)."""
    import torch
    import transformers as tf

    from tandem.tokenizer import Tokenizer

    ckpt = set_chat_template(make_checkpoint(path), TOOLS_TEMPLATE)
    tok = Tokenizer(ckpt)
    seqs = [(tok.encode_chat([{"role": "user", "content": q}], tools=TOOLS), tok.encode(a, add_special_tokens=False)
             + [1]) for q, a in {**ANSWERS, **LLAMA}.items()]
    model = tf.LlamaForCausalLM.from_pretrained(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    # All sequences in one right-padded batch (one forward a step, not one per sequence: the fixture took
    # 46 s of CI); the loss is still each answer's mean token loss, summed over the answers.
    width = max(len(p) + len(t) for p, t in seqs)
    ids = torch.tensor([p + t + [0] * (width - len(p) - len(t)) for p, t in seqs])
    mask = torch.tensor([[1] * (len(p) + len(t)) + [0] * (width - len(p) - len(t)) for p, t in seqs])
    labels = torch.tensor([[-100] * len(p) + t + [-100] * (width - len(p) - len(t)) for p, t in seqs])
    for step in range(400):
        logits = model(ids, attention_mask=mask).logits[:, :-1].float()
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")
        loss = (per_token.sum(1) / (labels[:, 1:] != -100).sum(1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            with torch.no_grad():
                if all(model.generate(torch.tensor([p]), max_new_tokens=len(t) + 2, do_sample=False)[0, len(p):]
                       .tolist() == t for p, t in seqs):
                    model.save_pretrained(ckpt)
                    return ckpt
    raise AssertionError("the tiny model did not learn its answers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _memorizing_checkpoint(str(tmp_path_factory.mktemp("tool-parser") / "ckpt"))


@pytest.fixture(scope="module")
def llama_client(trained, tmp_path_factory):
    """A second router, reading calls as llama3_json, with a colocated worker on the same model."""
    procs, ep = start_serving(trained, tmp_path_factory.mktemp("llama3-json"), "--tool-call-parser", "llama3_json",
                              disaggregated=False, num_kv_blocks=128)
    try:
        yield openai.OpenAI(base_url=f"{ep['http']}/v1", api_key="none", max_retries=0)
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def client(trained, tmp_path_factory):
    procs, ep = start_serving(trained, tmp_path_factory.mktemp("tool-parser-pd"), "--tool-call-parser", "hermes",
                              "--reasoning-parser", "qwen3", num_kv_blocks=128)
    try:
        yield openai.OpenAI(base_url=f"{ep['http']}/v1", api_key="none", max_retries=0)
    finally:
        stop_all(procs)


@pytest.mark.slow
@pytest.mark.parametrize("question", list(ANSWERS))
def test_auto_reads_the_models_calls_whole_and_streamed(client, question):
    messages = [{"role": "user", "content": question}]
    resp = client.chat.completions.create(model="", messages=messages, tools=TOOLS, temperature=0, max_tokens=200)
    choice, (reasoning, content, calls, reason) = resp.choices[0], EXPECTED[question]
    assert choice.message.content == content and choice.finish_reason == reason
    assert choice.message.reasoning_content == reasoning  # type: ignore[attr-defined]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=200, stream=True)
        if c.choices]
    streamed = "".join(c.delta.content or "" for c in chunks)
    assert (streamed or None) == content and chunks[-1].finish_reason == reason
    thought = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    assert (thought or None) == reasoning
    deltas = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in deltas] == calls
    assert [t.index for t in deltas] == list(range(len(calls)))


@pytest.mark.slow
def test_a_bad_response_format_under_auto_is_named_as_such(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hello"}], tools=TOOLS,
                                       max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}})
    assert err.value.body["param"] == "structured_outputs"  # the client's grammar, not the tools'


@pytest.mark.slow
def test_a_grammar_applies_after_the_thinking(client):
    """The thinking stays free, the answer follows the grammar (as vLLM applies it after the reasoning)."""
    def ask(question: str, stream: bool, **kw) -> tuple[str | None, str | None, list]:
        args = dict(model="", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=200, **kw)
        if not stream:
            m = client.chat.completions.create(**args).choices[0].message
            return m.reasoning_content, m.content, m.tool_calls or []  # type: ignore[attr-defined]
        chunks = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True) if c.choices]
        thought = "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) or None
        calls = [t for d in chunks for t in d.tool_calls or []]
        return thought, "".join(d.content or "" for d in chunks) or None, calls

    for stream in (False, True):
        # the model's own answer fits: unchanged (a grammar from the first token would have cut the thinking)
        plain = dict(tools=TOOLS, tool_choice="none")  # the prompt it was trained on; no tool plan
        fits = ask("think first", stream, **plain,
                   extra_body={"structured_outputs": {"regex": r"It is -?\d+ in [A-Z]\w+\."}})
        assert fits[:2] == ("It is cold there.", "It is -3 in Oslo.")
        # it does not: the same thinking, then an answer the grammar allows
        thought, content, _ = ask("think first", stream, **plain,
                                  extra_body={"structured_outputs": {"regex": "Oslo is [a-z]+"}})
        # (the grammar lets up to 3 whitespace characters follow </think>: they start the content)
        assert thought == "It is cold there." and re.fullmatch(r"\s{0,3}Oslo is [a-z]+", content or "")
        # a forced call: thinking, then arguments under the tool's schema
        thought, content, calls = ask("think, then call", stream, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert thought == "I need the weather." and content is None and calls[0].function.name == "get_weather"
        assert all(getattr(c, "index", 0) == 0 for c in calls)  # one call (streamed: in pieces)
        arguments = json.loads("".join(c.function.arguments for c in calls))
        jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])


@pytest.mark.slow
def test_tool_choice_none_leaves_the_text_alone(client):
    resp = client.chat.completions.create(model="", messages=[{"role": "user", "content": "weather in Oslo?"}],
                                          tools=TOOLS, tool_choice="none", temperature=0, max_tokens=200)
    assert resp.choices[0].message.content == ANSWERS["weather in Oslo?"] and not resp.choices[0].message.tool_calls


@pytest.mark.slow
def test_llama3_json_reads_a_call_and_leaves_prose_alone(llama_client):
    messages = [{"role": "user", "content": "time in Tokyo?"}]
    for stream in (False, True):
        kw = dict(model="", messages=messages, tools=TOOLS, temperature=0, max_tokens=100)
        if not stream:
            choice = llama_client.chat.completions.create(**kw).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            reason, content = choice.finish_reason, choice.message.content
        else:
            chunks = [c.choices[0] for c in llama_client.chat.completions.create(**kw, stream=True) if c.choices]
            calls = [(t.function.name, t.function.arguments) for c in chunks for t in c.delta.tool_calls or []]
            reason, content = chunks[-1].finish_reason, "".join(c.delta.content or "" for c in chunks) or None
        assert (calls, reason, content) == ([("get_time", '{"zone": 9}')], "tool_calls", None)
    joke = llama_client.chat.completions.create(model="", messages=[{"role": "user", "content": "tell a joke"}],
                                                tools=TOOLS, temperature=0, max_tokens=100).choices[0]
    assert joke.message.content == LLAMA["tell a joke"] and not joke.message.tool_calls


def test_llama3_json_split_anywhere_equals_whole():
    call = '{"name": "f", "parameters": {"a": 1}}'
    samples = {call: 1, f'<|python_tag|>{call}; {{"name": "g", "arguments": {{}}}}': 2, "Hello {not a call": 0,
               '{"answer": 42}': 0, f"  {call} trailing": 0, "": 0, "<|py": 0, f"\n{call}\n": 1,
               '{"name": "Alice", "age": 30}': 0, '{"name": "h", "parameters": {}}': 0}  # no arguments; no such tool
    for text, count in samples.items():
        whole, calls = parse_calls(text, "llama3_json", ("f", "g"))
        assert len(calls) == count and (whole is None) == (count > 0 or not text), text
        if count == 0:
            assert whole == (text or None)  # not calls: the text as written
        for cut in range(len(text) + 1):
            for second in range(cut, len(text) + 1):
                stream = reader("llama3_json", ("f", "g"))
                deltas = stream.feed(text[:cut], False) + stream.feed(text[cut:second], False) + stream.feed(
                    text[second:], True)
                assert "".join(d.get("content", "") for d in deltas) == (whole or "")
                assert _named([c for d in deltas for c in d.get("tool_calls", ())]) == _named(calls)
    assert _named(parse_calls(f"<|python_tag|>{call}", "llama3_json", ("f",))[1]) == [("f", '{"a": 1}')]


def _split_anywhere_equals_whole(name: str, samples: dict[str, int], tools: tuple[str, ...]) -> None:
    """Every sample read whole finds `count` calls (and is content as written when it finds none), and read
    as three chunks split at any two places sends the same content and calls."""
    for text, count in samples.items():
        whole, calls = parse_calls(text, name, tools)
        assert len(calls) == count, text
        if count == 0:
            assert whole == (text or None)  # not calls: the text as written
        for cut in range(len(text) + 1):
            for second in range(cut, len(text) + 1, 3):
                stream = reader(name, tools)
                deltas = stream.feed(text[:cut], False) + stream.feed(text[cut:second], False) + stream.feed(
                    text[second:], True)
                assert "".join(d.get("content", "") for d in deltas) == (whole or ""), (text, cut, second)
                assert _named([c for d in deltas for c in d.get("tool_calls", ())]) == _named(calls)


def test_mistral_reads_both_call_formats_split_anywhere():
    array = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    v11 = '[TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[ARGS]{"b": "x"}'
    samples = {array: 2, f"Let me check.{v11}": 2, v11: 2, "No tools [TOOL here": 0, "": 0,
               '[TOOL_CALLS][{"name": "h", "arguments": {}}]': 0,  # no such tool: content
               "[TOOL_CALLS]f[ARGS]{not json": 0, '[TOOL_CALLS]{"name": "f"}': 0, "[TOOL_CALLS][]": 0}
    _split_anywhere_equals_whole("mistral", samples, ("f", "g"))
    content, calls = parse_calls(f"Let me check.{v11}", "mistral", ("f", "g"))
    assert content == "Let me check." and _named(calls) == [("f", '{"a": [1, 2]}'), ("g", '{"b": "x"}')]


def test_pythonic_reads_a_list_of_calls_and_never_runs_code():
    calls = '[f(a=1, b="two", c=[3.5, None, True]), g()]'
    samples = {calls: 2, f"<|python_start|>{calls}<|python_end|>": 2, f"  {calls}\n": 2, "[1, 2]": 0,
               "Hello [world]": 0, "[f(1)]": 0, "[f(**kw)]": 0, "[h(a=1)]": 0, "[f(a={1, 2})]": 0,
               '[__import__("os").system("true")]': 0, "[f(a=x)]": 0, "[f(a=1)": 0, "": 0, "<|python": 0}
    _split_anywhere_equals_whole("pythonic", samples, ("f", "g"))
    assert _named(parse_calls(calls, "pythonic", ("f", "g"))[1]) == [
        ("f", '{"a": 1, "b": "two", "c": [3.5, null, true]}'), ("g", "{}")]
