"""Tool calling through the front door, disaggregated (router + prefill + decode processes, every prompt
prefilled remotely, so the first token is sampled under the call's grammar on the prefill worker), with
the `openai` client: a named function's arguments equal the offline engine's greedy output under that
function's schema, whole and streamed; `required` calls validate against their own tool's schema; the
tools reach the chat template exactly as transformers renders them; bad tool requests are 400s naming
the field, and the server keeps serving."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from service_procs import post, start_serving, stop_all
from tiny_models import make_checkpoint, set_chat_template

pytestmark = pytest.mark.slow

# A template that shows tools, an assistant's calls and tool results (the shape of Hermes / Qwen ones).
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }}{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools-pd")
    ckpt = set_chat_template(make_checkpoint(str(tmp / "ckpt")), TOOLS_TEMPLATE)
    procs, ep = start_serving(ckpt, tmp)
    try:
        client = openai.OpenAI(base_url=f"{ep['http']}/v1", api_key="none", max_retries=0)
        yield {"http": ep["http"], "ckpt": ckpt, "client": client}
    finally:
        stop_all(procs)


def offline_greedy(ckpt: str, messages: list, schema: dict | None, max_tokens: int) -> str:
    from tandem import LLM, SamplingParams

    llm = LLM(ckpt, num_kv_blocks=256)
    ids = llm.tokenizer.encode_chat(messages, tools=TOOLS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=None if schema is None else {"json": schema})
    return llm.generate([ids], params)[0].text


def test_the_template_sees_tools_and_history_as_transformers_renders_them(cluster):
    from transformers import AutoTokenizer

    from router_svc.prompts import ServedModel

    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]
    ids = ServedModel(cluster["ckpt"]).encode_chat(history, tools=TOOLS)
    as_object = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    as_hf = [history[0], {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0],
                                                                       "function": as_object}]}, history[2]]
    hf = AutoTokenizer.from_pretrained(cluster["ckpt"]).apply_chat_template(as_hf, tools=TOOLS,
                                                                            add_generation_prompt=True)
    hf = hf["input_ids"] if hasattr(hf, "keys") else hf
    assert ids == list(hf)
    text = ServedModel(cluster["ckpt"]).tokenizer.decode(ids, skip_special_tokens=False)
    assert '"enum": ["c", "f"]' in text and '<call>{"name": "get_weather", "arguments": {"city": "Oslo"' in text
    resp = cluster["client"].chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none",
                                                     max_tokens=2)
    assert resp.usage.prompt_tokens == len(ids)


def test_named_function_equals_offline_greedy_under_its_schema(cluster):
    resp = cluster["client"].chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                     temperature=0, max_tokens=60)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments == offline_greedy(cluster["ckpt"], MESSAGES, WEATHER, 60)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_named_function_streamed_sends_id_and_name_then_the_arguments(cluster):
    stream = cluster["client"].chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                       temperature=0, max_tokens=60, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:]) and len(calls) > 3  # arguments as generated
    assert "".join(c.function.arguments for c in calls) == offline_greedy(cluster["ckpt"], MESSAGES, WEATHER, 60)
    assert deltas[-1].finish_reason == "stop" and not any(d.delta.content for d in deltas)


def test_required_calls_validate_against_their_own_tool(cluster):
    client, names = cluster["client"], set()
    for seed in range(6):
        resp = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    resp = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=7, max_tokens=300, n=4)
    for choice in resp.choices:  # any number of calls: each valid, or cut short by max_tokens as text
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls and choice.message.content is None
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        else:
            assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert names  # every choice above made a call


def test_required_streamed_equals_whole(cluster):
    kw = dict(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=120)
    whole = cluster["client"].chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c.choices[0] for c in cluster["client"].chat.completions.create(**kw, stream=True) if c.choices]
    calls = [t for c in chunks if c.delta.tool_calls for t in c.delta.tool_calls]
    assert len(calls) == 1 and chunks[-1].finish_reason == "tool_calls"
    assert (calls[0].function.name, calls[0].function.arguments) == (whole.function.name, whole.function.arguments)
    assert len(chunks) > 4  # a chunk per step while the array is incomplete


def test_tool_choice_none_is_an_ordinary_answer_over_the_tools_prompt(cluster):
    resp = cluster["client"].chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                     temperature=0, max_tokens=12)
    assert not resp.choices[0].message.tool_calls
    assert resp.choices[0].message.content == offline_greedy(cluster["ckpt"], MESSAGES, None, 12)


def test_required_resolves_each_tools_definitions(cluster):
    """Schemas made by pydantic keep their parts under $defs: they resolve inside the one schema
    tool_choice 'required' builds from every tool."""
    place = {"$defs": {"Place": {"type": "object", "additionalProperties": False, "required": ["city"],
                                 "properties": {"city": {"type": "string", "maxLength": 6}}}},
             "type": "object", "additionalProperties": False, "required": ["at"],
             "properties": {"at": {"$ref": "#/$defs/Place"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "visit", "parameters": place}}]
    for seed in range(3):
        resp = cluster["client"].chat.completions.create(model="", messages=MESSAGES, tools=tools, seed=seed,
                                                         tool_choice="required", parallel_tool_calls=False,
                                                         temperature=1.0, max_tokens=120)
        (call,) = resp.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), {**SCHEMAS, "visit": place}[call.function.name])
    clash = {**place, "$defs": {"Place": {"type": "string"}}}
    status, _, out = post(f"{cluster['http']}/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 4, "tool_choice": "required",
        "tools": [*tools, {"type": "function", "function": {"name": "go", "parameters": clash}}]})
    assert status == 400 and out["error"]["param"] == "tools" and "Place" in out["error"]["message"], out


def test_completions_refuse_tools(cluster):
    for extra, param in (({"tools": TOOLS, "tool_choice": "required"}, "tools"),
                         ({"tool_choice": NAMED}, "tool_choice")):
        status, _, out = post(f"{cluster['http']}/v1/completions", {"prompt": "x", "max_tokens": 2, **extra})
        assert status == 400 and out["error"]["param"] == param, out


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: no parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "use_beam_search": True, "n": 2}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s(cluster, extra, param):
    status, _, out = post(f"{cluster['http']}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert status == 400 and out["error"]["param"] == param, out
    status, _, out = post(f"{cluster['http']}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert status == 200, out  # and the server keeps serving
