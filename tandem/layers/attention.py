"""Paged attention layer: project, rotate, store K/V into the paged cache, attend through kernels/.

A step's tokens are packed as [decode group | prefill group]. The decode group is the first
`num_decode_seqs` sequences, each with exactly `decode_query_len` new tokens (1, or k+1 when verifying
speculated tokens); they attend purely from the cache. Everything after is variable-length prefill
(new prompts, chunks, recomputation) over cached prefix + itself. A layer with a sliding window
(Mistral; Qwen2/Qwen3 layers marked "sliding_attention") passes it to both kernels: a query at
position p sees keys in (p - window, p].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kernels import KernelOps
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import rotate


@dataclass(slots=True)
class AttentionMetadata:
    ops: KernelOps
    kv_caches: list[torch.Tensor]
    kv_scales: list[torch.Tensor] | None
    slot_mapping: torch.Tensor  # [T]
    num_decode_seqs: int
    decode_query_len: int
    decode_block_tables: torch.Tensor | None  # [Bd, M]
    decode_seq_lens: torch.Tensor | None  # [Bd]
    prefill_block_tables: torch.Tensor | None  # [Bp, M]
    prefill_query_start_loc: torch.Tensor | None  # [Bp + 1], relative to the prefill group
    prefill_seq_lens: torch.Tensor | None  # [Bp]
    layer_hook: Callable[[int], None] | None = None  # called after a layer's K/V is in the cache
    # The rows whose final hidden states the step uses (the rows that sample), when that is fewer than
    # all: the last layer stores every row's K/V, then attends, projects and runs its MLP for these rows
    # only, each as a one-token query over the cache (its K/V and its prefix's are there by then). A
    # prompt's other rows feed nothing after that layer's K/V. None: every row.
    out_rows: torch.Tensor | None = None  # [K] ascending row indices
    out_block_tables: torch.Tensor | None = None  # [K, M]: each row's sequence's blocks
    out_seq_lens: torch.Tensor | None = None  # [K]: each row's position + 1
    # Cache layers after the model's that keep each token's final hidden state (tandem/engine/hidden_cache.py,
    # for EAGLE): the runner stores them after the model, unless a small decode step's C call did
    # (fused_model.run_model), which then sets hidden_stored.
    hidden_layers: int = 0
    hidden_stored: bool = False
    # Structured outputs on a CPU: (a ctypes array of one address per row, 0 or the int32 bit mask the row's
    # argmax is taken under; int32 words a mask) for a small decode step's C call (fused_model.run_model).
    argmax_masks: tuple[Any, int] | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs * self.decode_query_len


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = cfg.layer_windows[layer_idx]  # sliding-window attention: keys within the last `window`
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # One fused projection: three small matmuls cost more than one on CPU.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, out_rows_only: bool = False) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with `out_rows_only`, [K, hidden] for meta.out_rows."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent in the fused output: rotate them as one [T, H + Hkv, D] tensor
            # (half the small ops of rotating each; the arithmetic is the same per element).
            qk = rotate(qkv[:, :self.q_size + self.kv_size].reshape(t, self.num_heads + self.num_kv_heads,
                                                                      self.head_dim), rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, :self.q_size].reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(t, self.num_kv_heads,
                                                                                   self.head_dim))
            q, k = rotate(q, rope), rotate(k, rope)
        ops = meta.ops
        cache = meta.kv_caches[self.layer_idx]
        scales = meta.kv_scales[self.layer_idx] if meta.kv_scales is not None else None
        ops.store_kv(k, v, cache, meta.slot_mapping, scales)
        if meta.layer_hook is not None:
            meta.layer_hook(self.layer_idx)
        if out_rows_only:
            return self._out_rows(q, ops, cache, scales, meta)
        nd = meta.num_decode_tokens
        if nd == t:
            out = self._decode(q, ops, cache, scales, meta)
        elif nd == 0:
            out = ops.prefill_attention(q, k, v, cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                        meta.prefill_seq_lens, self.scale, scales, window=self.window)
        else:
            out = torch.cat([
                self._decode(q[:nd], ops, cache, scales, meta),
                ops.prefill_attention(q[nd:], k[nd:], v[nd:], cache, meta.prefill_block_tables,
                                      meta.prefill_query_start_loc, meta.prefill_seq_lens, self.scale, scales,
                                      window=self.window),
            ])
        return self.o_proj(out.reshape(t, self.q_size))

    def _out_rows(self, q, ops, cache, scales, meta: AttentionMetadata) -> torch.Tensor:
        rows = meta.out_rows
        assert rows is not None
        if not len(rows):  # a step that samples nothing (a prompt's middle chunk): K/V was all it needed
            return q.new_empty((0, self.o_proj.weight.shape[0]))
        q = q.index_select(0, rows).reshape(len(rows), 1, self.num_heads, self.head_dim)
        out = ops.paged_decode_attention(q, cache, meta.out_block_tables, meta.out_seq_lens, self.scale, scales,
                                         window=self.window)
        return self.o_proj(out.reshape(len(rows), self.q_size))

    def _decode(self, q, ops, cache, scales, meta: AttentionMetadata) -> torch.Tensor:
        b, ql = meta.num_decode_seqs, meta.decode_query_len
        out = ops.paged_decode_attention(q.reshape(b, ql, self.num_heads, self.head_dim), cache,
                                         meta.decode_block_tables, meta.decode_seq_lens, self.scale, scales,
                                         window=self.window)
        return out.reshape(b * ql, self.num_heads, self.head_dim)
