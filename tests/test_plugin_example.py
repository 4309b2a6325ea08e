"""The third-party example package (examples/tandem-plugin-example) plugs in through the `tandem`
entry-point group: once pip-installed, the engine uses its `fifo` eviction policy and its
`repeat_last` speculator by name, and `tandem plugins` lists both with their package.

Engines run in subprocesses so that the freshly installed entry points are read from scratch. The package is
pip-installed into a directory of its own, on those subprocesses' PYTHONPATH: installed into the shared
environment, every other test's workers running meanwhile (tests run in parallel) saw it come and go — a decode
worker once started while it was half uninstalled and refused the broken plugin."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_models import hf_greedy, make_checkpoint

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tandem-plugin-example"
DIST = "tandem-plugin-example"
BS = 8


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The directory the example package is installed into (its code and its entry points' dist-info)."""
    src = tmp_path_factory.mktemp("example") / "pkg"  # build from a copy: no build/ left in the repo
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("site")
    # Build with the environment's setuptools (no download); a venv without it (Python >= 3.12 ships
    # none) lets pip fetch the build backend in isolation instead.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _pip("install", "--no-deps", *isolation, "--target", str(target), "-q", str(src))
    return str(target)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def _run(site: str, *argv: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    env.pop("TANDEM_DISABLE_PLUGINS", None)
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from tandem import LLM, SamplingParams

    path, bs = sys.argv[1], int(sys.argv[2])
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    toks = lambda start, n: list(range(start, start + n))
    A, B, flood = toks(10, 2 * bs + 1), toks(40, 2 * bs + 1), toks(100, 9 * bs + 1)
    hits = {}
    for policy in ("lru", "fifo"):
        # 12 blocks: A and B cached (4), A hit again, then a 10-block prompt evicts 2 cached blocks.
        llm = LLM(path, num_kv_blocks=12, block_size=bs, max_model_len=12 * bs, eviction=policy)
        for p in (A, B, A, flood):
            llm.generate([p], one)
        hits[policy] = llm.generate([A], one)[0].num_cached_tokens
        policy_class = type(llm.engine.kv.pool.policy)
        llm.engine.check_invariants()
    prompts = [toks(20, 30), [7, 8, 9] * 10 + [7]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM(path, num_kv_blocks=64, max_model_len=256).generate(prompts, greedy)]
    spec = LLM(path, num_kv_blocks=64, max_model_len=256, spec_max_batch=8, speculator="repeat_last",
               num_speculative_tokens=3)
    outs = [o.token_ids for o in spec.generate(prompts, greedy)]
    s = type(spec.engine.speculator)
    print(json.dumps({"hits": hits, "policy": f"{policy_class.__module__}.{policy_class.__name__}",
                      "speculator": f"{s.__module__}.{s.__name__}", "stats": spec.engine.speculator_stats(),
                      "prompts": prompts, "plain": plain, "spec": outs}))
""")


def test_engine_uses_third_party_eviction_and_speculator(installed, model_path):
    res = json.loads(_run(installed, "-c", ENGINE_SCRIPT, model_path, str(BS)).stdout.strip().splitlines()[-1])
    assert res["policy"] == "tandem_plugin_example.fifo.FIFOEviction"
    assert res["speculator"] == "tandem_plugin_example.repeat_last.RepeatLastSpeculator"
    # lru moved A behind B when A was hit again, so the flood evicted B; fifo evicts in fill order: A.
    assert res["hits"] == {"lru": 2 * BS, "fifo": 0}
    assert res["stats"]["num_drafted_tokens"] > 0  # the speculator was asked, and proposed
    # Exact verification: speculation never changes greedy output, which matches transformers.
    assert res["spec"] == res["plain"] == hf_greedy(model_path, res["prompts"], 12)


def test_tandem_plugins_lists_the_package(installed):
    # One interpreter runs `tandem plugins --json` and then the table (torch import dominates).
    script = ("import sys\nfrom tandem.cli import main\n"
              "main(['plugins', '--json']); print('=====', flush=True); sys.exit(main(['plugins']))")
    as_json, table = _run(installed, "-c", script).stdout.split("=====\n")
    rows = json.loads(as_json)
    by_name = {(r["kind"], r["name"]): r for r in rows}
    for key in (("eviction", "fifo"), ("speculator", "repeat_last")):
        assert by_name[key]["package"] == DIST and by_name[key]["plugin"] == "example", by_name.get(key)
    assert by_name["eviction", "lru"]["package"] == "tandem-llm"
    fifo_line = next(line for line in table.splitlines() if " fifo " in line)
    assert fifo_line.split()[:3] == ["eviction", "fifo", DIST]


def test_disabled_plugin_is_not_loaded(installed):
    env_script = ("import os; os.environ['TANDEM_DISABLE_PLUGINS'] = 'example'\n"
                  "from plugins.registry import resolve_eviction\n"
                  "try:\n    resolve_eviction('fifo', 4)\nexcept ValueError as e:\n    print(e)\n")
    out = _run(installed, "-c", env_script).stdout
    assert "unknown eviction policy 'fifo'" in out and "prefix_aware" in out


# ---- broken third-party plugins: a ValueError that names the package (no pip needed) -------------
BAD_PLUGINS = {
    "clash": ("from plugins.hookspecs import hookimpl\nfrom plugins.eviction import LRUEviction\n"
              "@hookimpl\ndef tandem_eviction_policies():\n    return {'lru': LRUEviction}\n",
              "eviction 'lru' is registered by both package 'tandem-llm'"),
    "typo": ("from plugins.hookspecs import hookimpl\n"
             "@hookimpl\ndef tandem_evicton_policies():\n    return {}\n", "unknown hook 'tandem_evicton_policies'"),
    "notclass": ("from plugins.hookspecs import hookimpl\n"
                 "@hookimpl\ndef tandem_eviction_policies():\n    return {'x': 3}\n",
                 "eviction 'x' must be a subclass of tandem.engine.interfaces.eviction.EvictionPolicy"),
    "boom": ("raise ImportError('needs libfoo')\n", "failed to load: ImportError: needs libfoo"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLUGINS))
def test_broken_plugin_is_an_actionable_error(name, tmp_path, monkeypatch):
    from plugins import manager
    from plugins.registry import resolve_eviction

    source, message = BAD_PLUGINS[name]
    (tmp_path / f"bad_{name}.py").write_text(source)
    # A real (if minimal) installed distribution on sys.path, so pluggy's own entry-point loader finds it.
    info = tmp_path / f"bad_{name}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bad-{name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[tandem]\n{name} = bad_{name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TANDEM_DISABLE_PLUGINS", raising=False)
    manager.reset()
    try:
        with pytest.raises(ValueError, match=message) as info:
            resolve_eviction("lru", 4)
        assert name in str(info.value) and "TANDEM_DISABLE_PLUGINS" in str(info.value)
        monkeypatch.setenv("TANDEM_DISABLE_PLUGINS", name)  # the way out the message names
        manager.reset()
        assert type(resolve_eviction("lru", 4)).__name__ == "LRUEviction"
    finally:
        manager.reset()  # later tests collect the real entry points again


def test_collection_happens_once():
    from plugins import manager
    from plugins.registry import resolve_eviction, resolve_quantizer

    manager.reset()
    resolve_eviction("lru", 4)
    resolve_quantizer("int8")
    resolve_eviction("lfu", 4)
    assert manager.plugin_manager.cache_info().misses == 1
    assert manager.collect.cache_info().misses == 2  # one per kind asked for, then cached
    manager.reset()  # later tests collect the real entry points again
