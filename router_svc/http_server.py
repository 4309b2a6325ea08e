"""A small HTTP/1.1 server on asyncio streams (the standard library only): keep-alive, Content-Length
request bodies, JSON responses, and chunked streaming responses for server-sent events.

1. A connection reads one request head (bounded: MAX_HEAD_BYTES) and its body (bounded: max_body).
2. The app coroutine `app(request, response)` runs as a task while a watcher checks the socket: a
   client that disconnects cancels the task, so the app's `finally:` aborts the generation.
3. The app answers with `response.json(...)`, `response.send(...)`, or `start_stream()` /
   `write()` / `end_stream()`; an app that raised before answering gets a 500.
4. Past `max_connections` open connections a new one is answered 503 and closed: connections,
   like requests, must not grow memory without bound.
5. Slow clients: a request's head, then its body, must each arrive within `client_timeout_s` (a
   client sending a byte a second is answered 408 and closed, and logged once per peer address);
   an idle keep-alive connection is closed after KEEPALIVE_IDLE_S.
"""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_module
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 64 * 1024
DISCONNECT_POLL_S = 0.1
KEEPALIVE_IDLE_S = 60.0
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8")) if self.body else None


@dataclass(slots=True)
class Response:
    writer: asyncio.StreamWriter
    keep_alive: bool
    started: bool = False
    streaming: bool = False
    extra_headers: dict[str, str] = field(default_factory=dict)

    async def send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        head = self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})})
        self.started = True
        self.writer.write(head + body)
        await self.writer.drain()

    async def json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    async def start_stream(self, content_type: str = "text/event-stream") -> None:
        head = self._head(200, {"Content-Type": content_type, "Cache-Control": "no-cache",
                                "Transfer-Encoding": "chunked"})
        self.started = self.streaming = True
        self.writer.write(head)
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        if data:
            self.writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await self.writer.drain()  # raises ConnectionError once the client is gone

    async def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        headers = {**headers, **self.extra_headers, "Connection": "keep-alive" if self.keep_alive else "close"}
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


App = Callable[[Request, Response], Awaitable[None]]


class HttpServer:
    def __init__(self, app: App, max_body: int = 16 * 2**20, max_connections: int = 1024,
                 client_timeout_s: float = 10.0) -> None:
        self.app = app
        self.max_body = max_body
        self.max_connections = max_connections
        self.client_timeout_s = client_timeout_s
        self.slow_peers: set[str] = set()  # logged once each (bounded below)
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, ssl: "ssl_module.SSLContext | None" = None) -> int:
        self.server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEAD_BYTES, ssl=ssl)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.connections > self.max_connections:
                await _error(Response(writer, False), 503, "too many open connections")
                return
            first = True
            while await self._one_request(reader, writer, first):
                first = False
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except TimeoutError as exc:  # too slow a client: answered 408 above, or idle: just closed
            self._slow(writer, str(exc))
        finally:
            self.connections -= 1
            writer.close()

    def _slow(self, writer: asyncio.StreamWriter, what: str) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if what and host not in self.slow_peers and len(self.slow_peers) < 4096:
            self.slow_peers.add(host)
            log.warning("closed a slow HTTP client", peer=host, what=what, timeout_s=self.client_timeout_s)

    async def _read(self, coro: Awaitable[bytes], timeout_s: float, writer: asyncio.StreamWriter, what: str,
                    reader: asyncio.StreamReader | None = None) -> bytes:
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError:
            if what:
                await _error(Response(writer, False), 408, f"{what} did not arrive within {timeout_s:g} s")
                if reader is not None:
                    await _lingering_close(reader, writer)
            raise TimeoutError(what) from None

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool) -> bool:
        """Serve one request; returns whether the connection stays open."""
        try:
            # The first request's head must come within the client timeout; on a keep-alive
            # connection the wait for the next one may be idle longer (closed quietly after that).
            timeout = self.client_timeout_s if first else KEEPALIVE_IDLE_S
            head = await self._read(reader.readuntil(b"\r\n\r\n"), timeout, writer,
                                    "the request head" if first else "", reader)
        except asyncio.IncompleteReadError:
            return False  # client closed between requests
        except asyncio.LimitOverrunError:
            await _error(Response(writer, False), 431, "request head too large")
            return False
        try:
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, target, version = request_line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines if h)}
        except ValueError:
            await _error(Response(writer, False), 400, "malformed HTTP request")
            return False
        conn = headers.get("connection", "").lower()
        keep_alive = conn != "close" and (version == "HTTP/1.1" or conn == "keep-alive")
        response = Response(writer, keep_alive)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _error(Response(writer, False), 411, "chunked request bodies are not supported; send Content-Length")
            return False
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= self.max_body:
            await _error(Response(writer, False), 413, f"request body must be at most {self.max_body} bytes")
            return False
        body = await self._read(reader.readexactly(length), self.client_timeout_s, writer,
                                "the request body", reader) if length else b""
        path, _, query = target.partition("?")
        await self._run_app(Request(method.upper(), path, query, headers, body), response, reader)
        return keep_alive and response.started

    async def _run_app(self, request: Request, response: Response, reader: asyncio.StreamReader) -> None:
        task = asyncio.ensure_future(self.app(request, response))
        watcher = asyncio.ensure_future(_wait_disconnect(reader))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not task.done():  # the client went away: cancel, which aborts the generation
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ConnectionResetError("client disconnected")
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, ConnectionError):
            raise exc
        log.error("request handler failed", path=request.path, error=repr(exc), exc_info=exc)
        if not response.started:
            await _error(response, 500, f"internal error: {type(exc).__name__}")
        else:
            raise ConnectionResetError("handler failed mid-response")


async def _lingering_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, linger_s: float = 1.0) -> None:
    """Half-close and discard what the client still sends for a moment: closing with its bytes
    unread would reset the connection, and a reset makes the client's kernel drop our answer."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        deadline = asyncio.get_running_loop().time() + linger_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            if not await asyncio.wait_for(reader.read(65536), left):
                break
    except (TimeoutError, ConnectionError, OSError):
        pass


async def _wait_disconnect(reader: asyncio.StreamReader) -> None:
    # Polling the reader's EOF flag does not consume bytes (unlike a read), and costs nothing at
    # 10 Hz per busy connection.
    while not reader.at_eof() and reader.exception() is None:
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _error(response: Response, status: int, message: str) -> None:
    await response.json(status, {"error": {"message": message, "type": "invalid_request_error" if status < 500
                                           else "internal_error", "param": None, "code": None}})
