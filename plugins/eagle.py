"""EagleRunner: the `eagle` speculator's machinery — an EAGLE head (tandem/models/eagle.py) drafting
from the target's own final hidden states, with its own paged KV cache kept in step with each request.

Head position p pairs the target's hidden state f[p] with the token t[p+1] (see tandem/models/eagle.py),
so after a request's tokens t[0..n-1] the head needs f[0..n-2]: exactly the states the target computed
for tokens that are now accepted. Per request it remembers how many head positions hold KV made from
real target states (`num_computed_tokens`) and the target states it has not consumed yet (handed over
by the engine after every forward pass: `observe`). One proposal of k tokens is k batched passes:

1. catch-up: the head positions from `num_computed_tokens` to n-2, from real target states; its last
   row's output (a predicted f[n-1]) gives the first draft token through the target's lm_head (or its
   rows of the head's draft vocabulary);
2. k-1 single-token passes, each feeding the previous draft token with the head's own predicted state.

A request far behind (a long prompt, or one a prefill worker computed: D's head has run on none of it)
catches up in one pass when no other stream runs beside it (alone, or with prompts that arrived with it),
else CATCH_UP_TOKENS head positions a step, shared by all such requests, undrafted until within one decode
query of its tokens: a whole 900-token prompt at once stalled a decode worker's other streams ~25 ms.

Drafted positions hold KV made from *predicted* states, so they are never kept: the next proposal
recomputes them from the real states the verification pass produced (EAGLE's rule). Target states
this runner was not handed — a prefix-cache hit, a prompt prefilled by a prefill worker, state
dropped for room or because too many piled up — are read from the target's hidden-state cache
layers, where every forward pass (here, or on the prefill worker, whose KV transfer carries them)
left them (tandem/engine/hidden_cache.py; `num_cache_reads`). Only positions whose blocks were
released behind a sliding window are recomputed, with one cache-free target pass over the prefix
(`num_recomputes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels import get_ops
from plugins.draft_graphs import DraftGraphs, eagle_chains
from plugins.draft_model import own_cache, padded, paged_metadata, sample_drafts
from plugins.eagle_fused import FusedDrafter
from tandem.engine.model_runner import MAX_DECODE_QUERY_LEN
from tandem.engine.request import Request
from tandem.models.config import ModelConfig
from tandem.models.eagle import load_head, rows_of

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner

# Target states held per request at most: a request that is not speculated for a long time (batch
# above spec_max_batch, a long chunked prompt) would otherwise pile up [tokens, hidden] floats.
MAX_HELD_STATES = 4096
# Head positions one step runs for requests catching up beside others (module doc): 2-3 ms a step on the shipped
# model here, about one EAGLE decode step (a whole 900-token prompt at once: ~24 ms; in shares of 64: ~40 ms in all).
CATCH_UP_TOKENS = 64


@dataclass(slots=True)
class _HeadSeq:
    """The head cache's view of one request; duck-types what KVCacheManager reads off a Request."""

    num_computed_tokens: int = 0  # head positions whose KV was made from the target's real hidden states
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    feat_start: int = 0  # position of features[0]
    features: torch.Tensor | None = None  # the target's final hidden states from feat_start on
    seen: bytearray | None = None  # a mark per head logit column of the tokens seen (_seen_marks)
    seen_of: list[int] | None = None  # the token list they were read from, up to seen_upto
    seen_upto: int = 0


class EagleRunner:
    def __init__(self, path: str, *, target: "ModelRunner", target_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int, k: int, max_seqs: int,
                 seed: int = 0) -> None:
        self.head = load_head(path, target_config, dtype, device, max_model_len + k + 1)
        self.target = target
        self.embed = target.model.model.embed_tokens  # shared with the target, never copied
        self.vocab_size = target_config.vocab_size
        self.device, self.block_size = device, block_size
        self.ops = get_ops(device)
        self.kv_caches, self.kv = own_cache(self.head.config, dtype, device, block_size, max_model_len, k, max_seqs)
        self.seqs: dict[str, _HeadSeq] = {}
        self.generator = torch.Generator().manual_seed(seed)
        self.num_cache_reads = 0  # catch-ups whose target states were read from the cache (see module doc)
        self.num_recomputes = 0  # catch-ups whose target states had to be recomputed (see module doc)
        self.step_width = 0  # requests in the last forward pass (observe): beside others, catch-ups run in shares
        self.max_held_states = MAX_HELD_STATES
        # Greedy passes in one C call where it applies (propose); None: always the Python passes (tests compare).
        # The head's logits: the target's lm_head, or its rows of the head's draft vocabulary (a copy, 1/4 of it
        # on the shipped model: the head's lm_head was a third of a pass).
        self.draft_ids = self.head.draft_ids
        self.lm_head = target.model.lm_head if self.draft_ids is None else rows_of(target.model.lm_head, self.draft_ids)
        self.column_of: list[int] | None = None  # target id -> its head logit column, -1 outside the draft vocabulary
        if self.draft_ids is not None:
            self.column_of = [-1] * self.vocab_size
            for column, token in enumerate(self.draft_ids.tolist()):
                self.column_of[token] = column
        width = self.vocab_size if self.draft_ids is None else len(self.draft_ids)
        self.fused: FusedDrafter | None = FusedDrafter(self.head, self.embed, self.lm_head, width, self.kv_caches,
                                                       block_size, self.draft_ids)
        # A GPU's greedy passes: one CUDA graph a proposal (plugins/draft_graphs.py); the CPU's: the C loop above.
        self.graphs: DraftGraphs | None = eagle_chains(self, -(-(max_model_len + k) // block_size)) \
            if target.use_graphs else None  # not under --enforce-eager
        if self.graphs is not None:
            self.graphs.capture_all(k, max_seqs)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)  # type: ignore[arg-type]  (duck-typed Request)

    def observe(self, hidden: dict[str, tuple[int, torch.Tensor]]) -> None:
        """The target's final hidden states of one forward pass: rows for positions start.. of each request."""
        self.step_width = len(hidden)
        for rid, (start, rows) in hidden.items():
            seq = self.seqs.setdefault(rid, _HeadSeq())
            f = seq.features
            if f is not None and seq.feat_start <= start <= seq.feat_start + len(f):
                # Continues (or rewrites the rejected tail of) what is held: rows from `start` on are new.
                seq.features = torch.cat([f[:start - seq.feat_start], rows])
            else:  # a gap (prefix-cache hit) or a restart from 0 (preemption): what is held is no use
                seq.feat_start, seq.features = start, rows
            if len(seq.features) > self.max_held_states:
                seq.features = None  # recomputed if the request is speculated again

    @torch.inference_mode()
    def catch_up(self, requests: list[Request], budget: int | None = None, wanted: set[str] | None = None) -> None:
        """Run the head over the requests' positions behind n-2 (n-3 and before), in order, up to `budget` of
        them (default: all where the last step ran nothing else, else CATCH_UP_TOKENS), now: in the step that
        computed a prompt (vLLM's drafter also runs in the prefill's step), and in each later step of a request
        still far behind (propose), so its first proposal feeds one row, the decode way, and no step beside
        other streams runs the head over a whole long prompt. Position n-2 pairs with the token just sampled
        and is left to `propose`, whose first draft comes from its output."""
        if budget is None:
            budget = CATCH_UP_TOKENS if self.step_width > len(requests) else 1 << 62
        feed = []
        for r in requests:
            seq = self.seqs.setdefault(r.request_id, _HeadSeq())
            c = seq.num_computed_tokens
            hi = min(r.num_tokens - 2, c + budget)
            if self._behind(r) and hi > c and self._reserve(seq, hi - c, wanted):
                feed.append((r, r.token_ids[c + 1:hi + 1], self._features(r, c, hi + 1), c))
                budget -= hi - c
        if not feed:
            return
        self._forward([(r, toks, f[:-1], c) for r, toks, f, c in feed], decode=False)
        for r, toks, f, c in feed:  # keep f[hi] only (the next pass feeds it), read once if it came from the cache
            seq = self.seqs[r.request_id]
            seq.num_computed_tokens = seq.feat_start = c + len(toks)
            seq.features = f[-1:].clone()

    def _behind(self, req: Request) -> bool:
        """Whether req's head is further behind its tokens than one decode query (catch_up's work)."""
        seq = self.seqs.get(req.request_id)
        return req.num_tokens - 2 - (seq.num_computed_tokens if seq else 0) > MAX_DECODE_QUERY_LEN

    # ---- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Draft ks[i] tokens after each request's token_ids; also the [k, V] distributions sampled
        from, for requests with temperature > 0."""
        wanted = {r.request_id for r in requests}
        behind = [r for r in requests if self._behind(r)]
        if behind:  # far behind: caught up (a share a step beside streams that draft), not drafted
            self.catch_up(behind, CATCH_UP_TOKENS if len(requests) > len(behind) else 1 << 62, wanted)
        batch = [(r, k) for r, k in zip(requests, ks) if not self._behind(r) and self._prepare(r, k, wanted)]
        if not batch:
            return {}, {}
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in batch}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in batch if not r.params.greedy}
        # Pass 1: head positions num_computed..n-2 from the target's real states.
        feed = []
        for r, _ in batch:
            c, n = self.seqs[r.request_id].num_computed_tokens, r.num_tokens
            feed.append((r, r.token_ids[c + 1:n], self._features(r, c, n - 1), c))
        # Short catch-ups (always equal at batch 1) attend from the cache like the target's verification rows
        # do, unequal ones padded (plugins/draft_model.py): the decode path is cheaper than the varlen prefill one.
        feed, pads = padded(feed)
        decode = pads is not None
        passes = max(k for _, k in batch)
        # Greedy requests drafting alike: every pass in C (plugins/eagle_fused.py) or a CUDA graph (draft_graphs.py).
        fused = self.fused is not None and all(r.params.greedy and k == passes for r, k in batch)
        if fused and decode and self._fused_passes(batch, feed, tokens, passes, pads):
            passes = 0
        state = self._forward(feed, decode, pads) if passes else None
        if state is not None:
            sample_drafts(batch, self.lm_head(state).float(), tokens, probs, self.vocab_size, self.generator,
                          self.draft_ids)
            feed = [(r, tokens[r.request_id][-1:], state[i:i + 1], r.num_tokens - 1) for i, (r, _) in enumerate(batch)]
            if fused and passes > 1 and self._fused_passes(batch, feed, tokens, passes - 1):
                passes = 1
        # Passes 2..k: the previous draft token with the head's own prediction of the state before it.
        last = {r.request_id: f for r, _, f, _ in feed}
        for step in range(1, passes):
            live = [(r, k) for r, k in batch if k > step]
            feed = [(r, tokens[r.request_id][-1:], last[r.request_id], r.num_tokens - 2 + step) for r, _ in live]
            state = self._forward(feed, decode=True)
            sample_drafts(live, self.lm_head(state).float(), tokens, probs, self.vocab_size, self.generator,
                          self.draft_ids)
            last.update((r.request_id, state[i:i + 1]) for i, (r, _) in enumerate(live))
        for r, _ in batch:
            seq, n = self.seqs[r.request_id], r.num_tokens
            seq.num_computed_tokens = n - 1
            # Keep f[n-2]: if the next proposal comes before a verification, it re-feeds position n-2.
            if seq.features is not None:
                seq.features = seq.features[n - 2 - seq.feat_start:n - 1 - seq.feat_start]
                seq.feat_start = n - 2
        return tokens, {rid: torch.stack(rows) for rid, rows in probs.items()}

    def _fused_passes(self, batch: list[tuple[Request, int]], feed: list, tokens: dict[str, list[int]],
                      steps: int, pads: list[int] | None = None) -> bool:
        """Run `steps` greedy passes from feed (as _forward takes it, equal lengths, `pads` rows of padding
        in front) in one C call (a GPU: one CUDA graph) and append their drafts; False (nothing appended) where
        it does not apply."""
        assert self.fused is not None
        penalties = None
        if any(r.params.repetition_penalty != 1.0 for r, _ in batch):  # drafts follow the penalized argmax
            if self.graphs is not None:  # a GPU's chain has no penalties: the Python passes
                return False
            none = bytes(self.fused.vocab_size)
            marks = bytearray().join(self._seen_marks(r, tokens[r.request_id]) if r.params.repetition_penalty != 1.0
                                     else none for r, _ in batch)  # writable: the C loop marks its drafts
            penalties = ([r.params.repetition_penalty for r, _ in batch],
                         torch.frombuffer(marks, dtype=torch.uint8).view(len(batch), -1))
        states = feed[0][2].contiguous() if len(feed) == 1 else torch.cat([f for _, _, f, _ in feed])
        args = ([t for _, toks, _, _ in feed for t in toks], states, [start for _, _, _, start in feed],
                [self.seqs[r.request_id].block_ids for r, _ in batch], steps)
        pads, graphs = pads if pads and any(pads) else None, self.graphs
        drafted = graphs.draft(*args, pads) if graphs is not None else self.fused.draft(*args, penalties, pads)
        for (r, _), more in zip(batch, drafted or ()):
            tokens[r.request_id].extend(more)
        return drafted is not None

    def _seen_marks(self, req: Request, drafted: list[int]) -> bytearray:
        """A byte per head logit column, 1 for the columns of the tokens req has seen — prompt, output, then
        `drafted` — as seen_columns gives them. Kept per request and brought up to date with its new tokens
        only: built from all of them every step it cost ~150 us of a ~2.9 ms step at batch 1."""
        seq = self.seqs[req.request_id]
        ids = req.token_ids
        if seq.seen is None or seq.seen_of is not ids or seq.seen_upto > len(ids):
            seq.seen, seq.seen_of, seq.seen_upto = bytearray(self.fused.vocab_size), ids, 0
        for t in ids[seq.seen_upto:]:
            self._mark(seq.seen, t)
        seq.seen_upto = len(ids)
        marks = bytearray(seq.seen)
        for t in drafted:
            self._mark(marks, t)
        return marks

    def _mark(self, marks: bytearray, token: int) -> None:
        column = token if self.column_of is None else self.column_of[token]
        if column >= 0:
            marks[column] = 1

    def _prepare(self, req: Request, k: int, wanted: set[str]) -> bool:
        """Apply the catch-up rule to req's head state and reserve slots for this proposal."""
        seq = self.seqs.setdefault(req.request_id, _HeadSeq())
        # At least position n-2 is fed again: its output gives the first draft token.
        seq.num_computed_tokens = min(seq.num_computed_tokens, req.num_tokens - 2)
        need = req.num_tokens + k - 2 - seq.num_computed_tokens  # positions up to n+k-3
        return self._reserve(seq, need, wanted)

    def _reserve(self, seq: _HeadSeq, need: int, wanted: set[str] | None) -> bool:
        """Head cache slots for `need` more positions of seq, made where the cache is full by releasing the
        state of requests not in `wanted` (not speculated right now; None: release nothing)."""
        if self.kv.allocate(seq, need):  # type: ignore[arg-type]
            return True
        if wanted is None:
            return False
        for rid in [rid for rid in self.seqs if rid not in wanted]:
            self.release(rid)
        return self.kv.allocate(seq, need)  # type: ignore[arg-type]

    def _features(self, req: Request, lo: int, hi: int) -> torch.Tensor:
        """The target's final hidden states of positions [lo, hi) of req: held, read from the target's
        hidden-state cache layers, or (blocks released behind a sliding window) recomputed."""
        seq = self.seqs[req.request_id]
        f = seq.features
        if f is None or not seq.feat_start <= lo or seq.feat_start + len(f) < hi:
            cached = self.target.cached_hidden_states(req.block_ids, lo, hi)
            if cached is not None:
                self.num_cache_reads += 1
                return cached
            self.num_recomputes += 1
            seq.feat_start, seq.features = 0, self.target.hidden_states(req.token_ids[:hi])
            f = seq.features
        return f[lo - seq.feat_start:hi - seq.feat_start]

    def _forward(self, feed: list[tuple[Request, list[int], torch.Tensor, int]], decode: bool,
                 pads: list[int] | None = None) -> torch.Tensor:
        """feed: (request, input tokens, target states paired with them, position of the first); pads: rows
        of padding in front. Returns the head's output (a predicted next target state) at each request's last token."""
        ids = torch.tensor([t for _, toks, _, _ in feed for t in toks], device=self.device)
        spans = [(self.seqs[r.request_id].block_ids, start, len(toks)) for r, toks, _, start in feed]
        meta, positions, ends = paged_metadata(spans, decode, self.ops, self.kv_caches, self.block_size, self.device,
                                               pads)
        out = self.head(self.embed(ids), torch.cat([f for _, _, f, _ in feed]), positions, meta)
        return out if len(ends) == len(out) else out[ends]  # one token each (passes 2..k): every row, in order
