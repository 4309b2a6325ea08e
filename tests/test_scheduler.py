"""The scheduler without a model: driven with fake sampled tokens, as vLLM's tests/v1/core/test_scheduler.py
does. One rule (computed tokens catch up), one waiting queue for local and remote-KV requests, the
`max_num_seqs` seats and priority for both, chunking, preemption, speculative tokens, and held blocks."""

from __future__ import annotations

from plugins.eviction import LRUEviction
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_connector import KVConnector
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.sampling_params import SamplingParams

BS = 4
EOS = 0


class RemoteAll(KVConnector):
    """Every uncached prompt token comes from a peer; remembers what it was asked to fetch."""

    def __init__(self, threshold: int = 1, hold: bool = False) -> None:
        self.threshold, self.hold = threshold, hold
        self.fetching: dict[str, list[int]] = {}

    def num_external_tokens(self, req: Request, num_computed: int) -> int:
        uncached = req.num_tokens - num_computed
        return uncached if uncached >= self.threshold else 0

    def on_allocated(self, req: Request, num_computed: int) -> None:
        self.fetching[req.request_id] = req.block_ids[num_computed // BS:]

    def hold_blocks(self, req: Request) -> bool:
        return self.hold


def make(num_blocks: int = 64, budget: int = 64, seats: int = 8, connector: KVConnector | None = None,
         caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, LRUEviction(num_blocks), caching)
    return Scheduler(kv, budget, seats, True, connector)


def req(rid: str, n: int, max_tokens: int = 8, priority: int = 0, start: int = 1) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), {EOS}, max_tokens,
                   priority)


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step: every request that catches up samples `token` (plus its speculated tokens, all accepted)."""
    out = s.schedule()
    sampled = {x.request.request_id: [*x.spec_token_ids, token] for x in out.scheduled if x.samples}
    s.update(out, sampled)
    s.kv.check_invariants(s.live_requests())
    return out


def test_chunked_prefill_catches_up_and_samples_only_at_the_end():
    s = make(budget=32)
    s.add(req("a", 100))
    chunks = [run_step(s).scheduled[0] for _ in range(4)]
    assert [c.num_new_tokens for c in chunks] == [32, 32, 32, 4]
    assert s.requests["a"].num_computed_tokens == 100 and s.requests["a"].output_token_ids == [7]
    assert run_step(s).scheduled[0].num_new_tokens == 1  # then one token per step


def test_running_first_then_waiting_fcfs_with_priority():
    s = make(budget=64)
    s.add(req("low", 8, priority=5, start=100))
    s.add(req("first", 8, start=200))
    s.add(req("urgent", 8, priority=-1, start=300))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["urgent", "first", "low"]


def test_remote_requests_obey_max_num_seqs_and_use_no_budget():
    conn = RemoteAll()
    s = make(seats=2, budget=16, connector=conn)
    for i in range(4):
        s.add(req(f"r{i}", 40, start=100 * i + 1))
    out = run_step(s)
    assert out.scheduled == [] and sorted(s.remote) == ["r0", "r1"] and len(s.waiting) == 2
    assert len(conn.fetching["r0"]) == 10  # the whole prompt's blocks, though the budget is 16 tokens
    s.remote_kv_arrived("r0", 11)
    out = run_step(s)  # r0 decodes; r2 may not start: r0 and r1 still hold both seats
    assert [x.request.request_id for x in out.scheduled] == ["r0"] and sorted(s.remote) == ["r1"]
    assert s.requests["r0"].output_token_ids == [11, 7]
    s.finish(s.requests["r0"], "stop")
    run_step(s)
    assert sorted(s.remote) == ["r1", "r2"] and [r.request_id for r in s.waiting] == ["r3"]


def test_remote_admission_follows_priority():
    s = make(seats=1, connector=RemoteAll())
    s.add(req("later", 20, start=1))
    s.add(req("urgent", 20, priority=-3, start=50))
    run_step(s)
    assert list(s.remote) == ["urgent"]


def test_local_threshold_computes_a_short_remainder_here():
    conn = RemoteAll(threshold=16)
    s = make(connector=conn)
    s.add(req("long", 40, start=1))
    s.add(req("short", 8, start=100))
    out = run_step(s)
    assert list(s.remote) == ["long"] and [x.request.request_id for x in out.scheduled] == ["short"]


def test_failed_transfer_recomputes_keeping_its_seat_and_prefix():
    s = make(connector=RemoteAll(), seats=1)
    s.add(req("a", 12))
    run_step(s)
    s.compute_locally("a")
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 12 and s.requests["a"].output_token_ids == [7]


def test_aborted_remote_request_holds_blocks_until_released():
    s = make(connector=RemoteAll(hold=True))
    s.add(req("a", 16))
    run_step(s)
    blocks = list(s.remote["a"].block_ids)
    used = s.kv.stats().used_blocks
    s.abort("a")
    assert "a" in s.held and s.kv.stats().used_blocks == used  # a peer may still be writing them
    s.kv.check_invariants(s.live_requests())
    s.release("a")
    assert s.held == {} and s.kv.stats().used_blocks == used - len(blocks)


def test_preemption_recomputes_the_newest_running_request():
    s = make(num_blocks=6, budget=64, seats=4, caching=False)
    s.add(req("old", 8, max_tokens=20, start=1))
    s.add(req("new", 8, max_tokens=20, start=50))
    preempted = []
    for _ in range(12):
        out = run_step(s)
        preempted += out.preempted
        if preempted:
            break
    assert preempted == ["new"]
    new = s.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and s.waiting[0] is new
    assert s.requests["old"].status is RequestStatus.RUNNING


def test_speculative_tokens_ride_along_and_are_dropped_when_they_do_not_fit():
    s = make(budget=64)
    s.add(req("a", 8, max_tokens=20))
    run_step(s)
    a = s.requests["a"]
    a.spec_token_ids = [3, 4, 5]
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 4 and a.output_token_ids == [7, 3, 4, 5, 7]
    tight = make(budget=2)
    tight.add(req("b", 2, max_tokens=20))
    run_step(tight)
    b = tight.requests["b"]
    b.spec_token_ids = [3, 4, 5]
    out = run_step(tight)
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].spec_token_ids == []
