"""RouterConfig and `serve()`: everything the router runs, on one asyncio loop (no locks needed).

1. Load the served model's tokenizer and chat template (no weights: the router never runs the model).
2. Bind the registration socket (`listen`), the HTTP server and the gRPC server; add static workers.
3. Background tasks: the registration loop (register/heartbeat), and housekeeping every
   `tick_s` — expire silent workers (their requests are retried or failed by the core), poll
   static workers with `stats`, and keep the gRPC health status in step with the live workers.
4. Print the endpoints, then serve until cancelled (SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import ssl
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog
import zmq.asyncio
from prometheus_client import REGISTRY

from router_svc import metrics
from router_svc.admin import Admin
from router_svc.core import Router
from router_svc.grpc_api import set_health, start_grpc
from router_svc.http_server import HttpServer
from router_svc.links import ListenSocket, WorkerLinks
from router_svc.openai_server import OpenAIApp
from router_svc.prompts import ServedModel
from router_svc.rebalance import Rebalancer
from router_svc.registry import Registry
from router_svc.slo import SloTracker
from tandem.engine.strategies import resolve_routing_policy as resolve_policy
from tandem.protocol import security

log = structlog.get_logger(__name__)
ROUTER_STALL_S = 0.5  # housekeeping this late: skip one expiry round (see _housekeeping)


@dataclass(slots=True)
class RouterConfig:
    model: str
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 50051
    listen: str = "tcp://0.0.0.0:5557"
    decode: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode_policy: str = "prefix_affinity"
    prefill_policy: str = "prefix_affinity"
    max_inflight: int = 256
    local_prefill_if_busy: int = 0  # conditional disaggregation (core.py): prompts up to this many tokens
    static_timeout_s: float = 3.0  # static workers: silent this long = down
    heartbeat_misses: float = 4.0  # registered workers: this many missed 0.5 s intervals = dead (~2 s)
    migrate: bool = True  # a stream whose decode worker is lost continues on another one
    drain_timeout_s: float = 30.0  # on SIGTERM: refuse new requests, wait this long for those in flight
    api_key: str | None = None  # required on /v1/* (Bearer) and gRPC Generate when set
    ssl_certfile: str | None = None  # TLS for HTTP and gRPC (both files, or neither)
    ssl_keyfile: str | None = None
    hung_timeout_s: float = 60.0  # alive but no engine-loop progress this long = hung, handled like dead
    block_size: int = 16
    affinity_blocks: int = 4
    tick_s: float = 0.1
    metrics_port: int | None = None  # also serve /metrics here (0 = any free port)
    enable_admin: bool = False  # /admin/workers: drain and role switches (router_svc/admin.py)
    client_timeout_s: float = 10.0  # an HTTP request's head, then its body, must arrive within this
    protect_metrics: bool = False  # /metrics on the HTTP port needs the API key too
    ttft_slo_s: float | None = None  # judge every request against these (router_svc/slo.py)
    itl_slo_s: float | None = None
    rebalance: bool = False  # move workers between roles from the SLO signals (router_svc/rebalance.py)
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls with this (router_svc/tool_parsers.py)
    reasoning_parser: str | None = None  # chat answers' <think> text goes to reasoning_content (reasoning.py)

    def __post_init__(self) -> None:
        for name in ("max_inflight", "block_size", "affinity_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.local_prefill_if_busy < 0:
            raise ValueError(f"local_prefill_if_busy must be >= 0, got {self.local_prefill_if_busy}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.protect_metrics and not self.api_key:
            raise ValueError("--protect-metrics needs --api-key (or TANDEM_API_KEY)")
        if self.rebalance and not (self.ttft_slo_s and self.itl_slo_s):
            raise ValueError("--rebalance needs both --ttft-slo and --itl-slo: they are what it balances")
        for name in ("static_timeout_s", "heartbeat_misses", "hung_timeout_s", "tick_s", "client_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.model = ServedModel(config.model, config.served_model_name, config.tool_call_parser,
                                 config.reasoning_parser)
        self.registry = Registry(config.static_timeout_s, config.heartbeat_misses, config.hung_timeout_s)
        self.ctx = zmq.asyncio.Context()
        self.links: WorkerLinks | None = None
        self.router: Router | None = None
        self.endpoints: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._metrics_server: Any = None  # MetricsServer on --metrics-port
        self._collector: metrics.WorkerCollector | None = None
        self.rebalancer: Rebalancer | None = None

    async def start(self) -> dict[str, str]:
        cfg = self.config
        self.links = WorkerLinks(self.ctx, self._on_worker_message)
        self.router = Router(self.registry, self.links.send, resolve_policy(cfg.decode_policy),
                             resolve_policy(cfg.prefill_policy), cfg.max_inflight, cfg.block_size, cfg.affinity_blocks,
                             migrate=cfg.migrate, local_prefill_if_busy=cfg.local_prefill_if_busy)
        for role, addresses in (("decode", cfg.decode), ("prefill", cfg.prefill)):
            for address in addresses:
                self.registry.add_static(role, address)
        self.listen = ListenSocket(self.ctx, cfg.listen)
        admin = Admin(self.registry, self.links.send)
        metrics.SLO = SloTracker(cfg.ttft_slo_s, cfg.itl_slo_s) if cfg.ttft_slo_s or cfg.itl_slo_s else None
        self.rebalancer = Rebalancer(self.registry, admin, metrics.SLO) if cfg.rebalance else None
        self.http = HttpServer(OpenAIApp(self.router, self.registry, self.model, cfg.api_key,
                                         admin if cfg.enable_admin else None, cfg.protect_metrics),
                               max_connections=4 * cfg.max_inflight + 64, client_timeout_s=cfg.client_timeout_s)
        ssl_ctx, tls = _tls(cfg)
        http_port = await self.http.start(cfg.host, cfg.http_port, ssl_ctx)
        # RPCs past the admission limit are answered RESOURCE_EXHAUSTED by the router; past this
        # bound (health watches, a flood) by gRPC itself, before they take memory
        self.grpc, grpc_port, self.health = await start_grpc(self.router, self.model, cfg.host, cfg.grpc_port,
                                                             cfg.api_key, tls, max_rpcs=4 * cfg.max_inflight + 64)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.listen.serve(self._on_registration)),
                       loop.create_task(self._housekeeping())]
        shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host
        scheme = "https" if ssl_ctx is not None else "http"
        self.endpoints = {"http": f"{scheme}://{shown}:{http_port}", "grpc": f"{shown}:{grpc_port}",
                          "listen": self.listen.address}
        self._start_metrics(cfg)
        return self.endpoints

    def _start_metrics(self, cfg: RouterConfig) -> None:
        """Per-worker series at scrape time; /metrics on the HTTP port, and
        on --metrics-port when given."""
        from tandem.observability.http import MetricsServer

        self._collector = metrics.WorkerCollector(self.registry)
        REGISTRY.register(self._collector)
        self.endpoints["metrics"] = self.endpoints["http"] + "/metrics"
        if cfg.metrics_port is not None:
            live = lambda: (bool(self.registry.live("decode")), {"service": "router"})  # noqa: E731
            self._metrics_server = MetricsServer(cfg.host, cfg.metrics_port, REGISTRY, live)
            self.endpoints["metrics"] = self._metrics_server.url

    def _on_worker_message(self, address: str, msg: dict) -> None:
        assert self.router is not None
        self.router.on_worker_message(address, msg)

    def _on_registration(self, msg: dict, identity: bytes) -> str | None:
        assert self.links is not None
        error, replaced = self.registry.handle(msg, identity)
        if replaced is not None:
            self._lost(replaced)
        worker = self.registry.workers.get(msg.get("worker_id", "")) if error is None else None
        if worker is not None and worker.unverified_since is not None:
            self.links.try_send(worker.address, "stats")  # its reply makes it routable
        return error

    def _lost(self, worker) -> None:
        assert self.router is not None and self.links is not None
        self.router.on_worker_lost(worker)
        if not worker.static:
            self.links.drop(worker.address)
        if worker.role == "decode" and worker.kv_address:
            # Prefill workers drop their link to its receiver now, and with it the blocks lent to transfers it
            # will never acknowledge (else held for their hold timeout: prefill_svc/kv_connector.py).
            for p in self.registry.live("prefill"):
                self.links.try_send(p.address, "decode_lost", dest=worker.kv_address)

    async def _housekeeping(self) -> None:
        assert self.links is not None
        serving = None
        poll_every = max(1, round(self.config.static_timeout_s / self.config.heartbeat_misses / self.config.tick_s))
        tick, last = 0, time.monotonic()
        while True:
            now = time.monotonic()
            # If this loop was away (a long tokenization, GC), heartbeats may be waiting unread in
            # the listen socket: silence measured across that gap says nothing about the workers.
            if now - last <= ROUTER_STALL_S:
                for worker in self.registry.expire(now):
                    self._lost(worker)
            last = now
            if self.rebalancer is not None:
                self.rebalancer.tick(now)
            if tick % poll_every == 0:
                for worker in self.registry.statics() + self.registry.unverified():
                    self.links.try_send(worker.address, "stats")
            for worker, refusal in self.registry.unreachable(now):
                assert self.listen is not None
                self.listen.refuse(worker.identity, refusal)
                self.links.drop(worker.address)
            now_serving = bool(self.registry.live("decode")) and not (self.router is not None and self.router.draining)
            if now_serving != serving:
                serving = now_serving
                await set_health(self.health, serving)
            tick += 1
            await asyncio.sleep(self.config.tick_s)

    async def drain(self, signalled: asyncio.Event) -> None:
        """Refuse new requests (HTTP 503, gRPC UNAVAILABLE, health not serving) and wait for the
        streams in flight, up to drain_timeout_s or a second signal."""
        assert self.router is not None
        if self.config.drain_timeout_s <= 0 or not self.router.flights:
            return
        self.router.draining = True
        await set_health(self.health, False)
        signalled.clear()
        log.info("router draining", in_flight=len(self.router.flights), timeout_s=self.config.drain_timeout_s)
        print(f"tandem router: draining {len(self.router.flights)} requests in flight (at most "
              f"{self.config.drain_timeout_s:.0f}s; a second signal stops now)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.router.flights and time.monotonic() < deadline and not signalled.is_set():
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.http.close()
        await self.grpc.stop(grace=0.5)
        if self.links is not None:
            self.links.close()
        self.listen.close()
        security.release(self.ctx)
        self.ctx.term()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._collector is not None:
            REGISTRY.unregister(self._collector)


def _tls(cfg: RouterConfig) -> tuple[ssl.SSLContext | None, tuple[bytes, bytes] | None]:
    """The HTTP server's SSL context and gRPC's (key, certificate chain), or (None, None)."""
    if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
        return None, None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        with open(cfg.ssl_keyfile, "rb") as k, open(cfg.ssl_certfile, "rb") as c:
            return ctx, (k.read(), c.read())
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use --ssl-certfile {cfg.ssl_certfile} / --ssl-keyfile {cfg.ssl_keyfile}: "
                         f"{exc}") from None


def print_endpoints(model: ServedModel, endpoints: dict[str, str], file=sys.stdout) -> None:
    print(f"tandem router: serving model {model.name!r}", file=file)
    print(f"  http    {endpoints['http']}  (OpenAI /v1/completions /v1/chat/completions /v1/models; /health /metrics)",
          file=file)
    print(f"  grpc    {endpoints['grpc']}  (tandem.v1.Generation, grpc.health.v1.Health, reflection)", file=file)
    print(f"  listen  {endpoints['listen']}  (workers register here)", file=file)
    print(f"  metrics {endpoints['metrics']}  (Prometheus)", file=file, flush=True)


async def serve(config: RouterConfig, on_ready: Callable[[RouterService], None] | None = None) -> None:
    service = RouterService(config)
    await service.start()
    gc.collect()  # then freeze the startup heap: no multi-10-ms full collections of it while serving
    gc.freeze()  # (as the workers do: tandem/cli/worker_common.py freeze_startup_heap)
    print_endpoints(service.model, service.endpoints)
    if on_ready is not None:
        on_ready(service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    try:
        await stop.wait()
        await service.drain(stop)
    finally:
        log.info("router stopping")
        await service.stop()
