"""CUDA graphs of the decode forward: one captured graph per padded batch size, replayed each step.

On a GPU a small model's decode step is bound by launching kernels from Python, not by the GPU
(bench.decode_profile on an H100, the 55M Llama at batch 1: 215 kernel launches and 5.0 ms per step,
the GPU busy 0.55 ms of it). A graph replays a whole forward with one launch. Steps that use one:
every scheduled request decodes one token (no prefill rows, no speculative queries), at most
SIZES[-1] of them, and nothing watches the forward per layer (no P/D layer hook, no hidden states
kept for a speculator). The batch is padded to the next captured size with rows that write no K/V
(slot -1) and attend one token of block 0; their outputs are never read.

The graph reads its inputs from static buffers the step copies into (token ids, positions, slots,
block tables at the full width of max_model_len, sequence lengths); its output tensor is reused by
the next replay, so callers consume it before the next step. Each size is captured the first time
a step needs it (Triton compiles and cuBLAS warms up on a side stream first), all into one memory
pool. `capture=False` runs the same padded buffers eagerly: the CPU tests check the padding that way.
`EngineConfig.enforce_eager` (vLLM's name) turns graphs off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.attention import AttentionMetadata

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (capture=False)
    hidden: torch.Tensor | None  # the graph's output buffer, [size, hidden]
    meta: AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, ops, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 device: torch.device, max_blocks_per_seq: int, capture: bool = True) -> None:
        self.model, self.ops, self.kv_caches, self.kv_scales = model, ops, kv_caches, kv_scales
        self.capture = capture
        n = SIZES[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Captured] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and the profile read it)

    def fits(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None) -> bool:
        """The graphs baked these cache tensors' addresses in: any other tensors need new graphs."""
        return kv_caches is self.kv_caches and kv_scales is self.kv_scales

    @staticmethod
    def size_for(batch: int) -> int | None:
        return next((s for s in SIZES if s >= batch), None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int]) -> torch.Tensor:
        """The decode forward of len(input_ids) one-token queries; returns hidden states [batch, hidden]."""
        b = len(input_ids)
        size = self.size_for(b)
        assert size is not None and all(len(t) <= self.tables.shape[1] for t in tables)
        width = max(len(t) for t in tables)
        # One host-to-device copy per buffer. Pad rows: slot -1 (no K/V written), one token of block 0.
        # Table entries past a row's blocks point at block 0, as the eager path's do: the Triton kernels
        # never read them, but the reference decode op gathers (and masks) a bucket's whole span, and a
        # stale entry's freed block may hold non-finite values that a mask cannot hide (NaN * 0).
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * (size - b)))
        self.positions[:size].copy_(torch.tensor(positions + [0] * (size - b)))
        self.slots[:size].copy_(torch.tensor(slots + [-1] * (size - b)))
        self.lens[:size].copy_(torch.tensor(lens + [1] * (size - b), dtype=torch.int32))
        self.tables[:b, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
        self.tables[b:size, 0] = 0
        self.tables[:size, width:] = 0
        captured = self.graphs.get(size) or self._capture(size)
        self.replays += 1
        if captured.graph is None:  # eager: a fresh metadata object, as the reference ops cache their plan
            return self.model(self.input_ids[:size], self.positions[:size], self._meta(size))[:b]  # by identity
        captured.graph.replay()
        return captured.hidden[:b]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            ops=self.ops, kv_caches=self.kv_caches, kv_scales=self.kv_scales, slot_mapping=self.slots[:size],
            num_decode_seqs=size, decode_query_len=1, decode_block_tables=self.tables[:size],
            decode_seq_lens=self.lens[:size], prefill_block_tables=None, prefill_query_start_loc=None,
            prefill_seq_lens=None, layer_hook=None)

    def _capture(self, size: int) -> _Captured:
        meta = self._meta(size)
        if not self.capture:
            self.graphs[size] = _Captured(None, None, meta)
            return self.graphs[size]
        # Capture with harmless inputs (the step's own are copied in after): no K/V written, every row
        # attends token 0 of block 0. The step's inputs are already in the first rows, so save them.
        saved = [t[:size].clone() for t in (self.input_ids, self.positions, self.slots, self.lens)]
        saved_tables = self.tables[:size].clone()
        self.slots[:size] = -1
        self.lens[:size] = 1
        self.tables[:size] = 0
        ids, pos = self.input_ids[:size], self.positions[:size]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles and warms up outside the capture
            for _ in range(2):
                self.model(ids, pos, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, pos, meta)
        self.pool = graph.pool()
        for buf, value in zip((self.input_ids, self.positions, self.slots, self.lens), saved):
            buf[:size].copy_(value)
        self.tables[:size].copy_(saved_tables)
        self.graphs[size] = _Captured(graph, hidden, meta)
        return self.graphs[size]


def graphs_for(runner, decode: list, prefill: list, decode_q: int) -> DecodeGraphs | None:
    """The runner's graphs when this step can replay one (one-token decode queries only, nothing
    watching the forward per layer: P/D layer hook, hidden states for a speculator), else None."""
    if (not runner.use_graphs or prefill or not decode or decode_q != 1 or runner.keep_hidden
            or runner.hidden_layers or runner.layer_hook is not None or DecodeGraphs.size_for(len(decode)) is None):
        return None
    graphs = runner.decode_graphs
    if graphs is None or not graphs.fits(runner.kv_caches, runner.kv_scales):
        graphs = runner.decode_graphs = DecodeGraphs(runner.model, runner.ops, runner.kv_caches, runner.kv_scales,
                                                     runner.device, runner.max_blocks_per_seq,
                                                     capture=runner.device.type == "cuda")
    return graphs
