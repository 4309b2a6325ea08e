"""DraftModelRunner: the `draft_model` speculator's machinery — a small checkpoint loaded with
tandem's own model code, its own paged KV cache and block manager, and the catch-up rule that keeps
that cache in step with each target request.

Per request it remembers `num_computed_tokens` (draft KV that matches `req.token_ids`) and the
drafted tokens whose KV it wrote past them. On the next `propose` the drafted tokens the target
accepted are still valid KV; everything after the first mismatch is simply recomputed (and its
slots overwritten), the same one rule the target's scheduler follows. One proposal is k forward
passes of the draft, each batched over all requests: a varlen catch-up pass that yields the first
draft token, then k-1 single-token decode passes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer as HFTokenizer

from kernels import fused, get_ops
from plugins.draft_graphs import DraftGraphs, draft_model_chains
from plugins.eviction import LRUEviction
from tandem.engine.decode_group import MAX_DECODE_QUERY_LEN, MAX_PADDED_ROWS
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.logits_processors import scale_repeated
from tandem.engine.model_runner import position_seed
from tandem.engine.request import Request
from tandem.engine.sampler import draw, filter_logits
from tandem.layers.attention import AttentionMetadata
from tandem.models import weight_arena
from tandem.models.config import ModelConfig
from tandem.models.loader import load_model


@dataclass(slots=True)
class _DraftSeq:
    """The draft cache's view of one request; duck-types what KVCacheManager reads off a Request."""

    num_computed_tokens: int = 0  # leading req.token_ids whose draft KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # tokens whose KV sits right after num_computed_tokens


def check_same_tokenizer(draft_path: str, target_path: str) -> None:
    """A draft is only useful if its token ids mean the target's tokens."""
    files = [os.path.join(p, "tokenizer.json") for p in (draft_path, target_path)]
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"cannot check that the draft and target share a tokenizer: {f} not found")
    draft_vocab, target_vocab = (HFTokenizer.from_file(f).get_vocab(with_added_tokens=True) for f in files)
    if draft_vocab != target_vocab:
        diff = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise ValueError(f"draft model {draft_path!r} does not share the target's tokenizer "
                         f"({len(draft_vocab)} vs {len(target_vocab)} tokens; first differences {diff}); "
                         "speculative decoding needs identical token ids")


class DraftModelRunner:
    def __init__(self, path: str, *, target_path: str, target_vocab_size: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int, k: int, max_seqs: int,
                 seed: int = 0, graphs: bool = False) -> None:
        check_same_tokenizer(path, target_path)
        cfg = ModelConfig.from_dir(path)
        self.vocab_size = target_vocab_size  # draft rows are cut/padded to it (checkpoints pad vocabs differently)
        self.device, self.block_size = device, block_size
        self.model = load_model(path, dtype, device, max_model_len + k + 1)
        self.ops = get_ops(device)
        self.kv_caches, self.kv = own_cache(cfg, dtype, device, block_size, max_model_len, k, max_seqs)
        self.seqs: dict[str, _DraftSeq] = {}
        self.generator = torch.Generator().manual_seed(seed)
        # A GPU's greedy proposals of equal catch-ups: one CUDA graph each (plugins/draft_graphs.py), captured now
        # for catch-ups of 1 or 2 tokens (what follows a verification: _prepare keeps the accepted drafts' KV).
        self.graphs: DraftGraphs | None = draft_model_chains(self, -(-(max_model_len + k) // block_size)) \
            if graphs else None
        if self.graphs is not None:
            self.graphs.capture_all(k, max_seqs, max_q=2)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)  # type: ignore[arg-type]  (duck-typed Request)

    # ---- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Draft ks[i] tokens after each request's token_ids. Returns tokens and, for requests that
        sample (temperature > 0), the [k, V] distributions they were drawn from."""
        wanted = {r.request_id for r in requests}
        batch = [(r, k) for r, k in zip(requests, ks) if self._prepare(r, k, wanted)]
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in batch}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in batch if not r.params.greedy}
        if not batch:
            return {}, {}
        # Pass 1: catch up on everything after the valid draft KV, sample the first draft token.
        chunks = [(r, self.seqs[r.request_id].num_computed_tokens, r.num_tokens) for r, _ in batch]
        passes = max(k for _, k in batch)
        if self._graph_passes(batch, chunks, tokens, passes):
            passes = 0
        else:
            logits = self._forward([(r, r.token_ids[a:b], a) for r, a, b in chunks], decode=False)
            self._sample(batch, logits, tokens, probs)
        # Passes 2..k: one token each, for the requests that still want more.
        for step in range(1, passes):
            live = [(r, k) for r, k in batch if k > step]
            feed = [(r, [tokens[r.request_id][-1]], r.num_tokens + step - 1) for r, _ in live]
            self._sample(live, self._forward(feed, decode=True), tokens, probs)
        for r, k in batch:
            seq = self.seqs[r.request_id]
            seq.num_computed_tokens = r.num_tokens
            seq.drafted = tokens[r.request_id][:k - 1]  # the last draft token was never fed back
        return tokens, {rid: torch.stack(rows) for rid, rows in probs.items()}

    def _graph_passes(self, batch: list[tuple[Request, int]], chunks: list, tokens: dict[str, list[int]],
                      passes: int) -> bool:
        """All `passes` passes as one CUDA graph (a GPU's) where every request is greedy without a penalty, drafts
        as many and catches up as many tokens, 1 or 2 (the chains captured at start: a longer catch-up — a prompt
        — would capture one per length while serving); False (nothing appended) where that does not apply."""
        if self.graphs is None or len({b - a for _, a, b in chunks}) > 1 or chunks[0][2] - chunks[0][1] > 2 or any(
                k != passes or not r.params.greedy or r.params.repetition_penalty != 1.0 for r, k in batch):
            return False
        drafted = self.graphs.draft([t for r, a, b in chunks for t in r.token_ids[a:b]], None,
                                    [a for _, a, _ in chunks], [self.seqs[r.request_id].block_ids for r, _ in batch],
                                    passes)
        for (r, _), more in zip(batch, drafted or ()):
            tokens[r.request_id].extend(more)
        return drafted is not None

    def _prepare(self, req: Request, k: int, wanted: set[str]) -> bool:
        """Apply the catch-up rule to req's draft state and reserve slots for this proposal."""
        seq = self.seqs.setdefault(req.request_id, _DraftSeq())
        valid, ids = seq.num_computed_tokens, req.token_ids
        # Drafted tokens the target accepted kept their (correct) KV. Capping at num_tokens - 1 alone
        # already stops at the first rejected one; comparing is a cheap guard for proposals cut short.
        for t in seq.drafted:
            if valid >= len(ids) or ids[valid] != t:
                break
            valid += 1
        # At least the last token is fed again: its logits give the first draft token.
        seq.num_computed_tokens = min(valid, req.num_tokens - 1)
        seq.drafted = []
        need = req.num_tokens + k - 1 - seq.num_computed_tokens
        if self.kv.allocate(seq, need):  # type: ignore[arg-type]
            return True
        for rid in [rid for rid in self.seqs if rid not in wanted]:
            self.release(rid)  # stale state of requests not speculated right now
        return self.kv.allocate(seq, need)  # type: ignore[arg-type]

    def _sample(self, batch: list[tuple[Request, int]], logits: torch.Tensor, tokens: dict[str, list[int]],
                probs: dict[str, list[torch.Tensor]]) -> None:
        sample_drafts(batch, logits, tokens, probs, self.vocab_size, self.generator)

    def _forward(self, feed: list[tuple[Request, list[int], int]], decode: bool) -> torch.Tensor:
        """feed: (request, input tokens, position of the first). Returns logits of each last token."""
        ids = [t for _, toks, _ in feed for t in toks]
        spans = [(self.seqs[r.request_id].block_ids, start, len(toks)) for r, toks, start in feed]
        meta, positions, ends = paged_metadata(spans, decode, self.ops, self.kv_caches, self.block_size, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), positions, meta)
        return self.model.compute_logits(hidden[ends])


def own_cache(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int, max_model_len: int,
              k: int, max_seqs: int) -> tuple[list[torch.Tensor], KVCacheManager]:
    """A speculator's own paged KV cache (per-layer tensors) and its block manager: room for max_seqs
    full-length sequences plus their drafted tail. More live requests than that only happens after
    speculation was off, and then stale states are dropped (the runners' `_prepare`)."""
    per_seq = -(-(max_model_len + k) // block_size)
    num_blocks = (max_seqs + 1) * per_seq
    shape = (num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = list(weight_arena.zeros({f"kv{i}": (shape, dtype) for i in range(cfg.num_layers)}, device).values())
    return caches, KVCacheManager(num_blocks, block_size, LRUEviction(num_blocks), enable_caching=False)


def sample_drafts(batch: list[tuple[Request, int]], logits: torch.Tensor, tokens: dict[str, list[int]],
                  probs: dict[str, list[torch.Tensor]], vocab_size: int, generator: torch.Generator,
                  draft_ids: torch.Tensor | None = None) -> None:
    """Append one draft token per request of `batch` (row i of logits): the argmax for greedy requests,
    else a draw from the request's filtered distribution, which is kept in `probs` (over the target's
    `vocab_size` tokens) for verification. With `draft_ids` (a draft vocabulary, tandem/models/eagle.py)
    logits' columns are those target tokens only."""
    width = vocab_size if draft_ids is None else len(draft_ids)
    if logits.shape[1] > width:
        logits = logits[:, :width]
    elif logits.shape[1] < width:
        logits = torch.nn.functional.pad(logits, (0, width - logits.shape[1]), value=float("-inf"))
    penalized = [(i, r) for i, (r, _) in enumerate(batch) if r.params.repetition_penalty != 1.0]
    if penalized:  # as verification will (see seen_columns)
        logits = logits.clone()
        for i, r in penalized:
            cols = seen_columns(r, tokens[r.request_id], draft_ids)
            logits[i, cols] = scale_repeated(logits[i, cols], r.params.repetition_penalty)
    greedy = fused.argmax_rows(logits)
    for i, (r, _) in enumerate(batch):
        if r.params.greedy:
            tokens[r.request_id].append(greedy[i] if draft_ids is None else int(draft_ids[greedy[i]]))
            continue
        q = filter_logits(logits[i].float().cpu(), r.params)
        if r.generator is not None:  # drafts of a seeded request depend on its tokens alone (migration)
            r.generator.manual_seed(position_seed(r.params.seed, r.num_tokens + len(tokens[r.request_id]), 1))
        drawn = draw(q, r.generator or generator)
        if draft_ids is not None:  # back to target ids; the target's other tokens were drafted with q = 0
            drawn, q = int(draft_ids[drawn]), q.new_zeros(vocab_size).index_copy_(0, draft_ids, q)
        tokens[r.request_id].append(drawn)
        probs[r.request_id].append(q)


def seen_columns(req: Request, drafted: list[int], draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The logit columns of the tokens req has seen (prompt, output, drafts so far), distinct: what the
    target's repetition penalty scales when it verifies, so drafts that track it are accepted more often
    (the shipped model serves with repetition_penalty 1.2). With a draft vocabulary (ascending target
    ids), its columns of those tokens."""
    seen = torch.frombuffer(req.token_array(), dtype=torch.int64)
    if drafted:
        seen = torch.cat([seen, torch.tensor(drafted, dtype=torch.int64)])
    seen = torch.unique(seen)
    if draft_ids is None:
        return seen
    col = torch.searchsorted(draft_ids, seen).clamp_(max=len(draft_ids) - 1)
    return col[draft_ids[col] == seen]


def paged_metadata(spans: list[tuple[list[int], int, int]], decode: bool, ops, kv_caches: list[torch.Tensor],
                   block_size: int, device: torch.device, pads: list[int] | None = None
                   ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Attention metadata of one pass over a speculator's own paged cache. spans: (block table, position
    of the first new token, number of new tokens) per sequence, all the same number (at most 16) if
    `decode`; pads: how many of each span's first tokens are padding, which attend but write no K/V (slot
    -1). Returns the metadata, the positions of every token and the index of each sequence's last token."""
    slots, positions, ends, starts, lens, tables = [], [], [], [0], [], []
    for i, (bt, start, n) in enumerate(spans):
        pos = range(start, start + n)
        positions.extend(pos)
        skip = pads[i] if pads else 0
        slots.extend([-1] * skip)
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in pos[skip:])
        ends.append(len(positions) - 1)
        starts.append(len(positions))
        lens.append(start + n)
        tables.append(bt)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        ops=ops, kv_caches=kv_caches, kv_scales=None,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_seqs=len(spans) if decode else 0, decode_query_len=spans[0][2] if decode else 0,
        decode_block_tables=table if decode else None, decode_seq_lens=seq_lens if decode else None,
        prefill_block_tables=None if decode else table,
        prefill_query_start_loc=None if decode else torch.tensor(starts, dtype=torch.int32, device=device),
        prefill_seq_lens=None if decode else seq_lens,
    )
    return meta, torch.tensor(positions, device=device), torch.tensor(ends, device=device)


def padded(feed: list) -> tuple[list, list[int] | None]:
    """An EAGLE first pass's catch-ups ((request, tokens, target states, first position) each, as
    plugins/eagle.py's _forward takes them) as one decode pass, and each one's rows of padding: equal and
    short as they are, unequal padded to the longest in front with positions the head already computed (fed
    copies of the first row: padding attends and writes nothing), as the target's decode group pads short
    queries; (feed, None) where that does not fit and the varlen prefill path takes them — a catch-up above one
    decode query, more rows than MAX_PADDED_ROWS, fewer computed positions than the padding."""
    lens = [len(toks) for _, toks, _, _ in feed]
    longest = max(lens)
    if longest > MAX_DECODE_QUERY_LEN:
        return feed, None
    if min(lens) == longest:
        return feed, [0] * len(feed)
    if len(feed) * longest > MAX_PADDED_ROWS or any(c < longest - n for (_, _, _, c), n in zip(feed, lens)):
        return feed, None
    pads = [longest - n for n in lens]
    return [(r, toks[:1] * pad + toks, torch.cat([f[:1].expand(pad, -1), f]) if pad else f, c - pad)
            for (r, toks, f, c), pad in zip(feed, pads)], pads
