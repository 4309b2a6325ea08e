"""The router as real processes on loopback (ephemeral ports): `tandem router`, `tandem decode` and
`tandem prefill` workers that register and heartbeat, the `openai` client and a gRPC client; every
output is compared with the offline engine's greedy output on the same checkpoint. (The router's
core, registry and routing policies are unit-tested in test_router_core.py.)

Process map (module fixture `cluster`):
  router    --decode-policy round_robin; d1, d2 (decode) and p1 (prefill) register to its --listen
  small     a second router with static --decode d1 --prefill p1 and --max-inflight 2 (admission control)
  empty     a third router with no workers (503 / UNAVAILABLE)
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request

import grpc
import openai
import pytest
from service_procs import (
    Proc,
    get_json,
    grpc_stub,
    post,
    router_endpoints,
    start_router,
    stop_all,
    wait_workers,
    worker_stats,
)
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

MAX_TOKENS = 12


def start_worker(role: str, wid: str, ckpt: str, router: str, logs) -> Proc:
    # --local-prefill-threshold 0: every prompt goes through the prefill worker (the disaggregated path).
    extra = ["--local-prefill-threshold", "0"] if role == "decode" else []
    return Proc(wid, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                      "--router", router, "--worker-id", wid, "--num-kv-blocks", "512", *extra], logs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tandem import LLM

    tmp = tmp_path_factory.mktemp("router")
    ckpt = make_checkpoint(str(tmp / "ckpt"))
    logs = tmp / "logs"
    logs.mkdir()
    procs = [start_router("router", ckpt, logs, "--decode-policy", "round_robin", "--heartbeat-misses", "4"),
             start_router("empty", ckpt, logs)]
    try:
        ep = router_endpoints(procs[0])
        procs += [start_worker(role, wid, ckpt, ep["listen"], logs)
                  for role, wid in (("decode", "d1"), ("decode", "d2"), ("prefill", "p1"))]
        llm = LLM(ckpt, num_kv_blocks=512)  # the oracle loads while the workers start
        workers = {p.name: json.loads(p.wait_for(r"tandem-\w+-ready (.*)").group(1))["control"] for p in procs[2:]}
        procs.append(start_router("small", ckpt, logs, "--decode", workers["d1"], "--prefill", workers["p1"],
                                  "--max-inflight", "2"))
        info = {"ckpt": ckpt, "llm": llm, "procs": {p.name: p for p in procs}, "workers": workers, **ep,
                "empty": router_endpoints(procs[1]), "small": router_endpoints(procs[5])}
        wait_workers(ep["http"], 2, prefill=1)
        wait_workers(info["small"]["http"], 1, prefill=1)
        yield info
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def oracle(cluster):
    from tandem import SamplingParams

    llm = cluster["llm"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def complete(prompts):
        return [o.text for o in llm.generate(list(prompts), greedy)]

    def chat(messages):
        return llm.chat(messages, greedy)[0].text

    def token_ids(prompt):
        return llm.generate([prompt], greedy)[0].token_ids

    return complete, chat, token_ids


def client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0)


# ---- correctness -------------------------------------------------------------------------------
def test_openai_chat_and_completion_stream_match_offline(cluster, oracle):
    complete, chat, _ = oracle
    c = client(cluster["http"])
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chunks = list(c.chat.completions.create(model="ckpt", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat(messages)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS and chunks[-1].usage.prompt_tokens > 0

    prompt = "import os\nimport sys\n"
    stream = c.completions.create(model="ckpt", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == complete([prompt])[0]
    whole = c.completions.create(model="ckpt", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == complete([prompt])[0]
    assert (whole.usage.completion_tokens, whole.choices[0].finish_reason) == (MAX_TOKENS, "length")
    assert [m.id for m in c.models.list().data] == ["ckpt"]


def test_grpc_generate_matches_offline(cluster, oracle):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.protocol import generation_pb2 as pb

    prompt = "class Foo:\n    def"
    stub = grpc_stub(cluster["grpc"])
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    responses = list(stub.Generate(req, timeout=60))
    assert [t for r in responses for t in r.token_ids] == oracle[2](prompt)
    assert "".join(r.text for r in responses) == oracle[0]([prompt])[0]
    last = responses[-1]
    assert last.finished and last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster["grpc"]))
    assert health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Generation")).status == \
        health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflect = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(cluster["grpc"]))
    listed = next(iter(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    assert "tandem.v1.Generation" in {s.name for s in listed.list_services_response.service}


def test_32_concurrent_clients(cluster, oracle):
    prompts = [f"def function_{i}(x, y):\n    return" for i in range(32)]
    expected = oracle[0](prompts)
    aclient = openai.AsyncOpenAI(base_url=f"{cluster['http']}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> str:
        if i % 2:
            stream = await aclient.completions.create(model="ckpt", prompt=prompts[i], max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream])
        out = await aclient.completions.create(model="ckpt", prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(main()) == expected
    # They took the disaggregated path: P computed the prompts, D received their KV.
    stats = {w: worker_stats(a) for w, a in cluster["workers"].items()}
    assert stats["p1"]["prefills"] >= 32 and stats["d1"]["remote_prefills"] + stats["d2"]["remote_prefills"] >= 32
    assert stats["d1"]["remote_prefills"] and stats["d2"]["remote_prefills"]  # round_robin used both
    assert stats["d1"]["fallbacks"] + stats["d2"]["fallbacks"] == 0


def test_cancelled_stream_frees_blocks(cluster):
    from tandem.protocol import generation_pb2 as pb

    before = {w: worker_stats(a)["kv_blocks_used"] for w, a in cluster["workers"].items()}
    call = grpc_stub(cluster["grpc"]).Generate(pb.GenerateRequest(
        text="while True:", sampling=pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)))
    for i, _ in enumerate(call):
        if i == 2:
            call.cancel()
            break
    deadline = time.monotonic() + 10
    while True:
        stats = {w: worker_stats(a) for w, a in cluster["workers"].items()}
        idle = all(s["running"] == 0 and s["waiting"] == 0 for s in stats.values())
        if idle and all(stats[w]["kv_blocks_used"] == before[w] for w in stats):
            break
        assert time.monotonic() < deadline, f"blocks not freed after cancel: {stats} (before {before})"
        time.sleep(0.05)
    # An HTTP client that disconnects mid-stream is aborted the same way.
    body = json.dumps({"prompt": "while True:", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    import http.client
    host, port = cluster["http"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 10
    while any(worker_stats(a)["running"] for a in cluster["workers"].values()):
        assert time.monotonic() < deadline, "a disconnected HTTP stream was not aborted"
        time.sleep(0.05)
    assert get_json(f"{cluster['http']}/health")[1]["in_flight"] == 0


# ---- admission control and errors --------------------------------------------------------------
def test_overload_returns_429_and_resource_exhausted(cluster):
    import http.client

    from tandem.protocol import generation_pb2 as pb

    small = cluster["small"]
    host, port = small["http"].removeprefix("http://").split(":")
    long_body = json.dumps({"prompt": "for i in range(10):", "max_tokens": 900, "temperature": 0,
                            "ignore_eos": True, "stream": True}).encode()
    conns = []
    for _ in range(2):  # fill the admission limit (--max-inflight 2) with two long streams
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", long_body, {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conns.append(conn)
    try:
        status, headers, body = post(f"{small['http']}/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
        assert body["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client(small["http"]).chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(grpc.RpcError) as err:
            list(grpc_stub(small["grpc"]).Generate(pb.GenerateRequest(text="x"), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())["retry-after"] == "1"
    finally:
        for conn in conns:
            conn.close()
    deadline = time.monotonic() + 10
    while get_json(f"{small['http']}/health")[1]["in_flight"]:
        assert time.monotonic() < deadline, "closed streams were not released"
        time.sleep(0.05)
    status, _, body = post(f"{small['http']}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, body


@pytest.mark.parametrize("field, value", [("temperature", -1), ("temperature", 2.5), ("top_p", 2), ("max_tokens", 0),
                                          ("max_tokens", 5000), ("n", 0), ("presence_penalty", 3), ("top_k", "3"),
                                          ("stop", 5), ("logit_bias", {"x": 1}), ("echo", 1)])
def test_bad_parameters_are_400_naming_them(cluster, field, value):
    status, _, body = post(f"{cluster['http']}/v1/completions", {"prompt": "x", field: value})
    assert status == 400 and body["error"]["param"] == field and field in body["error"]["message"], body


def test_errors_openai_and_grpc(cluster):
    from tandem.protocol import generation_pb2 as pb

    c = client(cluster["http"])
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x")
    stub = grpc_stub(cluster["grpc"])
    with pytest.raises(grpc.RpcError) as gerr:
        list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=2.0)), timeout=10))
    assert gerr.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in gerr.value.details()
    with pytest.raises(grpc.RpcError) as gerr:
        list(stub.Generate(pb.GenerateRequest(text="x", model="gpt-4"), timeout=10))
    assert gerr.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as gerr:  # a message over the size cap is refused before it is parsed
        list(stub.Generate(pb.GenerateRequest(text="x" * (5 * 1024 * 1024)), timeout=10))
    assert gerr.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [r.text for r in stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2)),
                                          timeout=30)]  # and the next request is served
    empty = cluster["empty"]
    status, _, body = post(f"{empty['http']}/v1/completions", {"prompt": "x"})
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert get_json(f"{empty['http']}/health")[0] == 503
    with pytest.raises(grpc.RpcError) as gerr:
        list(grpc_stub(empty["grpc"]).Generate(pb.GenerateRequest(text="x"), timeout=10))
    assert gerr.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- worker failure (last: it kills d2) ------------------------------------------------------------
def test_killed_worker_requests_are_retried_elsewhere(cluster, oracle):
    prompts = [f"# note {i}\nimport" for i in range(8)]
    expected = oracle[0](prompts)
    cluster["procs"]["d2"].popen.kill()
    # round_robin sends every other request to d2, which is dead but not yet expired: those never
    # get a token, so when d2 misses its heartbeats the router re-sends them to d1.
    aclient = openai.AsyncOpenAI(base_url=f"{cluster['http']}/v1", api_key="none", max_retries=0)

    async def main():
        outs = await asyncio.gather(*(aclient.completions.create(model="ckpt", prompt=p, max_tokens=MAX_TOKENS,
                                                                  temperature=0) for p in prompts))
        return [o.choices[0].text for o in outs]

    started = time.monotonic()
    assert asyncio.run(main()) == expected
    assert time.monotonic() - started < 30
    health = wait_workers(cluster["http"], 1, prefill=1)
    assert [w["worker_id"] for w in health["workers"]] == ["d1", "p1"]
    metrics = urllib.request.urlopen(f"{cluster['http']}/metrics", timeout=10).read().decode()
    retries = float(re.search(r"^tandem_router_retries_total (\S+)", metrics, re.M).group(1))
    assert retries >= 1
