"""SLO judging (router_svc/slo.py) and the --rebalance policy (router_svc/rebalance.py) on a real
Registry: what counts as met, when a worker moves, and the hysteresis that keeps it from flapping.
(The move itself, a live role switch, is exercised with real processes in test_role_switch.py.)"""

from __future__ import annotations

import pytest

from router_svc.admin import Admin
from router_svc.rebalance import MIN_REQUESTS, Policy, Rebalancer, verdict
from router_svc.registry import Registry
from router_svc.slo import SloTracker, Window


def test_judge_uses_ttft_and_mean_itl():
    slo = SloTracker(ttft_slo_s=0.5, itl_slo_s=0.05, window_s=10)
    ok = slo.judge(started=100.0, first_token_at=100.4, last_token_at=101.12, tokens=19, now=101.3)  # ITL 0.04
    assert ok.met and ok.itl_s == pytest.approx(0.04)
    late = slo.judge(100.0, 100.6, 100.68, 3, now=101.4)
    assert not late.ttft_ok and late.itl_ok and not late.met
    slow = slo.judge(100.0, 100.1, 100.5, 3, now=101.5)  # mean ITL 0.2 (the first gap is not an ITL)
    assert slow.ttft_ok and not slow.itl_ok
    one = slo.judge(100.0, 100.2, 100.2, 1, now=101.6)  # a one-token answer: no ITL to miss
    assert one.met and one.itl_s is None
    w = slo.recent(now=102.0)
    assert (w.requests, w.ttft_missed, w.itl_missed) == (4, 0.25, 0.25)
    assert slo.recent(now=111.45).requests == 2  # the first two left the 10 s window
    with pytest.raises(ValueError, match="--itl-slo must be > 0"):
        SloTracker(0.5, 0.0)


@pytest.mark.parametrize("window,want", [
    (Window(MIN_REQUESTS, 0.30, 0.00, 1.0), "prefill"),
    (Window(MIN_REQUESTS, 0.00, 0.50, 1.0), "decode"),
    (Window(MIN_REQUESTS, 0.30, 0.30, 1.0), None),  # both missed: too small a cluster, not a bad split
    (Window(MIN_REQUESTS, 0.05, 0.01, 1.0), None),  # both fine
    (Window(MIN_REQUESTS - 1, 1.0, 0.0, 1.0), None),  # too few requests to judge
])
def test_verdict(window, want):
    assert verdict(window) == want


def _cluster(decode: int, prefill: int, switchable: bool = True) -> Registry:
    reg = Registry()
    for role, n in (("decode", decode), ("prefill", prefill)):
        for i in range(n):
            wid = f"{role[0]}{i}"
            reg.handle({"type": "register", "worker_id": wid, "role": role, "control_address": f"tcp://h:{i}/{wid}",
                        "model": "m", "interval_ms": 500})
            reg.on_stats_reply(f"tcp://h:{i}/{wid}", {})  # its control address answered
            reg.handle({"type": "heartbeat", "worker_id": wid, "stats": {"switchable": switchable, "running": i}})
    return reg


def _feed(slo: SloTracker, n: int, now: float, ttft: float, itl: float) -> None:
    for _ in range(n):
        slo.judge(now - ttft - itl * 9, now - itl * 9, now, 10, now=now)


def test_rebalancer_moves_one_decode_worker_after_the_hold_and_then_waits():
    reg, sent = _cluster(decode=3, prefill=1), []
    admin = Admin(reg, lambda address, kind, **f: sent.append((address, kind, f)))
    slo = SloTracker(0.5, 0.05, window_s=30)
    rb = Rebalancer(reg, admin, slo, Policy(hold_s=5, cooldown_s=20))
    t = 1000.0
    _feed(slo, 20, t, ttft=2.0, itl=0.01)  # prompts wait; decoding is fast: prefill is the bottleneck
    moved = [rb.tick(t + s) for s in range(0, 12)]
    assert [m for m in moved if m] == ["d0"] and moved.index("d0") == 5  # after hold_s, the least loaded D
    assert sent == [("tcp://h:0/d0", "set_role", {"role": "prefill"})]
    assert reg.workers["d0"].stats["draining"]  # routed nothing new from the moment it was asked
    for s in range(12, 25):  # same verdict, but within the cooldown
        _feed(slo, 1, t + s, ttft=2.0, itl=0.01)
        assert rb.tick(t + s) is None
    _feed(slo, 1, t + 26, ttft=2.0, itl=0.01)
    assert rb.tick(t + 26) == "d1"  # cooldown over, the verdict has held: the next one
    assert rb.moves == 2


def test_rebalancer_hysteresis_and_limits():
    reg, sent = _cluster(decode=1, prefill=2), []
    admin = Admin(reg, lambda address, kind, **f: sent.append(kind))
    slo = SloTracker(0.5, 0.05, window_s=4)
    rb = Rebalancer(reg, admin, slo, Policy(hold_s=3, cooldown_s=0))
    t = 0.0
    _feed(slo, 20, t, ttft=2.0, itl=0.01)  # wants a D -> P move, but D has one worker only
    assert all(rb.tick(t + s) is None for s in range(6)) and not sent
    # a verdict that flips before hold_s never acts
    for s in range(6, 20):
        itl_bad = (s // 2) % 2 == 0
        _feed(slo, MIN_REQUESTS, t + s, ttft=0.1 if itl_bad else 2.0, itl=0.2 if itl_bad else 0.01)
        rb.tick(t + s)
    assert not sent
    with pytest.raises(ValueError, match="needs both --ttft-slo and --itl-slo"):
        Rebalancer(reg, admin, SloTracker(0.5, None))


def test_rebalancer_skips_workers_that_cannot_switch():
    reg, sent = _cluster(decode=3, prefill=1, switchable=False), []
    slo = SloTracker(0.5, 0.05)
    rb = Rebalancer(reg, Admin(reg, lambda *a, **f: sent.append(a)), slo, Policy(hold_s=0, cooldown_s=0))
    _feed(slo, 20, 10.0, ttft=2.0, itl=0.01)
    assert rb.tick(10.0) is None and not sent
