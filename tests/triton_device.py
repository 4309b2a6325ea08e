"""The Triton ops as the kernel tests call them: compiled on the GPU where there is one, interpreted on CPU.

The kernel tests build their inputs on the CPU (seeded CPU generators) and check against the torch
reference ops on the CPU. With a GPU, `on_device(op)` copies each tensor argument to it with its
strides (a strided view stays a strided view), runs the compiled kernel, writes every argument back
(store_kv and scatter_blocks write in place) and returns the result on the CPU; so the same test
checks the real compiled kernel against the same oracle. Without a GPU the op is returned as it is
and runs under TRITON_INTERPRET=1 (tests/conftest.py). Import triton only through these functions:
the interpreter switch must be set before triton's first import.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

GPU = torch.device("cuda") if torch.cuda.is_available() else None
OPS = ("store_kv", "paged_decode_attention", "prefill_attention", "gather_blocks", "scatter_blocks")


def _to_gpu(t):
    if not isinstance(t, torch.Tensor):
        return t
    if 0 in t.stride():  # an expanded view: one element read many times, no strided copy of it
        return t.to(GPU)
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=GPU)
    out.copy_(t)
    return out


def on_device(op):
    """op itself without a GPU; with one, op run on GPU copies of its arguments (see the docstring)."""
    if GPU is None:
        return op

    @functools.wraps(op)  # keeps the signature: tests compare it with the reference op's
    def call(*args, **kwargs):
        moved = [_to_gpu(a) for a in args]
        moved_kw = {k: _to_gpu(v) for k, v in kwargs.items()}
        out = op(*moved, **moved_kw)
        for mine, theirs in zip([*args, *kwargs.values()], [*moved, *moved_kw.values()]):
            if isinstance(mine, torch.Tensor) and 0 not in mine.stride():
                mine.copy_(theirs.cpu())
                if out is theirs:  # an op that returns its `out=` argument returns the caller's tensor
                    out = mine
        return out.cpu() if isinstance(out, torch.Tensor) else out

    return call


def triton_ops():
    """TRITON_OPS with every op wrapped by on_device."""
    from kernels.triton_ops import TRITON_OPS

    return dataclasses.replace(TRITON_OPS, **{name: on_device(getattr(TRITON_OPS, name)) for name in OPS})


def triton_decode():
    """The decode op with its test-only keyword (partition_tokens), wrapped by on_device."""
    from kernels.triton_decode import paged_decode_attention

    return on_device(paged_decode_attention)
