"""A decode worker that refuses a request it never ran costs the client nothing: the router sends
the request to another decode worker. This is what happens when a request is routed to a worker in
the instant it switches from decode to prefill (test_role_switch.py); here it is made certain, as real
processes: a router whose static `--decode` list names a prefill worker's address beside a real
decode worker's, round robin. Every request must come back with the offline engine's greedy output
and the router must count the re-routes.
"""

from __future__ import annotations

import json
import sys

import pytest
from service_procs import Proc, metric_value, post, router_endpoints, start_router, stop_all
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow


def test_request_refused_by_a_prefill_worker_goes_to_a_decode_worker(tmp_path):
    from tandem import LLM, SamplingParams

    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [Proc(role, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                         "--num-kv-blocks", "128"], logs) for role in ("prefill", "decode")]
    try:
        addr = {p.name: json.loads(p.wait_for(r"tandem-\w+-ready (.*)").group(1))["control"] for p in procs}
        # the prefill worker first: round robin's first pick is the worker that refuses
        router = start_router("router", ckpt, logs, "--decode", addr["prefill"], "--decode", addr["decode"],
                              "--decode-policy", "round_robin")
        procs.append(router)
        http = router_endpoints(router)["http"]
        prompts = [f"Request number {i} asks for" for i in range(6)]
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        expected = [o.text for o in LLM(ckpt, num_kv_blocks=128).generate(prompts, greedy)]
        for prompt, want in zip(prompts, expected):
            status, _, body = post(f"{http}/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                              "ignore_eos": True})
            assert status == 200, body  # before the fix: 400 "a prefill worker does not accept 'add_request'"
            assert body["choices"][0]["text"] == want
        assert metric_value(http, "tandem_router_retries_total") >= 1
        assert procs[0].popen.poll() is None and procs[1].popen.poll() is None
    finally:
        stop_all(procs)
