"""vLLM's text options: `include_stop_str_in_output` (the stop string, or the stop token's text, that
ended a request stays at the end of its text) and `skip_special_tokens: false` (special tokens' text is
kept) — offline against the same request without them, then through the front door (HTTP and gRPC)
equal to the offline engine."""

from __future__ import annotations

import json
import urllib.request

import pytest
from service_procs import grpc_stub, post, start_serving, stop_all
from tiny_models import make_checkpoint

PROMPT = "def walk(node):"
END = 2  # "<|end|>", a special token of the tiny tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("text") / "ckpt"))


@pytest.fixture(scope="module")
def llm(ckpt):
    from tandem import LLM

    return LLM(ckpt, num_kv_blocks=64)


def _text(llm, **kw) -> tuple[str, list[int]]:
    from tandem import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw))[0]
    return out.text, out.outputs[0].token_ids


def test_a_stop_string_stays_in_the_text_when_asked(llm):
    full, _ = _text(llm)
    stop = full[6:9]
    at = full.index(stop)
    assert _text(llm, stop=[stop])[0] == full[:at]
    assert _text(llm, stop=[stop], include_stop_str_in_output=True)[0] == full[:at + len(stop)]


def test_a_stop_token_keeps_its_text_when_asked(llm):
    _, ids = _text(llm)
    stop_token = ids[5]
    cut = ids[:ids.index(stop_token) + 1]
    text, got = _text(llm, stop_token_ids=[stop_token])
    assert got == cut and text == llm.tokenizer.decode(cut[:-1])
    assert _text(llm, stop_token_ids=[stop_token], include_stop_str_in_output=True)[0] == llm.tokenizer.decode(cut)


def test_special_tokens_text_is_kept_when_not_skipped(llm):
    forced = {"logit_bias": {END: 100.0}, "max_tokens": 3}
    from tandem import SamplingParams

    def text(**kw) -> str:
        return llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True, **forced, **kw))[0].text

    assert text() == "" and text(skip_special_tokens=False) == "<|end|>" * 3
    with pytest.raises(TypeError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    procs, ep = start_serving(ckpt, tmp_path_factory.mktemp("text-serve"), disaggregated=False, num_kv_blocks=64)
    try:
        yield ep
    finally:
        stop_all(procs)


@pytest.mark.slow
def test_both_through_http_and_grpc_equal_offline(llm, served):
    from tandem.protocol import generation_pb2 as pb

    full, _ = _text(llm)
    stop = full[6:9]
    want = _text(llm, stop=[stop], include_stop_str_in_output=True)[0]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    http = f"{served['http']}/v1/completions"
    status, _, out = post(http, {**body, "stop": stop, "include_stop_str_in_output": True})
    assert status == 200 and out["choices"][0]["text"] == want, out
    status, _, out = post(http, {**body, "logit_bias": {str(END): 100}, "max_tokens": 3, "skip_special_tokens": False})
    assert status == 200 and out["choices"][0]["text"] == "<|end|>" * 3, out
    status, _, out = post(http, {**body, "skip_special_tokens": "no"})
    assert status == 400 and out["error"]["param"] == "skip_special_tokens", out
    params = pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=True)
    got = "".join(r.text for r in grpc_stub(served["grpc"]).Generate(
        pb.GenerateRequest(text=PROMPT, sampling=params), timeout=60))
    assert got == want


@pytest.mark.slow
def test_json_nested_past_the_recursion_limit_is_a_400_not_a_500(served):
    import grpc

    from tandem.protocol import generation_pb2 as pb

    deep = "[" * 100_000 + "]" * 100_000
    req = urllib.request.Request(f"{served['http']}/v1/completions", ('{"prompt": ' + deep + "}").encode(),
                                 {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "not valid JSON" in json.loads(e.read())["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_stub(served["grpc"]).Generate(pb.GenerateRequest(
            text="x", sampling=pb.SamplingParams(structured_outputs=deep)), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, _, out = post(f"{served['http']}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, out  # and it keeps serving
