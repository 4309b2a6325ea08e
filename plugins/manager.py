"""Plugin manager: registers the built-in plugin and every `tandem` entry point, then collects each
kind of strategy once into a plain dict `name -> PluginEntry(cls, source, plugin)`.

1. `plugin_manager()` (cached) builds the pluggy manager: hookspecs, `plugins.builtin`, then the
   entry points of the `tandem` group (importlib.metadata), each tagged with its distribution.
2. `collect(kind)` (cached per kind) calls that kind's hook on every plugin, checks the answers and
   merges them. Kinds are collected lazily so that, e.g., resolving an eviction policy does not
   import the KV-transfer connectors.
3. Nothing here runs per engine step: the engine resolves its strategies once at start-up.

A broken plugin (import error, unknown hook, bad return value, name clash) is a ValueError naming
the package, so the user can fix or uninstall it; `TANDEM_DISABLE_PLUGINS=name1,name2` (entry-point
names) or `TANDEM_DISABLE_PLUGINS=*` skips third-party plugins without uninstalling them.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
from dataclasses import dataclass
from typing import Any

import pluggy

from plugins import builtin
from plugins.hookspecs import ENTRY_POINT_GROUP, KIND_HOOKS, PROJECT, TandemHookSpecs

BUILTIN_SOURCE = "tandem-llm"  # the distribution that ships the built-in plugin
DISABLE_ENV = "TANDEM_DISABLE_PLUGINS"


@dataclass(frozen=True, slots=True)
class PluginEntry:
    cls: type[Any]
    source: str  # distribution (package) that provided it, e.g. "tandem-llm"
    plugin: str  # plugin name inside pluggy: "builtin" or the entry-point name


@dataclass(frozen=True, slots=True)
class _Loaded:
    manager: pluggy.PluginManager
    sources: dict[str, str]  # pluggy plugin name -> distribution name


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else f"<unknown package of {ep.value}>"


@functools.cache
def plugin_manager() -> _Loaded:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(TandemHookSpecs)
    pm.register(builtin, name="builtin")
    sources = {"builtin": BUILTIN_SOURCE}
    disabled = _disabled()
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if "*" in disabled or ep.name in disabled:
            continue
        dist = _dist_name(ep)
        if ep.name in sources:
            raise ValueError(f"two plugins are named {ep.name!r} (packages {sources[ep.name]!r} and {dist!r}); "
                             f"uninstall one or set {DISABLE_ENV}={ep.name}")
        try:
            obj = ep.load()
            pm.register(obj, name=ep.name)
        except Exception as exc:  # any failure inside third-party code: report it with its origin
            raise ValueError(f"tandem plugin {ep.name!r} from package {dist!r} ({ep.value}) failed to load: "
                             f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={ep.name}") from exc
        sources[ep.name] = dist
    try:
        pm.check_pending()  # a misspelled hook name would otherwise be ignored silently
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) if exc.plugin is not None else "?"
        raise ValueError(f"tandem plugin {name!r} from package {sources.get(name, '?')!r}: {exc}; "
                         f"known hooks: {', '.join(KIND_HOOKS.values())}; fix or uninstall it, "
                         f"or set {DISABLE_ENV}={name}") from exc
    return _Loaded(pm, sources)


def _base_class(kind: str) -> type | None:
    """Interface a kind's classes must subclass, where one is defined (checked at collection)."""
    if kind == "eviction":
        from plugins.eviction import EvictionPolicy

        return EvictionPolicy
    if kind == "kv_quantizer":
        from plugins.quantizers import KVQuantizer

        return KVQuantizer
    return None


@functools.cache
def collect(kind: str) -> dict[str, PluginEntry]:
    """Every strategy of `kind` by name. Cached: treat the returned dict as read-only."""
    if kind not in KIND_HOOKS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KIND_HOOKS)}")
    loaded = plugin_manager()
    hook = getattr(loaded.manager.hook, KIND_HOOKS[kind])
    base = _base_class(kind)
    out: dict[str, PluginEntry] = {}
    # Call each implementation on its own (not hook()) so every name keeps the plugin it came from.
    for impl in hook.get_hookimpls():  # registration order: builtin first, so a clash names the newcomer
        source = loaded.sources.get(impl.plugin_name, "?")
        where = f"plugin {impl.plugin_name!r} from package {source!r}"
        fix = f"; fix or uninstall it, or set {DISABLE_ENV}={impl.plugin_name}"
        try:
            answer = impl.function()
        except Exception as exc:
            raise ValueError(f"{where}: {KIND_HOOKS[kind]}() raised {type(exc).__name__}: {exc}{fix}") from exc
        if answer is None:
            continue
        if not isinstance(answer, dict):
            raise ValueError(f"{where}: {KIND_HOOKS[kind]}() must return a dict {{name: class}}, "
                             f"got {type(answer).__name__}{fix}")
        for name, cls in answer.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}: {kind} names must be non-empty strings, got {name!r}{fix}")
            if not isinstance(cls, type) or (base is not None and not issubclass(cls, base)):
                need = f"a subclass of {base.__module__}.{base.__name__}" if base else "a class"
                raise ValueError(f"{where}: {kind} {name!r} must be {need}, got {cls!r}{fix}")
            if name in out:
                raise ValueError(f"{kind} {name!r} is registered by both package {out[name].source!r} "
                                 f"(plugin {out[name].plugin!r}) and {where}{fix}")
            out[name] = PluginEntry(cls, source, impl.plugin_name)
    return out


def collect_all() -> dict[str, dict[str, PluginEntry]]:
    return {kind: collect(kind) for kind in KIND_HOOKS}


def reset() -> None:
    """Forget what was collected (tests; a process that installed a plugin at run time)."""
    collect.cache_clear()
    plugin_manager.cache_clear()
