"""Service-level objectives at the router: did each finished request meet its TTFT and ITL targets?

With `--ttft-slo S` and/or `--itl-slo S` the router judges every request that finished with tokens:
TTFT is admission to the first token, ITL the request's mean gap between tokens after the first
(DistServe's TPOT). A request meets the SLO when both hold. Counted in
`tandem_router_slo_requests_total{result}` (met | ttft_missed | itl_missed | both_missed) and
`tandem_router_goodput_requests_per_second` (met requests per second over the last WINDOW_S);
`recent()` gives the rebalancer the same window.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

WINDOW_S = 30.0
SLO_REQUESTS = Counter("tandem_router_slo_requests_total", "Finished requests judged against --ttft-slo / --itl-slo",
                       ["result"])
for _result in ("met", "ttft_missed", "itl_missed", "both_missed"):
    SLO_REQUESTS.labels(_result)  # exported at 0 from the start
GOODPUT = Gauge("tandem_router_goodput_requests_per_second",
                f"Requests per second that met every SLO, over the last {WINDOW_S:.0f} s")


@dataclass(slots=True, frozen=True)
class Judged:
    at: float
    ttft_s: float
    itl_s: float | None  # None: a one-token answer has no gaps
    ttft_ok: bool
    itl_ok: bool

    @property
    def met(self) -> bool:
        return self.ttft_ok and self.itl_ok


@dataclass(slots=True)
class Window:
    """The judged requests of the last WINDOW_S: what share missed each target."""

    requests: int
    ttft_missed: float  # fraction
    itl_missed: float
    goodput: float  # met requests per second


class SloTracker:
    def __init__(self, ttft_slo_s: float | None, itl_slo_s: float | None, window_s: float = WINDOW_S) -> None:
        for name, value in (("--ttft-slo", ttft_slo_s), ("--itl-slo", itl_slo_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.ttft_slo_s, self.itl_slo_s, self.window_s = ttft_slo_s, itl_slo_s, window_s
        self.started = time.monotonic()
        self._recent: deque[Judged] = deque()

    def judge(self, started: float, first_token_at: float, last_token_at: float, tokens: int,
              now: float | None = None) -> Judged:
        ttft = first_token_at - started
        itl = (last_token_at - first_token_at) / (tokens - 1) if tokens > 1 else None
        judged = Judged(time.monotonic() if now is None else now, ttft, itl,
                        self.ttft_slo_s is None or ttft <= self.ttft_slo_s,
                        self.itl_slo_s is None or itl is None or itl <= self.itl_slo_s)
        result = "met" if judged.met else ("both_missed" if not (judged.ttft_ok or judged.itl_ok)
                                           else "ttft_missed" if not judged.ttft_ok else "itl_missed")
        SLO_REQUESTS.labels(result).inc()
        self._recent.append(judged)
        self.recent(judged.at)  # trims the window, updates the gauge
        return judged

    def recent(self, now: float | None = None) -> Window:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0].at < now - self.window_s:
            self._recent.popleft()
        n = len(self._recent)
        span = min(self.window_s, max(now - self.started, 1e-9))
        met = sum(j.met for j in self._recent)
        window = Window(n, sum(not j.ttft_ok for j in self._recent) / n if n else 0.0,
                        sum(not j.itl_ok for j in self._recent) / n if n else 0.0, met / span)
        GOODPUT.set(window.goodput)
        return window
