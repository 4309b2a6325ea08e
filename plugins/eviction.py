"""Built-in eviction policies `lru` and `lfu` (`prefix_aware` is in plugins/eviction_prefix.py).

They implement `tandem.engine.interfaces.eviction.EvictionPolicy` (re-exported here under its old
name `plugins.eviction.EvictionPolicy` for existing plugins): which free block that still holds
cached KV gets reused first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from tandem.engine.interfaces.eviction import EvictionPolicy

__all__ = ["EvictionPolicy", "LFUEviction", "LRUEviction"]


class LRUEviction(EvictionPolicy):
    """Least recently freed first. Requests free their blocks tail first, so within one request
    the deepest blocks of a prefix go before the shared blocks they hang from."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._order: OrderedDict[int, None] = OrderedDict()

    def block_freed(self, block_id: int, parent_id: int | None) -> None:
        self._order[block_id] = None

    def block_taken(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._order)


class LFUEviction(EvictionPolicy):
    """Fewest uses first (a use = one request that filled or hit the block), ties to the least
    recently freed. A shared system prompt collects a use per request and outlives the one-off user
    suffixes around it. Counts restart when a block is evicted (it will hold new content).

    A child is never used more often than its parent (a hit on it is a hit on the whole chain), and
    on ties the child was freed first, so parents are not evicted before their children."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._count = [0] * num_blocks
        self._stamp = [0] * num_blocks  # stamp of the live heap entry; 0 = not a candidate
        self._heap: list[tuple[int, int, int]] = []  # (uses, freed stamp, block); stale entries skipped
        self._clock = itertools.count(1)
        self._n = 0

    def block_used(self, block_id: int) -> None:
        self._count[block_id] += 1  # only called on blocks in use, never on a candidate

    def block_freed(self, block_id: int, parent_id: int | None) -> None:
        stamp = next(self._clock)
        self._stamp[block_id] = stamp
        heapq.heappush(self._heap, (self._count[block_id], stamp, block_id))
        self._n += 1
        if len(self._heap) > 2 * self._n + 64:  # bound the stale entries left by block_taken
            self._heap = [e for e in self._heap if self._stamp[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def block_taken(self, block_id: int) -> None:
        self._stamp[block_id] = 0
        self._n -= 1

    def pop_victim(self) -> int:
        while True:
            _, stamp, block_id = heapq.heappop(self._heap)
            if self._stamp[block_id] == stamp:
                break
        self._stamp[block_id] = 0
        self._count[block_id] = 0
        self._n -= 1
        return block_id

    def __len__(self) -> int:
        return self._n
