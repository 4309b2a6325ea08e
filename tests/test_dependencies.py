"""What a fresh `pip install -e .` gives is enough to run every shipped module.

1. Every third-party module that the installed packages import is a declared dependency in
   `pyproject.toml` (the test extras pull in transformers -> numpy and would hide a missing one).
2. The KV transfer path, the one that once needed numpy (`tensor.numpy()`), moves exact bytes
   between two real processes in which numpy cannot be imported at all.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

from kvtransfer import CacheLayout
from kvtransfer.testing import Proc

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _shipped_packages() -> list[str]:
    patterns = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({p.rstrip("*") for p in patterns})


def _norm(name: str) -> str:
    return re.split(r"[<>=!~;\[ ]", name)[0].strip().lower().replace("_", "-")


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported anywhere in the file, except under `if TYPE_CHECKING:` and inside
    `try: ... except ImportError` (an optional import that is guarded is allowed)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        guarded = (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)) or (
            isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Name("x"))
                                              for h in node.handlers))
        if guarded:
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_every_runtime_import_is_declared() -> None:
    declared = {_norm(d) for d in PYPROJECT["project"]["dependencies"]}
    optional = {_norm(d) for deps in PYPROJECT["project"]["optional-dependencies"].values() for d in deps}
    dists = metadata.packages_distributions()  # import name -> distributions that provide it
    local = {p.name for p in ROOT.iterdir() if p.is_dir()}
    missing = []
    for pkg in _shipped_packages():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in _top_level_imports(path):
                if name in sys.stdlib_module_names or name in local or name == "__future__":
                    continue
                provided_by = {_norm(d) for d in dists.get(name, [name])}
                if not provided_by & declared:
                    # triton is optional by design: every import of it is lazy, behind TANDEM_KERNELS
                    kind = "optional extra" if provided_by & optional else "not declared at all"
                    missing.append(f"{path.relative_to(ROOT)} imports {name!r} ({kind})")
    allowed = [m for m in missing if "'triton'" in m and "optional extra" in m]
    assert sorted(set(missing) - set(allowed)) == []


def test_no_tensor_numpy_in_shipped_code() -> None:
    """`tensor.numpy()` raises 'Numpy is not available' on an install without numpy."""
    offenders = []
    for pkg in _shipped_packages():
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "numpy" and isinstance(node.ctx, ast.Load):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["zmq", "shm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_kv_transfer_without_numpy(connector: str, dtype: str) -> None:
    """Sender and receiver both run with numpy unimportable; the receiver's blocks equal the sender's."""
    layout = CacheLayout("tiny", "float32" if dtype == "int8" else dtype, dtype, block_size=4, num_layers=2,
                         num_kv_heads=2, head_dim=8)
    d, p = Proc(str(ROOT), without_numpy=True), Proc(str(ROOT), without_numpy=True)
    try:
        addr = d("open_receiver", name="k", connector=connector, layout=layout.to_dict(), num_blocks=16,
                 fence_timeout_s=1.0)["address"]
        p("open_sender", name="k", connector=connector, layout=layout.to_dict(), num_blocks=16, seed=7,
          checksum=True)
        assert p("connect", name="k", address=addr) == {}
        src, dest = [1, 5, 2], [9, 3, 12]
        d("expect", name="k", rid="r1", dest=dest)
        p("send", name="k", address=addr, rid="r1", src=src, dest=dest)
        assert p("finish", name="k", rid="r1", timeout_s=20)["ok"]
        events = d("wait", name="k", rids=["r1"], timeout_s=10)["events"]
        assert events[-1]["type"] == "TransferDone", events
        assert sorted(e["layer"] for e in events if e["type"] == "LayerReceived") == [0, 1]
        assert d("digest", name="k", ids=dest)["digest"] == p("digest", name="k", ids=src)["digest"]
        # the numpy block really held in the workers: torch there cannot convert to numpy
        assert p("numpy_probe")["blocked"] and d("numpy_probe")["blocked"]
    finally:
        d.close()
        p.close()
