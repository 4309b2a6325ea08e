"""Linear layers whose CPU matmuls run through oneDNN instead of the BLAS behind `F.linear`.

Why: on CPU, `F.linear` in fp32 calls MKL's sgemm/sgemv. On AMD processors MKL takes its AVX2 path
even where AVX-512 exists, and its batch-1 sgemv runs on one thread: on the benchmark machine (Zen,
AVX-512) the 55M Llama's weights stream at ~18 GB/s through it, half of what one memcpy gets.
oneDNN (`torch.ops.mkldnn._linear_pointwise`, what vLLM's CPU build also dispatches to) picks its
kernel from the CPU's real ISA and threads the batch-1 case: 2.0-2.5x faster at every batch size
measured here, from 1 token to 1024 (docs/PERFORMANCE.md, "oneDNN linears"), for that model's weights.
Small weights (under ONEDNN_MIN_NUMEL elements, e.g. the shipped 5.4M model's) stay on `F.linear`
when the process computes with one thread: there oneDNN's fixed cost per call is most of the call.
With more threads every weight goes to oneDNN, which splits even a batch-1 product across them (MKL
runs it on one): the shipped model at 2 threads, batch 1, 3.90-4.15 -> 3.69-3.77 ms a token
(docs/PERFORMANCE.md, "Small linears at two threads"; the 55M model's runs were within noise).

The results differ from `F.linear` only by summation order (~1e-6 relative in fp32), as two BLAS
builds would. `TANDEM_LINEAR=torch` switches back to `F.linear` (for A/B runs and as an escape
hatch); any tensor the oneDNN op does not take (CUDA, fp16, autograd) goes to `F.linear` anyway.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_choice = os.environ.get("TANDEM_LINEAR", "").strip().lower()
if _choice not in ("", "onednn", "torch"):
    raise ValueError(f"TANDEM_LINEAR must be 'onednn' or 'torch', got {_choice!r}")
_mkldnn = getattr(torch.ops, "mkldnn", None)
_ONEDNN = (getattr(_mkldnn, "_linear_pointwise", None)
           if _choice != "torch" and torch.backends.mkldnn.is_available() else None)
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Below this many weight elements, at one thread, oneDNN's fixed cost per call (~10-20 us here)
# outweighs its faster kernel, and F.linear is quicker (docs/PERFORMANCE.md, "Small linears").
ONEDNN_MIN_NUMEL = 1 << 19


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it applies (CPU, fp32/bf16, no autograd)."""
    if (_ONEDNN is not None and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dtype == weight.dtype
            and (weight.numel() >= ONEDNN_MIN_NUMEL or torch.get_num_threads() > 1)
            and not (weight.requires_grad and torch.is_grad_enabled())):
        return _ONEDNN(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def backend() -> str:
    """The matmul path a CPU fp32 linear takes in this process (for benchmarks to print)."""
    return "onednn" if _ONEDNN is not None else "torch"


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
