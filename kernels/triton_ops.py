"""The Triton implementation of `kernels.KernelOps`, picked by `kernels.get_ops` on CUDA (or with
TANDEM_KERNELS=triton). Owns nothing but the assembly: each op lives in its own module and has the
exact signature of its counterpart in `kernels.reference`."""

from __future__ import annotations

from kernels import KernelOps
from kernels.triton_blocks import gather_blocks, scatter_blocks
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import prefill_attention
from kernels.triton_store import store_kv

TRITON_OPS = KernelOps(
    name="triton",
    store_kv=store_kv,
    paged_decode_attention=paged_decode_attention,
    prefill_attention=prefill_attention,
    gather_blocks=gather_blocks,
    scatter_blocks=scatter_blocks,
)

__all__ = ["TRITON_OPS"]
