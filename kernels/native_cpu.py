"""Native CPU kernels: C sources in kernels/csrc/ compiled on first use with the machine's C compiler.

Paged decode attention is here; the fused elementwise ops of a layer (RMSNorm, SiLU*mul, RoPE) are
in kernels/fused.py, the small-batch linears in tandem/layers/linear.py and the one-call decoder layer
of a small decode step in tandem/layers/fused_decode.py, on the same library.

The torch reference ops are exact but, for paged decode attention on a CPU, most of their time is
the gather of each sequence's blocks into a padded buffer and a dozen small ops per layer (measured:
18 ms of a batch-32 decode step of the 55M benchmark Llama, for ~100 MB of K/V). The C kernel reads
the paged cache in place. It is built once per machine into a cache directory (`TANDEM_CACHE_DIR`,
default ~/.cache/tandem) keyed by the source, the compiler and the CPU's flags, so `-march=native`
never runs on a CPU it was not built for. No compiler, or a failed build: one warning, and the torch
reference runs instead — nothing else changes.

The library is linked with -fopenmp and loaded after torch, so it shares torch's OpenMP runtime
(the same `libgomp.so.1`) and thread count instead of starting a second pool of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.c"))  # all of them: the cache key below covers every file in csrc/
# gnu11, not c11: ISO mode turns off the contraction of a * b + c into one FMA (5-8% of the attention kernel).
# -fno-trapping-math: no kernel enables FP traps, and with them possible GCC will not turn exp_approx's clamps
# into selects, so every loop calling it (SiLU, the softmax) stayed scalar ("control flow in loop").
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
          "-std=gnu11"]
_lib: list = []  # [] not tried yet; [None] unavailable; [CDLL] loaded


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in sorted(_CSRC.glob("*.[ch]")))  # headers too
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    cache_dir = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "kernels"
    target = cache_dir / f"tandem_cpu-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together (P and D workers) never load
    # a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True, text=True,
                       check=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None where they cannot be built (logged once)."""
    if _lib:
        return _lib[0]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    lib = None
    try:
        if compiler is None:
            raise OSError("no C compiler (cc or gcc) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        for name, restype, argtypes in [
            ("tandem_paged_decode_f32", i32, [ptr] * 3 + [i64, ptr, ptr] + [i32] * 6 + [f32, i32, i32]),
            ("tandem_add_rms_norm_f32", None, [ptr] * 5 + [i64, i64, f32, i32]),
            ("tandem_silu_and_mul_f32", None, [ptr, ptr, i64, i64, i32]),
            ("tandem_rope_f32", None, [ptr, i64, ptr, ptr, i64, i32, i32, i32]),
            ("tandem_argmax_f32", None, [ptr, i64, i64, ptr, i32]),
            ("tandem_store_kv_f32", i32, [ptr, i64, ptr, i64, ptr, i64, i32, ptr, i64, i64]),
            ("tandem_apply_bitmask_f32", None, [ptr, i64, i64, i64, ptr, i64, i64, ptr]),
            ("tandem_masked_argmax_f32", None, [ptr, i64, i64, ptr, i64, ptr, i64, i64, ptr]),
            ("tandem_argmax_masked_rows_f32", None, [ptr, i64, i64, ptr, i64, ptr, i32]),
            ("tandem_penalize_f32", i32, [ptr, i64, i64, i64] + [ptr] * 9),
            ("tandem_copy_stream", None, [ptr, ptr, i64]),
            ("tandem_linear_bf16w_f32", i32, [ptr] * 4 + [i64] * 3 + [i32]),
            ("tandem_linear_f32w_f32", i32, [ptr] * 4 + [i64] * 3 + [i32]),
            ("tandem_decode_layer_scratch", i64, [ptr, i64]),
            ("tandem_decode_layer_f32", i32, [ptr] * 3 + [i64] + [ptr] * 3 + [i64, i32] + [ptr] * 2 + [i64, ptr]
             + [i32] * 2 + [ptr, i32]),
            ("tandem_decode_layers_f32", i32, [ptr, i32] + [ptr] * 5 + [i64] + [ptr] * 2 + [i64, i32] + [ptr] * 2
             + [i64, ptr] + [i32] * 2 + [i32]),
            ("tandem_decode_model_f32", i32, [ptr, i32] + [ptr] * 3 + [i64] + [ptr] * 2 + [i64, ptr, f32] + [ptr] * 4
             + [i64, i32, i32] + [ptr] * 2 + [i64] + [ptr] * 2 + [i64, i64, ptr, i32, i32] + [ptr] * 4 + [i64, ptr]
             + [i32, i32]),
            ("tandem_eagle_draft_scratch", i64, [ptr, i32, i64]),
            ("tandem_eagle_draft_f32", i32, [ptr, i32, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, ptr,
                                             i64, i32, i32, ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, i32]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        log.warning("native CPU kernels unavailable, using the torch reference ops: %s %s", exc, detail[-500:])
        lib = None
    _lib.append(lib)
    return lib


_last_checked: list = [None]
# Block tables up to this many entries are checked in Python: ~10 torch ops cost ~27 us, which a
# batch-1 step pays once and an EAGLE head once per drafted token (its tables change every pass).
SMALL_TABLE = 256


def _check_small(tables: list[list[int]], lens: list[int], q_len: int, num_blocks: int, block_size: int,
                 window: int | None) -> None:
    """_checked's checks over plain lists: the same blocks counted as read, the same errors."""
    capacity = len(tables[0]) * block_size
    if min(lens) < q_len or max(lens) > capacity:
        raise ValueError(f"seq_lens must lie in [{q_len}, {capacity}] (query length, block-table capacity), "
                         f"got {lens}")
    for row, n in zip(tables, lens):
        # blocks j with j * bs < n, and under a window (j + 1) * bs > n - q_len - window + 1
        first = max(0, (n - q_len - window + 1) // block_size) if window else 0
        used = row[first:-(-n // block_size)]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            raise ValueError(f"block ids must lie in [0, {num_blocks}): the cache has {num_blocks} blocks")


def _checked(block_tables, seq_lens, q_len, num_blocks, block_size, window):
    """int32 contiguous tables and lengths, after checking that every block the C code will read is
    in the cache (the reference would raise an IndexError where C would read out of bounds; blocks
    wholly behind a sliding window are never read, so their entries may point anywhere). Every
    layer of a step passes the same two tensors, so the check runs once per step (keyed on their
    identity, like the reference's decode plan: callers must not edit them in place between calls)."""
    last = _last_checked[0]
    if last is not None and last[0] is block_tables and last[1] is seq_lens and last[2] == (q_len, num_blocks, window):
        return last[3]
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if lens.numel() != tables.shape[0]:
        raise ValueError(f"seq_lens has {lens.numel()} entries for {tables.shape[0]} block-table rows")
    if lens.numel() and tables.numel() <= SMALL_TABLE:
        _check_small(tables.tolist(), lens.tolist(), q_len, num_blocks, block_size, window)
    elif lens.numel():
        if int(lens.min()) < q_len or int(lens.max()) > tables.shape[1] * block_size:
            raise ValueError(f"seq_lens must lie in [{q_len}, {tables.shape[1] * block_size}] "
                             f"(query length, block-table capacity), got {lens.tolist()}")
        starts = torch.arange(tables.shape[1]).unsqueeze(0) * block_size
        used = starts < lens.unsqueeze(1)
        if window:
            used &= starts + block_size > (lens - q_len - window + 1).unsqueeze(1)
        ids = tables[used]
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(f"block ids must lie in [0, {num_blocks}): the cache has {num_blocks} blocks")
    _last_checked[0] = (block_tables, seq_lens, (q_len, num_blocks, window), (tables, lens))
    return tables, lens


def _rows_of(t: torch.Tensor) -> bool:
    """[T, Hkv, D] whose rows are each contiguous (a column slice of a wider tensor is fine)."""
    return t.dim() == 3 and t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store_kv(key, value, kv_cache, slot_mapping, kv_scale=None):
    """kernels.reference.store_kv's contract as row copies in C, for fp32 caches on the CPU; a quantized
    or half cache, or rows laid out otherwise, go to the reference."""
    from kernels import reference

    lib = library()
    if (lib is None or kv_scale is not None or kv_cache.dtype != torch.float32 or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous() or not _rows_of(key) or not _rows_of(value)
            or slot_mapping.device.type != "cpu"):
        return reference.store_kv(key, value, kv_cache, slot_mapping, kv_scale)
    slots = slot_mapping.to(torch.int64).contiguous()
    num_blocks, _, bs, hkv, d = kv_cache.shape
    if key.shape != (slots.numel(), hkv, d) or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match {slots.numel()} slots "
                         f"of [{hkv}, {d}]")
    rc = lib.tandem_store_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                 kv_cache.data_ptr(), num_blocks * bs, bs, slots.data_ptr(), slots.numel(), hkv * d)
    if rc != 0:
        raise IndexError(f"slot_mapping holds a slot past the cache's {num_blocks * bs}")


def paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, kv_scale=None, window=None):
    """kernels.reference.paged_decode_attention's contract, computed in C for fp32 caches on the CPU;
    any other case (a quantized or half cache, a non-CPU tensor, a shape past the kernel's limits)
    goes to the reference."""
    from kernels import reference

    lib = library()
    if (lib is None or kv_scale is not None or kv_cache.dtype != torch.float32 or query.dtype != torch.float32
            or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous()):
        return reference.paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, kv_scale, window)
    b, q_len, h, d = query.shape
    query = query.contiguous()
    tables, lens = _checked(block_tables, seq_lens, q_len, kv_cache.shape[0], kv_cache.shape[2], window)
    out = torch.empty_like(query)
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    rc = lib.tandem_paged_decode_f32(query.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                                     lens.data_ptr(), out.data_ptr(), b, q_len, h, hkv, d, bs, scale,
                                     window or 0, torch.get_num_threads())
    if rc != 0:
        return reference.paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, kv_scale, window)
    return out
