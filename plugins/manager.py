"""Plugin manager: the one pluggy `PluginManager` of a process, and the strategies it collects once
per kind into a plain dict `name -> PluginEntry(cls, source, plugin)`.

1. `plugin_manager()` (cached) builds it as pytest builds its own: hookspecs, the built-in plugin
   registered like any other (`pm.register(plugins.builtin)`), names in `TANDEM_DISABLE_PLUGINS`
   blocked (`pm.set_blocked`), then third-party plugins from the `tandem` entry-point group
   (`pm.load_setuptools_entrypoints`), which also records the package each came from
   (`pm.list_plugin_distinfo()`).
2. `collect(kind)` (cached per kind) calls that kind's hook through pluggy, checks the answers and
   merges them. Kinds are collected lazily so that, e.g., resolving an eviction policy does not
   import the KV-transfer connectors.
3. Nothing here runs per engine step: the engine resolves its strategies once at start-up
   (tandem/engine/strategies.py).

A broken plugin (import error, unknown hook, bad return value, name clash) is a ValueError naming
the package, so the user can fix or uninstall it; `TANDEM_DISABLE_PLUGINS=name1,name2` (entry-point
names) or `TANDEM_DISABLE_PLUGINS=*` skips third-party plugins without uninstalling them. The
built-in plugin cannot be disabled.
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

BUILTIN_PLUGIN = "builtin"  # the built-in plugin's name inside pluggy
BUILTIN_SOURCE = "tandem-llm"  # the distribution that ships the built-in plugin
DISABLE_ENV = "TANDEM_DISABLE_PLUGINS"


@dataclass(frozen=True, slots=True)
class PluginEntry:
    cls: type[Any]
    source: str  # distribution (package) that provided it, e.g. "tandem-llm"
    plugin: str  # plugin name inside pluggy: "builtin" or the entry-point name


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def _fix(name: str) -> str:
    return f"fix or uninstall it, or set {DISABLE_ENV}={name}"


def _check_unique_names(pm: pluggy.PluginManager) -> None:
    """pluggy keeps the first of two entry points with one name and silently skips the other; a
    user who installed both should hear about it."""
    seen = {BUILTIN_PLUGIN: BUILTIN_SOURCE}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):  # one per installed distribution
        if pm.is_blocked(ep.name):
            continue
        dist = ep.dist.metadata["Name"] if ep.dist is not None else f"<unknown package of {ep.value}>"
        if ep.name in seen:
            raise ValueError(f"two plugins are named {ep.name!r} (packages {seen[ep.name]!r} and {dist!r}); "
                             f"uninstall one or set {DISABLE_ENV}={ep.name}")
        seen[ep.name] = dist


def _failed_entry_point(pm: pluggy.PluginManager) -> tuple[str, str, str]:
    """(name, package, value) of the entry point `load_setuptools_entrypoints` stopped at: it loads
    them in `distributions()` order and registers each before the next, so it is the first one that
    is neither registered nor blocked."""
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and not pm.has_plugin(ep.name) and not pm.is_blocked(ep.name):
                return ep.name, dist.metadata["Name"], ep.value
    return "?", "?", "?"


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(TandemHookSpecs)
    pm.register(builtin, name=BUILTIN_PLUGIN)
    disabled = _disabled()
    if "*" not in disabled:
        for name in disabled - {BUILTIN_PLUGIN}:  # blocking "builtin" would unregister it
            pm.set_blocked(name)
        _check_unique_names(pm)
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:  # any failure inside third-party code: report it with its origin
            name, dist, value = _failed_entry_point(pm)
            raise ValueError(f"tandem plugin {name!r} from package {dist!r} ({value}) failed to load: "
                             f"{type(exc).__name__}: {exc}; {_fix(name)}") from exc
    try:
        pm.check_pending()  # a misspelled hook name would otherwise be ignored silently
    except pluggy.PluginValidationError as exc:
        bad = (pm.get_name(exc.plugin) if exc.plugin is not None else None) or "?"
        raise ValueError(f"tandem plugin {bad!r} from package {plugin_source(pm, bad)!r}: {exc}; "
                         f"known hooks: {', '.join(KIND_HOOKS.values())}; {_fix(bad)}") from exc
    return pm


def plugin_source(pm: pluggy.PluginManager, name: str) -> str:
    """The distribution a registered plugin came from (what `tandem plugins` shows)."""
    if name == BUILTIN_PLUGIN:
        return BUILTIN_SOURCE
    plugin = pm.get_plugin(name)
    for obj, dist in pm.list_plugin_distinfo():
        if obj is plugin:
            return str(dist.project_name)
    return "?"  # registered by hand (tests), not through an entry point


def _base_class(kind: str) -> type | None:
    """Interface a kind's classes must subclass, where one is defined (checked at collection)."""
    if kind == "eviction":
        from tandem.engine.interfaces.eviction import EvictionPolicy

        return EvictionPolicy
    if kind == "kv_quantizer":
        from tandem.engine.interfaces.kv_quantizer import KVQuantizer

        return KVQuantizer
    return None


@functools.cache
def collect(kind: str) -> dict[str, PluginEntry]:
    """Every strategy of `kind` by name. Cached: treat the returned dict as read-only."""
    if kind not in KIND_HOOKS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KIND_HOOKS)}")
    pm = plugin_manager()
    hook_name = KIND_HOOKS[kind]
    base = _base_class(kind)
    out: dict[str, PluginEntry] = {}
    # Plain implementations in registration order (builtin first, so a clash names the newcomer).
    # Each is called through pluggy as a subset of one, wrappers kept, because `pm.hook.<name>()`
    # merges the answers and every name must keep the plugin (and package) it came from.
    impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if not (i.wrapper or i.hookwrapper)]
    for impl in impls:
        plugin = impl.plugin_name
        source = plugin_source(pm, plugin)
        where = f"plugin {plugin!r} from package {source!r}"
        fix = f"; {_fix(plugin)}"
        others = [i.plugin for i in impls if i.plugin is not impl.plugin]
        try:
            answers = pm.subset_hook_caller(hook_name, remove_plugins=others)()
        except Exception as exc:
            raise ValueError(f"{where}: {hook_name}() raised {type(exc).__name__}: {exc}{fix}") from exc
        for answer in answers:  # [] when the plugin returned None: it contributes nothing
            if not isinstance(answer, dict):
                raise ValueError(f"{where}: {hook_name}() must return a dict {{name: class}}, "
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
                out[name] = PluginEntry(cls, source, plugin)
    return out


def collect_all() -> dict[str, dict[str, PluginEntry]]:
    return {kind: collect(kind) for kind in KIND_HOOKS}


def reset() -> None:
    """Forget what was collected (tests; a process that installed a plugin at run time)."""
    collect.cache_clear()
    plugin_manager.cache_clear()
