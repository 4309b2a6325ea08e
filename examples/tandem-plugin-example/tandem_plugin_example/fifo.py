"""`fifo` eviction: free cached blocks are reused in the order they were filled. A prefix hit does
not move a block back (unlike `lru`), so even a popular system prompt eventually cycles out."""

from __future__ import annotations

import heapq
import itertools

from tandem.engine.interfaces.eviction import EvictionPolicy


class FIFOEviction(EvictionPolicy):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._filled_at = [0] * num_blocks  # 0 = not filled since it was last evicted
        self._candidates: set[int] = set()
        self._heap: list[tuple[int, int]] = []  # (filled_at, block); entries of revived blocks go stale
        self._clock = itertools.count(1)

    def block_used(self, block_id: int) -> None:
        if not self._filled_at[block_id]:  # the first use after a (re)fill is the fill itself
            self._filled_at[block_id] = next(self._clock)

    def block_freed(self, block_id: int, parent_id: int | None) -> None:
        self._candidates.add(block_id)
        heapq.heappush(self._heap, (self._filled_at[block_id], block_id))
        if len(self._heap) > 2 * len(self._candidates) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if e[1] in self._candidates and self._filled_at[e[1]] == e[0]]
            heapq.heapify(self._heap)

    def block_taken(self, block_id: int) -> None:
        self._candidates.discard(block_id)

    def pop_victim(self) -> int:
        while True:
            filled_at, block_id = heapq.heappop(self._heap)
            if block_id in self._candidates and self._filled_at[block_id] == filled_at:
                break
        self._candidates.discard(block_id)
        self._filled_at[block_id] = 0
        return block_id

    def __len__(self) -> int:
        return len(self._candidates)
