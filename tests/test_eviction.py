"""Eviction policies (lru, lfu, prefix_aware) on the real BlockPool, and through the engine.

The victims differ by what each policy ranks on: lru on the time a block was freed, lfu on how
many requests used it, prefix_aware on tree position (leaves only, unshared before branch points)
and then on the time it was last used."""

import random

import pytest
from tiny_models import make_checkpoint

from plugins.registry import resolve_eviction
from tandem import LLM, SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

POLICIES = ("lru", "lfu", "prefix_aware")


def _pool(policy: str, num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, resolve_eviction(policy, num_blocks))


def _fill(pool: BlockPool, hashes: list[bytes], parent: int | None = None) -> list[int]:
    """A request computes len(hashes) new blocks, chained under `parent`, and registers them."""
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h, parent)
        parent = b
    return blocks


def _release(pool: BlockPool, blocks: list[int]) -> None:
    pool.free(blocks[::-1])  # tail first, as KVCacheManager.free does


@pytest.mark.parametrize("policy,victim", [("lru", "x"), ("lfu", "y"), ("prefix_aware", "z")])
def test_three_policies_pick_three_different_victims(policy, victim):
    pool = _pool(policy, 3)
    z = _fill(pool, [b"z"])
    _release(pool, z)                      # z: filled (use 1), freed
    x = _fill(pool, [b"x"])
    _release(pool, x)                      # x: filled (use 1), freed
    pool.touch(z)                          # z: hit (use 2) by a long request ...
    pool.touch(x)                          # x: hit (use 2), last use of all but y
    _release(pool, x)                      # x freed first
    _release(pool, z)                      # ... the long request ends: z freed after x
    y = _fill(pool, [b"y"])
    _release(pool, y)                      # y: used once, most recent in every sense
    ids = {"x": x[0], "y": y[0], "z": z[0]}
    # lru: x was freed longest ago. lfu: y has 1 use (x, z have 2). prefix_aware: all three are
    # unshared leaves, and z's last use (its hit) is older than x's hit and y's fill.
    [got] = pool.allocate(1)
    assert got == ids[victim], f"{policy} evicted {[k for k, v in ids.items() if v == got]}, expected {victim}"
    assert pool.lookup(victim.encode()) is None
    assert all(pool.lookup(k.encode()) == v for k, v in ids.items() if k != victim)
    pool.check_invariants([1 if b == got else 0 for b in range(3)])


def _shared_trunk_pool(policy: str) -> tuple[BlockPool, dict[str, int]]:
    """A system-prompt block S extended by two users (a1, a2), then a prompt R repeated 3 times."""
    pool = _pool(policy, 5)
    s, a1 = _fill(pool, [b"S", b"a1"])
    pool.touch([s])
    [a2] = _fill(pool, [b"a2"], parent=s)
    _release(pool, [s, a1])
    _release(pool, [s, a2])
    [r] = _fill(pool, [b"R"])
    _release(pool, [r])
    for _ in range(2):
        pool.touch([r])
        _release(pool, [r])
    [u] = _fill(pool, [b"u"])
    _release(pool, [u])
    return pool, {"S": s, "a1": a1, "a2": a2, "R": r, "u": u}


@pytest.mark.parametrize("policy,order", [
    ("lru", ["a1", "a2", "S", "R", "u"]),          # freed order
    ("lfu", ["a1", "a2", "u", "S", "R"]),          # uses 1,1,1 (freed order), then S 2, R 3
    ("prefix_aware", ["a1", "a2", "R", "u", "S"]),  # unshared leaves by last use, the branch point last
])
def test_eviction_order_over_a_prefix_tree(policy, order):
    pool, ids = _shared_trunk_pool(policy)
    names = {v: k for k, v in ids.items()}
    got = [names[pool.allocate(1)[0]] for _ in range(5)]
    assert got == order


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), set(), 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_workload_keeps_accounting_and_never_strands_a_suffix(policy):
    """Many overlapping requests over a few shared prefixes on a small pool: the block accounting
    holds after every operation, and no cached block outlives the block before it in its prefix
    chain (such a block could never be hit again)."""
    rng = random.Random(policy)
    bs, num_blocks = 4, 24
    kv = KVCacheManager(num_blocks, bs, resolve_eviction(policy, num_blocks), enable_caching=True)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    parent_hash: dict[bytes, bytes | None] = {}
    live: list[Request] = []
    for i in range(400):
        if live and (len(live) > 3 or rng.random() < 0.45):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            req = _request(str(i), toks)
            cached = kv.find_cached_prefix(req)
            if kv.allocate(req, req.num_tokens - len(cached) * bs, cached):
                req.num_computed_tokens = req.num_tokens
                kv.cache_computed_blocks(req)
                live.append(req)
                for j, h in enumerate(req.block_hashes):
                    parent_hash[h] = req.block_hashes[j - 1] if j else None
        kv.check_invariants(live)
        for h in kv.pool.cached:
            ph = parent_hash[h]
            assert ph is None or ph in kv.pool.cached, f"{policy}: a cached block's prefix was evicted"
    assert kv.stats().prefix_hit_tokens > 0


# ---- through the engine --------------------------------------------------------------------
BS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_engine_prefix_hits_differ_per_policy(model_path):
    """12 blocks of 8 tokens. Cached before the flood: R (3 blocks, prompt repeated 3x), the system
    prompt S (2 blocks, extended by users a1 and a2), a1, a2, F1 (4 blocks): 11. F2 needs 8 blocks,
    7 of them evicted. lru drops the 7 freed longest ago (R, a1, a2, S); lfu the 6 used once (a1, a2,
    F1) and then S1 (2 uses) before R (3 uses); prefix_aware the unshared leaves by last use (R, a1,
    a2, F1's tail) and keeps the branch point S."""
    S, R = _tokens(10, 2 * BS), _tokens(100, 3 * BS + 1)
    workload = [R, R, R, S + _tokens(200, BS + 1), S + _tokens(220, BS + 1),
                _tokens(300, 4 * BS + 1), _tokens(400, 7 * BS + 1)]
    expected = {"lru": (0, 0), "lfu": (BS, 3 * BS), "prefix_aware": (2 * BS, 0)}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    answers = {}
    for policy in POLICIES:
        llm = LLM(model_path, num_kv_blocks=12, block_size=BS, max_model_len=12 * BS, eviction=policy)
        warm = [llm.generate([p], params)[0] for p in workload]
        assert [o.num_cached_tokens for o in warm[:3]] == [0, 3 * BS, 3 * BS]
        assert warm[4].num_cached_tokens == 2 * BS  # a2 hits S
        s_again = llm.generate([S + _tokens(240, BS + 1)], params)[0]
        r_again = llm.generate([R], params)[0]
        assert (s_again.num_cached_tokens, r_again.num_cached_tokens) == expected[policy], policy
        llm.engine.check_invariants()
        answers[policy] = [o.token_ids for o in warm + [s_again, r_again]]
    # What is cached never changes what is generated.
    assert answers["lru"] == answers["lfu"] == answers["prefix_aware"]


def test_the_invariant_check_catches_each_kind_of_broken_accounting():
    """What a worker's heartbeat reports as `kv_invariant_ok` (counted in C now, so it is cheap on the
    engine loop): a leaked reference, a negative count and a block missing from every list each fail."""
    pool = _pool("lru", 8)
    held = pool.allocate(3)
    refs = [1 if b in held else 0 for b in range(8)]
    pool.check_invariants(refs)
    pool.ref_counts[held[0]] += 1  # a reference no live request holds
    with pytest.raises(AssertionError, match="ref counts differ"):
        pool.check_invariants(refs)
    pool.ref_counts[held[0]] = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_invariants(refs)
    pool.ref_counts[held[0]] = 1
    pool.free_empty.pop()  # a free block that is no longer anywhere
    with pytest.raises(AssertionError, match="accounting broken"):
        pool.check_invariants(refs)
