"""Eviction policies: which free block that still holds cached KV gets reused first.

The block pool owns ref counts and hashes; a policy only sees cached blocks entering and leaving the
free set and answers `pop_victim()`. Blocks that hold no cached content never reach the policy
(the pool reuses those first, they are worth nothing).

Built-ins: `lru` (here), `lfu` (here), `prefix_aware` (plugins/eviction_prefix.py).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict


class EvictionPolicy(ABC):
    """Ranks free cached blocks. Called by the block pool only, never per model step."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    @abstractmethod
    def block_freed(self, block_id: int, parent_id: int | None) -> None:
        """A cached block's ref count fell to 0: it becomes a candidate. `parent_id` is the block
        holding the previous block of the same prefix chain (None for a chain's first block)."""

    @abstractmethod
    def block_taken(self, block_id: int) -> None:
        """A candidate was revived by a prefix-cache hit: it is no longer a candidate."""

    def block_used(self, block_id: int) -> None:  # noqa: B027 (optional hook)
        """A cached block was referenced by a request (hit or freshly filled); for frequency policies."""

    @abstractmethod
    def pop_victim(self) -> int:
        """Remove and return the candidate to reuse now (its cached content will be overwritten)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of candidates."""


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
