"""Fused elementwise ops of a decoder layer: RMSNorm (with the residual add before it), SiLU*mul, RoPE;
the greedy sampler's row-wise argmax, and a grammar's token bitmask applied to logits.

On the CPU with fp32 tensors each is one C call (kernels/csrc/fused_cpu.c, built with the decode
attention kernel by kernels/native_cpu.py) where torch runs 2-10 ops and as many passes over memory;
anywhere else — CUDA, half precision, `TANDEM_KERNELS=reference|triton`, no C compiler — the torch
forms below run, and they are the reference: Hugging Face Llama's arithmetic, op for op.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from kernels import native_cpu

# Read once: these ops run ~50 times a decode step, and an environment lookup each time cost ~5% of the
# shipped model's batch-1 step. (Tests switch it with monkeypatch.setattr.)
ALLOWED = os.environ.get("TANDEM_KERNELS", "").strip().lower() not in ("reference", "triton")


def _native(*tensors: torch.Tensor):
    """The compiled library when every tensor is a contiguous fp32 CPU tensor and native ops are allowed."""
    if not ALLOWED:
        return None
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            return None
    return native_cpu.library()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: variance in fp32, scaled by `weight` after the cast back."""
    lib = _native(x, weight)
    if lib is None or x.numel() == 0:
        return _torch_rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    lib.tandem_add_rms_norm_f32(x.data_ptr(), None, x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                x.numel() // hidden, hidden, eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a decoder layer's residual add and the norm after it, one pass."""
    lib = _native(x, delta, weight)
    if lib is None or x.numel() == 0 or x.shape != delta.shape:
        residual = x + delta
        return residual, _torch_rms_norm(residual, weight, eps)
    residual, out = torch.empty_like(x), torch.empty_like(x)
    hidden = x.shape[-1]
    lib.tandem_add_rms_norm_f32(x.data_ptr(), delta.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                out.data_ptr(), x.numel() // hidden, hidden, eps, torch.get_num_threads())
    return residual, out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate then up, as the fused projection writes them) -> silu(gate) * up [..., I]."""
    inter = gate_up.shape[-1] // 2
    lib = _native(gate_up)
    if lib is None or gate_up.numel() == 0:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    lib.tandem_silu_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                                torch.get_num_threads())
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, 1, D] (rotate-half style). On the native path x is
    rotated in place and returned: it may be a view into a wider row (the fused q/k/v projection's
    output), as long as each head's D values are contiguous and the heads of a row adjacent."""
    t, heads, d = x.shape
    lib = None
    if x.stride(2) == 1 and x.stride(1) == d and d % 2 == 0:
        lib = _native(cos, sin)
        if lib is not None and (x.dtype != torch.float32 or x.device.type != "cpu" or cos.shape != (t, 1, d)):
            lib = None
    if lib is None or t == 0:
        half = d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    lib.tandem_rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d,
                        torch.get_num_threads())
    return x


def argmax_rows(x: torch.Tensor) -> list[int]:
    """x [N, V] -> each row's argmax, as `x.argmax(-1).tolist()` (the first maximum; NaN wins)."""
    lib = _native(x)
    if lib is None or x.dim() != 2 or x.numel() == 0:
        return x.argmax(dim=-1).tolist()
    n = x.shape[0]
    out = (ctypes.c_int64 * n)()  # not a tensor: inside a decode step torch.empty + tolist cost ~50 us cold
    lib.tandem_argmax_f32(x.data_ptr(), n, x.shape[1], out, torch.get_num_threads())
    return out[:]


def masked_argmax(x: torch.Tensor, rows: list[int], words: torch.Tensor, vocab: int) -> list[int]:
    """For each of x's rows `rows` [.., V], the argmax among the tokens its bit mask (row i of the int32
    words [>= len(rows), W]) allows: what masking the row (apply_bitmask) and taking argmax gives (the first
    maximum; a NaN among the allowed tokens wins), without writing the row, except where that would leave
    the grammar: allowed tokens all -inf give the first allowed one (not token 0), and none allowed -1."""
    lib = _native(x)
    n = len(rows)
    if lib is None or x.dim() != 2 or words.dtype != torch.int32 or not words.is_contiguous() or not words.is_cpu:
        if not n:
            return []
        allowed = unpack_bitmask(words[:n].to(x.device), vocab)[:, :x.shape[1]]
        part = x[torch.tensor(rows, dtype=torch.long, device=x.device), :allowed.shape[1]]
        part = part.masked_fill(~allowed, float("-inf"))
        first = allowed.int().argmax(-1)  # the first allowed token (0 where none is)
        best = torch.where(part.amax(-1) == float("-inf"), first, part.argmax(-1))  # a NaN row: amax is NaN
        return torch.where(allowed.any(-1), best, -1).tolist()
    if n and not 0 <= min(rows) <= max(rows) < x.shape[0]:
        raise ValueError(f"masked_argmax: rows {rows} outside x's {x.shape[0]} rows")
    out = (ctypes.c_int64 * n)()  # ctypes arrays: torch tensors cost ~10 us to make and read back
    lib.tandem_masked_argmax_f32(x.data_ptr(), x.stride(0), x.shape[1], (ctypes.c_int64 * n)(*rows), n,
                                 words.data_ptr(), words.shape[-1], vocab, out)
    return out[:]


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bit masks [N, W] -> bool [N, vocab] (bit b of word w is token 32 w + b)."""
    return ((words.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :vocab].bool()


def apply_bitmask(x: torch.Tensor, words: torch.Tensor, vocab: int, rows: list[int] | None = None) -> None:
    """In place: x [N, V'] (V' >= vocab) gets -inf where a bitmask row of `words` [M, W] has a token's
    bit clear, and in every column >= vocab, in x's rows `rows` (M of them; default all, M = N)."""
    lib = _native(x)
    if lib is None or x.dim() != 2 or not words.is_contiguous() or words.dtype != torch.int32:
        target = slice(None) if rows is None else torch.tensor(rows, device=x.device)
        allowed = unpack_bitmask(words, vocab).to(x.device)
        n = allowed.shape[1]
        part = x[target]
        part[:, :n] = part[:, :n].masked_fill(~allowed, float("-inf"))
        part[:, n:] = float("-inf")
        x[target] = part
        return
    ids = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    if ids is not None and (ids.numel() != words.shape[0] or (ids.numel() and not 0 <= int(ids.min()) <= int(
            ids.max()) < x.shape[0])):
        raise ValueError(f"apply_bitmask: {words.shape[0]} mask rows for x rows {rows}")
    lib.tandem_apply_bitmask_f32(x.data_ptr(), words.shape[0], x.shape[1], x.stride(0), words.data_ptr(),
                                 words.shape[1], vocab, None if ids is None else ids.data_ptr())
