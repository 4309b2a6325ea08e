"""The prefix-cache block hash: one chained hash that every process computes the same way.

Workers key their prefix caches on it (tandem/engine/block_pool.py) and the router hashes a prompt's
first blocks with it to send shared prefixes to the same worker (`prefix_affinity`). It lives here,
standard library only, because it is a contract between processes: the router must be able to
compute it without importing torch or the engine.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, tokens: Iterable[int]) -> bytes:
    """`h_i = H(h_{i-1}, tokens_i)`: a hit on block i implies the whole prefix before it matched.
    Stable across processes and runs (no Python `hash()`, which is salted per process)."""
    h = hashlib.blake2b(parent_hash or b"tandem", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prefix_key(token_ids: Sequence[int], block_size: int, num_blocks: int) -> bytes:
    """The chained hash of the first `num_blocks` full blocks (the same chain the workers' prefix
    caches use), or of the whole prompt when it has no full block."""
    n_full = min(len(token_ids) // block_size, num_blocks)
    if n_full == 0:
        return hash_block_tokens(None, token_ids)
    h: bytes | None = None
    for i in range(n_full):
        h = hash_block_tokens(h, token_ids[i * block_size:(i + 1) * block_size])
    return h  # type: ignore[return-value]  # n_full >= 1, so the loop ran
