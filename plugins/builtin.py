"""The built-in plugin: tandem's own strategies, published through the same hooks a third-party
package uses (so `tandem plugins` lists them side by side, source `tandem-llm`). plugins/manager.py
registers this module with pluggy as pytest registers its built-in plugins.

Strategies that other parts of the tree own are imported lazily, when their kind is first
collected:

- speculators: `plugins/speculators.py` exposes `SPECULATORS: dict[str, type]`
- connectors:  `kvtransfer` exposes `CONNECTORS`, a name -> class mapping that imports each
               connector module on first access (so collecting this kind imports all three)
- routing:     `plugins/routing.py` exposes `ROUTING_POLICIES: dict[str, type]` (standard library
               only, so the router loads it without torch)
"""

from __future__ import annotations

from typing import Any

from plugins.hookspecs import hookimpl


@hookimpl
def tandem_eviction_policies() -> dict[str, type[Any]]:
    from plugins.eviction import LFUEviction, LRUEviction
    from plugins.eviction_prefix import PrefixAwareEviction

    return {"lru": LRUEviction, "lfu": LFUEviction, "prefix_aware": PrefixAwareEviction}


@hookimpl
def tandem_kv_quantizers() -> dict[str, type[Any]]:
    from plugins.quantizers import BUILTIN_QUANTIZERS

    return dict(BUILTIN_QUANTIZERS)


@hookimpl
def tandem_speculators() -> dict[str, type[Any]]:
    from plugins.speculators import SPECULATORS

    return dict(SPECULATORS)


@hookimpl
def tandem_kv_connectors() -> dict[str, type[Any]]:
    from kvtransfer import CONNECTORS

    return dict(CONNECTORS)


@hookimpl
def tandem_routing_policies() -> dict[str, type[Any]]:
    from plugins.routing import ROUTING_POLICIES

    return dict(ROUTING_POLICIES)
