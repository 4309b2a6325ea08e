"""Triton kernels beside the attention ops: block gather/scatter (bit-exact against the reference), the
kernels compiled for a real GPU (no GPU needed), and the engine's greedy output with either set of
kernels. Shapes and tolerances as in tests/test_kernels.py (interpreted on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton_device
from test_kernels import _bits, _make_cache, _randn

from kernels import reference as ref

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ops():
    return triton_device.triton_ops()  # imports triton: after conftest set TRITON_INTERPRET


# ----------------------------------------------------------------------------------- gather / scatter

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_gather_scatter_round_trip_exact(ops, dtype):
    src, scale, _ = _make_cache(12, 2, 64, dtype)
    ids = torch.tensor([7, 2, 11, 0])
    packed = ops.gather_blocks(src, ids)
    assert packed.is_contiguous() and torch.equal(_bits(packed), _bits(ref.gather_blocks(src, ids)))
    dst = torch.zeros_like(src)
    dest_ids = torch.tensor([1, 9, 4, 3], dtype=torch.int32)
    ops.scatter_blocks(dst, dest_ids, packed)
    assert torch.equal(_bits(dst[dest_ids.long()]), _bits(src[ids]))
    untouched = [i for i in range(12) if i not in dest_ids.tolist()]
    assert not _bits(dst[untouched]).any()
    if scale is not None:  # the scale tensor travels through the same ops
        out = torch.empty(4, *scale.shape[1:])
        assert ops.gather_blocks(scale, ids, out=out) is out and torch.equal(out, scale[ids])
        dst_scale = torch.zeros_like(scale)
        ops.scatter_blocks(dst_scale, dest_ids, out)
        assert torch.equal(dst_scale[dest_ids.long()], scale[ids])


def test_gather_scatter_odd_shapes(ops):
    """Trailing shapes whose byte size is not a multiple of 4, a strided pool, a dtype-converting scatter."""
    odd = torch.randint(-100, 100, (9, 3, 5), dtype=torch.int8)  # 15 bytes per block: byte path
    ids = torch.tensor([8, 0, 4])
    assert torch.equal(ops.gather_blocks(odd, ids), odd[ids])
    pool = _randn(20, 2, 4, 1, 8)[::2]  # dim-0 stride of two blocks
    assert torch.equal(ops.gather_blocks(pool, ids), pool[ids])
    cache, expected = torch.zeros(9, 2, 4, 1, 8), torch.zeros(9, 2, 4, 1, 8)
    blocks = _randn(3, 2, 4, 1, 8, dtype=torch.bfloat16)
    ops.scatter_blocks(cache, ids, blocks)
    ref.scatter_blocks(expected, ids, blocks)
    assert torch.equal(cache, expected)
    assert ops.gather_blocks(odd, torch.tensor([], dtype=torch.int64)).shape == (0, 3, 5)


def test_kernels_compile_for_a_real_gpu():
    """The interpreter forgives what the compiler does not: lower every kernel to an sm_90 cubin with
    triton's own ptxas (no GPU needed). The fp8 cache case covers every kernel with the quantized
    path, the bf16 tensor-core dots and bf16 outputs, for ~10 s of compiling; `python -m
    kernels.triton_compile_check` without --dtypes builds all cache dtypes."""
    import importlib.util

    spec = importlib.util.find_spec("triton")  # locate, don't import
    if not (Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no CUDA backend / ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.triton_compile_check", "--arch", "90",
                           "--dtypes", "fp8"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "OK: 7 kernels compiled" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


# --------------------------------------------------------------------------------------- engine level

_ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from tandem.llm import LLM
    from tandem.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[0, 5, 9, 13, 200, 7, 7, 31, 64, 3, 90, 11, 12, 5, 6, 300, 18, 19, 2], [0, 42, 17], [0, 8] * 9]
    results = []
    for options in json.loads(sys.argv[2]):
        llm = LLM(model=sys.argv[1], max_num_batched_tokens=24, block_size=16, num_kv_blocks=64, **options)
        outs = llm.generate(prompts, greedy)
        outs += llm.generate([prompts[0] + [77, 78]], greedy)  # its first block is a prefix-cache hit
        results.append([o.outputs[0].token_ids for o in outs])
    print(json.dumps(results))
""")
ENGINE_VARIANTS = [{}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8_e4m3"},
                   {"speculator": "ngram", "num_speculative_tokens": 3, "spec_max_batch": 8}]


def _engine_run(model_dir: str, kernels: str, variants: list[dict]) -> list[list[list[int]]]:
    """Every variant in one subprocess per kernel choice (the env var must apply before imports). The
    reference runs on the CPU; Triton on the GPU in fp32 where there is one, else interpreted on CPU."""
    env = {**os.environ, "TANDEM_KERNELS": kernels, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if kernels == "triton" and triton_device.GPU is not None:
        del env["TRITON_INTERPRET"], env["CUDA_VISIBLE_DEVICES"]
        variants = [{**v, "device": "cuda", "dtype": "float32"} for v in variants]
    proc = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, model_dir, json.dumps(variants)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_greedy_reference_equals_triton(tmp_path):
    """A tiny random Llama (2 layers, hidden 64, GQA 2:1) generates the same greedy tokens whichever
    kernels run it: chunked prefill (budget 24 < the prompts' total), a prefix-cache hit and decode,
    with fp32 / int8 / fp8 caches and, where the engine has one, an n-gram speculator (Q > 1 queries)."""
    from tandem.config import EngineConfig
    from tests.tiny_models import make_checkpoint

    model_dir = make_checkpoint(str(tmp_path / "tiny-llama"), "llama")
    variants = [v for v in ENGINE_VARIANTS if set(v) <= set(EngineConfig.option_names())]
    expected = _engine_run(model_dir, "reference", variants)
    assert all([len(t) for t in run] == [6, 6, 6, 6] for run in expected)
    got = _engine_run(model_dir, "triton", variants)
    for variant, want, have in zip(variants, expected, got):
        assert have == want, f"engine options {variant}: triton {have} != reference {want}"
