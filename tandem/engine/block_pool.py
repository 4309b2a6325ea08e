"""BlockPool: the KV blocks of one worker, their ref counts, and the prefix cache (hash -> block).

A block is in exactly one of three states: in use (ref > 0), free and cached (ref 0, still holds a
prefix the cache can revive), or free and empty. Empty blocks are reused first; among cached ones
the eviction policy decides. Hashes chain (`h_i = H(h_{i-1}, tokens_i)`) so a hit on block i implies
the whole prefix before it matched.
"""

from __future__ import annotations

from collections import deque

from tandem.engine.interfaces.eviction import EvictionPolicy
from tandem.protocol.prefix_hash import hash_block_tokens  # a cross-process contract: the router hashes too

__all__ = ["BlockPool", "hash_block_tokens"]


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.policy = policy
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.parent: list[int | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_empty: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_empty) + len(self.policy)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits), reviving free ones."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                self.policy.block_taken(b)
            self.ref_counts[b] += 1
            self.policy.block_used(b)

    def share(self, block_ids: list[int]) -> None:
        """One more reference on blocks in use (a beam fork shares its parent's full blocks)."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"share() of block {b}, which is not in use")
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")  # caller checks first
        out = []
        for _ in range(n):
            b = self.free_empty.popleft() if self.free_empty else self._evict()
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def _evict(self) -> int:
        b = self.policy.pop_victim()
        h = self.block_hash[b]
        if h is not None and self.cached.get(h) == b:
            del self.cached[h]
        self.block_hash[b] = None
        self.parent[b] = None
        return b

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each; pass a request's blocks tail first so that policies that
        rank by recency see a prefix's deepest blocks freed first."""
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.policy.block_freed(b, self.parent[b])
                else:
                    self.free_empty.append(b)

    def cache_block(self, block_id: int, block_hash: bytes, parent_block: int | None) -> None:
        """Register a block whose tokens are now computed. If another block already caches the same
        prefix (two requests computed it at once), this one stays uncached and is reused first."""
        if not self.enable_caching or self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        self.block_hash[block_id] = block_hash
        self.parent[block_id] = parent_block
        self.cached[block_hash] = block_id
        self.policy.block_used(block_id)

    def check_invariants(self, expected_refs: list[int]) -> None:
        """free + cached + in_use == total, and every ref count equals what live requests hold."""
        # Counted in C (list.count, min): workers run this for every heartbeat's stats, on the engine loop.
        if self.ref_counts and min(self.ref_counts) < 0:
            raise AssertionError("negative ref count")
        in_use = self.num_blocks - self.ref_counts.count(0)
        if len(self.free_empty) + len(self.policy) + in_use != self.num_blocks:
            raise AssertionError(f"block accounting broken: empty {len(self.free_empty)} + cached "
                                 f"{len(self.policy)} + in_use {in_use} != {self.num_blocks}")
        if expected_refs != self.ref_counts:
            leaked = [b for b in range(self.num_blocks) if expected_refs[b] != self.ref_counts[b]]
            raise AssertionError(f"ref counts differ from live requests for blocks {leaked[:16]}")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"cache map points block {b} at a hash it no longer holds")
