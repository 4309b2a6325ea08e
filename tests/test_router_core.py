"""Unit tests of the router's pieces without processes: routing policies, the worker registry, and the
core's retry / fail / abort / admission rules (the end-to-end behaviour is in test_router.py)."""

from __future__ import annotations

import asyncio

import pytest


def _workers(n: int, **stats):
    from router_svc.registry import Worker

    return [Worker(worker_id=f"w{i}", role="decode", address=f"tcp://w{i}", stats=dict(stats)) for i in range(n)]


def test_prefix_affinity_keeps_shared_prefixes_together():
    from plugins.routing import PrefixAffinity, RouteRequest, prefix_key

    policy, workers = PrefixAffinity(), _workers(4)
    shared = list(range(100, 164))  # 4 full blocks of 16

    def pick(tokens, ws):
        return policy.choose(ws, RouteRequest("r", tokens, prefix_key(tokens, 16, 4))).worker_id

    assert len({pick(shared + [i, i + 1], workers) for i in range(20)}) == 1
    prompts = [[i] * 70 for i in range(200)]
    before = {i: pick(p, workers) for i, p in enumerate(prompts)}
    assert len(set(before.values())) == 4
    after = {i: pick(p, workers[:3]) for i, p in enumerate(prompts)}  # w3 leaves
    assert all(after[i] == before[i] for i in before if before[i] != "w3")  # only w3's share moves
    workers[0].inflight = 100  # a hot worker spills to the next in the prompt's hash order
    assert all(pick(p, workers) != "w0" for p in prompts[:20])


def test_least_loaded_and_round_robin():
    from plugins.routing import LeastLoaded, RoundRobin, RouteRequest

    req = RouteRequest("r", [1, 2, 3], b"k")
    workers = _workers(3, waiting=5, kv_usage=0.5)
    workers[1].stats = {"waiting": 1, "kv_usage": 0.9}
    assert LeastLoaded().choose(workers, req).worker_id == "w1"
    workers[1].inflight = 10
    workers[2].stats = {"waiting": 5, "kv_usage": 0.1}
    assert LeastLoaded().choose(workers, req).worker_id == "w2"
    rr = RoundRobin()
    assert [rr.choose(workers, req).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_registry_heartbeats_expiry_and_static_workers():
    from router_svc.registry import Registry

    reg = Registry(static_timeout_s=1.0, misses=3)
    beat = {"type": "heartbeat", "worker_id": "d9", "stats": {"waiting": 2}}
    assert "register first" in reg.handle(beat)[0]
    register = {"type": "register", "worker_id": "d9", "role": "decode", "control_address": "tcp://d9",
                "model": "m", "interval_ms": 100}
    assert reg.handle(register) == (None, None) and reg.handle(beat) == (None, None)
    assert reg.live("decode") == []  # registered, but not routable before its control address answers
    reg.on_stats_reply("tcp://d9", {"waiting": 2})
    assert reg.live("decode")[0].stats == {"waiting": 2}
    assert "role" in reg.handle({**register, "worker_id": "x", "role": "both"})[0]
    static = reg.add_static("prefill", "tcp://p9")
    assert reg.live("prefill") == []  # down until it answers a stats poll
    reg.on_stats_reply("tcp://p9", {"running": 0})
    assert reg.live("prefill") == [static]
    now = reg.workers["d9"].last_seen
    assert reg.expire(now + 0.2) == []
    assert [w.worker_id for w in reg.expire(now + 0.5)] == ["d9"] and "d9" not in reg.workers
    assert reg.expire(static.last_seen + 1.5) == [static] and reg.live("prefill") == []
    reg.on_stats_reply("tcp://p9", {"running": 0})  # a static worker comes back with its next reply
    assert reg.live("prefill") == [static]


def test_registry_refuses_a_duplicate_id_and_an_unreachable_address_by_name():
    from router_svc.registry import REACH_TIMEOUT_S, Registry

    reg = Registry(misses=3)
    register = {"type": "register", "worker_id": "d1", "role": "decode", "control_address": "tcp://a:1",
                "model": "m", "interval_ms": 100}
    assert reg.handle(register, b"conn-a") == (None, None)
    reg.on_stats_reply("tcp://a:1", {})
    twin = {**register, "control_address": "tcp://b:1"}
    error, replaced = reg.handle(twin, b"conn-b")  # same id, another address, the first one alive
    assert replaced is None and "'d1' is in use by a live decode worker at tcp://a:1" in error and "tcp://b:1" in error
    # the twin's heartbeats (same id, another connection) neither count for d1 nor are accepted
    seen = reg.workers["d1"].last_seen
    beat = {"type": "heartbeat", "worker_id": "d1", "stats": {"twin": True}}
    assert "another connection" in reg.handle(beat, b"conn-b")[0]
    assert reg.workers["d1"].last_seen == seen and reg.workers["d1"].stats == {}
    assert reg.handle(beat, b"conn-a") == (None, None)
    # once the first d1 has missed its heartbeats, the same id at a new address is a restart: taken
    reg.workers["d1"].last_seen -= 1.0
    error, replaced = reg.handle(twin, b"conn-b")
    assert error is None and replaced is not None and replaced.address == "tcp://a:1"
    assert reg.live("decode") == []  # not routable until tcp://b:1 answers
    # a worker whose address never answers is removed after REACH_TIMEOUT_S, with a refusal naming it
    reg.handle({**register, "worker_id": "ghost", "control_address": "tcp://nowhere:9"}, b"conn-g")
    assert reg.unreachable() == []
    gone = reg.unreachable(reg.workers["ghost"].unverified_since + REACH_TIMEOUT_S + 0.1)
    assert sorted(w.worker_id for w, _ in gone) == ["d1", "ghost"]  # tcp://b:1 never answered either
    refusal = dict((w.worker_id, text) for w, text in gone)["ghost"]
    assert "'ghost' advertises control address tcp://nowhere:9, which the router cannot reach" in refusal
    assert "ghost" not in reg.workers


def test_registry_refuses_a_prefill_worker_whose_kv_layout_its_decode_workers_cannot_take():
    from kvtransfer.base import CacheLayout
    from router_svc.registry import Registry

    layout = CacheLayout("m@1", "float32", "float32", block_size=16, num_layers=7, num_kv_heads=4, head_dim=32,
                         hidden_layers=1).to_dict()  # a worker with --speculator eagle
    reg = Registry(misses=3)
    d1 = {"type": "register", "worker_id": "d1", "role": "decode", "control_address": "tcp://d:1", "model": "m",
          "interval_ms": 100, "kv_layout": layout}
    assert reg.handle(d1, b"conn-d") == (None, None)
    reg.on_stats_reply("tcp://d:1", {})
    plain = {**d1, "worker_id": "p1", "role": "prefill", "control_address": "tcp://p:1",
             "kv_layout": {**layout, "num_layers": 6, "hidden_layers": 0}}
    error, _ = reg.handle(plain, b"conn-p")
    assert "p1" not in reg.workers and "differs from decode worker 'd1'" in error
    assert "hidden_layers: this=0 d1=1" in error and "--speculator" in error
    assert reg.handle({**plain, "kv_layout": layout}, b"conn-p") == (None, None)  # an eagle P agrees
    assert reg.handle({**d1, "worker_id": "d2", "control_address": "tcp://d:2", "kv_layout": None},
                      b"conn-d2") == (None, None)  # colocated (no KV connector): nothing to agree on


def test_core_retries_unstarted_fails_started_and_admits_boundedly():
    from plugins.routing import RoundRobin
    from router_svc.core import Router
    from router_svc.errors import Overloaded, WorkerLost
    from router_svc.registry import Registry
    from tandem.sampling_params import SamplingParams

    def out(rid, tokens, finished=False):
        return {"type": "output", "id": rid, "token_ids": tokens, "text": "t" * len(tokens), "finished": finished,
                "finish_reason": "length" if finished else None, "num_cached_tokens": 0, "num_prompt_tokens": 3}

    async def main():
        reg, sent = Registry(), []
        for wid in ("a", "b"):
            reg.handle({"type": "register", "worker_id": wid, "role": "decode", "control_address": f"tcp://{wid}",
                        "model": "m", "interval_ms": 100})
            reg.on_stats_reply(f"tcp://{wid}", {})  # its control address answered
        router = Router(reg, lambda addr, kind, **f: sent.append((addr, kind, f["id"])), RoundRobin(), RoundRobin(),
                        max_inflight=3, migrate=False)
        params = SamplingParams(max_tokens=4)
        s1, s2, s3 = (router.submit([1, 2, 3], params, rid) for rid in ("r1", "r2", "r3"))  # a, b, a
        with pytest.raises(Overloaded):
            router.submit([1], params)
        router.on_worker_message("tcp://a", out("r1", [7]))
        assert (await s1.__anext__()).token_ids == [7]
        reg.workers["b"].last_seen += 10  # a goes silent, b keeps beating
        lost = reg.expire(reg.workers["a"].last_seen + 1.0)
        assert [w.worker_id for w in lost] == ["a"]
        router.on_worker_lost(lost[0])
        with pytest.raises(WorkerLost, match="after 1 tokens"):
            await s1.__anext__()  # r1 had streamed a token: a clear error, not a hang
        assert ("tcp://b", "add_request", "r3") in sent  # r3 had not: re-sent to b
        router.on_worker_message("tcp://a", out("r3", [9], finished=True))  # a late reply from a is ignored
        router.on_worker_message("tcp://b", out("r3", [5, 6], finished=True))
        assert (await s3.__anext__()).token_ids == [5, 6]
        s2.close()  # a client that goes away aborts its request on D
        assert sent[-1] == ("tcp://b", "abort", "r2") and router.flights == {}

    asyncio.run(main())


def test_core_migrates_a_started_stream_to_another_worker():
    from plugins.routing import RoundRobin
    from router_svc.core import Router
    from router_svc.registry import Registry
    from tandem.sampling_params import SamplingParams

    def out(rid, tokens, finished=False, prompt=3):
        return {"type": "output", "id": rid, "token_ids": tokens, "text": "t" * len(tokens), "finished": finished,
                "finish_reason": "length" if finished else None, "num_cached_tokens": 0, "num_prompt_tokens": prompt}

    async def main():
        reg, sent = Registry(), []
        for wid in ("a", "b"):
            reg.handle({"type": "register", "worker_id": wid, "role": "decode", "control_address": f"tcp://{wid}",
                        "model": "m", "interval_ms": 100})
            reg.on_stats_reply(f"tcp://{wid}", {})  # its control address answered
        router = Router(reg, lambda addr, kind, **f: sent.append((addr, kind, f)), RoundRobin(), RoundRobin())
        stream = router.submit([1, 2, 3], SamplingParams(max_tokens=5, temperature=0), "r1")
        router.on_worker_message("tcp://a", out("r1", [7, 8]))
        assert (await stream.__anext__()).token_ids == [7, 8]
        reg.workers["b"].last_seen += 10
        router.on_worker_lost(reg.expire(reg.workers["a"].last_seen + 1.0)[0])
        addr, kind, fields = sent[-1]
        assert (addr, kind, fields["token_ids"], fields["sampling"]["max_tokens"]) == ("tcp://b", "add_request",
                                                                                        [1, 2, 3, 7, 8], 3)
        router.on_worker_message("tcp://b", out("r1", [9, 4, 2], finished=True, prompt=5))
        last = await stream.__anext__()
        assert last.token_ids == [9, 4, 2] and last.finished and last.num_prompt_tokens == 3  # the client's prompt

    asyncio.run(main())


def test_core_migrates_twice_with_the_clients_budget_and_the_grammar_resumed():
    from plugins.routing import RoundRobin
    from router_svc.core import Router
    from router_svc.registry import Registry
    from tandem.sampling_params import SamplingParams

    def out(rid, tokens):
        return {"type": "output", "id": rid, "token_ids": tokens, "text": "t" * len(tokens), "finished": False,
                "finish_reason": None, "num_cached_tokens": 0, "num_prompt_tokens": 3}

    async def main():
        reg, sent = Registry(), []
        for wid in ("a", "b", "c"):
            reg.handle({"type": "register", "worker_id": wid, "role": "decode", "control_address": f"tcp://{wid}",
                        "model": "m", "interval_ms": 100})
            reg.on_stats_reply(f"tcp://{wid}", {})  # its control address answered
        router = Router(reg, lambda addr, kind, **f: sent.append((addr, kind, f)), RoundRobin(), RoundRobin())
        spec = {"regex": "[0-9]+"}
        stream = router.submit([1, 2, 3], SamplingParams(max_tokens=10, temperature=0, structured_outputs=spec), "r1")
        for tokens in ([7, 8], [9]):
            lost = sent[-1][0].removeprefix("tcp://")  # the worker serving it now
            router.on_worker_message(f"tcp://{lost}", out("r1", tokens))
            assert (await stream.__anext__()).token_ids == tokens
            now = reg.workers[lost].last_seen + 1.0
            for other in reg.workers.values():
                if other.worker_id != lost:
                    other.last_seen = now
            router.on_worker_lost(reg.expire(now)[0])
        addr, kind, fields = sent[-1]
        assert fields["token_ids"] == [1, 2, 3, 7, 8, 9] and len({a for a, _, _ in sent}) == 3
        assert fields["sampling"]["max_tokens"] == 7  # 10 asked, 3 sent: not 10 - 2 - 3
        assert fields["sampling"]["structured_outputs"] == {**spec, "resume_tokens": 3}

    asyncio.run(main())


def test_conditional_disaggregation_prefers_an_idle_prefill_worker_to_the_decode_worker():
    """A short prompt whose chosen P is busy goes to another, idle P; only when every P is busy does D
    compute it itself (prefill_peer None). A long prompt always goes to the chosen P."""
    from router_svc.core import Router
    from router_svc.registry import Registry
    from tandem.sampling_params import SamplingParams

    class First:  # as prefix affinity can: the same P for every request, busy or not
        name = "first"

        def choose(self, workers, request):
            return workers[0]

    reg, sent = Registry(), []
    for wid, role in (("d", "decode"), ("pa", "prefill"), ("pb", "prefill")):
        reg.handle({"type": "register", "worker_id": wid, "role": role, "control_address": f"tcp://{wid}",
                    "model": "m", "interval_ms": 100})
        reg.on_stats_reply(f"tcp://{wid}", {})
    router = Router(reg, lambda addr, kind, **f: sent.append((f["id"], f.get("prefill_peer"))), First(), First(),
                    local_prefill_if_busy=4)
    params = SamplingParams(max_tokens=2)
    for rid, prompt in (("r1", [1, 2, 3]), ("r2", [4, 5]), ("r3", [6, 7]), ("r4", list(range(9)))):
        router.submit(prompt, params, rid)
    assert sent == [("r1", "tcp://pa"), ("r2", "tcp://pb"), ("r3", None), ("r4", "tcp://pa")]
