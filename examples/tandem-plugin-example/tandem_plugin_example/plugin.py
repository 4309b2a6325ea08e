"""The module the `tandem` entry point names: hook implementations only. The strategy classes are
imported inside the hooks, so loading the plugin stays cheap and each kind is imported only when
tandem first collects it."""

from __future__ import annotations

from plugins.hookspecs import hookimpl


@hookimpl
def tandem_eviction_policies() -> dict[str, type]:
    from tandem_plugin_example.fifo import FIFOEviction

    return {"fifo": FIFOEviction}


@hookimpl
def tandem_speculators() -> dict[str, type]:
    from tandem_plugin_example.repeat_last import RepeatLastSpeculator

    return {"repeat_last": RepeatLastSpeculator}
