"""Linear layers whose CPU matmuls run through oneDNN instead of the BLAS behind `F.linear`.

Why: on CPU, `F.linear` in fp32 calls MKL's sgemm/sgemv. On AMD processors MKL takes its AVX2 path
even where AVX-512 exists, and its batch-1 sgemv runs on one thread: on the benchmark machine (Zen,
AVX-512) the 55M Llama's weights stream at ~18 GB/s through it, half of what one memcpy gets.
oneDNN (`torch.ops.mkldnn._linear_pointwise`, what vLLM's CPU build also dispatches to) picks its
kernel from the CPU's real ISA and threads the batch-1 case: 2.0-2.5x faster at every batch size
measured here, from 1 token to 1024 (docs/PERFORMANCE.md, "oneDNN linears"), for that model's weights.
With more threads oneDNN also splits even a batch-1 product across them (MKL runs it on one).

Each `Linear` also keeps its weight re-laid-out once in oneDNN's blocked format for a batch of
PACK_ROWS rows (`mkldnn._reorder_linear_weight`, as vLLM's CPU build prepacks): with the plain layout
oneDNN works from row-major weights on every call, and products of 8-32 rows — a decode step's batch —
ran 1.2-1.9x slower (docs/PERFORMANCE.md, "Prepacked linears"). Packed, oneDNN also wins for the
small weights of the shipped 5.4M model at one thread and one row, where unpacked it only tied
`F.linear` (the chain of its 25 linears, weights evicted as a step evicts them: F.linear 2.53 ms,
oneDNN 2.27, packed 1.83-1.98; at 8 rows 3.89 / 3.50 / 2.26-2.41), so every weight takes it. The cost
is a second copy of each linear weight in memory (`TANDEM_LINEAR=torch` has none).

**Small batches of bf16-stored weights.** A checkpoint stored in bf16 and served in fp32 (the usual
CPU case; the shipped model is one) has fp32 weights that are bf16 values widened. For up to
SMALL_BATCH_BF16 rows — a decode step of a few sequences, whose time is the bytes of the weights —
`Linear` keeps those bf16 bits (checked exact once per weight version) and multiplies through
kernels/csrc/linear_cpu.c, which widens them in registers: the same products from half the bytes
(the shipped model's 25 linears at one row: 2.80 -> 1.16 ms at 1 thread, 2.23 -> 0.68 ms at 2). Other
fp32 weights (the 55M benchmark Llama's random ones) go through the same kernel's fp32 variant, also up
to SMALL_BATCH rows: oneDNN's packed kernel streams such small products at 14-18 GB/s here, the C loop
(each thread reading its weight rows as one stream) at 21-23 GB/s from 1 to 5 rows and as fast as oneDNN
at 6-8 (55M Llama's 33 linears, 2 threads: 1 row 10.7 -> 6.9 ms, 4 rows 8.9 -> 7.1 ms); since session 39 it
reads one row's weights in four streams and 2-6 rows' in two: 1 row 25-39 GB/s, 3 rows ~31.

The results differ from `F.linear` only by summation order (~1e-6 relative in fp32), as two BLAS
builds would. `TANDEM_LINEAR=torch` switches back to `F.linear` (for A/B runs and as an escape
hatch); any tensor the oneDNN op does not take (CUDA, fp16, autograd) goes to `F.linear` anyway.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused, native_cpu
from tandem.models import weight_arena

_choice = os.environ.get("TANDEM_LINEAR", "").strip().lower()
if _choice not in ("", "onednn", "torch"):
    raise ValueError(f"TANDEM_LINEAR must be 'onednn' or 'torch', got {_choice!r}")
_mkldnn = getattr(torch.ops, "mkldnn", None)
_ONEDNN = (getattr(_mkldnn, "_linear_pointwise", None)
           if _choice != "torch" and torch.backends.mkldnn.is_available() else None)


def _bf16_inner_product() -> bool:
    """Whether this CPU's oneDNN builds a bf16 inner product: it needs AVX-512 or newer; on an AVX2-only CPU
    (the AMD EPYC VM of session 26) it refuses ("could not create a primitive descriptor"), and every bf16
    linear raised. There, bf16 goes to F.linear."""
    check = getattr(_mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None:
        return bool(check())
    try:
        _ONEDNN(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(8, 8, dtype=torch.bfloat16), None, "none", [], "")
        return True
    except RuntimeError:
        return False


_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN is not None and _bf16_inner_product() else (torch.float32,)
PACK_ROWS = 64  # the batch size oneDNN lays packed weights out for (8 and 64 measured the same)
_REORDER = getattr(_mkldnn, "_reorder_linear_weight", None) if _ONEDNN is not None else None
# Rows up to which weights go through kernels/csrc/linear_cpu.c (one pass over the weights per 8 rows; a
# batch-1 speculative step verifies k + 1 = 5 rows). fp32 weights: up to 8 (at 12-16 rows oneDNN's packed
# kernel was faster: the 55M Llama's linears 9.6 / 10.9 ms against 11.7 / 13.0). bf16-stored weights, half
# the bytes: up to 16 (the shipped model's, 12 / 16 rows: oneDNN 2.15 / 2.17 ms, C 1.54 / 1.71).
SMALL_BATCH = 8
SMALL_BATCH_BF16 = 16
# oneDNN builds (and caches, 1024 at most) a primitive per distinct row count: a prefill of a length it
# has not seen paid ~0.9 ms per linear shape, 3.5 ms a step for the shipped model's four (one thread;
# a 256-token prefill is ~22 ms), and prompt lengths and mixed prefill + decode batches vary without end.
# Above BUCKET_FROM rows a product is padded to a multiple of 8 rows, of 2^(bit_length - 6) past 512
# (<= 3% more rows from 256 up; ~150 row counts up to 4096, so a model's few shapes stay in the cache).
BUCKET_FROM = 64


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN product of `rows` rows runs at: itself up to BUCKET_FROM, else rounded up
    (65 -> 72, 257 -> 264, 300 -> 304, 1000 -> 1008, 2049 -> 2112)."""
    if rows <= BUCKET_FROM:
        return rows
    step = max(8, 1 << (rows.bit_length() - 6))
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it applies (CPU, fp32/bf16, no autograd), with
    `packed` (`Linear.packed_weight`: the same weight in oneDNN's layout) in its place if given."""
    if (_ONEDNN is not None and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dtype == weight.dtype
            and not (weight.requires_grad and torch.is_grad_enabled())):
        w = weight if packed is None else packed
        rows = x.shape[0] if x.dim() == 2 else 0
        padded = bucket_rows(rows)
        if padded == rows:
            return _ONEDNN(x, w, bias, "none", [], "")
        xp = x.new_empty((padded, x.shape[1]))  # rows are independent: the padding changes no real row
        xp[:rows] = x
        xp[rows:] = 0
        return _ONEDNN(xp, w, bias, "none", [], "")[:rows]
    return F.linear(x, weight, bias)


def backend() -> str:
    """The matmul path a CPU fp32 linear takes in this process (for benchmarks to print)."""
    return "onednn" if _ONEDNN is not None else "torch"


def _exact_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w as bf16 when that loses nothing (a CPU fp32 weight whose every value is a bf16 value), else None."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        return None
    narrow = w.detach().to(torch.bfloat16).contiguous()
    # in huge pages, as the loader keeps the fp32 weights (tandem/models/weight_arena.py): this copy is what
    # a decode step of a few rows streams
    return weight_arena.copy_into_huge_pages(narrow) if torch.equal(narrow.float(), w.detach()) else None


def _weight_key(w: torch.Tensor) -> tuple:
    """What identifies a weight's values for the copies made from it: its storage, shape and version
    counter. A weight made under `torch.inference_mode()` has no version counter; writes to it in place
    are not seen (the loader writes weights outside inference mode; a replaced weight is a new storage)."""
    return (w.data_ptr(), None if w.is_inference() else w._version, tuple(w.shape))


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose forward is `linear` above."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None

    _bf16: torch.Tensor | None = None
    _plan: tuple | None = None  # (C kernel, weight it reads, bias address) for _small_batch
    _plan_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_BF16 and _choice != "torch":
            y = self._small_batch(x)
            if y is not None:
                return y
        return linear(x, self.weight, self.bias, self.packed_weight())

    def _small_batch(self, x: torch.Tensor) -> torch.Tensor | None:
        """y = x W^T + b through kernels/csrc/linear_cpu.c, from the weight's bf16 bits where they lose
        nothing, else from its fp32 values; None where neither applies: not CPU fp32 inference, or no
        native library (see the module docstring). What the kernel reads is
        planned once per weight version (a batch-1 step makes ~25 of these calls, each ~6 us of Python
        before the plan)."""
        w, plan, rows = self._parameters["weight"], self.small_batch_plan(), x.shape[0]
        if plan is None or rows > (SMALL_BATCH_BF16 if plan[3] else SMALL_BATCH) or not fused.ALLOWED or (
                w.requires_grad and torch.is_grad_enabled()) or x.numel() == 0 or (
                x.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu):
            return None
        y = x.new_empty((rows, w.shape[0]))
        plan[0](x.data_ptr(), plan[1], plan[2], y.data_ptr(), rows, w.shape[0], w.shape[1], torch.get_num_threads())
        return y

    def small_batch_plan(self) -> tuple | None:
        """(C kernel, address of the weight it reads, bias address or None, reads bf16 bits, the bf16 copy),
        current for this weight and bias (remade when either is replaced or written); None where the C
        kernel does not apply. tandem/layers/fused_decode.py hands these to its fused layer."""
        w, bias = self._parameters["weight"], self._parameters["bias"]
        key = (_weight_key(w), None if bias is None else _weight_key(bias))
        if self._plan_key != key:  # first use, or the weight or bias was replaced or written
            self._plan, self._plan_key = self._make_plan(w, bias), key
        return self._plan

    def _make_plan(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple | None:
        self._bf16 = narrow = _exact_bf16(w)
        lib = native_cpu.library()
        if lib is None or (narrow is None and not self._plain_fp32(w)) or (bias is not None and (
                bias.dtype != torch.float32 or not bias.is_contiguous() or bias.device.type != "cpu")):
            return None
        kernel = lib.tandem_linear_f32w_f32 if narrow is None else lib.tandem_linear_bf16w_f32
        # The plan keeps `narrow` alive (its address is in it); the key holds w's and bias's addresses.
        return (kernel, (w if narrow is None else narrow).data_ptr(), None if bias is None else bias.data_ptr(),
                narrow is not None, narrow)

    @staticmethod
    def _plain_fp32(w: torch.Tensor) -> bool:
        return w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()

    def packed_weight(self) -> torch.Tensor | None:
        """The weight in oneDNN's packed layout (CPU fp32 inference only), made on first use and again
        whenever the weight is replaced or written (keyed on its storage and version counter)."""
        w = self.weight
        if _REORDER is None or w.dtype != torch.float32 or w.device.type != "cpu" or (
                w.requires_grad and torch.is_grad_enabled()):
            return None
        key = _weight_key(w)
        if self._packed_key != key:
            self._packed, self._packed_key = _REORDER(w.detach(), PACK_ROWS), key
        return self._packed
