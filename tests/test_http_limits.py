"""The router's HTTP limits against slow and oversized clients, on a real router process: a head or
body trickled a byte at a time is cut off with 408 within --client-timeout (logged once per peer),
oversized heads and bodies are refused (431, 413), and other clients are served meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from service_procs import get_json, router_endpoints, start_router, stop_all
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow
TIMEOUT_S = 1.5


def _trickle(port: int, first: bytes, drip: bytes, seconds: float) -> tuple[bytes, float]:
    """Send `first`, then `drip` a byte every 0.25 s; returns (what the server answered, when it closed)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(0.25)
    t0, answer = time.monotonic(), b""
    s.sendall(first)
    try:
        for i in range(int(seconds / 0.25)):
            try:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
            except socket.timeout:
                pass
            except ConnectionResetError:  # the server is gone; what it answered before is in `answer`
                break
            try:
                s.sendall(drip[i % len(drip):i % len(drip) + 1])
            except OSError:
                break
    finally:
        s.close()
    return answer, time.monotonic() - t0


def test_slow_and_oversized_clients(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    router = start_router("router", ckpt, tmp_path, "--client-timeout", str(TIMEOUT_S))
    try:
        http = router_endpoints(router)["http"]
        port = int(http.rsplit(":", 1)[1])
        served: list[int] = []

        def others() -> None:  # a normal client keeps being answered while the slow ones hang on
            for _ in range(10):
                served.append(get_json(f"{http}/health")[0])
                time.sleep(0.2)

        t = threading.Thread(target=others)
        t.start()
        head, took = _trickle(port, b"GET /health HTTP/1.1\r\n", b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 8)
        assert head.startswith(b"HTTP/1.1 408") and b"the request head" in head, head
        assert took < TIMEOUT_S + 2
        body, took = _trickle(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{", b"aaaa", 8)
        assert body.startswith(b"HTTP/1.1 408") and b"the request body" in body and took < TIMEOUT_S + 2, body
        t.join()
        assert served == [503] * 10  # answered (no workers: 503), none stuck behind the slow ones
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 413")
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 431")
        assert router.log.read_text().count("closed a slow HTTP client") == 1  # once per peer, not per connection
    finally:
        stop_all([router])


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_ten_times_overload_is_429s_not_memory(tmp_path):
    """--max-inflight 4 and a slowed decode worker; 40 clients at once, over and over: the excess is
    answered 429 with Retry-After at once, everything admitted completes, the router's memory stays flat."""
    import json
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from service_procs import start_colocated_decode, wait_workers

    from tandem.default_model import ASSETS_DIR, TARGET_NAME

    router = start_router("router", str(ASSETS_DIR / TARGET_NAME), tmp_path, "--max-inflight", "4")
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(start_colocated_decode("d1", ep["listen"], tmp_path, delay=0.01))
        wait_workers(ep["http"], decode=1)

        def one(i: int) -> tuple[int, str | None]:
            body = json.dumps({"prompt": f"# {i}\n", "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(f"{ep['http']}/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After")

        with ThreadPoolExecutor(40) as pool:
            list(pool.map(one, range(40)))  # warm-up: the router's steady state
            before = _rss_mb(router.popen.pid)
            results = [r for _ in range(5) for r in pool.map(one, range(40))]
        after = _rss_mb(router.popen.pid)
        codes = [c for c, _ in results]
        assert set(codes) <= {200, 429} and codes.count(429) >= 40 and codes.count(200) >= 20, codes
        assert all(retry == "1" for c, retry in results if c == 429)
        assert after - before < 30, (before, after)  # 200 requests at 10x the admission limit: no growth
    finally:
        stop_all(procs)
