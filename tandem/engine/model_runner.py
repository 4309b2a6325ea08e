"""ModelRunner: owns the model weights and the paged KV cache tensors; turns a SchedulerOutput into
one forward pass (positions, slot mapping, block tables) and samples the rows that caught up.

Row order is [decode group | prefill group] (see tandem/layers/attention.py); sampled tokens are
returned per request id, so the order never leaks out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from kernels import get_ops
from tandem.engine import grammar_rows, hidden_cache, logits_processors, sampler, spec_decode, structured
from tandem.engine.cuda_graphs import DecodeGraphs, graphs_for
from tandem.engine.decode_group import MAX_DECODE_QUERY_LEN, decode_group
from tandem.engine.interfaces.kv_quantizer import KVQuantizer, NoQuantizer
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.step_inputs import held, out_rows, step_metadata
from tandem.layers.attention import AttentionMetadata
from tandem.models.loader import load_model


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, list[int]]
    logits: dict[str, torch.Tensor]  # the rows sampled from, per request (kept for logprobs/speculation)
    # With `keep_hidden`: request id -> (position of its first row, final hidden states [n, H]) of every
    # token the step computed, speculated ones included (an EAGLE head drafts from them).
    hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 block_size: int, seed: int = 0, kv_quantizer: KVQuantizer | None = None,
                 cuda_graphs: bool = True) -> None:
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.model = load_model(model_path, dtype, device, max_model_len + MAX_DECODE_QUERY_LEN)
        self.config = self.model.config
        self.ops = get_ops(device)
        # Decode steps replay CUDA graphs on a GPU (tandem/engine/cuda_graphs.py), made on first use; the
        # reference ops read sequence lengths on the host, which a graph cannot.
        self.use_graphs = cuda_graphs and device.type == "cuda" and self.ops.name == "triton"
        self.decode_graphs: DecodeGraphs | None = None
        self.max_blocks_per_seq = -(-(max_model_len + MAX_DECODE_QUERY_LEN) // block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor] | None = None
        # KV cache storage format (plugins/quantizers.py): cache dtype, optional per-token-head scales
        # and the true bytes per block. None = the model's dtype, no scales.
        self.kv_quantizer = kv_quantizer if kv_quantizer is not None else NoQuantizer()
        self.generator = torch.Generator().manual_seed(seed)
        self.layer_hook: Callable[[int], None] | None = None
        # Speculative decoding: the engine leaves the draft distributions of sampled proposals here
        # each step (absent = deterministic proposal); `_sample` verifies and counts.
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.spec_stats = spec_decode.SpecStats()
        self.keep_hidden = False  # set by the engine when its speculator reads the target's hidden states
        self.hidden_layers = 0  # cache layers after the model's that keep them (tandem/engine/hidden_cache.py)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        decode_q, decode = decode_group(out.scheduled, pad=self.config.sliding_window is None)
        in_decode = {id(s) for s in decode}
        prefill = [s for s in out.scheduled if id(s) not in in_decode]
        input_ids, positions, slots, sample_rows, spans = [], [], [], [], []
        bs = self.block_size
        for s in decode + prefill:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            pad = decode_q - n if id(s) in in_decode else 0
            if pad:  # computed tokens in front of a short query: attended, their K/V not written (slot -1)
                input_ids += r.token_ids[start - pad:start]
                positions += range(start - pad, start)
                slots += [-1] * pad
            if self.keep_hidden:  # only a speculator that reads hidden states pays for this, per row
                spans.append((r.request_id, start, len(input_ids), n))
            toks = r.token_ids[start:start + n]
            if len(toks) < n:  # speculated tokens are not part of token_ids until accepted
                toks = toks + s.spec_token_ids[: n - len(toks)]
            input_ids.extend(toks)
            pos = range(start, start + n)
            positions.extend(pos)
            bt = r.block_ids
            slots.extend(bt[p // bs] * bs + p % bs for p in pos)
            if s.samples:
                k = 1 + len(s.spec_token_ids)
                sample_rows.append((s, len(input_ids) - k, k))
        dev = self.device
        plain_masks, argmax_masks = grammar_rows.start_masks(sample_rows, len(input_ids))  # before the model runs
        graphs, hidden = graphs_for(self, decode, prefill, decode_q), None
        if graphs is not None:
            hidden = graphs.run(input_ids, positions, slots, [held(s.request.block_ids) for s in decode],
                                [s.request.num_computed_tokens + s.num_new_tokens for s in decode], decode_q)
        narrow = False
        if hidden is None:  # eager: no graph for this step, or its capture failed
            # Prompt rows that do not sample need nothing past the last layer's K/V, unless the final
            # hidden states of every row are kept (EAGLE).
            narrow = bool(prefill) and not (self.keep_hidden or self.hidden_layers) and sum(
                k for _, _, k in sample_rows) < len(input_ids)
            rows = out_rows(sample_rows, positions, dev) if narrow else None
            meta = step_metadata(self, decode, prefill, decode_q, slots, rows)
            meta.argmax_masks = None if argmax_masks is None else argmax_masks[:2]
            hidden = self.forward(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta)
        # Copies where a speculator holding a few rows would keep a prompt's whole output alive, or where the
        # rows are a CUDA graph's output, which its next replay overwrites; a decode step's own are small.
        copy = graphs is not None or bool(prefill)
        kept = {rid: (start, hidden[row:row + n].clone() if copy else hidden[row:row + n])
                for rid, start, row, n in spans}
        return self._finish(hidden, sample_rows, plain_masks, kept, narrowed=narrow,
                            premasked=None if argmax_masks is None else argmax_masks[2])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model, then (for a speculator that reads them) its final hidden states into their cache layers."""
        hidden = self.model(input_ids, positions, meta)
        if self.hidden_layers and not meta.hidden_stored:
            hidden_cache.store_hidden(self.ops, self.kv_caches, self.kv_scales, hidden, meta.slot_mapping,
                                      self.hidden_layers, meta.layer_hook)
        return hidden

    def _finish(self, hidden: torch.Tensor, sample_rows: list, plain_masks: Any, kept: dict,
                narrowed: bool = False, premasked: torch.Tensor | None = None) -> StepResult:
        """Logits of the rows that sample, and the sampled tokens (`narrowed`: hidden holds just those;
        `premasked`: the masks of the greedy rows under a grammar, made by grammar_rows.start_masks)."""
        if not sample_rows:
            return StepResult({}, {}, kept)
        rows = [i for _, start, k in sample_rows for i in range(start, start + k)]
        if not narrowed and (len(rows) < hidden.shape[0] or rows[-1] != len(rows) - 1):  # else no copy
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        result = self._sample(sample_rows, logits, plain_masks, premasked)
        result.hidden = kept
        return result

    def _sample(self, sample_rows: list[tuple[ScheduledRequest, int, int]], logits: torch.Tensor,
                plain_masks: Any = None, premasked: torch.Tensor | None = None) -> StepResult:
        """logits holds k rows per request (k = 1 + speculated tokens). Plain requests sample their one
        row; speculating ones verify all k rows (tandem/engine/spec_decode.py). The logits returned per
        request are the rows of the tokens it emits (for logprobs)."""
        per_req, sampled, plain, offset = {}, {}, [], 0
        for s, _, k in sample_rows:
            rid, r = s.request.request_id, s.request
            if r.generator is not None:  # a seeded request draws from (seed, position): see position_seed
                r.generator.manual_seed(position_seed(r.params.seed, r.num_tokens))
            if not s.spec_token_ids:
                plain.append((r, offset))
                per_req[rid] = logits[offset:offset + 1]
            else:
                rows = logits_processors.process(logits[offset:offset + k], [r] * k,
                                                 [s.spec_token_ids[:j] for j in range(k)])
                if r.grammar is not None:  # row j under the grammar state the first j draft tokens lead to
                    r.grammar.sync(r.token_ids, r.num_prompt_tokens)
                    rows = rows.clone()  # it may be a view of the step's logits, kept raw for logprobs
                    structured.mask_rows(rows, r.grammar.allowed_along(s.spec_token_ids), r.grammar.vocab_size)
                toks = spec_decode.verify(rows, s.spec_token_ids, self.draft_probs.get(rid),
                                          r.params, r.generator or self.generator)
                emitted = spec_decode.truncate_at_stop(r, toks)
                self.spec_stats.record(len(s.spec_token_ids), len(toks) - 1, len(emitted))
                sampled[rid], per_req[rid] = emitted, logits[offset:offset + len(emitted)]
            offset += k
        self.draft_probs = {}
        if plain:
            reqs = [r for r, _ in plain]
            picked = [row for _, row in plain]
            # Every row, in order, and no masks to write into them: sample from logits as they
            # are (a copy of a batch-32 step's [32, 32000] logits costs 0.6 ms here).
            whole = plain_masks is None and len(picked) == logits.shape[0] and picked[-1] == len(picked) - 1
            rows = logits_processors.process(logits if whole else logits[picked], reqs)
            masked: list[int] = []
            if plain_masks is not None:  # structured outputs: only what each grammar allows next
                masked, pending = plain_masks
                structured.mask_rows(rows, pending.result(), pending.vocab_size, masked)  # rows: a copy
            held = getattr(self.model, "fused_argmax", None)  # the argmax of the very logits, unprocessed
            argmax = held[1] if held is not None and held[0] is rows else None  # (a grammar row's: under its mask)
            if any(r.grammar is not None for r in reqs):
                tokens = grammar_rows.tokens(reqs, rows, masked, partial(self._sample_rows, rows, reqs, argmax),
                                             self.generator, premasked, argmax)
            else:
                tokens = sampler.sample(rows, [r.params for r in reqs], [r.generator for r in reqs], self.generator,
                                        argmax)
            sampled.update((r.request_id, [t]) for r, t in zip(reqs, tokens))
        return StepResult(sampled, per_req)

    def _sample_rows(self, rows: torch.Tensor, reqs: list[Any], argmax: list[int] | None, picked: list[int]
                     ) -> list[int]:
        """sampler.sample over the rows `picked` of `rows` (one request each; `argmax`: each row's, taken by the
        forward's C call, or None)."""
        if argmax is not None and all(reqs[i].params.greedy for i in picked):  # no row to slice out
            return [argmax[i] for i in picked]
        part = rows if len(picked) == rows.shape[0] else rows[picked]
        return sampler.sample(part, [reqs[i].params for i in picked], [reqs[i].generator for i in picked],
                              self.generator, None if argmax is None else [argmax[i] for i in picked])

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token after the first given its prefix, in one cache-free pass."""
        return [row[t] for row, t in zip(self.prompt_logprobs(token_ids, 0), token_ids[1:])]

    def cached_hidden_states(self, block_ids: list[int], lo: int, hi: int) -> torch.Tensor | None:
        """The final hidden states of positions [lo, hi) of a sequence holding `block_ids`, as its
        forward passes (here, or on the prefill worker that sent its KV) left them in the cache; None
        without hidden-state layers or where a block is not held."""
        if not self.hidden_layers:
            return None
        return hidden_cache.read_hidden(self.kv_caches, self.kv_scales, block_ids, lo, hi, self.hidden_layers,
                                        self.config.hidden_size, self.dtype)

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """The final hidden states [n, H] of a token sequence, in one cache-free pass (no KV block is
        touched): for prompt log-probs, and for a speculator whose target states were never computed
        here (a prefix-cache hit, a prompt prefilled by another worker)."""
        n = len(token_ids)
        meta = AttentionMetadata(
            ops=self.ops, kv_caches=self.kv_caches, kv_scales=self.kv_scales,
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            num_decode_seqs=0, decode_query_len=0, decode_block_tables=None, decode_seq_lens=None,
            prefill_block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            prefill_seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
        )
        return self.model(torch.tensor(token_ids, device=self.device), torch.arange(n, device=self.device), meta)

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], top_n: int) -> list[dict[int, float]]:
        """For each token after the first: {token: logprob given its prefix} for it and the top_n most
        likely tokens there. One cache-free pass over the prompt (no KV block is touched), so it is the
        same whether the prompt's KV came from the prefix cache, a chunked prefill or a prefill worker."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.hidden_states(token_ids)
        rows: list[dict[int, float]] = []
        for start in range(0, n - 1, 256):  # [256, vocab] logits at a time, not [n, vocab]
            logp = torch.log_softmax(self.model.compute_logits(hidden[start:min(start + 256, n - 1)]).float(), dim=-1)
            chosen = logp.gather(1, ids[start + 1:start + 1 + logp.shape[0], None]).squeeze(1).tolist()
            top = logp.topk(top_n) if top_n > 0 else None
            for i, lp in enumerate(chosen):
                row = dict(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else {}
                row[int(token_ids[start + 1 + i])] = lp
                rows.append(row)
        return rows


def position_seed(seed: int, num_tokens: int, stream: int = 0) -> int:
    """The generator seed of a seeded request's sampling step that starts at sequence length
    `num_tokens`. A function of the sequence alone, not of the generator's history, so the same
    request continued elsewhere from the same tokens (the router's mid-stream migration, which sends
    prompt + tokens so far) draws exactly what it would have drawn uninterrupted. `stream` keeps
    independent draws apart (a draft model's proposals: 1; the target's sampling: 0)."""
    return hash((seed, num_tokens, stream)) & 0x7FFF_FFFF_FFFF_FFFF  # int tuples hash alike in every process
