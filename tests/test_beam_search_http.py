"""Beam search through the front door: HTTP `use_beam_search` (completions and chat) answers what
`LLM.beam_search` gives offline, colocated and under P/D (prompt prefilled on P, beams expanded on D,
no blocks left behind); bad beam-search bodies are a 400 naming the field and the server keeps serving."""

import json

import pytest
from test_beam_search import MAX_TOKENS, PROMPTS, beam_checkpoint

from tandem import LLM, BeamSearchParams

pytestmark = pytest.mark.slow  # real processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return beam_checkpoint(tmp_path_factory)


# ---- served: router + decode worker (colocated) or + prefill worker (P/D) ----------------------------
def serve(mode, ckpt, tmp_path_factory):
    import sys

    from service_procs import Proc, router_endpoints, start_router, stop_all, wait_workers

    logs = tmp_path_factory.mktemp(f"beam-{mode}")
    procs = [start_router("router", ckpt, logs)]
    try:
        ep = router_endpoints(procs[0])

        def worker(role, *extra):
            return Proc(f"{role}-1", [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen",
                                      "tcp://127.0.0.1:0", "--router", ep["listen"], "--num-kv-blocks", "256",
                                      *extra], logs)

        if mode == "colocated":
            procs.append(worker("decode", "--kv-connector", "none"))
        else:
            procs += [worker("prefill"), worker("decode", "--local-prefill-threshold", "0")]
        ready = {p.name: json.loads(p.wait_for(r"tandem-\w+-ready (.*)").group(1)) for p in procs[1:]}
        wait_workers(ep["http"], decode=1, prefill=0 if mode == "colocated" else 1)
        yield {"http": ep["http"], "ready": ready, "mode": mode}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def colocated(ckpt, tmp_path_factory):
    yield from serve("colocated", ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def disaggregated(ckpt, tmp_path_factory):
    yield from serve("disaggregated", ckpt, tmp_path_factory)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_http_use_beam_search_equals_offline(mode, ckpt, request):
    from service_procs import post, worker_stats

    served = request.getfixturevalue(mode)
    llm = LLM(ckpt, num_kv_blocks=256)
    cases = [(4, PROMPTS[:1], {"early_stopping": True}), (2, PROMPTS[1:], {"length_penalty": 0.5})]
    for width, prompts, extra in cases:
        body = {"prompt": prompts[0] if len(prompts) == 1 else prompts, "use_beam_search": True,
                "n": width, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        status, _, out = post(f"{served['http']}/v1/completions", body)
        assert status == 200, out
        params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, **extra)
        expected = [s for o in llm.beam_search(prompts, params) for s in o.sequences]
        assert [c["text"] for c in out["choices"]] == [s.text for s in expected]
        assert [c["finish_reason"] for c in out["choices"]] == [s.finish_reason for s in expected]
        assert [c["index"] for c in out["choices"]] == list(range(len(expected)))
        assert out["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in expected)
    messages = [{"role": "user", "content": "hi"}]
    status, _, chat = post(f"{served['http']}/v1/chat/completions", {
        "messages": messages, "use_beam_search": True, "n": 3, "max_tokens": 6})
    assert status == 200, chat
    ids = llm.tokenizer.encode_chat(messages)
    expected = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    assert [c["message"]["content"] for c in chat["choices"]] == [s.text for s in expected]
    if served["mode"] == "disaggregated":  # the prompts were prefilled on P; the beams expanded on D
        stats = worker_stats(served["ready"]["decode-1"]["control"])
        assert stats["remote_prefills"] >= 3 and stats["fallbacks"] == 0
        assert worker_stats(served["ready"]["prefill-1"]["control"])["prefills"] >= 3
        assert stats["kv_blocks_used"] == 0


BAD_BODIES = [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2, "best_of": 3}, "best_of"), ({"temperature": 0.8}, "temperature"),
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
    ({"early_stopping": "sometimes"}, "early_stopping"), ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ({"length_penalty": "long"}, "length_penalty"),
]


@pytest.mark.parametrize("extra,param", BAD_BODIES)
def test_http_bad_beam_search_is_400_naming_the_field(colocated, extra, param):
    from service_procs import post

    served = colocated
    body = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 4, **extra}
    status, _, out = post(f"{served['http']}/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    status, _, out = post(f"{served['http']}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 200, out  # and the server keeps serving
