"""Compile every Triton kernel for a real CUDA architecture without a GPU, through the public ops.

Owns the one check of the GPU code path that a CPU-only machine can make. The interpreter runs
kernels as numpy and forgives things the compiler does not (scalar tensors, constexpr plumbing,
tl.dot shape and dtype rules, fp8 support per architecture, shared-memory budgets); this tool calls
each op with CPU tensors shaped like real workloads, and instead of launching, lowers each kernel
through Triton's CUDA backend to a cubin (ptxas ships with triton). It checks that the kernels build
for the target, not that they are right (tests/test_kernels.py does that) or fast (bench/kernels.py).

    python -m kernels.triton_compile_check --arch 90 [--dtypes bf16,fp16,fp32,int8,fp8]

TRITON_INTERPRET must be unset for this process (it is removed here before triton is imported).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported, or jit hands out interpreters

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import reference, triton_common  # noqa: E402

_PTR = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
        torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8,
          "fp8": torch.float8_e4m3fn}


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Triton signature strings and constexpr values for one launch, as the launcher would infer them."""
    values = dict(zip(fn.arg_names, args), **kwargs)
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _PTR[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name} = {v!r}")
    return sig, consts


def run(arch: int, dtypes: list[torch.dtype], log=print) -> int:
    """Compile every kernel the ops launch for each cache dtype; returns the number compiled."""
    from kernels.triton_ops import TRITON_OPS as ops

    compiled = []

    def compile_instead(self: JITFunction, *args, grid, warmup, **kwargs):  # replaces the launch
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        sig, consts = _signature(self, args, kwargs)
        kernel = triton.compile(ASTSource(self, sig, consts), target=GPUTarget("cuda", arch, 32), options=options)
        shown = {k: v for k, v in consts.items() if not k.startswith("BLOCK")}
        log(f"sm_{arch} {self.__name__:<20} shared {kernel.metadata.shared:>6} B  {shown}")
        compiled.append(self.__name__)

    saved_run, saved_sms = JITFunction.run, triton_common.COMPILE_ONLY_SM_COUNT
    JITFunction.run, triton_common.COMPILE_ONLY_SM_COUNT = compile_instead, 132
    try:
        for cache_dtype in dtypes:
            _launch_all(ops, cache_dtype)
    finally:
        JITFunction.run, triton_common.COMPILE_ONLY_SM_COUNT = saved_run, saved_sms
    return len(compiled)


def _launch_all(ops, cache_dtype: torch.dtype) -> None:
    """One call of each op at Llama-70B-like head geometry (64 query heads, 8 KV heads, head dim 128)."""
    qdt = torch.float32 if cache_dtype == torch.float32 else (
        torch.float16 if cache_dtype == torch.float16 else torch.bfloat16)
    full = torch.randn(64, 2, 16, 8, 128)
    cache, scale = (reference.quantize_rows(full, cache_dtype) if cache_dtype in reference.QUANT_MAX
                    else (full.to(cache_dtype), None))
    tables = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.full((4,), 100, dtype=torch.int32)
    query = torch.randn(4, 1, 64, 128, dtype=qdt)
    ops.paged_decode_attention(query, cache, tables, lens, 0.1, scale)  # split + merge
    ops.paged_decode_attention(query.expand(4, 4, 64, 128), cache, tables, lens, 0.1, scale,
                               partition_tokens=1024)  # one split (direct), Q = 4
    kv = torch.randn(10, 8, 128, dtype=qdt)
    ops.store_kv(kv, kv, cache, torch.arange(10), scale)
    ops.prefill_attention(torch.randn(10, 64, 128, dtype=qdt), kv, kv, cache, tables[:2],
                          torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32),
                          0.1, scale)
    ops.gather_blocks(cache, torch.tensor([1, 2]))
    if scale is not None:
        ops.scatter_blocks(scale, torch.tensor([1, 2]), scale[:2].clone())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Compile the Triton kernels for a CUDA arch, no GPU needed.")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 = A100, 90 = H100)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32,int8,fp8", help=f"cache dtypes among {sorted(DTYPES)}")
    args = p.parse_args(argv)
    names = [d for d in args.dtypes.split(",") if d]
    if unknown := set(names) - set(DTYPES):
        raise SystemExit(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
    if args.arch < 89 and "fp8" in names:
        print(f"sm_{args.arch}: skipping fp8 (float8_e4m3fn needs compute capability >= 8.9)")
        names.remove("fp8")
    count = run(args.arch, [DTYPES[d] for d in names])
    print(f"OK: {count} kernels compiled for sm_{args.arch}")


if __name__ == "__main__":
    sys.exit(main())
