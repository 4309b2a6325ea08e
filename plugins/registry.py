"""Resolve strategy names to classes/objects, once at start-up, from what the plugin manager collected.

The engine and the services call only these functions; an unknown name is a ValueError that lists
the available names (and where each came from is shown by `tandem plugins`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugins.manager import PluginEntry, collect

if TYPE_CHECKING:
    from plugins.eviction import EvictionPolicy
    from plugins.quantizers import KVQuantizer

_WHAT = {"eviction": "eviction policy", "kv_quantizer": "KV cache dtype", "speculator": "speculator",
         "kv_connector": "KV connector", "routing": "routing policy"}
# `--kv-cache-dtype auto` means: store K/V in the model's dtype.
_QUANTIZER_ALIASES = {"auto": "none"}


def lookup(kind: str, name: str) -> PluginEntry:
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


def resolve_speculator(name: str) -> type[Any]:
    return lookup("speculator", name).cls


def resolve_connector(name: str) -> type[Any]:
    return lookup("kv_connector", name).cls


def resolve_routing_policy(name: str) -> type[Any]:
    return lookup("routing", name).cls
