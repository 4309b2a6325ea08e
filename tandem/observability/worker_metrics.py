"""WorkerMetrics: the Prometheus metrics of one prefill / decode / colocated worker process.

Two sources, both cheap for the engine loop:

1. Counters and gauges the worker keeps anyway (`stats_dict()`: queue lengths, KV blocks, prefix
   cache tokens, preemptions, transfer bytes, fallbacks; `engine.speculator_stats()`) are read by a
   custom collector *at scrape time*, on the metrics server's thread. The loop never calls into
   prometheus_client for them; the reads are len()s and ints, safe under the GIL.
2. Per-step and per-request timings only the loop sees: `step_done(schedule, t0, outputs)` after
   each engine step (one histogram observe each for step time, batch requests, batch tokens — never
   per token or per layer), `request_started(req)` / the first time a request is scheduled (queue
   time), `transfer_done(trace)` when a request's remote KV is complete (D).

Every series has the labels `role` (prefill | decode | both — a decode worker without a KV
connector) and `worker` (the worker id). Metric names: docs/OBSERVABILITY.md.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ("role", "worker")
# 1 ms .. 5 min: one histogram family spans a CPU step of a tiny model and a long prefill queue.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_MAX_TRACKED = 65536  # bound on request ids remembered for queue time (leaked ids, e.g. aborts, age out)


class WorkerMetrics:
    def __init__(self, role: str, worker_id: str, stats_fn: Callable[[], dict[str, Any]],
                 spec_fn: Callable[[], dict[str, Any]] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {role!r}")
        self.role, self.worker_id = role, worker_id
        self.registry = registry if registry is not None else CollectorRegistry()
        lv = (role, worker_id)
        self._families: dict[str, Histogram] = {}  # attribute -> its family, to label again on a role switch

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            family = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
            self._families[name] = family
            return family.labels(*lv)

        self.step_seconds = hist("tandem_engine_step_duration_seconds",
                                 "Wall time of one engine step (schedule, forward, sample, update)", STEP_BUCKETS)
        self.batch_requests = hist("tandem_engine_step_batch_requests", "Requests in one engine step", BATCH_BUCKETS)
        self.batch_tokens = hist("tandem_engine_step_batch_tokens", "Tokens computed in one engine step",
                                 TOKEN_BUCKETS)
        self.queue_seconds = hist("tandem_worker_queue_time_seconds",
                                  "Arrival at this worker to the start of its prompt's computation (D: or of "
                                  "its remote prefill, once blocks were free)", TIME_BUCKETS)
        self.transfer_seconds = hist("tandem_kv_transfer_duration_seconds",
                                     "Decode side: first KV layer received to the request's KV complete",
                                     TIME_BUCKETS)
        self._stats = _StatsCollector(lv, role, stats_fn, spec_fn)
        self.registry.register(self._stats)
        self._queue: dict[str, float] = {}  # request id -> its queue time (seconds), once started
        self._forget: list[str] = []
        self.last_step = time.monotonic()
        self.steps = 0

    def switch_role(self, role: str, stats_fn: Callable[[], dict[str, Any]]) -> None:
        """The worker now serves `role` (tandem/cli/roles.py): new samples carry the new role label.
        The old role's histograms keep their last values; the stats-backed series follow the new role."""
        self.role = role
        lv = (role, self.worker_id)
        for attr, name in (("step_seconds", "tandem_engine_step_duration_seconds"),
                           ("batch_requests", "tandem_engine_step_batch_requests"),
                           ("batch_tokens", "tandem_engine_step_batch_tokens"),
                           ("queue_seconds", "tandem_worker_queue_time_seconds"),
                           ("transfer_seconds", "tandem_kv_transfer_duration_seconds")):
            setattr(self, attr, self._families[name].labels(*lv))
        self._stats.lv, self._stats.role, self._stats.stats_fn = list(lv), role, stats_fn

    # ---- called from the worker loop -------------------------------------------------------------
    def step_done(self, schedule: Any, t0: float, outputs: Iterable[Any] = ()) -> None:
        """After `engine.step()` begun at `t0` (time.monotonic()); `schedule` is engine.current_schedule."""
        now = time.monotonic()
        for rid in self._forget:  # finished last step: the worker had one step to read their queue time
            self._queue.pop(rid, None)
        self._forget = [o.request_id for o in outputs if o.finished]
        if schedule is None or not schedule.scheduled:
            return
        self.last_step, self.steps = now, self.steps + 1
        self.step_seconds.observe(now - t0)
        self.batch_requests.observe(len(schedule.scheduled))
        self.batch_tokens.observe(schedule.num_tokens)
        queue = self._queue
        for s in schedule.scheduled:
            if s.request.request_id not in queue:
                self._started(s.request.request_id, t0 - s.request.arrival_time)

    def request_started(self, req: Any) -> None:
        """A request's prompt starts now without being scheduled here (D: its remote prefill was sent)."""
        if req.request_id not in self._queue:
            self._started(req.request_id, time.monotonic() - req.arrival_time)

    def _started(self, rid: str, seconds: float) -> None:
        self._queue[rid] = seconds
        self.queue_seconds.observe(max(seconds, 0.0))
        if len(self._queue) > _MAX_TRACKED:
            self._queue.pop(next(iter(self._queue)))

    def queue_time(self, request_id: str) -> float | None:
        return self._queue.get(request_id)

    def transfer_done(self, trace: dict[str, int] | None) -> None:
        """D: a request's remote KV is complete; `trace` has the receiver's monotonic ns stamps."""
        if trace and "first_layer_received_ns" in trace and "last_layer_received_ns" in trace:
            self.transfer_seconds.observe(max(trace["last_layer_received_ns"] - trace["first_layer_received_ns"], 0)
                                          / 1e9)

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"role": self.role, "worker": self.worker_id, "steps": self.steps,
                      "seconds_since_step": round(time.monotonic() - self.last_step, 3)}


class NoMetrics:
    """Stands in for WorkerMetrics where none is configured (a worker built in-process by a test)."""

    def step_done(self, schedule: Any, t0: float, outputs: Iterable[Any] = ()) -> None:
        pass

    def request_started(self, req: Any) -> None:
        pass

    def queue_time(self, request_id: str) -> float | None:
        return None

    def transfer_done(self, trace: dict[str, int] | None) -> None:
        pass


NO_METRICS = NoMetrics()

# stats_dict() key -> (metric, kind, help); kind "gauge" or "counter". Keys a role lacks are skipped.
_SIMPLE: list[tuple[str, str, str, str]] = [
    ("running", "tandem_worker_requests_running", "gauge", "Requests in the running batch"),
    ("waiting_for_kv", "tandem_worker_requests_waiting_for_kv", "gauge",
     "Decode: requests whose prompt KV is being received from a prefill worker"),
    ("kv_usage", "tandem_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0..1)"),
    ("kv_invariant_ok", "tandem_kv_invariant_ok", "gauge",
     "1 while the KV block accounting holds (every block free, cached or held by a live request)"),
    ("prefix_queried_tokens", "tandem_prefix_cache_queried_tokens_total", "counter",
     "Prompt tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "tandem_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache"),
    ("preemptions", "tandem_preemptions_total", "counter", "Requests preempted (recomputed) for lack of KV blocks"),
    ("errors", "tandem_worker_errors_total", "counter", "Control messages whose handling raised"),
    ("bad_messages", "tandem_worker_bad_messages_total", "counter", "Control frames that failed validation"),
    ("fallbacks", "tandem_kv_recompute_fallbacks_total", "counter",
     "Decode: remote prefills that failed or timed out and were recomputed locally"),
    ("transferred_blocks", "tandem_kv_transferred_blocks_total", "counter",
     "Decode: KV blocks requested from prefill workers"),
    ("reused_blocks", "tandem_kv_reused_blocks_total", "counter",
     "Decode: prompt blocks found in this worker's prefix cache instead of being transferred"),
    ("kv_transfers", "tandem_kv_transfers_total", "counter", "Prefill: KV transfers the decode worker acknowledged"),
    ("kv_transfer_failures", "tandem_kv_transfer_failures_total", "counter",
     "Prefill: KV transfers refused, cancelled by the receiver or not acknowledged in time"),
]


class _StatsCollector:
    """Builds the stats-backed families from one `stats_dict()` call per scrape."""

    def __init__(self, label_values: tuple[str, str], role: str, stats_fn: Callable[[], dict[str, Any]],
                 spec_fn: Callable[[], dict[str, Any]] | None) -> None:
        self.lv, self.role, self.stats_fn, self.spec_fn = list(label_values), role, stats_fn, spec_fn

    def describe(self) -> list[Metric]:
        return []  # names vary with the role; describing nothing defers checks to collect()

    def collect(self) -> Iterable[Metric]:
        s = _retrying(self.stats_fn)
        for key, name, kind, doc in _SIMPLE:
            if key in s:
                yield self._one(name, kind, doc, float(s[key]))
        waiting = s.get("waiting", 0) + s.get("backlog", 0)
        yield self._one("tandem_worker_requests_waiting", "gauge", "Requests queued for their first computation "
                        "(decode: including those waiting for free blocks to receive KV into)", waiting)
        blocks = GaugeMetricFamily("tandem_kv_cache_blocks", "KV cache blocks by state", labels=[*LABELS, "state"])
        used, total = s.get("kv_blocks_used", 0), s.get("kv_blocks_total", 0)
        blocks.add_metric([*self.lv, "used"], used)
        blocks.add_metric([*self.lv, "free"], total - used)
        yield blocks
        # Transfer bytes exist on every role (0 when colocated), so a dashboard's sum never vanishes.
        sent = CounterMetricFamily("tandem_kv_transfer_bytes", "KV cache bytes moved between workers",
                                   labels=[*LABELS, "direction"])
        if self.role == "prefill":
            sent.add_metric([*self.lv, "sent"], s.get("kv_bytes_sent", 0))
        else:
            sent.add_metric([*self.lv, "received"], s.get("kv_bytes_received", 0))
        yield sent
        if self.role == "prefill":
            pre = CounterMetricFamily("tandem_prefill_requests", "Prefill requests from decode workers, by result",
                                      labels=[*LABELS, "result"])
            for result, key in (("done", "prefills"), ("failed", "failed"), ("aborted", "aborted")):
                pre.add_metric([*self.lv, result], s.get(key, 0))
            yield pre
        else:
            where = CounterMetricFamily("tandem_decode_prefills", "Prompts a decode worker got computed, by where",
                                        labels=[*LABELS, "where"])
            where.add_metric([*self.lv, "local"], s.get("local_prefills", 0))
            where.add_metric([*self.lv, "remote"], s.get("remote_prefills", 0))
            yield where
            yield from self._spec()

    def _spec(self) -> Iterable[Metric]:
        """Speculative decoding (decode / both): zeros without a speculator, so panels read 0, not 'no data'."""
        sp = _retrying(self.spec_fn) if self.spec_fn is not None else {}
        drafted, accepted = sp.get("num_drafted_tokens", 0), sp.get("num_accepted_tokens", 0)
        yield self._one("tandem_spec_drafted_tokens_total", "counter", "Speculated tokens proposed for verification",
                        drafted)
        yield self._one("tandem_spec_accepted_tokens_total", "counter", "Speculated tokens accepted by verification",
                        accepted)
        yield self._one("tandem_spec_emitted_tokens_total", "counter",
                        "Tokens produced by verifying steps (accepted + one each)", sp.get("num_emitted_tokens", 0))
        yield self._one("tandem_spec_acceptance_ratio", "gauge",
                        "Accepted / drafted speculative tokens since start (0 without speculation)",
                        accepted / drafted if drafted else 0.0)
        yield self._one("tandem_spec_target_state_recomputes_total", "counter",
                        "Target hidden states a drafting head (eagle) had to recompute with a target pass, "
                        "not read from the cache", sp.get("target_state_recomputes", 0))

    def _one(self, name: str, kind: str, doc: str, value: float) -> Metric:
        fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=list(LABELS))
        fam.add_metric(self.lv, value)
        return fam


def _retrying(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The loop thread mutates what stats_fn reads; a rare 'changed size during iteration' is retried."""
    for _ in range(3):
        try:
            return fn()
        except RuntimeError:
            continue
    return {}
