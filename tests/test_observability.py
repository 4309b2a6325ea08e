"""Observability as real processes on loopback (ephemeral ports): Prometheus metrics of the router and
the workers, request ids across the logs of router, decode and prefill, prompt privacy, the dashboard.

Process map (module fixture `cluster`):
  router  d1 (decode, zmq connector, --local-prefill-threshold 0: every prompt goes through p1) and
          p1 (prefill) register to it; logs are JSON lines (stdout/stderr are files), no --log-prompts
  colo    a second router with c1, a colocated decode worker (--kv-connector none, metrics role
          "both"); both started with --log-prompts
Metrics are compared as deltas around the requests a test sends, so tests do not depend on each other.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_procs import ROOT, Proc, get_json, grpc_stub, router_endpoints, start_router, stop_all, wait_workers
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

SECRET = "zebra quartz marmalade"  # prompt text that must not reach logs without --log-prompts
LONG_PREFIX = "def shared_prefix_function(alpha, beta, gamma):\n    return alpha * beta + gamma - 42\n" * 2


def start_worker(role: str, wid: str, ckpt: str, router: str, logs, *extra: str) -> Proc:
    return Proc(wid, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                      "--router", router, "--worker-id", wid, "--num-kv-blocks", "256", "--metrics-port", "0", *extra],
                logs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("obs")
    ckpt = make_checkpoint(str(tmp / "ckpt"))
    logs = tmp / "logs"
    logs.mkdir()
    procs = [start_router("router", ckpt, logs, "--metrics-port", "0"),
             start_router("colo", ckpt, logs, "--log-prompts")]
    try:
        ep, colo = router_endpoints(procs[0]), router_endpoints(procs[1])
        procs += [start_worker("decode", "d1", ckpt, ep["listen"], logs, "--local-prefill-threshold", "0"),
                  start_worker("prefill", "p1", ckpt, ep["listen"], logs),
                  start_worker("decode", "c1", ckpt, colo["listen"], logs, "--kv-connector", "none", "--log-prompts")]
        by_name = {p.name: p for p in procs}
        ready = {p.name: json.loads(p.wait_for(r"tandem-\w+-ready (.*)").group(1)) for p in procs[2:]}
        wait_workers(ep["http"], 1, prefill=1)
        wait_workers(colo["http"], 1)
        metrics = {"router": procs[0].wait_for(r"(?m)^\s*metrics\s+(\S+)").group(1),
                   "colo": procs[1].wait_for(r"(?m)^\s*metrics\s+(\S+)").group(1),
                   **{name: r["metrics"] for name, r in ready.items()}}
        yield {"procs": by_name, "ready": ready, "metrics": metrics, "http": ep["http"], "grpc": ep["grpc"],
               "colo": colo["http"], "model": Path(ckpt).name}
    finally:
        stop_all(procs)


# ---- helpers ------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lv), v in samples.items() if n == name and want <= lv)


def eventually(check, timeout: float = 10.0):
    """Retry an assertion: counters are updated right after the response is written."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0, timeout=60)


def stream_completion(http: str, model: str, prompt: str, max_tokens: int = 6, rid: str | None = None) -> dict:
    """Stream one OpenAI completion; returns its usage."""
    headers = {"X-Request-Id": rid} if rid else None
    stream = client(http).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_headers=headers)
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}


def grpc_generate(target: str, text: str, max_tokens: int, rid: str = "") -> dict:
    """One gRPC stream; `streamed` counts the token ids that arrived (SSE text may merge or omit tokens)."""
    from tandem.protocol import generation_pb2 as pb

    responses = list(grpc_stub(target).Generate(pb.GenerateRequest(
        request_id=rid, text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))))
    usage = responses[-1].usage
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens,
            "streamed": sum(len(r.token_ids) for r in responses)}


def json_lines(proc: Proc) -> list[dict]:
    """The JSON log lines of a process (every line that looks like one must parse)."""
    return [json.loads(line) for line in proc.log.read_text().splitlines() if line.startswith("{")]


# ---- metrics ------------------------------------------------------------------------------------------
def test_every_service_reports_and_serves_its_metrics(cluster):
    for name in ("router", "colo", "d1", "p1", "c1"):
        url = cluster["metrics"][name]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), (name, url)
        assert scrape(url), name
    assert cluster["metrics"]["colo"] == cluster["colo"] + "/metrics"  # no --metrics-port: the HTTP port
    assert cluster["metrics"]["router"] != cluster["http"] + "/metrics"  # --metrics-port 0: its own port
    for name, role in (("d1", "decode"), ("p1", "prefill"), ("c1", "both")):
        status, health = get_json(cluster["metrics"][name].replace("/metrics", "/health"))
        assert status == 200 and health["status"] == "ok" and health["role"] == role and health["worker"] == name


def test_counts_after_n_requests(cluster):
    n, urls = 4, cluster["metrics"]
    before = {k: scrape(urls[k]) for k in ("router", "d1", "p1")}
    usages = [grpc_generate(cluster["grpc"], f"import os\nprint({i} * {i})", 5 + i) for i in range(n)]
    streamed = sum(u["streamed"] for u in usages)
    assert streamed == sum(u["completion"] for u in usages)

    def check():
        after = {k: scrape(urls[k]) for k in ("router", "d1", "p1")}
        d = lambda k, name, **lb: total(after[k], name, **lb) - total(before[k], name, **lb)  # noqa: E731
        assert d("router", "tandem_router_requests_total", outcome="finished") == n
        assert d("router", "tandem_router_requests_total", api="grpc", outcome="finished", reason="length") == n
        for hist in ("time_to_first_token", "request_duration", "queue_time"):
            assert d("router", f"tandem_router_{hist}_seconds_count") == n, hist
        assert d("router", "tandem_router_inter_token_latency_seconds_count") == streamed - n
        assert d("router", "tandem_router_generation_tokens_total") == streamed
        assert d("router", "tandem_router_prompt_tokens_total") == sum(u["prompt"] for u in usages)
        assert d("router", "tandem_router_routing_decisions_total", role="decode", worker="d1") == n
        assert d("router", "tandem_router_routing_decisions_total", role="prefill", worker="p1") == n
        assert total(after["router"], "tandem_router_requests_in_flight") == 0
        assert d("p1", "tandem_prefill_requests_total", result="done", role="prefill", worker="p1") == n
        assert d("d1", "tandem_decode_prefills_total", where="remote", role="decode") == n
        assert d("d1", "tandem_kv_transfer_duration_seconds_count") == n
        assert d("d1", "tandem_kv_transfer_bytes_total", direction="received") > 0
        assert d("p1", "tandem_kv_transfer_bytes_total", direction="sent") > 0
        steps = d("d1", "tandem_engine_step_duration_seconds_count")
        assert steps >= streamed - n and d("d1", "tandem_engine_step_batch_requests_count") == steps
        assert d("p1", "tandem_engine_step_duration_seconds_count") >= 1
        assert d("d1", "tandem_worker_queue_time_seconds_count") == n
        for role, worker in (("decode", "d1"), ("prefill", "p1")):
            assert total(after["router"], "tandem_router_worker_up", role=role, worker=worker) == 1
            assert 0 <= total(after["router"], "tandem_router_worker_heartbeat_age_seconds", worker=worker) < 5
        assert 0 <= total(after["d1"], "tandem_kv_cache_usage_ratio") <= 1

    eventually(check)


def test_prefix_hit_tokens_rise_when_a_prefix_repeats(cluster):
    urls = cluster["metrics"]
    first = stream_completion(cluster["http"], cluster["model"], LONG_PREFIX + "# first")
    assert first["prompt"] >= 48  # several full blocks to share
    before = {k: scrape(urls[k]) for k in ("router", "d1", "p1")}
    again = stream_completion(cluster["http"], cluster["model"], LONG_PREFIX + "# again")
    assert again["cached"] > 0

    def check():
        after = {k: scrape(urls[k]) for k in ("router", "d1", "p1")}
        hit = lambda k: (total(after[k], "tandem_prefix_cache_hit_tokens_total")  # noqa: E731
                         - total(before[k], "tandem_prefix_cache_hit_tokens_total"))
        assert hit("d1") > 0  # D found the shared blocks and asked P for the rest only
        assert (total(after["d1"], "tandem_kv_reused_blocks_total")
                - total(before["d1"], "tandem_kv_reused_blocks_total")) > 0
        assert (total(after["router"], "tandem_router_cached_prompt_tokens_total")
                - total(before["router"], "tandem_router_cached_prompt_tokens_total")) == again["cached"]

    eventually(check)


def test_colocated_worker_is_role_both_and_transfers_nothing(cluster):
    url = cluster["metrics"]["c1"]
    before = scrape(url)
    for i in range(2):
        stream_completion(cluster["colo"], cluster["model"], f"x = {i}")

    def check():
        after = scrape(url)
        roles = {dict(lv).get("role") for (_, lv) in after if "role" in dict(lv)}
        assert roles == {"both"}
        assert total(after, "tandem_kv_transfer_bytes_total") == 0
        assert (total(after, "tandem_decode_prefills_total", where="local")
                - total(before, "tandem_decode_prefills_total", where="local")) == 2
        assert total(after, "tandem_engine_step_duration_seconds_count") > total(
            before, "tandem_engine_step_duration_seconds_count")

    eventually(check)


def test_rejected_request_is_counted_and_logged_with_its_id(cluster):
    before = scrape(cluster["metrics"]["router"])
    with pytest.raises(openai.BadRequestError):
        client(cluster["http"]).completions.create(model=cluster["model"], prompt="hi", max_tokens=-1,
                                                   extra_headers={"X-Request-Id": "obs-bad-1"})

    def check():
        labels = {"outcome": "rejected", "reason": "bad_request"}
        after = scrape(cluster["metrics"]["router"])
        assert total(after, "tandem_router_requests_total", **labels) - total(before, "tandem_router_requests_total",
                                                                              **labels) == 1
        lines = [r for r in json_lines(cluster["procs"]["router"]) if r.get("request_id") == "obs-bad-1"]
        assert lines and lines[-1]["outcome"] == "rejected" and "max_tokens" in lines[-1]["error"]

    eventually(check)


# ---- logs ---------------------------------------------------------------------------------------------
def test_one_request_id_in_router_decode_and_prefill_logs(cluster):
    rid = "obs-trace-0001"
    stream_completion(cluster["http"], cluster["model"], "def trace_me():\n    return 1", rid=rid)
    grpc_rid = "obs-trace-grpc"
    grpc_generate(cluster["grpc"], "import sys", 3, rid=grpc_rid)

    def check():
        for name, service in (("router", "router"), ("d1", "decode"), ("p1", "prefill")):
            lines = json_lines(cluster["procs"][name])
            for want in (rid, grpc_rid):
                mine = [r for r in lines if r.get("request_id") == want]
                assert mine, f"{name} logged nothing for {want}"
                assert all(r["service"] == service and r["level"] and r["timestamp"] for r in mine)
        finished = [r for r in json_lines(cluster["procs"]["router"])
                    if r.get("request_id") == grpc_rid and r["event"] == "request finished"]
        assert finished and finished[0]["api"] == "grpc"

    eventually(check)


def test_prompt_text_is_logged_only_with_log_prompts(cluster):
    stream_completion(cluster["http"], cluster["model"], f"# {SECRET}\nprint(1)")
    stream_completion(cluster["colo"], cluster["model"], f"# {SECRET}\nprint(2)", rid="obs-prompt-colo")
    procs = cluster["procs"]

    def check():
        for name in ("router", "d1", "p1"):
            assert SECRET not in procs[name].log.read_text(), name
        for name in ("colo", "c1"):  # started with --log-prompts
            assert any(SECRET in str(r.get("prompt", "")) and r.get("request_id") == "obs-prompt-colo"
                       for r in json_lines(procs[name])), name

    eventually(check)


# ---- dashboard and deployment files --------------------------------------------------------------------
def test_dashboard_queries_only_live_metrics(cluster):
    dash = json.loads((ROOT / "deploy/grafana/tandem.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]]
    assert len(exprs) >= 20
    used = {m for e in exprs for m in re.findall(r"\btandem_[a-zA-Z0-9_]+", e)}
    live = {name for url in cluster["metrics"].values() for (name, _) in scrape(url)}
    missing = sorted(used - live)
    assert not missing, f"the dashboard queries metrics no service exposes: {missing}"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("first token", "inter-token", "throughput", "kv cache usage", "prefix cache hit", "acceptance",
                  "bandwidth", "fallbacks"):
        assert topic in titles, topic
