"""The two objects the router's HTTP server hands its app (router_svc/http_server.py): the parsed
`Request`, and the `Response` it answers with over ASGI `send` — one body, or a stream of writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not (nesting past Python's recursion limit included)."""
        try:
            return json.loads(self.body.decode("utf-8")) if self.body else None
        except RecursionError:
            raise ValueError("the JSON body is nested too deeply") from None


class Response:
    """What the app answers with, over ASGI `send`: one JSON/bytes body, or a stream of writes."""

    __slots__ = ("_send", "started", "streaming", "extra_headers")

    def __init__(self, send: Callable[[dict], Awaitable[None]]) -> None:
        self._send = send
        self.started = False
        self.streaming = False
        self.extra_headers: dict[str, str] = {}

    def _head(self, status: int, headers: dict[str, str]) -> dict:
        merged = {**headers, **self.extra_headers}
        return {"type": "http.response.start", "status": status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()]}

    async def send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.started = True
        await self._send(self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body)),
                                             **(headers or {})}))
        await self._send({"type": "http.response.body", "body": body})

    async def json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    async def start_stream(self, content_type: str = "text/event-stream") -> None:
        self.started = self.streaming = True  # no Content-Length: uvicorn sends it chunked
        await self._send(self._head(200, {"Content-Type": content_type, "Cache-Control": "no-cache"}))

    async def write(self, data: bytes) -> None:
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        await self._send({"type": "http.response.body", "body": b""})
