"""KVCacheManager: gives requests blocks for the tokens they are about to compute, finds their
cached prefix, and registers computed full blocks in the prefix cache.

Blocks are registered only after their tokens' K/V exist (after the step that computed them, or
when a decode worker's remote KV arrived), so a prefix hit can never read a block still being filled.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.block_pool import BlockPool, hash_block_tokens
from tandem.engine.interfaces.eviction import EvictionPolicy
from tandem.engine.request import Request


@dataclass(slots=True)
class CacheStats:
    num_blocks: int
    used_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, policy, enable_caching)
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover the full blocks among its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else None
            req.block_hashes.append(hash_block_tokens(parent, req.token_ids[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of req's tokens. At least one token is always
        left to compute: the step that computes it produces the logits to sample from."""
        if not self.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for req's next num_new_tokens (after its cached blocks). False if not enough
        free blocks; then nothing changed."""
        total_tokens = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(req.block_ids) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free:
            return False
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            req.block_ids.extend(cached_blocks)
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the full blocks covered by req.num_computed_tokens in the prefix cache."""
        if not self.enable_caching:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        self._update_hashes(req, n_full * self.block_size)
        for i in range(req.num_registered_blocks, n_full):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i], req.block_ids[i - 1] if i else None)
        req.num_registered_blocks = max(req.num_registered_blocks, n_full)

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_registered_blocks = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> CacheStats:
        return CacheStats(self.pool.num_blocks, self.pool.num_used, self.queried_tokens, self.hit_tokens)

    def check_invariants(self, live_requests: list[Request]) -> None:
        refs = [0] * self.pool.num_blocks
        for req in live_requests:
            for b in req.block_ids:
                refs[b] += 1
        self.pool.check_invariants(refs)
