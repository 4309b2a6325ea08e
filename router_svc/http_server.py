"""The router's HTTP server: uvicorn (httptools parser) running an ASGI adapter around the
OpenAI app's `app(request, response)` coroutine, on the router's own asyncio loop.

1. uvicorn parses HTTP/1.1 (keep-alive, pipelining, chunked responses, TLS); a connection idle
   between requests is closed after KEEPALIVE_IDLE_S. Past `max_connections` open connections (or
   as many requests in progress) a request is answered 503: connections must not grow memory
   without bound either.
2. Slow clients (`_GuardedProtocol`): a request's head, then its body, must each arrive within
   `client_timeout_s` — a client sending a byte a second is answered 408 and closed, logged once per
   peer address. A head over MAX_HEAD_BYTES is a 431; a body over `max_body` a 413; a chunked
   request body a 411.
3. The adapter (`_Asgi`) reads the body and runs the app; a client that goes away before the
   response is complete has its handler cancelled from `connection_lost`, so the app's `finally:`
   aborts the generation. An app that raised before answering gets a 500 in the OpenAI error shape.
4. /docs and /openapi.json go to a FastAPI app built from the typed request models
   (router_svc/openai_models.py); everything else to the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl as ssl_module
from typing import Any, Awaitable, Callable, Generator, cast

import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router_svc.http_messages import Request, Response

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 64 * 1024
KEEPALIVE_IDLE_S = 60
LINGER_S = 1.0  # after a 408: how long the client's trickle is read and dropped before closing
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/openapi.json")
_TASK, _GONE = "tandem.task", "tandem.client_gone"  # scope keys: the request's task, "the client left"


App = Callable[[Request, Response], Awaitable[None]]


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "internal_error", "param": None, "code": None}}).encode()


async def _error(response: Response, status: int, message: str, close: bool = False) -> None:
    await response.send(status, _error_body(status, message), "application/json",
                        {"Connection": "close"} if close else None)


class _Asgi:
    def __init__(self, app: App, max_body: int, docs: Any) -> None:
        self.app = app
        self.max_body = max_body
        self.docs = docs

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in DOCS_PATHS:
            await self.docs(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        response = Response(send)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _error(response, 411, "chunked request bodies are not supported; send Content-Length", close=True)
            return
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= self.max_body:
            await _error(response, 413, f"request body must be at most {self.max_body} bytes", close=True)
            return
        body = b""
        while length:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # gone (or cut off by the body timeout) before the body was complete
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        request = Request(scope["method"], scope["path"], scope["query_string"].decode("latin-1"), headers, body)
        await self._run(request, response, scope)

    async def _run(self, request: Request, response: Response, scope: dict) -> None:
        # The app runs in uvicorn's task for this request; if the client goes away first, the
        # connection's protocol cancels that task (_GuardedProtocol.connection_lost) — no watcher
        # task per request: measurable at thousands of requests/s.
        me = asyncio.current_task()
        assert me is not None
        scope[_TASK] = me
        try:
            await self.app(request, response)
        except asyncio.CancelledError:
            if not scope.get(_GONE):
                raise  # cancelled from outside (shutdown): not ours to swallow
            me.uncancel()  # the client went away; the app's finally: aborted the generation
        except ConnectionError:
            pass
        except Exception as exc:
            log.error("request handler failed", path=request.path, error=repr(exc), exc_info=exc)
            if not response.started:
                await _error(response, 500, f"internal error: {type(exc).__name__}")
            # else: returning with the response unfinished makes uvicorn close the connection
        finally:
            scope.pop(_TASK, None)


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines for a request's head and body, and a head size cap."""

    owner: "HttpServer"  # set on the per-server subclass

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head, self._head_bytes, self._discarding = True, 0, False
        super().connection_made(transport)
        self._arm("the request head")  # the first request's head; later ones: from their first byte

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        super().data_received(data)
        if self._in_head and not self._discarding and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "request head too large")

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_bytes += len(name) + len(value) + 4

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._deadline is None:
            self._arm("the request head")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self._head_bytes > MAX_HEAD_BYTES:  # arrived in one piece (a trickled one is cut in data_received)
            self._refuse(431, "request head too large")
            return
        super().on_headers_complete()
        length = next((v for k, v in self.headers if k == b"content-length"), b"0")
        if length.strip() not in (b"0", b""):
            self._arm("the request body")

    def on_body(self, body: bytes) -> None:
        if not self._discarding:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self._discarding:
            super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        scope = cast(dict, cycle.scope) if cycle is not None else {}
        if cycle is not None and not cycle.response_complete and _TASK in scope:
            scope[_GONE] = True  # the client left mid-request: stop its handler (and generation)
            scope[_TASK].cancel()
        super().connection_lost(exc)

    def _arm(self, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.owner.client_timeout_s, self._too_slow, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self, what: str) -> None:
        self._deadline = None
        self.owner.slow_client(self.client, what)
        self._refuse(408, f"{what} did not arrive within {self.owner.client_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer and close, reading (and dropping) what the client still sends for a moment: closing
        with its bytes unread would reset the connection, and a reset makes the client's kernel drop
        the answer."""
        self._disarm()
        body = _error_body(status, message)
        reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: "
                             f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the router handles SIGINT/SIGTERM itself (drain)


class HttpServer:
    def __init__(self, app: App, max_body: int = 16 * 2**20, max_connections: int = 1024,
                 client_timeout_s: float = 10.0) -> None:
        from router_svc.openai_models import docs_app

        self.asgi = _Asgi(app, max_body, docs_app())
        self.max_connections = max_connections
        self.client_timeout_s = client_timeout_s
        self.slow_peers: set[str] = set()  # logged once each (bounded below)
        self.server: _Server | None = None
        self._task: asyncio.Task | None = None

    def slow_client(self, peer: Any, what: str) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if host not in self.slow_peers and len(self.slow_peers) < 4096:
            self.slow_peers.add(host)
            log.warning("closed a slow HTTP client", peer=host, what=what, timeout_s=self.client_timeout_s)

    async def start(self, host: str, port: int, ssl: "ssl_module.SSLContext | None" = None) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY on accepted sockets only then (without
        # it a response's head and body wait on the client's delayed ACK: 40 ms per request)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        protocol = type("GuardedProtocol", (_GuardedProtocol,), {"owner": self})
        config = uvicorn.Config(self.asgi, http=protocol, lifespan="off", log_config=None, log_level="warning",
                                access_log=False, server_header=False, proxy_headers=False,
                                limit_concurrency=self.max_connections,
                                timeout_keep_alive=KEEPALIVE_IDLE_S, timeout_graceful_shutdown=1)
        config.load()
        config.ssl = ssl  # the router's own context (router_svc/server.py builds and checks it)
        self.server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise its error
            await asyncio.sleep(0.005)
        return sock.getsockname()[1]

    async def close(self) -> None:
        if self.server is not None and self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), 3)
