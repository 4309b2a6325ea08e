"""KVCacheManager: gives requests blocks for the tokens they are about to compute, finds their
cached prefix, and registers computed full blocks in the prefix cache.

Blocks are registered only after their tokens' K/V exist (after the step that computed them, or
when a decode worker's remote KV arrived), so a prefix hit can never read a block still being filled.

Sliding window (`window`, set when every layer of the model slides): a query at position p reads only
keys in (p - window, p], so a block whose tokens all lie before the next query's window is never read
again. Such a block is released as soon as the computed tokens pass it (it stays in the prefix cache
while free), never allocated for a prompt whose KV comes from a peer, and not needed for a prefix hit.
Its place in `req.block_ids` holds NULL_BLOCK, so a position still maps to its block index; NULLs
are always a leading run of the list.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.block_pool import BlockPool, hash_block_tokens
from tandem.engine.interfaces.eviction import EvictionPolicy
from tandem.engine.request import Request

NULL_BLOCK = -1  # a block position the request does not hold (out of its sliding window)


def release_window(model_config, role: str) -> int | None:
    """The window behind which blocks are released: only when every layer slides (one full-attention
    layer reads every block), and not on a prefill worker, whose blocks the layer-by-layer transfer
    reads while the step runs — it computes a prompt once and drops it anyway."""
    return model_config.sliding_window if model_config.every_layer_slides and role != "prefill" else None


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
    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy, enable_caching: bool,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
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
        left to compute: the step that computes it produces the logits to sample from. Under a
        sliding window only the blocks the next query's window reaches must be cached; the ones
        before are NULL_BLOCK."""
        if not self.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        found = [self.pool.lookup(h) for h in req.block_hashes[:max_blocks]]
        hits: list[int] = []
        if self.window is None:
            for b in found:
                if b is None:
                    break
                hits.append(b)
        else:  # the longest n whose window blocks are all cached (hashes chain: block n-1 proves the rest)
            for n in range(max_blocks, 0, -1):
                first = self._first_needed_block(n * self.block_size)
                if all(b is not None for b in found[first:n]):
                    hits = [NULL_BLOCK] * first + found[first:n]  # type: ignore[operator]
                    break
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return hits

    def _first_needed_block(self, next_pos: int) -> int:
        """Index of the first block a query at next_pos (or later) can still read."""
        if self.window is None:
            return 0
        return max(0, next_pos - self.window + 1) // self.block_size

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = (),
                 computed_elsewhere: bool = False) -> bool:
        """Make room for req's next num_new_tokens (after its cached blocks). False if not enough
        free blocks; then nothing changed. `computed_elsewhere`: a peer computes those tokens and
        writes their KV here (a decode worker's prompt), so under a sliding window only the blocks
        the first decode step reads are allocated."""
        bs = self.block_size
        start = req.num_computed_tokens + len(cached_blocks) * bs
        total_tokens = start + num_new_tokens
        have = len(req.block_ids) + len(cached_blocks)
        positions = -(-total_tokens // bs) - have
        # Under a window, new positions wholly before what later queries read stay NULL. Those read
        # from the first new token on, or, for a prompt computed elsewhere, from after its last token.
        reader = total_tokens - 1 if computed_elsewhere else start
        nulls = min(max(0, self._first_needed_block(reader) - have), max(positions, 0))
        needed = positions - nulls
        real_cached = [b for b in cached_blocks if b != NULL_BLOCK]
        revived = sum(1 for b in real_cached if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free:
            return False
        if cached_blocks:
            self.pool.touch(real_cached)
            req.block_ids.extend(cached_blocks)
        req.block_ids.extend([NULL_BLOCK] * nulls)
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the full blocks covered by req.num_computed_tokens in the prefix cache, then
        release the blocks the sliding window has left behind."""
        if self.enable_caching:
            n_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
            self._update_hashes(req, n_full * self.block_size)
            ids = req.block_ids
            for i in range(req.num_registered_blocks, n_full):
                if ids[i] != NULL_BLOCK:
                    parent = ids[i - 1] if i and ids[i - 1] != NULL_BLOCK else None
                    self.pool.cache_block(ids[i], req.block_hashes[i], parent)
            req.num_registered_blocks = max(req.num_registered_blocks, n_full)
        if self.window is not None:
            self._release_out_of_window(req)

    def _release_out_of_window(self, req: Request) -> None:
        ids = req.block_ids
        i = min(self._first_needed_block(req.num_computed_tokens), len(ids)) - 1
        while i >= 0 and ids[i] != NULL_BLOCK:  # the NULLs are a leading run: stop at the first
            self.pool.free([ids[i]])
            ids[i] = NULL_BLOCK
            i -= 1

    def first_held_block(self, req: Request, start: int = 0) -> int:
        """Index of the first block at or after `start` that req holds (skipping its NULL run)."""
        ids = req.block_ids
        while start < len(ids) and ids[start] == NULL_BLOCK:
            start += 1
        return start

    def free(self, req: Request) -> None:
        self.pool.free([b for b in req.block_ids[::-1] if b != NULL_BLOCK])
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
                if b != NULL_BLOCK:
                    refs[b] += 1
        self.pool.check_invariants(refs)
