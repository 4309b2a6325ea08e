"""`prefix_aware` eviction: radix-tree eviction over the prefix cache, trunks protected.

Free cached blocks form a forest through their parent links (the block that held the previous block
of the same prefix chain). The policy evicts only **leaves** — candidates with no candidate children —
because a prefix hit stops at the first missing block: evicting a parent would strand its children,
which still occupy memory but can never be hit again. Among leaves:

1. **unshared before shared**: a block is *shared* once two different continuations have been
   built on it (a branch point — e.g. the last block of a system prompt that several users extend).
   One-off user suffixes hanging from a trunk go first; the trunk goes only when no such leaf is left.
2. **least recently used first**, where a use is a prefix hit or the fill (not the free, as in
   `lru`): the order SGLang's radix cache evicts in.

Why not plain `lru` + "leaves first": requests free tail first and a hit on a block is a hit on its
whole chain, so a parent is never freed before its free children — `lru`'s oldest candidate is
always a leaf already. What this policy adds is rule 1: recently finished one-off suffixes can no
longer push out an older system prompt that many users share.

Parent links are hints from the block pool; a block reused outside the policy can leave a stale link
to it. That only costs ordering quality: if no leaf can be found, the least recently used candidate
goes, so `pop_victim` always succeeds.
"""

from __future__ import annotations

import heapq
import itertools

from tandem.engine.interfaces.eviction import EvictionPolicy

_NO_CHILD = -1


class PrefixAwareEviction(EvictionPolicy):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._used_at = [0] * num_blocks  # clock of last use (fill or hit)
        self._first_child = [_NO_CHILD] * num_blocks  # first child ever freed under the block
        self._shared = [False] * num_blocks  # a second, different child was seen: a branch point
        self._leaf_stamp = [0] * num_blocks  # stamp of the block's live leaf entry; 0 = not a leaf
        self._parent: dict[int, int | None] = {}  # candidates -> parent link
        self._kids: dict[int, set[int]] = {}  # block -> its children that are candidates
        self._heaps: tuple[list, list] = ([], [])  # (unshared, shared) leaves: (used_at, stamp, block)
        self._clock = itertools.count(1)

    # ---- events from the block pool ----------------------------------------------------------
    def block_used(self, block_id: int) -> None:
        self._used_at[block_id] = next(self._clock)

    def block_freed(self, block_id: int, parent_id: int | None) -> None:
        self._parent[block_id] = parent_id
        if parent_id is not None:
            first = self._first_child[parent_id]
            if first == _NO_CHILD:
                self._first_child[parent_id] = block_id
            elif first != block_id:
                self._shared[parent_id] = True
            self._kids.setdefault(parent_id, set()).add(block_id)
            self._leaf_stamp[parent_id] = 0  # has a candidate child now: not a leaf
        if not self._kids.get(block_id):
            self._push_leaf(block_id)
        self._compact()

    def block_taken(self, block_id: int) -> None:
        self._detach(block_id)

    def pop_victim(self) -> int:
        for heap in self._heaps:  # unshared leaves first
            while heap:
                _, stamp, block_id = heapq.heappop(heap)
                if self._leaf_stamp[block_id] == stamp:
                    return self._evict(block_id)
        # No leaf: only reachable through stale parent links (a cycle); see the module docstring.
        return self._evict(min(self._parent, key=self._used_at.__getitem__))

    def __len__(self) -> int:
        return len(self._parent)

    # ---- internals ---------------------------------------------------------------------------
    def _push_leaf(self, block_id: int) -> None:
        stamp = next(self._clock)
        self._leaf_stamp[block_id] = stamp
        heapq.heappush(self._heaps[self._shared[block_id]], (self._used_at[block_id], stamp, block_id))

    def _detach(self, block_id: int) -> None:
        """Remove a candidate; its parent may become a leaf."""
        self._leaf_stamp[block_id] = 0
        parent = self._parent.pop(block_id)
        if parent is None:
            return
        kids = self._kids.get(parent)
        if kids is not None:
            kids.discard(block_id)
            if not kids:
                del self._kids[parent]
                if parent in self._parent:
                    self._push_leaf(parent)

    def _evict(self, block_id: int) -> int:
        self._detach(block_id)
        for child in self._kids.pop(block_id, ()):  # only in the fallback: orphan the children
            self._parent[child] = None
        # The block will hold new content: forget what was learnt about the old one.
        self._first_child[block_id] = _NO_CHILD
        self._shared[block_id] = False
        self._used_at[block_id] = 0
        return block_id

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (bounds memory)."""
        for i, heap in enumerate(self._heaps):
            if len(heap) > 2 * len(self._parent) + 64:
                live = [e for e in heap if self._leaf_stamp[e[2]] == e[1]]
                heapq.heapify(live)
                self._heaps[i][:] = live
