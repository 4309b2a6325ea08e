"""The hooks a tandem plugin can implement (pluggy project name `tandem`).

Every hook takes no arguments and returns `{name: class}`: the strategies that plugin contributes.
Hooks are called once, when the registry first needs a kind (see plugins/manager.py), never per
engine step. A third-party package exposes a module (or object) carrying `@hookimpl` functions
through the `tandem` entry-point group:

    # pyproject.toml of the third-party package
    [project.entry-points.tandem]
    my_plugin = "my_package.tandem_plugin"

    # my_package/tandem_plugin.py
    from plugins.hookspecs import hookimpl
    from tandem.engine.interfaces.eviction import EvictionPolicy  # class FIFOEviction(EvictionPolicy)

    @hookimpl
    def tandem_eviction_policies():
        return {"fifo": FIFOEviction}

A name may be registered by only one plugin per kind (a clash is a ValueError naming both packages).
The interfaces the classes implement live in tandem/engine/interfaces/ (and kvtransfer.base for
connectors): plugins depend on tandem, never the other way round.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "tandem"
ENTRY_POINT_GROUP = "tandem"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class TandemHookSpecs:
    """Namespace of hook specifications; pluggy reads the marked methods (`self` is not passed)."""

    @hookspec
    def tandem_eviction_policies(self) -> dict[str, type[Any]]:
        """Prefix-cache eviction policies. Each class subclasses
        `tandem.engine.interfaces.eviction.EvictionPolicy` and is built as `cls(num_blocks)`; it
        ranks the free blocks that still hold cached KV."""

    @hookspec
    def tandem_kv_quantizers(self) -> dict[str, type[Any]]:
        """KV-cache storage formats (`--kv-cache-dtype NAME`). Each class subclasses
        `tandem.engine.interfaces.kv_quantizer.KVQuantizer` and is built with no arguments; it names
        the cache dtype, whether per-token-head scales exist, the bytes per block, and the per-layer
        transfer layout."""

    @hookspec
    def tandem_speculators(self) -> dict[str, type[Any]]:
        """Speculative-decoding proposers (`--speculator NAME`): each proposes k tokens per running
        request; the interface is `tandem.engine.interfaces.speculator.Speculator`."""

    @hookspec
    def tandem_kv_connectors(self) -> dict[str, type[Any]]:
        """KV-transfer connectors between prefill and decode workers: subclasses of
        `kvtransfer.base.KVConnector` (see kvtransfer/README.md)."""

    @hookspec
    def tandem_routing_policies(self) -> dict[str, type[Any]]:
        """Router policies that pick a prefill and a decode worker per request: subclasses of
        `tandem.engine.interfaces.routing.RoutingPolicy`, built with no arguments."""


# Plugin kind (as shown by `tandem plugins` and used by the registry) -> hook name.
KIND_HOOKS: dict[str, str] = {
    "eviction": "tandem_eviction_policies",
    "kv_quantizer": "tandem_kv_quantizers",
    "speculator": "tandem_speculators",
    "kv_connector": "tandem_kv_connectors",
    "routing": "tandem_routing_policies",
}
