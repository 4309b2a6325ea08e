"""Strategy names -> implementations (`--eviction`, `--kv-cache-dtype`, `--speculator`,
`--kv-connector`, the router's `--decode-policy` / `--prefill-policy`), resolved once at start-up.

The engine and the router call only these functions. They depend on the interfaces in
tandem/engine/interfaces/, never on plugins/ at import time: the plugin manager (plugins/manager.py,
which loads the built-ins and every `tandem` entry point) is imported on the first resolution.
That keeps the arrow one way — plugins implement the interfaces, the engine asks the manager by
name — and keeps this module torch-free for the router. An unknown name is a ValueError that lists
the available names (`tandem plugins` shows which package provides each).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.base import KVConnector
    from plugins.manager import PluginEntry
    from tandem.engine.interfaces.eviction import EvictionPolicy
    from tandem.engine.interfaces.kv_quantizer import KVQuantizer
    from tandem.engine.interfaces.routing import RoutingPolicy
    from tandem.engine.interfaces.speculator import Speculator

_WHAT = {"eviction": "eviction policy", "kv_quantizer": "KV cache dtype", "speculator": "speculator",
         "kv_connector": "KV connector", "routing": "routing policy"}
# `--kv-cache-dtype auto` means: store K/V in the model's dtype.
_QUANTIZER_ALIASES = {"auto": "none"}


def lookup(kind: str, name: str) -> PluginEntry:
    from plugins.manager import collect  # on first use only: see the module docstring

    table = collect(kind)
    if not isinstance(name, str) or name not in table:
        avail = ", ".join(sorted(table)) or "none installed"
        raise ValueError(f"unknown {_WHAT[kind]} {name!r}; available: {avail} (see `tandem plugins`)")
    return table[name]


def resolve_eviction(name: str, num_blocks: int) -> EvictionPolicy:
    """A fresh policy instance for a pool of `num_blocks` blocks."""
    return lookup("eviction", name).cls(num_blocks)


def resolve_quantizer(name: str) -> KVQuantizer:
    """The KV-cache format for `--kv-cache-dtype NAME` ('auto' = 'none': the model's dtype)."""
    return lookup("kv_quantizer", _QUANTIZER_ALIASES.get(name, name)).cls()


def resolve_speculator(name: str) -> type[Speculator]:
    """The class; the engine builds it with a `SpeculatorContext`."""
    return lookup("speculator", name).cls


def resolve_connector(name: str) -> type[KVConnector]:
    """The class; built with the connector's keyword options (`timeout_s`, `checksum`)."""
    return lookup("kv_connector", name).cls


def resolve_routing_policy(name: str) -> RoutingPolicy:
    """A fresh routing-policy instance (the router keeps one per worker role)."""
    return lookup("routing", name).cls()
