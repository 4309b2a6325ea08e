"""Structured outputs through the front door, disaggregated (router + prefill + decode processes,
every prompt prefilled remotely, so the first token is sampled under the grammar on the prefill
worker): OpenAI `response_format` (json_schema, json_object), vLLM's `structured_outputs` and
`guided_choice`; greedy equal to the offline engine; every seeded sample valid; bad grammars 400.
Also the logits controls the same way: penalties, logit_bias (string keys, as JSON sends them) and
min_tokens equal to the offline engine, P sampling the first token under them; and completions'
echo with the prompt's logprobs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from service_procs import post, start_serving, stop_all
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured-pd")
    ckpt = make_checkpoint(str(tmp / "ckpt"))
    procs, ep = start_serving(ckpt, tmp)
    try:
        yield {"http": ep["http"], "grpc": ep["grpc"], "ckpt": ckpt}
    finally:
        stop_all(procs)


def complete(http: str, **body) -> tuple[int, dict]:
    status, _, out = post(f"{http}/v1/completions", {"prompt": "record = ", "max_tokens": 60, **body})
    return status, out


def test_greedy_json_schema_equals_offline_and_validates(cluster):
    from tandem import LLM, SamplingParams

    status, out = complete(cluster["http"], temperature=0,
                           response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    assert status == 200, out
    expected = LLM(cluster["ckpt"], num_kv_blocks=256).generate(
        ["record = "], SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA}))[0].text
    assert out["choices"][0]["text"] == expected
    jsonschema.validate(json.loads(expected), SCHEMA)


def test_every_seeded_sample_is_valid(cluster):
    http = cluster["http"]
    for seed in range(6):
        status, out = complete(http, temperature=1.0, seed=seed, structured_outputs={"regex": r"[a-f]{2,5}-[0-9]{1,3}"})
        assert status == 200 and re.fullmatch(r"[a-f]{2,5}-[0-9]{1,3}", out["choices"][0]["text"]), out
        status, out = complete(http, temperature=1.0, seed=seed, guided_choice=["alpha", "beta", "gamma"])
        assert status == 200 and out["choices"][0]["text"] in ("alpha", "beta", "gamma"), out
    status, _, out = post(f"{http}/v1/chat/completions", {"messages": [{"role": "user", "content": "json please"}],
                                                          "max_tokens": 80, "temperature": 1.0, "seed": 3,
                                                          "response_format": {"type": "json_object"}})
    assert status == 200, out
    text = out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text


def test_grpc_structured_outputs(cluster):
    import grpc
    from service_procs import grpc_stub

    from tandem.protocol import generation_pb2 as pb

    stub = grpc_stub(cluster["grpc"])
    params = pb.SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                               structured_outputs=json.dumps({"choice": ["alpha", "beta"]}))
    text = "".join(r.text for r in stub.Generate(pb.GenerateRequest(text="x = ", sampling=params), timeout=60))
    assert text in ("alpha", "beta")
    for bad in ("{not json", json.dumps({"regex": "(unclosed"})):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(structured_outputs=bad)),
                               timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.value.details()


def test_penalties_and_logit_bias_equal_offline(cluster):
    from tandem import LLM, SamplingParams

    kw = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 8}
    status, out = complete(cluster["http"], temperature=0, max_tokens=20, logit_bias={"1": 20, "40": 2.5}, **kw)
    assert status == 200, out
    expected = LLM(cluster["ckpt"], num_kv_blocks=256).generate(["record = "], SamplingParams(
        temperature=0, max_tokens=20, logit_bias={1: 20, 40: 2.5}, **kw))[0]
    assert out["choices"][0]["text"] == expected.text and out["usage"]["completion_tokens"] == len(expected.token_ids)
    assert len(expected.token_ids) == 9  # EOS (+20) forbidden for 8 tokens, taken at once after
    status, out = complete(cluster["http"], logit_bias={"999999": 1})
    assert status == 400 and out["error"]["param"] == "logit_bias", out


def test_completion_logprobs_with_text_offsets(cluster):
    from tandem import LLM, SamplingParams

    status, out = complete(cluster["http"], temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    text = out["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text and len(lp["tokens"]) == 12
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(12)]  # from the completion's start
    offline = LLM(cluster["ckpt"], num_kv_blocks=256).generate(["record = "], SamplingParams(
        temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))[0]
    want = [entry[t] for t, entry in zip(offline.outputs[0].token_ids, offline.outputs[0].logprobs)]
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert all(len(top) >= 2 for top in lp["top_logprobs"])


def test_echo_prompt_logprobs_through_pd_equal_llm_score(cluster):
    """The prompt is prefilled on P; its logprobs come from D's own pass (P never computes them), equal
    to the offline engine's score; the completion after it equals the offline greedy output."""
    from tandem import LLM, SamplingParams

    llm = LLM(cluster["ckpt"], num_kv_blocks=256)
    ids = llm.tokenizer.encode("record = {'id': 7, 'ok':")
    status, out = complete(cluster["http"], prompt=ids, temperature=0, max_tokens=4, echo=True, logprobs=2,
                           ignore_eos=True)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(llm.score(ids), abs=1e-4)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out["choices"][0]["text"] == llm.tokenizer.decode(ids, skip_special_tokens=False) + want.text
    assert len(lp["tokens"]) == len(ids) + 4


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
])
def test_bad_structured_requests_are_400s(cluster, body, param):
    status, out = complete(cluster["http"], **body)
    assert status == 400 and out["error"]["param"] == param, out
    status, out = complete(cluster["http"], temperature=0, max_tokens=3)
    assert status == 200  # and the server keeps serving
