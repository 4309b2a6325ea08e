"""The eviction-policy interface: which free block that still holds cached KV gets reused first.

The block pool (tandem/engine/block_pool.py) owns ref counts and hashes; a policy only sees cached
blocks entering and leaving the free set and answers `pop_victim()`. Blocks that hold no cached
content never reach the policy (the pool reuses those first, they are worth nothing).
Implementations: plugins/eviction.py, plugins/eviction_prefix.py, or a third-party plugin.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class EvictionPolicy(ABC):
    """Ranks free cached blocks. Built as `cls(num_blocks)`; called by the block pool only, never per
    model step."""

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
