"""The router's own cost: `tandem router` in front of a fake decode worker that answers instantly.

The fake worker (`--fake-worker ADDR`, run as its own process) is a static decode worker speaking the
router protocol: it answers `stats` polls and streams every `add_request` back as one-token `output`
messages, each token's text being the worker's CLOCK_MONOTONIC send time. The client reads that stamp
back from the SSE stream, so "added latency per token" is measured end to end (ZMQ in, the router's
handling, HTTP/SSE out, the client's parse) with no model in the way.

Three measurements, each on a fresh router + fake worker:
1. rps: non-streaming completions (max_tokens 1) from `--concurrency` keep-alive connections for
   `--seconds`: requests per second and mean latency.
2. stream: streaming completions (max_tokens 256, the worker emits tokens as fast as the loop allows)
   from `--concurrency` connections: tokens per second through the router (1 / its per-token cost).
3. latency: streaming completions with the worker pacing each stream's tokens every 10 ms, at
   concurrency 1 and `--concurrency`: p50 / p99 of (client receive - worker send) per token.
Each also reports the router process's CPU time per request (rps) or per streamed token: on a shared
machine the wall-clock rates move with the neighbours' load, the CPU cost much less.

Usage: python -m bench.router_overhead [--concurrency 16] [--seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "tandem" / "assets" / "tiny-target")


# ---- the fake decode worker ---------------------------------------------------------------------------
async def fake_worker(address: str, interval_s: float) -> None:
    import zmq
    import zmq.asyncio

    from tandem.protocol import messages

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    tasks: dict[str, asyncio.Task] = {}

    async def emit(ident: bytes, rid: str, n: int, prompt: int) -> None:
        try:
            for i in range(n):
                last = i == n - 1
                await sock.send_multipart([ident, messages.encode(
                    "output", id=rid, token_ids=[100 + i % 100], text=f"{time.monotonic():.6f};", finished=last,
                    finish_reason="length" if last else None, num_cached_tokens=0, num_prompt_tokens=prompt)])
                await asyncio.sleep(interval_s)  # 0: yield to the other streams between tokens
        finally:
            tasks.pop(rid, None)

    while True:
        ident, frame = await sock.recv_multipart()
        msg = messages.decode(frame)
        if msg["type"] == "stats":
            await sock.send_multipart([ident, messages.encode("stats_reply", stats={"running": len(tasks),
                                                                                     "waiting": 0})])
        elif msg["type"] == "add_request":
            n = int(msg["sampling"].get("max_tokens") or 1)
            tasks[msg["id"]] = asyncio.create_task(emit(ident, msg["id"], n, len(msg["token_ids"])))
        elif msg["type"] == "abort" and msg["id"] in tasks:
            tasks[msg["id"]].cancel()


# ---- processes ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A fake worker and a router with it as a static decode worker."""

    def __init__(self, interval_s: float, max_inflight: int, log_dir: Path) -> None:
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.port = _free_port()
        env_cmd = [sys.executable, "-m", "bench.router_overhead"]
        self.worker = subprocess.Popen([*env_cmd, "--fake-worker", self.address, "--interval", str(interval_s)],
                                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.log = log_dir / f"router-{self.port}.log"
        self.router = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "router", "--model", MODEL, "--host", "127.0.0.1",
             "--http-port", str(self.port), "--grpc-port", "0", "--listen", "tcp://127.0.0.1:0",
             "--decode", self.address, "--decode-policy", "round_robin", "--max-inflight", str(max_inflight),
             "--log-level", "warning"], cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.loads(r.read())["live_workers"]["decode"] == 1:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router not ready: {self.log.read_text()[-2000:]}")

    def cpu_s(self) -> float:
        """The router process's user + system CPU seconds so far."""
        with open(f"/proc/{self.router.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        for p in (self.router, self.worker):
            p.terminate()
        for p in (self.router, self.worker):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- the client -------------------------------------------------------------------------------------
async def _request(reader, writer, port: int, body: dict) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    status = int((await reader.readline()).split()[1])
    length, chunked = 0, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
        elif k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length)
    out = b""
    while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
        out += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)
    return status, out


async def _rps(port: int, concurrency: int, seconds: float) -> dict:
    body = {"model": "tiny-target", "prompt": [1, 2, 3, 4], "max_tokens": 1}
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def conn() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            status, _ = await _request(reader, writer, port, body)
            latencies.append(time.perf_counter() - t0)
            errors += status != 200
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests_per_s": round(len(latencies) / wall, 1), "mean_latency_ms": round(
        1000 * statistics.fmean(latencies), 2), "errors": errors, "requests": len(latencies)}


async def _stream(port: int, concurrency: int, per_conn: int, max_tokens: int) -> dict:
    body = {"model": "tiny-target", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "stream": True}
    delays: list[float] = []
    tokens = 0

    async def conn() -> None:
        nonlocal tokens
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(per_conn):
            data = json.dumps(body).encode()
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            assert b" 200 " in await reader.readline()
            while await reader.readline() not in (b"\r\n", b""):
                pass
            while size := int((await reader.readline()).strip() or b"0", 16):
                chunk = await reader.readexactly(size)
                await reader.readexactly(2)
                now = time.monotonic()
                for line in chunk.split(b"\n"):
                    if line.startswith(b"data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            for stamp in filter(None, c["text"].split(";")):
                                delays.append(now - float(stamp))
                                tokens += 1
            await reader.readexactly(2)
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    delays.sort()
    return {"tokens_per_s": round(tokens / wall), "token_delay_p50_ms": round(1000 * delays[len(delays) // 2], 3),
            "token_delay_p99_ms": round(1000 * delays[int(len(delays) * 0.99)], 3), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fake-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--interval", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.fake_worker:
        asyncio.run(fake_worker(args.fake_worker, args.interval))
        return
    log_dir = Path("/tmp/router_overhead")
    log_dir.mkdir(exist_ok=True)
    results: dict = {}
    for name, interval, run in (
            ("rps", 0.0, lambda port: _rps(port, args.concurrency, args.seconds)),
            ("stream", 0.0, lambda port: _stream(port, args.concurrency, 4, 256)),
            ("latency_c1", 0.01, lambda port: _stream(port, 1, 2, 200)),
            (f"latency_c{args.concurrency}", 0.01, lambda port: _stream(port, args.concurrency, 1, 200))):
        cluster = Cluster(interval, max_inflight=4 * args.concurrency, log_dir=log_dir)
        try:
            asyncio.run(run(cluster.port))  # warm-up
            cpu = cluster.cpu_s()
            results[name] = out = asyncio.run(run(cluster.port))
            cpu = cluster.cpu_s() - cpu
            per, unit = (out["requests"], "request") if "requests" in out else (out["tokens"], "token")
            out[f"router_cpu_us_per_{unit}"] = round(1e6 * cpu / per, 1)
        finally:
            cluster.close()
        print(name, results[name], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
