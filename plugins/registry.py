"""Resolve strategy names to objects once at start-up. (Becomes the pluggy-backed registry.)"""

from __future__ import annotations

from plugins.eviction import EvictionPolicy, LRUEviction

_EVICTION = {"lru": LRUEviction}


def resolve_eviction(name: str, num_blocks: int) -> EvictionPolicy:
    if name not in _EVICTION:
        raise ValueError(f"unknown eviction policy {name!r}; available: {', '.join(sorted(_EVICTION))}")
    return _EVICTION[name](num_blocks)
