"""A step's attention inputs for the eager forward: block tables, sequence lengths and query starts of
its decode and prefill groups, as the kernels take them (kernels/README.md). The CUDA graphs build
the same from static buffers (tandem/engine/cuda_graphs.py)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.scheduler import ScheduledRequest
from tandem.layers.attention import AttentionMetadata


def held(block_ids: list[int]) -> list[int]:
    """A request's blocks for the kernels' table: positions released behind a sliding window
    (NULL_BLOCK, a leading run) point at block 0, which the window masks out (the kernels never read
    them; the reference decode op may gather and mask them when it pads a bucket)."""
    if block_ids and block_ids[0] < 0:
        return [max(b, 0) for b in block_ids]
    return block_ids


def block_table(group: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    width = max(len(s.request.block_ids) for s in group)
    table = [held(s.request.block_ids) + [0] * (width - len(s.request.block_ids)) for s in group]
    return torch.tensor(table, dtype=torch.int32, device=device)


def seq_lens(group: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    lens = [s.request.num_computed_tokens + s.num_new_tokens for s in group]
    return torch.tensor(lens, dtype=torch.int32, device=device)


def start_loc(group: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    loc = [0]
    for s in group:
        loc.append(loc[-1] + s.num_new_tokens)
    return torch.tensor(loc, dtype=torch.int32, device=device)


def out_rows(sample_rows: list[tuple[ScheduledRequest, int, int]], positions: list[int],
             device: torch.device) -> dict[str, torch.Tensor]:
    """AttentionMetadata's out_rows fields for the rows that sample: (request, first row, rows) each."""
    rows = [i for _, start, k in sample_rows for i in range(start, start + k)]
    tables = [held(s.request.block_ids) for s, _, k in sample_rows for _ in range(k)]
    width = max((len(t) for t in tables), default=1)
    return dict(
        out_rows=torch.tensor(rows, dtype=torch.long, device=device),
        out_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int32,
                                      device=device)[:len(rows)],
        out_seq_lens=torch.tensor([positions[i] + 1 for i in rows], dtype=torch.int32, device=device),
    )


def step_metadata(runner: Any, decode: list[ScheduledRequest], prefill: list[ScheduledRequest], decode_q: int,
                  slots: list[int], rows: dict[str, torch.Tensor] | None = None) -> AttentionMetadata:
    """The metadata of one eager step: the decode group's rows first, then the prefill group's; `rows`
    (out_rows()): the last layer computes only those."""
    dev = runner.device
    return AttentionMetadata(
        ops=runner.ops, kv_caches=runner.kv_caches, kv_scales=runner.kv_scales,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        num_decode_seqs=len(decode), decode_query_len=decode_q,
        decode_block_tables=block_table(decode, dev) if decode else None,
        decode_seq_lens=seq_lens(decode, dev) if decode else None,
        prefill_block_tables=block_table(prefill, dev) if prefill else None,
        prefill_query_start_loc=start_loc(prefill, dev) if prefill else None,
        prefill_seq_lens=seq_lens(prefill, dev) if prefill else None,
        layer_hook=runner.layer_hook,
        hidden_layers=runner.hidden_layers,
        **(rows or {}),
    )
