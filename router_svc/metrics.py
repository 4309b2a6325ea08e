"""The router's Prometheus metrics (default registry; `/metrics` exposes it)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("tandem_router_requests_total", "Requests finished by the router, by API and outcome",
                   ["api", "outcome"])  # outcome: ok | bad_request | rejected | unavailable | cancelled | error
IN_FLIGHT = Gauge("tandem_router_requests_in_flight", "Requests admitted and not finished")
RETRIES = Counter("tandem_router_retries_total", "Requests re-sent to another decode worker after theirs was lost")
WORKERS = Gauge("tandem_router_workers", "Live workers known to the router", ["role"])
WORKERS_LOST = Counter("tandem_router_workers_lost_total", "Workers removed for missing heartbeats", ["role"])
TTFT = Histogram("tandem_router_time_to_first_token_seconds", "Admission to first token, as seen by the router",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
DURATION = Histogram("tandem_router_request_duration_seconds", "Admission to the last token",
                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


def outcome_of(exc: BaseException | None) -> str:
    """Label for REQUESTS from how a request ended."""
    from router_svc.errors import BadRequest, ModelNotFound, NoWorkers, Overloaded, WorkerLost

    if exc is None:
        return "ok"
    if isinstance(exc, (BadRequest, ModelNotFound)):
        return "bad_request"
    if isinstance(exc, Overloaded):
        return "rejected"
    if isinstance(exc, (NoWorkers, WorkerLost)):
        return "unavailable"
    if isinstance(exc, (ConnectionError, GeneratorExit)) or type(exc).__name__ == "CancelledError":
        return "cancelled"
    return "error"
