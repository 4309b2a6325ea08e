"""An open-loop load generator for an OpenAI-compatible server: exact arrival times, per-chunk timestamps.

`run_load(base, model, requests)` sends each request at its own `arrival_s` (from the start, whether or
not earlier ones finished: open loop) as a streaming `/v1/completions` with token-id prompts,
`ignore_eos` and `stream_options.include_usage`, and records when every SSE chunk arrived. Plain
asyncio streams and HTTP/1.1 (chunked or not): no client library, so nothing of its own to tune or
queue behind. TTFT is send to first text chunk; ITL is the request's mean gap after its first token,
(last - first) / (tokens - 1), with the token count from the usage chunk (as the router's SLO judge).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass(slots=True)
class Sent:
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Received:
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # one per chunk that carried text
    tokens: int = 0  # completion tokens, from the usage chunk
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def itl_s(self) -> float | None:
        if self.tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


async def _read_body(reader: asyncio.StreamReader, chunked: bool):
    """Yield the response body's bytes as they arrive, undoing chunked transfer encoding."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after each chunk


async def stream_one(host: str, port: int, model: str, sent: Sent, out: Received, timeout_s: float,
                     per_token: bool = False) -> None:
    """per_token: ask for logprobs, so every token arrives in a chunk of its own even when its text is
    empty (a held-back partial character, a random model's tokens) and time chunks that carry tokens."""
    req = {"model": model, "prompt": sent.prompt, "max_tokens": sent.max_tokens, "temperature": 0,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if per_token:
        req["logprobs"] = 1
    body = json.dumps(req).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n").encode()
    out.sent_at = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(head + body)
        await writer.drain()
        status = (await reader.readline()).decode("latin-1").split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        if len(status) < 2 or status[1] != "200":
            out.error = f"HTTP {' '.join(status[1:])}"
            return
        buf = b""
        async for data in _read_body(reader, headers.get("transfer-encoding") == "chunked"):
            now = time.perf_counter()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.splitlines():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    msg = json.loads(payload)
                    if msg.get("error"):
                        out.error = str(msg["error"].get("message", msg["error"]))
                    choices = msg.get("choices") or []
                    if per_token:
                        n = sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in choices)
                        out.chunk_times += [now] * n  # k tokens in one chunk: one gap, then k - 1 zeros
                    elif any(c.get("text") for c in choices):
                        out.chunk_times.append(now)
                    if msg.get("usage"):
                        out.tokens = int(msg["usage"]["completion_tokens"])
    finally:
        writer.close()


async def _run(base: str, model: str, requests: list[Sent], timeout_s: float) -> list[Received]:
    url = urlparse(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    results = [Received() for _ in requests]
    start = time.perf_counter()

    async def one(i: int) -> None:
        delay = start + requests[i].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await asyncio.wait_for(stream_one(host, port, model, requests[i], results[i], timeout_s), timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            results[i].error = f"{type(exc).__name__}: {exc}"

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results


def run_load(base: str, model: str, requests: list[Sent], timeout_s: float = 300.0) -> list[Received]:
    """Send every request at its arrival time (seconds from now); wait for all; results in order."""
    return asyncio.run(_run(base, model, requests, timeout_s))
