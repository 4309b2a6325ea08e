"""Kernel dispatch: the one place that picks Triton kernels (CUDA) or the CPU ops.

The engine calls `get_ops(device)` once and keeps the returned `KernelOps`; no other module branches
on the device. On a CPU the ops are the torch reference ops with decode attention in C
(kernels/native_cpu.py, built on first use; the reference where it cannot be built).
`TANDEM_KERNELS=reference|native|triton` overrides the choice (tests run the Triton kernels on CPU
under `TRITON_INTERPRET=1` this way, and the pure reference as the oracle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels import native_cpu, reference


@dataclass(frozen=True, slots=True)
class KernelOps:
    name: str
    store_kv: Callable
    paged_decode_attention: Callable
    prefill_attention: Callable
    gather_blocks: Callable
    scatter_blocks: Callable


REFERENCE_OPS = KernelOps(
    name="reference",
    store_kv=reference.store_kv,
    paged_decode_attention=reference.paged_decode_attention,
    prefill_attention=reference.prefill_attention,
    gather_blocks=reference.gather_blocks,
    scatter_blocks=reference.scatter_blocks,
)


NATIVE_CPU_OPS = replace(REFERENCE_OPS, name="native", paged_decode_attention=native_cpu.paged_decode_attention,
                         store_kv=native_cpu.store_kv)


def _triton_ops() -> KernelOps:
    try:
        from kernels import triton_ops  # noqa: WPS433 (import only when asked for)
    except ImportError as exc:  # triton is an optional extra
        raise ValueError(f"Triton kernels requested but unavailable: {exc}") from exc
    return triton_ops.TRITON_OPS


def get_ops(device: torch.device | str) -> KernelOps:
    """Triton on CUDA, native elsewhere; TANDEM_KERNELS=reference|native|triton overrides."""
    choice = os.environ.get("TANDEM_KERNELS", "").strip().lower()
    if choice not in ("", "reference", "native", "triton"):
        raise ValueError(f"TANDEM_KERNELS must be 'reference', 'native' or 'triton', got {choice!r}")
    if choice == "triton" or (choice == "" and torch.device(device).type == "cuda"):
        return _triton_ops()
    return REFERENCE_OPS if choice == "reference" else NATIVE_CPU_OPS
