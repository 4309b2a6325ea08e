"""The observability flags every service CLI shares (`tandem router|decode|prefill`):

  --metrics-port PORT   Prometheus `/metrics` (+ `/health`) port. Workers: default 0 = a free port,
                        reported in the ready line as "metrics"; -1 turns it off. Fixed defaults
                        would collide as soon as two workers share a host, and launchers
                        (`tandem up`) read the URL from the ready line anyway. Where a scraper needs
                        a known port, pass one (deploy/docker-compose.yml: 9100 in every worker
                        container). Router: default unset = served on its HTTP port; a port adds a dedicated
                        metrics server there.
  --metrics-host HOST   interface for the workers' metrics server (default: the --listen host).
  --log-level LEVEL     debug | info | warning | error (default info).
  --log-format FMT      auto | json | console (auto: JSON lines unless stderr is a terminal).
  --log-prompts         include prompt text in logs (off: prompts may be private).
"""

from __future__ import annotations

import argparse

from tandem.observability.logging import LEVELS, configure_logging


def add_observability_args(p: argparse.ArgumentParser, worker: bool) -> None:
    g = p.add_argument_group("observability")
    if worker:
        g.add_argument("--metrics-port", type=int, default=0,
                       help="port for Prometheus /metrics and /health (0 = a free one, printed in the ready line; "
                            "-1 = off)")
        g.add_argument("--metrics-host", default=None,
                       help="interface for the metrics server (default: the --listen host, 127.0.0.1 for ipc://)")
    else:
        g.add_argument("--metrics-port", type=int, default=None,
                       help="also serve /metrics on this port (0 = a free one); by default /metrics is served on "
                            "the HTTP port only. The URL is printed as `metrics <url>`")
    g.add_argument("--log-level", default="info", choices=LEVELS, help="minimum level of log lines (default info)")
    g.add_argument("--log-format", default="auto", choices=("auto", "json", "console"),
                   help="log line format on stderr (auto: JSON lines unless stderr is a terminal)")
    g.add_argument("--log-prompts", action="store_true",
                   help="log prompt text (off by default: prompts may contain private data)")


def setup_logging(args: argparse.Namespace) -> None:
    json = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(args.log_level, json, log_prompts=args.log_prompts)


def metrics_host(args: argparse.Namespace) -> str:
    """Where a worker's metrics server binds: --metrics-host, else the host of its tcp:// --listen."""
    if args.metrics_host:
        return args.metrics_host
    listen = getattr(args, "listen", "") or ""
    if listen.startswith("tcp://"):
        host = listen[len("tcp://"):].rsplit(":", 1)[0]
        return "0.0.0.0" if host == "*" else host
    return "127.0.0.1"


def setup_worker_observability(args: argparse.Namespace, worker, role: str, worker_id: str) -> str | None:
    """Attach WorkerMetrics to `worker` (its loop times steps and queues through `worker.obs`) and
    serve them unless --metrics-port is negative. `role`: prefill | decode | both. Returns the URL."""
    from tandem.observability.http import MetricsServer
    from tandem.observability.worker_metrics import WorkerMetrics

    metrics = WorkerMetrics(role, worker_id, worker.stats_dict, worker.engine.speculator_stats)
    worker.obs = metrics
    if args.metrics_port < 0:
        return None
    server = MetricsServer(metrics_host(args), args.metrics_port, metrics.registry, metrics.health)
    return server.url
