"""The router's Prometheus metrics (default registry: `/metrics` on the HTTP port, and on
`--metrics-port` when given) and its per-request log line. Names and labels: docs/OBSERVABILITY.md.

Where they are updated (all on the router's one asyncio loop):
1. `core.Router._dispatch` -> `routed()`: one routing decision per chosen worker (D, and P if any).
2. `core.Router._on_output` -> `on_output()`: every output message from D — TTFT on the first
   tokens, inter-token latency per token after that, token totals, and on the last message the
   end-to-end latency and D's queue time (an optional `queue_time_s` field of its final output).
3. The front ends' `finally:` -> `request_ended()`: the outcome counter and one info line per request.
4. `WorkerCollector`, at scrape time: per-worker heartbeat age, health and in-flight requests, read
   from the registry (nothing to keep up to date in the loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import structlog
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from tandem.observability.logging import prompts_enabled

log = structlog.get_logger(__name__)

# 1 ms .. 5 min: TTFT on an idle tiny model and end-to-end latency of a long generation.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0)

# outcome: finished | cancelled | rejected | error; reason: the finish reason (stop, length, abort)
# for finished, else the cause (client, bad_request, overloaded, no_workers, worker_lost, worker_error, internal).
REQUESTS = Counter("tandem_router_requests_total", "Requests that ended, by API, outcome and reason",
                   ["api", "outcome", "reason"])
IN_FLIGHT = Gauge("tandem_router_requests_in_flight", "Requests admitted and not finished")
LOCAL_WHEN_BUSY = Counter("tandem_router_local_prefills_when_busy_total",
                          "Short prompts sent to their decode worker to prefill because their prefill worker was "
                          "busy (conditional disaggregation, --local-prefill-if-busy)")
RETRIES = Counter("tandem_router_retries_total", "Requests re-sent to another decode worker after theirs was lost")
MIGRATIONS = Counter("tandem_router_migrations_total",
                     "Streams moved mid-way to another decode worker (prompt + tokens sent so far) after "
                     "theirs was lost")
WORKERS = Gauge("tandem_router_workers", "Live workers known to the router", ["role"])
ROLE_CHANGES = Counter("tandem_router_role_changes_total", "Workers asked to move to the other role (admin API or "
                       "--rebalance)", ["from_role", "to_role", "by"])
DRAINS = Counter("tandem_router_drains_total", "Workers asked to drain and exit through the admin API", ["role"])
for _from, _to in (("prefill", "decode"), ("decode", "prefill")):  # exported at 0 from the start: panels and
    DRAINS.labels(_from)  # alerts see a series, not "no data"
    for _by in ("admin", "rebalance"):
        ROLE_CHANGES.labels(_from, _to, _by)
WORKERS_LOST = Counter("tandem_router_workers_lost_total", "Workers removed for missing heartbeats", ["role"])
REGISTRATIONS_REFUSED = Counter("tandem_router_registrations_refused_total",
                                "Worker registrations refused: reason duplicate_id or unreachable (advertised address)",
                                ["reason"])
WORKERS_HUNG = Counter("tandem_router_workers_hung_total",
                       "Workers declared hung: heartbeating, but no engine-loop progress for the hung timeout",
                       ["role"])
TTFT = Histogram("tandem_router_time_to_first_token_seconds", "Admission to the first token, as seen by the router",
                 buckets=TIME_BUCKETS)
ITL = Histogram("tandem_router_inter_token_latency_seconds",
                "Time between consecutive tokens of a request (a message of k tokens counts k times)",
                buckets=TIME_BUCKETS)
DURATION = Histogram("tandem_router_request_duration_seconds", "End-to-end latency: admission to the last token",
                     buckets=TIME_BUCKETS)
QUEUE = Histogram("tandem_router_queue_time_seconds",
                  "Time a request waited on its decode worker before its prompt started being computed "
                  "(locally, or sent to a prefill worker), as reported by the decode worker", buckets=TIME_BUCKETS)
PROMPT_TOKENS = Counter("tandem_router_prompt_tokens_total", "Prompt tokens of requests that reached a decode worker")
CACHED_TOKENS = Counter("tandem_router_cached_prompt_tokens_total",
                        "Prompt tokens the decode worker found in its prefix cache")
GENERATION_TOKENS = Counter("tandem_router_generation_tokens_total", "Tokens streamed back to clients")
ROUTED = Counter("tandem_router_routing_decisions_total", "Workers chosen by the routing policies",
                 ["role", "policy", "worker"])


@dataclass(slots=True)
class FlightStats:
    """What the metrics and the request's log line need from one request (lives on core.Flight)."""

    first_token_at: float = 0.0
    last_token_at: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    queue_time_s: float | None = None


def routed(role: str, policy: Any, worker: Any) -> None:
    ROUTED.labels(role, getattr(policy, "name", type(policy).__name__), worker.worker_id).inc()


def on_output(flight: Any, msg: dict[str, Any]) -> None:
    """One `output` message from D for `flight` (core.Flight)."""
    st: FlightStats = flight.stats
    now, n = time.monotonic(), len(msg["token_ids"])
    if n:
        if not st.first_token_at:
            st.first_token_at = now
            TTFT.observe(now - flight.started)
            st.prompt_tokens, st.cached_tokens = msg["num_prompt_tokens"], msg["num_cached_tokens"]
            PROMPT_TOKENS.inc(st.prompt_tokens)
            CACHED_TOKENS.inc(st.cached_tokens)
            n_gaps = n - 1
        else:
            n_gaps = n
        if n_gaps:  # k tokens arriving together (speculation) count as k gaps of equal length
            gap = (now - st.last_token_at) / n if st.last_token_at and n_gaps == n else 0.0
            for _ in range(n_gaps):
                ITL.observe(gap)
        st.last_token_at = now
        GENERATION_TOKENS.inc(n)
    if msg["finished"]:
        st.finish_reason = msg["finish_reason"]
        DURATION.observe(now - flight.started)
        q = msg.get("queue_time_s")
        if isinstance(q, (int, float)) and not isinstance(q, bool):
            st.queue_time_s = float(q)
            QUEUE.observe(max(float(q), 0.0))


def outcome_of(exc: BaseException | None, finish_reason: str | None = None) -> tuple[str, str]:
    """(outcome, reason) labels for REQUESTS from how a request ended."""
    from router_svc.errors import BadRequest, ModelNotFound, NoWorkers, Overloaded, RouterError, WorkerLost

    if exc is None:
        return "finished", finish_reason or "unknown"
    if isinstance(exc, (BadRequest, ModelNotFound)):
        return "rejected", "bad_request"
    if isinstance(exc, Overloaded):
        return "rejected", "overloaded"
    if isinstance(exc, NoWorkers):
        return "rejected", "no_workers"
    if isinstance(exc, WorkerLost):
        return "error", "worker_lost"
    if isinstance(exc, (ConnectionError, GeneratorExit)) or type(exc).__name__ == "CancelledError":
        return "cancelled", "client"
    if isinstance(exc, RouterError):
        return "error", "worker_error"
    return "error", "internal"


SLO: Any = None  # router_svc.slo.SloTracker when --ttft-slo / --itl-slo are given (set by the server)


def request_ended(api: str, ended_by: BaseException | None, stream: Any, request_id: str | None) -> None:
    """Count the request and write its one info line (request_id is bound by the front end)."""
    flight = stream.flight if stream is not None else None
    st: FlightStats | None = flight.stats if flight is not None else None
    outcome, reason = outcome_of(ended_by, st.finish_reason if st else None)
    REQUESTS.labels(api, outcome, reason).inc()
    if SLO is not None and flight is not None and st is not None and outcome == "finished" and st.first_token_at:
        SLO.judge(flight.started, st.first_token_at, st.last_token_at, flight.tokens_out)
    fields: dict[str, Any] = {"api": api, "outcome": outcome, "reason": reason}
    if flight is not None:
        st = flight.stats
        fields.update(completion_tokens=flight.tokens_out, prompt_tokens=flight.prompt_len,
                      cached_tokens=st.cached_tokens, duration_s=round(time.monotonic() - flight.started, 4),
                      decode=flight.decode.worker_id if flight.decode else None)
        if st.first_token_at:
            fields["ttft_s"] = round(st.first_token_at - flight.started, 4)
        if st.queue_time_s is not None:
            fields["queue_time_s"] = round(st.queue_time_s, 4)
    if outcome == "error":
        log.error("request failed", request_id=request_id, error=str(ended_by) or type(ended_by).__name__,
                  exc_info=ended_by if reason == "internal" else None, **fields)
    elif outcome == "rejected":
        log.info("request rejected", request_id=request_id, error=str(ended_by), **fields)
    else:
        log.info("request finished" if outcome == "finished" else "request cancelled", request_id=request_id,
                 **fields)


def request_admitted(request_id: str, token_ids: list[int], model: Any) -> None:
    """Debug line per admitted request; the prompt text only with --log-prompts."""
    if prompts_enabled():
        log.info("request admitted", request_id=request_id, prompt_tokens=len(token_ids),
                 prompt=model.tokenizer.decode(token_ids))
    else:
        log.debug("request admitted", request_id=request_id, prompt_tokens=len(token_ids))


class WorkerCollector:
    """Per-worker series read from the router's Registry at scrape time."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["role", "worker"]
        up = GaugeMetricFamily("tandem_router_worker_up", "1 while the worker is live (heartbeats on time)",
                               labels=labels)
        age = GaugeMetricFamily("tandem_router_worker_heartbeat_age_seconds",
                                "Seconds since the worker's last heartbeat (static workers: last stats reply)",
                                labels=labels)
        inflight = GaugeMetricFamily("tandem_router_worker_requests_in_flight",
                                     "Requests this router routed to the worker and has not seen finish "
                                     "(prefill: not started)", labels=labels)
        now = time.monotonic()
        for w in list(self.registry.workers.values()):
            lv = [w.role, w.worker_id]
            up.add_metric(lv, 1.0 if w.alive else 0.0)
            age.add_metric(lv, max(now - w.last_seen, 0.0))
            inflight.add_metric(lv, w.inflight)
        return [up, age, inflight]
