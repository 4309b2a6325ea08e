"""OpenAI parameters as clients send them, against a real router and decode worker (tiny random
checkpoint): `n` fanned out at the router with seed + i, batched prompts (strings and token-id lists),
the request bodies lm-eval (local-completions, local-chat-completions) and guidellm send, and the
400s for what the server does not do. Outputs are compared with the offline engine (greedy) or with
single requests (seeded sampling)."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
import urllib.request

import pytest
from service_procs import (
    Proc,
    get_json,
    grpc_stub,
    post,
    router_endpoints,
    sse,
    start_router,
    stop_all,
    wait_workers,
    worker_stats,
)
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # real processes: deselected by -m 'not slow'

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tandem import LLM

    tmp = tmp_path_factory.mktemp("params")
    ckpt = make_checkpoint(str(tmp / "ckpt"))
    router = start_router("router", ckpt, tmp)
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(Proc("d1", [sys.executable, "-m", "tandem.cli", "decode", "--model", ckpt, "--kv-connector",
                                 "none", "--listen", "tcp://127.0.0.1:0", "--router", ep["listen"],
                                 "--num-kv-blocks", "512"], tmp))
        llm = LLM(ckpt, num_kv_blocks=512)
        control = json.loads(procs[1].wait_for(r"tandem-\w+-ready (.*)").group(1))["control"]
        # a second router, admitting 2 requests, in front of the same worker
        procs.append(start_router("small", ckpt, tmp, "--decode", control, "--max-inflight", "2"))
        small = router_endpoints(procs[2])
        wait_workers(ep["http"], decode=1)
        wait_workers(small["http"], decode=1)
        yield {"http": ep["http"], "grpc": ep["grpc"], "small": small["http"], "llm": llm, "control": control,
               "router_log": router.log}
    finally:
        stop_all(procs)


def greedy(llm, prompts, max_tokens, **kw):
    from tandem import SamplingParams

    return [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))]


def complete(http, **body):
    status, _, out = post(f"{http}/v1/completions", {"model": "ckpt", **body})
    assert status == 200, out
    return out


# ---- n ---------------------------------------------------------------------------------------------
def test_n_with_a_seed_is_reproducible_and_choice_i_is_seed_plus_i(served):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 7}
    first = complete(served["http"], n=3, **body)
    again = complete(served["http"], n=3, **body)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) == 3  # seeds 7, 8, 9: three different samples
    singles = [complete(served["http"], **{**body, "seed": 7 + i})["choices"][0]["text"] for i in range(3)]
    assert texts == singles
    n_prompt = len(served["llm"].tokenizer.encode(PROMPT))
    assert first["usage"]["prompt_tokens"] == n_prompt  # the prompt is counted once, not n times
    assert first["usage"]["completion_tokens"] == 24
    # best_of equal to n is the same request
    assert [c["text"] for c in complete(served["http"], n=3, best_of=3, **body)["choices"]] == texts


def test_n_streamed_chat_interleaves_choices_by_index(served):
    body = {"model": "ckpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0,
            "seed": 3, "ignore_eos": True, "n": 2}
    status, _, whole = post(f"{served['http']}/v1/chat/completions", body)
    assert status == 200, whole
    events = sse(served["http"], "/v1/chat/completions",
                 {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, finish, roles = ["", ""], [None, None], [0, 0]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            roles[c["index"]] += c["delta"].get("role") == "assistant"
            finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert texts == [c["message"]["content"] for c in whole["choices"]] and texts[0] != texts[1]
    assert roles == [1, 1] and finish == ["length", "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_n_beyond_the_admission_limit_is_429_and_admits_nothing(served):
    status, headers, body = post(f"{served['small']}/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 3})
    assert status == 429 and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", body
    assert get_json(f"{served['small']}/health")[1]["in_flight"] == 0  # the 2 admitted ones were taken back
    out = complete(served["small"], prompt="x", max_tokens=2, n=2, temperature=0, ignore_eos=True)
    assert [c["text"] for c in out["choices"]] == greedy(served["llm"], ["x", "x"], 2, ignore_eos=True)


def test_a_client_gone_mid_stream_aborts_every_choice_on_the_worker(served):
    body = json.dumps({"model": "ckpt", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "n": 3,
                       "stream": True}).encode()
    host, port = served["http"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"X-Request-Id: gone\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
        # the first token of one choice can precede the others' admission: wait for all three to run
        deadline = time.monotonic() + 10
        while (stats := worker_stats(served["control"]))["running"] < 3:
            assert time.monotonic() < deadline, f"the three choices never ran together: {stats}"
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while (stats := worker_stats(served["control"]))["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, f"the choices still run on the worker: {stats}"
        time.sleep(0.05)
    log = served["router_log"].read_text()
    assert all(re.search(rf"aborting.*gone-{i}|gone-{i}.*aborting", log) for i in range(3)), log[-2000:]


# ---- batched prompts and the request shapes of real clients -----------------------------------------
def test_lm_eval_local_completions_generate_until(served):
    """lm-eval's local-completions (tokenized_requests, batch_size 2): token-id prompts in a batch, stop,
    temperature 0, a seed; choices come back in prompt order."""
    llm, prompts = served["llm"], ["def f(x):", "class A:\n    def"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    out = complete(served["http"], prompt=ids, max_tokens=10, temperature=0, stop=["\n\n"], seed=1234)
    assert [c["text"] for c in out["choices"]] == greedy(llm, prompts, 10, stop=["\n\n"])
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
    # tokenized_requests=False: the same batch as strings
    out = complete(served["http"], prompt=prompts, max_tokens=10, temperature=0, stop=["\n\n"], seed=1234)
    assert [c["text"] for c in out["choices"]] == greedy(llm, prompts, 10, stop=["\n\n"])
    # n x batch: prompt-major
    out = complete(served["http"], prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c["text"] for c in out["choices"]] == [t for t in greedy(llm, prompts, 4) for _ in range(2)]


def test_lm_eval_local_chat_completions(served):
    llm = served["llm"]
    messages = [{"role": "user", "content": "Question: 2+2?\nAnswer:"}]
    status, _, out = post(f"{served['http']}/v1/chat/completions", {
        "messages": messages, "model": "ckpt", "max_tokens": 10, "temperature": 0, "stop": ["<|endoftext|>"],
        "seed": 1234})
    assert status == 200, out
    from tandem import SamplingParams

    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, stop=["<|endoftext|>"]))[0].text
    assert out["choices"][0]["message"]["content"] == want


def test_lm_eval_loglikelihood_echo_prompt_logprobs_equal_llm_score(served):
    """lm-eval's local-completions loglikelihood request: token-id prompts, max_tokens 0, echo, logprobs 1.
    Each choice is the prompt itself with its logprobs: None for the first token, then the engine's
    score of each token given its prefix, and the most likely token among the top entries."""
    llm = served["llm"]
    ids = [llm.tokenizer.encode(p) for p in ("def f(x):\n    return x", "class A:")]
    out = complete(served["http"], prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0, seed=1234)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == sum(map(len, ids))
    for choice, prompt in zip(out["choices"], ids):
        lp = choice["logprobs"]
        assert choice["text"] == llm.tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(llm.score(prompt), abs=1e-4)
        for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and max(top.values()) >= chosen - 1e-6
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(prompt))]


def test_grpc_takes_every_sampling_field_and_returns_prompt_logprobs(served):
    """The gRPC SamplingParams carries the penalties, min_tokens, logit_bias and prompt_logprobs the
    HTTP API has: greedy output equals the offline engine's under the same params (and differs from
    plain greedy, so they took effect); prompt logprobs come on the first message and equal LLM.score."""
    import grpc

    from tandem import SamplingParams
    from tandem.protocol import generation_pb2 as pb

    llm = served["llm"]
    ids = llm.tokenizer.encode("def f(x):\n    return x")
    kw = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, min_tokens=6, logit_bias={7: 8.0})
    stub = grpc_stub(served["grpc"])
    msgs = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=8, temperature=0, prompt_logprobs=2, **kw)), timeout=60))
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, **kw))[0].token_ids
    assert tokens != llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    first = msgs[0].prompt_logprobs
    assert [e.token_id for e in first] == ids[1:]
    assert [e.logprob for e in first] == pytest.approx(llm.score(ids), abs=1e-4)
    assert all(2 <= len(e.top) <= 3 for e in first) and not any(m.prompt_logprobs for m in msgs[1:])
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(presence_penalty=5.0)), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "presence_penalty" in err.value.details()


def test_echo_with_generated_tokens_puts_the_prompt_first(served):
    """lm-eval's newer shape (max_tokens 1) and a streamed echo: prompt text, then the greedy output;
    the prompt's logprobs, then the generated token's."""
    llm = served["llm"]
    want = greedy(llm, [PROMPT], 3)[0]
    out = complete(served["http"], prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0)
    choice = out["choices"][0]
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    assert choice["text"] == PROMPT + want and out["usage"]["completion_tokens"] == 3
    assert len(choice["logprobs"]["tokens"]) == n_prompt + 3
    assert choice["logprobs"]["token_logprobs"][1:n_prompt] == pytest.approx(llm.score(
        llm.tokenizer.encode(PROMPT)), abs=1e-4)
    assert choice["logprobs"]["text_offset"][n_prompt] == len(PROMPT)  # generated tokens start after the prompt
    events = sse(served["http"], "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                     "temperature": 0, "stream": True})
    texts = [c["text"] for e in events for c in e["choices"] if c["text"]]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + want


def test_guidellm_streams(served):
    """guidellm's OpenAI backend: streaming with usage, max_tokens and max_completion_tokens both set,
    stop null, ignore_eos, no temperature; chat content as a list of text parts."""
    events = sse(served["http"], "/v1/completions", {
        "model": "ckpt", "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 12, "max_completion_tokens": 12, "stop": None, "ignore_eos": True})
    text_chunks = [c["text"] for e in events for c in e["choices"] if c["text"]]
    assert len(text_chunks) >= 6  # streamed as it is generated (no temperature: sampled, any text)
    assert events[-1]["usage"]["completion_tokens"] == 12
    events = sse(served["http"], "/v1/chat/completions", {
        "model": "ckpt", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7, "max_completion_tokens": 7,
        "stop": None, "ignore_eos": True})
    assert events[-1]["usage"]["completion_tokens"] == 7


@pytest.mark.parametrize("field, value, named", [
    ("n", 0, "n"), ("n", "2", "n"), ("n", 65, "n"), ("best_of", 3, "best_of"),
    ("prompt", ["a", [1, 2]], "prompt"), ("prompt", [], "prompt"), ("prompt", [[]], "prompt"),
    ("prompt", ["x"] * 65, "prompt"), ("suffix", "}", "suffix"), ("max_tokens", 0, "max_tokens"),
    ("echo", "yes", "echo"), ("logprobs", 21, "logprobs"),
    ("logprobs", True, "logprobs"), ("stream_options", {"include_usage": True}, "stream_options")])
def test_refused_completion_fields_are_400_naming_them(served, field, value, named):
    status, _, body = post(f"{served['http']}/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
    assert status == 400 and body["error"]["param"] == named, body
    assert complete(served["http"], prompt="x", max_tokens=1)["choices"]  # and it keeps serving


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("tool_choice", "auto"),
                                          ("top_logprobs", 3), ("n", -1), ("echo", True)])
def test_refused_chat_fields_are_400_naming_them(served, field, value):
    status, _, body = post(f"{served['http']}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value})
    assert status == 400 and body["error"]["param"] == field, body


# ---- the typed models: OpenAPI, docs, and their errors as OpenAI 400s ------------------------------
def test_openapi_and_docs_are_served_from_the_typed_models(served):
    status, schema = get_json(f"{served['http']}/openapi.json")
    assert status == 200 and {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(
        schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "seed", "logit_bias", "max_completion_tokens", "stream_options"} <= set(props)
    assert schema["components"]["schemas"]["CompletionRequest"]["required"] == ["prompt"]
    with urllib.request.urlopen(f"{served['http']}/docs", timeout=10) as r:
        assert r.status == 200 and b"/openapi.json" in r.read()


@pytest.mark.parametrize("path, body, named", [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}, "top_logprobs"),
])
def test_type_errors_are_openai_400s_naming_the_field(served, path, body, named):
    status, _, out = post(f"{served['http']}{path}", body)
    assert status == 400 and out["error"]["param"] == named and named in out["error"]["message"], out
    assert out["error"]["type"] == "invalid_request_error"
