"""Observability shared by every tandem service (docs/OBSERVABILITY.md).

- logging.py         `configure_logging(level, json=None)`: structlog JSON lines / console, request ids
- worker_metrics.py  WorkerMetrics: a worker's Prometheus metrics (stats read at scrape time + step timing)
- http.py            MetricsServer: `/metrics` and `/health` on a thread, for the workers
- cli.py             the flags every service CLI takes: --metrics-port, --log-level, --log-format, --log-prompts

The router's own metrics live in router_svc/metrics.py (they need its request lifecycle).
"""
