"""MetricsServer: a tiny HTTP server (standard library, one daemon thread) that serves a Prometheus
registry on `/metrics` and a JSON `/health` for the worker processes.

Workers run a synchronous ZMQ loop, so their metrics endpoint lives on its own thread: a scrape
never waits for an engine step, and collection (see worker_metrics.py) reads plain counters that
the loop updates anyway. Port 0 binds a free port; `url` says which one was bound.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


def shown_host(host: str) -> str:
    """The host to put in a URL: a wildcard bind is reachable on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::", "*") else host


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry = REGISTRY,
                 health: Callable[[], tuple[bool, dict[str, Any]]] | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {port}")
        self.registry = registry
        self.health = health or (lambda: (True, {}))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/metrics":
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path == "/health":
                    ok, body = server.health()
                    self._send(200 if ok else 503, json.dumps({"status": "ok" if ok else "unhealthy", **body}).encode(),
                               "application/json")
                else:
                    self._send(404, b'{"error": "try /metrics or /health"}', "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the service's own logs

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ValueError(f"cannot bind the metrics port {host}:{port}: {exc.strerror}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{shown_host(host)}:{self.port}/metrics"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
