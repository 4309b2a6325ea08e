"""CUDA graphs of the decode forward: one captured graph per (padded batch size, query length), replayed.

On a GPU a small model's decode step is bound by launching kernels from Python, not by the GPU
(bench.decode_profile on an H100, the 55M Llama at batch 1: 215 kernel launches and 5.0 ms per step,
the GPU busy 0.55 ms of it; replayed as a graph, 0.89 ms). Steps that use one: every scheduled request
is in the decode group (no prefill rows) with the group's query length Q (1, or 1 + proposals when
speculating: decode_group.py pads ragged queries to one Q), at most SIZES[-1] requests and MAX_ROWS
rows, and nothing watches the forward per layer (no P/D layer hook). The graph holds the runner's
whole forward, the EAGLE hidden-state cache writes included (ModelRunner.forward). The batch is
padded to the next size in SIZES with requests that write no K/V (slot -1) and attend Q tokens of
block 0; their outputs are never read.

The graph reads its inputs from static buffers the step copies into (token ids, positions, slots,
block tables at the full width of max_model_len, sequence lengths); its output tensor is reused by
the next replay, so callers consume it before the next step. Each (size, Q) is captured the first
time a step needs it (Triton compiles and cuBLAS warms up on a side stream first), all into one memory
pool. `capture=False` runs the same padded buffers eagerly: the CPU tests check the padding that way.
A capture the driver refuses (an op that talks to the host mid-forward, say a plugin's quantizer that
reads a value back) turns graphs off for these caches with a warning, and steps run eagerly: nothing
is lost but speed. `EngineConfig.enforce_eager` (vLLM's name) turns graphs off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from tandem.engine.decode_group import MAX_DECODE_QUERY_LEN
from tandem.layers.attention import AttentionMetadata

log = structlog.get_logger(__name__)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # up to the default max_num_seqs (vLLM captures up to 512)
MAX_ROWS = 256  # size x Q of the largest graph: past it a step is long enough to launch eagerly


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (capture=False)
    hidden: torch.Tensor | None  # the graph's output buffer, [size * Q, hidden]


class DecodeGraphs:
    def __init__(self, forward, ops, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 device: torch.device, max_blocks_per_seq: int, capture: bool = True) -> None:
        """forward(input_ids, positions, meta) -> hidden states: what a graph captures."""
        self.forward, self.ops, self.kv_caches, self.kv_scales = forward, ops, kv_caches, kv_scales
        self.capture = capture
        n, rows = SIZES[-1], min(MAX_ROWS, SIZES[-1] * MAX_DECODE_QUERY_LEN)
        # Token ids, positions and slots are views of one device tensor, filled by one copy a step. Every copy in
        # comes from a pinned host tensor, asynchronously (the host allocator keeps its block until the copy has
        # run): copies from fresh pageable tensors made the host wait for the GPU at each (an H200, 55M Llama,
        # batch 1: 6 copies and 6 synchronizations, ~70 us each, of a 0.9 ms step).
        self.rows, self.pinned = rows, device.type == "cuda"
        self._ids_pos_slots = torch.zeros(3 * rows, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots = self._ids_pos_slots.view(3, rows).unbind()
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and the profile read it)
        self.failed = False  # a capture failed: these caches' steps run eagerly

    def fits(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None) -> bool:
        """The graphs baked these cache tensors' addresses in: any other tensors need new graphs."""
        return kv_caches is self.kv_caches and kv_scales is self.kv_scales

    @staticmethod
    def size_for(batch: int, q: int = 1) -> int | None:
        size = next((s for s in SIZES if s >= batch), None)
        return size if size is not None and size * q <= MAX_ROWS else None

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int], q: int = 1) -> torch.Tensor | None:
        """The decode forward of len(tables) queries of q tokens each (input rows request by request):
        hidden states [len(input_ids), hidden]; None if the graph could not be captured (run it eagerly)."""
        b, rows = len(tables), len(input_ids)
        size = self.size_for(b, q)
        assert size is not None and rows == b * q and all(len(t) <= self.tables.shape[1] for t in tables)
        self._copy_in(input_ids, positions, slots, tables, lens, size, q)
        captured = self.graphs.get((size, q)) or self._capture(size, q)
        if captured is None:
            return None
        self.replays += 1
        if captured.graph is None:  # eager, with fresh metadata: the reference ops cache their plan by identity
            return self.forward(self.input_ids[:size * q], self.positions[:size * q], self._meta(size, q))[:rows]
        captured.graph.replay()
        return captured.hidden[:rows]

    def _copy_in(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                 lens: list[int], size: int, q: int) -> None:
        """The step's inputs into the static buffers: three asynchronous copies from pinned memory. Pad requests:
        slots -1 (no K/V written), Q tokens of block 0. Table entries past a row's blocks point at block 0, as the
        eager path's do: the Triton kernels never read them, but the reference decode op gathers (and masks) a
        bucket's whole span, and a stale entry's freed block may hold non-finite values that a mask cannot hide
        (NaN * 0)."""
        b, pad, width = len(tables), [0] * (self.rows - len(input_ids)), max(len(t) for t in tables)
        flat = input_ids + pad + positions + pad + slots + [-1] * len(pad)
        self._ids_pos_slots.copy_(torch.tensor(flat, pin_memory=self.pinned), non_blocking=True)
        self.lens[:size].copy_(torch.tensor(lens + [q] * (size - b), dtype=torch.int32, pin_memory=self.pinned),
                               non_blocking=True)
        self.tables[:b, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                                   pin_memory=self.pinned), non_blocking=True)
        self.tables[b:size, 0] = 0
        self.tables[:size, width:] = 0

    def _meta(self, size: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            ops=self.ops, kv_caches=self.kv_caches, kv_scales=self.kv_scales, slot_mapping=self.slots[:size * q],
            num_decode_seqs=size, decode_query_len=q, decode_block_tables=self.tables[:size],
            decode_seq_lens=self.lens[:size], prefill_block_tables=None, prefill_query_start_loc=None,
            prefill_seq_lens=None, layer_hook=None)

    def capture_size(self, size: int, q: int) -> bool:
        """Capture (size, q) now (warm_up.py), not at the first step that needs it; False if it failed."""
        return self._capture(size, q) is not None

    def _capture(self, size: int, q: int) -> _Captured | None:
        """Capture with harmless inputs (no K/V written; every request attends Q tokens of block 0),
        then put back the step's own, already copied in. None (and `failed`) if the capture fails."""
        if not self.capture:
            self.graphs[(size, q)] = _Captured(None, None)
            return self.graphs[(size, q)]
        bufs = (self.input_ids[:size * q], self.positions[:size * q], self.slots[:size * q], self.lens[:size],
                self.tables[:size])
        saved = [t.clone() for t in bufs]
        self.slots[:size * q] = -1
        self.lens[:size] = q
        self.tables[:size] = 0
        try:
            self.graphs[(size, q)] = self._record(bufs[0], bufs[1], self._meta(size, q))
        except RuntimeError as exc:
            self.failed = True
            log.warning("CUDA graph capture failed: decode steps run eagerly", batch=size, query_len=q,
                        error=str(exc)[:300])
            return None
        finally:
            for buf, value in zip(bufs, saved):
                buf.copy_(value)
        return self.graphs[(size, q)]

    def _record(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> _Captured:
        graph, hidden = record(lambda: self.forward(ids, pos, meta), self.pool)
        self.pool = graph.pool()
        return _Captured(graph, hidden)


def record(fn, pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn() run twice on a side stream (Triton compiles, cuBLAS warms up: outside the capture), then captured
    into the memory pool `pool` (None: a new one): (the graph, fn's output, which each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def graphs_for(runner, decode: list, prefill: list, decode_q: int) -> DecodeGraphs | None:
    """The runner's graphs when this step can replay one (decode rows only, none of them a new short prompt —
    a graph per prompt length captured at first use would cost more than it saves —, a size it may capture,
    nothing watching the forward per layer: a P/D layer hook), else None."""
    if (not runner.use_graphs or prefill or not decode or runner.layer_hook is not None
            or DecodeGraphs.size_for(len(decode), decode_q) is None
            or any(s.request.num_computed_tokens == 0 for s in decode)):
        return None
    graphs = runner.decode_graphs
    if graphs is not None and graphs.failed and graphs.fits(runner.kv_caches, runner.kv_scales):
        return None
    return graphs_of(runner)


def graphs_of(runner) -> DecodeGraphs:
    """The runner's graphs for its current caches, made (empty) if it has none for them."""
    graphs = runner.decode_graphs
    if graphs is None or not graphs.fits(runner.kv_caches, runner.kv_scales):
        graphs = runner.decode_graphs = DecodeGraphs(runner.forward, runner.ops, runner.kv_caches, runner.kv_scales,
                                                     runner.device, runner.max_blocks_per_seq,
                                                     capture=runner.device.type == "cuda")
    return graphs
