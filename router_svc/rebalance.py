"""`--rebalance`: move workers between the prefill and decode roles from live SLO signals.

Every CHECK_S the router looks at the last window of judged requests (router_svc/slo.py):
- prompts are the bottleneck when many requests miss the TTFT target while the ITL target has
  headroom: one decode worker moves to prefill;
- decoding is, when many miss the ITL target while TTFT has headroom: one prefill worker moves to
  decode.
Both missing at once means the cluster is too small, not mis-split: nothing moves. Hysteresis keeps
it from flapping: the same verdict must hold for `hold_s`, a move waits `cooldown_s` after the last
one (long enough for the moved worker to drain and for the window to see its effect), a window
needs MIN_REQUESTS judged requests, and a role never loses its last worker (Admin refuses that).
The moved worker is the donor role's least loaded switchable one; the move is an ordinary
`Admin.set_role`, counted with by="rebalance".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from router_svc.admin import Admin
from router_svc.errors import RouterError
from router_svc.registry import Registry, Worker
from router_svc.slo import SloTracker, Window

log = structlog.get_logger(__name__)

CHECK_S = 1.0
MIN_REQUESTS = 10
MISSING = 0.10  # a target this often missed is the bottleneck...
HEADROOM = 0.02  # ...if the other is missed at most this often


@dataclass(slots=True)
class Policy:
    hold_s: float = 10.0
    cooldown_s: float = 30.0


def verdict(window: Window) -> str | None:
    """'prefill' (move a worker to prefill), 'decode', or None."""
    if window.requests < MIN_REQUESTS:
        return None
    if window.ttft_missed >= MISSING and window.itl_missed <= HEADROOM:
        return "prefill"
    if window.itl_missed >= MISSING and window.ttft_missed <= HEADROOM:
        return "decode"
    return None


class Rebalancer:
    def __init__(self, registry: Registry, admin: Admin, slo: SloTracker, policy: Policy | None = None) -> None:
        if slo.ttft_slo_s is None or slo.itl_slo_s is None:
            raise ValueError("--rebalance needs both --ttft-slo and --itl-slo: they are what it balances")
        self.registry, self.admin, self.slo = registry, admin, slo
        self.policy = policy or Policy()
        self.last_move = -float("inf")
        self._since: tuple[str, float] | None = None  # (verdict, first seen)
        self._next_check = 0.0
        self.moves = 0

    def tick(self, now: float | None = None) -> str | None:
        """Called from the router's housekeeping; returns the worker id it moved, if any."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_S
        want = verdict(self.slo.recent(now))
        if want is None:
            self._since = None
            return None
        if self._since is None or self._since[0] != want:
            self._since = (want, now)
        if now - self._since[1] < self.policy.hold_s or now - self.last_move < self.policy.cooldown_s:
            return None
        donor = self._donor("decode" if want == "prefill" else "prefill")
        if donor is None:
            return None
        try:
            self.admin.set_role(donor.worker_id, {"role": want}, by="rebalance")
        except RouterError as exc:  # e.g. it is the donor role's last worker: nothing to give
            log.info("rebalance: no move", wanted=want, reason=exc.message)
            self._since = None
            return None
        self.last_move, self._since, self.moves = now, None, self.moves + 1
        log.warning("rebalance: moving a worker", worker_id=donor.worker_id, to_role=want)
        return donor.worker_id

    def _donor(self, role: str) -> Worker | None:
        candidates = [w for w in self.registry.routable(role) if w.stats.get("switchable") and not w.static
                      and not w.stats.get("draining")]
        if len(candidates) < 1 or len(self.registry.routable(role)) < 2:
            return None
        return min(candidates, key=lambda w: (w.inflight, w.stats.get("running", 0) + w.stats.get("waiting", 0)))
