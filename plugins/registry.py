"""Compatibility names: strategy resolution moved to tandem/engine/strategies.py, next to the
interfaces it returns, so the engine never imports plugins/ at import time. Import from there in
new code; these names stay for existing callers and third-party plugins.
"""

from __future__ import annotations

from typing import Any

from plugins.manager import PluginEntry
from tandem.engine.strategies import lookup, resolve_connector, resolve_eviction, resolve_quantizer, resolve_speculator

__all__ = ["PluginEntry", "lookup", "resolve_connector", "resolve_eviction", "resolve_quantizer",
           "resolve_routing_policy", "resolve_speculator"]


def resolve_routing_policy(name: str) -> type[Any]:
    """The class (unlike tandem.engine.strategies.resolve_routing_policy, which returns an instance)."""
    return lookup("routing", name).cls
