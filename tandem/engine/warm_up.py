"""Warm-up at start: what a first request would wait for, done before the engine takes one — on a GPU the
Triton kernels compiled and the decode CUDA graphs captured (vLLM captures its graphs at start too), on a
CPU oneDNN's primitives for the prompt sizes made.

Why: Triton compiles a kernel on its first call with each specialization — integer arguments are
specialized on being 1 and on divisibility by 16, a block table's width (its row stride) among them —
and tandem/engine/cuda_graphs.py captures a graph the first time a step needs its (batch size, query
length). Served on an H100, the first second of requests waited for both: at 8 req/s, first chunk p90
860 ms without the warm-up, 22.5 ms with it (docs/PERFORMANCE.md, session 24), the delay before the
prefill worker took the request.

On a CPU oneDNN builds a primitive per linear shape and row count (tandem/layers/linear.py buckets the
counts past 64), ~0.9 ms each: the shipped model's first prompt of each new size paid ~2.5-5 ms (17 prompts
of distinct sizes: 178-199 ms cold, 123-125 ms warmed; 0.41 s of warm-up, 0.72 s for the 55M Llama). So
each decoder-layer linear shape runs once at every row count a prompt up to CPU_WARM_ROWS tokens uses, the
speculator's too (a draft model's layers, an EAGLE head's fc and layer: its catch-up over a new prompt runs
them at the prompt's size). Not the lm_head's row counts: a prompt's logits are its last row's (and their
compute would dominate: ~3 s for the 55M Llama); its packed weight is made, which a batch of more than 8
sampling rows reads.

Nothing is written to the cache: every row's slot is -1 (no K/V stored), every table points at block 0,
and the outputs are dropped. The GPU steps run on a CPU only when forced (the tests force them, with
graphs that run eagerly).
"""

from __future__ import annotations

import time

import structlog
import torch

from tandem.engine.cuda_graphs import SIZES, DecodeGraphs, graphs_of
from tandem.layers import linear as linear_mod
from tandem.layers.attention import AttentionMetadata

log = structlog.get_logger(__name__)
TABLE_WIDTHS = (1, 2, 16)  # a block table's width specializes the kernels: 1, a multiple of 16, neither
CPU_WARM_ROWS = 512  # past it a prefill step is long enough that a primitive's ~1 ms hardly shows


@torch.inference_mode()
def warm_up(runner, query_lens: tuple[int, ...] = (1,), spec_batch: int = SIZES[-1], force: bool = False,
            extra: tuple[torch.nn.Module, ...] = ()) -> float:
    """GPU (or `force`): compile the attention kernels for each kind of step and capture the decode graphs
    of every batch size (query length 1; longer query lengths `query_lens`, a speculator's verification
    steps, up to `spec_batch` requests). CPU: oneDNN's primitives (module doc) for the target's layers and
    `extra` (a speculator's: Speculator.warm_modules). The seconds it took."""
    start = time.perf_counter()
    rows = onednn_row_counts(runner.model.model.layers, *extra) if runner.device.type == "cpu" else []
    if rows:  # a step sampling more than SMALL_BATCH rows reads the lm_head packed: packed now, not by that step
        runner.model.lm_head.packed_weight()
    widths, captured = _gpu_steps(runner, query_lens, spec_batch) if runner.device.type == "cuda" or force else ([], 0)
    seconds = time.perf_counter() - start
    log.info("warmed up", seconds=round(seconds, 3), onednn_row_counts=len(rows), table_widths=widths, graphs=captured)
    return seconds


def _gpu_steps(runner, query_lens: tuple[int, ...], spec_batch: int) -> tuple[list[int], int]:
    """The GPU half of warm_up: (the table widths compiled for, the graphs captured)."""
    widths = [w for w in TABLE_WIDTHS if w <= runner.max_blocks_per_seq]
    for width in widths:
        n = (width - 1) * runner.block_size + 1  # a prompt that fills `width` blocks' table
        _forward(runner, width, n, decode=True)  # a mixed step: one decode row and a prompt
        # a prompt alone, its last row sampled (the last layer narrowed to it, unless hidden states are kept)
        _forward(runner, width, n, decode=False, narrow=not (runner.keep_hidden or runner.hidden_layers))
    graphs = graphs_of(runner) if runner.use_graphs else None
    captured, widest = 0, DecodeGraphs.size_for(max(spec_batch, 1)) or SIZES[-1]
    for q in sorted(set(query_lens) | {1}):
        for size in SIZES:
            if graphs is None or graphs.failed:
                break
            if (q == 1 or size <= widest) and DecodeGraphs.size_for(size, q) == size and (size, q) not in graphs.graphs:
                captured += graphs.capture_size(size, q)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return widths, captured


def _forward(runner, width: int, n: int, decode: bool, narrow: bool = False) -> None:
    """One eager forward over dummy rows: [1 decode row +] a prompt of n tokens, tables `width` wide."""
    dev, rows = runner.device, n + int(decode)
    table = torch.zeros((1, width), dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        ops=runner.ops, kv_caches=runner.kv_caches, kv_scales=runner.kv_scales,
        slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=dev),
        num_decode_seqs=int(decode), decode_query_len=1, decode_block_tables=table if decode else None,
        decode_seq_lens=one if decode else None, prefill_block_tables=table,
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), layer_hook=None,
        **(dict(out_rows=torch.tensor([rows - 1], device=dev), out_block_tables=table,
                out_seq_lens=torch.tensor([n], dtype=torch.int32, device=dev)) if narrow else {}))
    positions = ([0] if decode else []) + list(range(n))
    hidden = runner.forward(torch.zeros(rows, dtype=torch.long, device=dev), torch.tensor(positions, device=dev), meta)
    runner.model.compute_logits(hidden[-1:])


def onednn_row_counts(*trees: torch.nn.Module, max_rows: int = CPU_WARM_ROWS) -> list[int]:
    """Run each distinct linear shape in the module `trees` once at every oneDNN row count of a prompt up to
    max_rows tokens (small batches take the C kernels); the row counts, [] without oneDNN."""
    if linear_mod.backend() != "onednn":
        return []
    shapes: dict[tuple, linear_mod.Linear] = {}
    for module in (m for tree in trees for m in tree.modules()):
        if isinstance(module, linear_mod.Linear) and module.weight.is_cpu:
            # A primitive serves every module of its shape, a packed weight only its own: the other layers'
            # (and an EAGLE head's, shaped as the target's) were packed by the first prompt (~3 ms on the head).
            module.packed_weight()
            shapes.setdefault((module.in_features, module.out_features, module.weight.dtype), module)
    rows = sorted({linear_mod.bucket_rows(n) for n in range(linear_mod.SMALL_BATCH + 1, max_rows + 1)})
    for module in shapes.values():
        for n in rows:
            module(torch.zeros((n, module.in_features), dtype=module.weight.dtype))
    return rows
