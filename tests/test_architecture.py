"""Import-graph rules, checked in fresh interpreters (sys.modules of this test process is polluted):

- the router is torch-free: `import router_svc.server` (and the routing plugins) loads no torch;
- arrows point one way: the engine depends on its interfaces (tandem/engine/interfaces/), plugins/
  implements them, so importing engine modules loads no `plugins.*` module;
- `import kvtransfer` loads no connector: each is imported when its name is first looked up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(imports: list[str]) -> set[str]:
    """The module names in sys.modules after importing `imports` in a fresh interpreter."""
    script = textwrap.dedent(f"""
        import importlib, json, sys
        for name in {imports!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(sys.modules)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_router_does_not_import_torch():
    loaded = _modules_after(["router_svc", "router_svc.server", "router_svc.core", "plugins.routing",
                             "tandem.engine.strategies", "tandem.protocol.prefix_hash"])
    assert "torch" not in loaded, "the router's import chain reaches torch (run python -X importtime)"
    assert not {m for m in loaded if m.startswith(("tandem.engine.llm_engine", "tandem.models"))}


ENGINE_MODULES = [
    "tandem.engine.block_pool",
    "tandem.engine.kv_cache_manager",
    "tandem.engine.kv_layout",
    "tandem.engine.llm_engine",
    "tandem.engine.model_runner",
    "tandem.engine.scheduler",
    "tandem.engine.spec_decode",
    "tandem.engine.strategies",
    "tandem.engine.interfaces.eviction",
    "tandem.engine.interfaces.kv_quantizer",
    "tandem.engine.interfaces.routing",
    "tandem.engine.interfaces.speculator",
    "tandem.llm",
]


def test_engine_does_not_import_plugins():
    # One interpreter for all (each costs torch's import). builtins.__import__ sees every import
    # statement, even of a module already loaded, so each offender is named, not just the first.
    script = textwrap.dedent(f"""
        import builtins, importlib, json, sys
        seen, real_import = {{}}, builtins.__import__

        def spy(name, globals=None, locals=None, fromlist=(), level=0):
            importer = (globals or {{}}).get("__name__", "")
            if level == 0 and name.split(".")[0] == "plugins" and importer.startswith("tandem."):
                seen.setdefault(importer, []).append(name)
            return real_import(name, globals, locals, fromlist, level)

        builtins.__import__ = spy
        for name in {ENGINE_MODULES!r}:
            importlib.import_module(name)
        print(json.dumps(seen))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    offenders = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not offenders, (f"tandem modules import plugins/ at import time: {offenders}; depend on "
                           "tandem.engine.interfaces / tandem.engine.strategies instead")


def test_kvtransfer_imports_connectors_lazily():
    loaded = _modules_after(["kvtransfer"])
    connectors = {"kvtransfer.zmq_connector", "kvtransfer.shm_connector", "kvtransfer.dist_connector"}
    assert not connectors & loaded


def test_lazy_connectors_table():
    from kvtransfer import CONNECTORS

    assert set(CONNECTORS) == {"zmq", "shm", "torch_dist"} and "zmq" in CONNECTORS and "nope" not in CONNECTORS
    for name, cls in CONNECTORS.items():
        assert cls.name == name
    with pytest.raises(KeyError, match="available: shm, torch_dist, zmq"):
        CONNECTORS["nope"]


def test_old_plugin_names_still_work():
    """Moved interfaces stay importable under their plugins.* names (third-party plugins use them)."""
    from plugins.eviction import EvictionPolicy
    from plugins.quantizers import KVQuantizer, NoQuantizer
    from plugins.routing import RouteRequest, RoutingPolicy, prefix_key
    from plugins.speculators import Speculator, SpeculatorContext
    from tandem.engine.interfaces import eviction, kv_quantizer, routing, speculator

    assert EvictionPolicy is eviction.EvictionPolicy and Speculator is speculator.Speculator
    assert SpeculatorContext is speculator.SpeculatorContext and RoutingPolicy is routing.RoutingPolicy
    assert (KVQuantizer, NoQuantizer) == (kv_quantizer.KVQuantizer, kv_quantizer.NoQuantizer)
    assert RouteRequest is routing.RouteRequest and prefix_key is routing.prefix_key


def test_prefix_hash_is_the_block_pools():
    """The router's prefix key and the workers' block hashes are the same chain."""
    from tandem.engine.block_pool import hash_block_tokens
    from tandem.protocol.prefix_hash import prefix_key

    tokens = list(range(40))
    chain = hash_block_tokens(hash_block_tokens(None, tokens[:16]), tokens[16:32])
    assert prefix_key(tokens, 16, 2) == chain == prefix_key(tokens, 16, 5)
    assert prefix_key(tokens[:5], 16, 2) == hash_block_tokens(None, tokens[:5])
