"""Structured outputs: sampling constrained by a grammar (llguidance), so every output parses.

A request asks for one of (vLLM's `structured_outputs` names; OpenAI's `response_format` maps onto
`json` / `json_object` at the front door):

    {"json": <JSON schema, dict or string>}  {"json_object": true}  {"regex": "<pattern>"}
    {"choice": ["a", "b", ...]}  {"grammar": "<Lark grammar>"}

`Grammars` (one per engine: the tokenizer is built once) turns a spec into a checked llguidance
grammar (its text: tandem/engine/grammar_text.py) — once per distinct spec (an LRU cache), off the
engine loop when asked (`compile_async`). JSON is compiled without free whitespace (only the
separators), so a model cannot loop on spaces. `GrammarState` (one per request) follows the request's
output tokens and gives the mask of tokens allowed next: for the one row a plain step samples, or for
each row a speculative step verifies, under the grammar state the draft advances (an invalid draft
token is masked out, so it is rejected). The state catches up on tokens it has not seen (a first
token sampled on the prefill worker, tokens generated before a migration), so it needs no other hook.

A thinking model's answer (`reasoning_block`, set by the router's reasoning parser): the grammar applies
after the `<think>` block, as vLLM applies it after the reasoning ends — the block is free text up to the
first `</think>` (a special token or the text), then up to 3 whitespace characters, then the grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import llguidance
import torch

from kernels import fused
from tandem.engine.grammar_text import grammar_text, spec_key
from tandem.sampling_params import STRUCTURED_KINDS as KINDS
from tandem.sampling_params import check_structured as check_spec

CACHE_SIZE = 256
MISS_RATE_LIMIT, MISS_DECAY, PROBE_EVERY = 0.5, 0.9, 16  # see GrammarState.masks_first
INLINE_ROWS = 4  # up to this many constrained rows, masks are computed inline (no thread hand-off)
# On a CPU engine masks are computed on the engine thread, one matcher after another, never by
# llguidance's thread pool or the helper thread: the forward pass's OpenMP threads hold every core, so
# those threads beside them made the engine's run-queue wait look like a neighbour's, and ThreadBackoff
# dropped it to one thread for >= 5 s after a structured batch of more than INLINE_ROWS rows — every
# request, constrained or not, ~30% slower (55M model, batch 16: 1052 -> 706-725 tok/s unconstrained).
class Grammars:
    """Compiles and caches grammars for one tokenizer (vocabulary `vocab_size`, the model's rows)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], threads: bool = True) -> None:
        self.vocab_size = vocab_size
        self.threads = threads  # batched masks on llguidance's threads (False: a CPU engine, see above)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        added = json.loads(tokenizer_json).get("added_tokens") or []
        self.think_tags = {t["content"]: t["id"] for t in added if t.get("special") and t["content"] in
                           ("<think>", "</think>")}
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance.LLExecutor, on first batched mask
        self._mask_pool: ThreadPoolExecutor | None = None
        self._mask_buffer = torch.empty((0, self.mask_words), dtype=torch.int32)

    def compile(self, spec: dict[str, Any]) -> llguidance.LLMatcher:
        """A pristine matcher for `spec` (cached; never advanced: requests get copies), or ValueError
        naming the field if it cannot compile. Building a matcher costs ~0.5 ms, a copy ~1 µs."""
        key = spec_key(check_spec(spec))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = grammar_text(spec, self.think_tags)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            kind = next(k for k in spec if k in KINDS)
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {' '.join(error.split())[:500]}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def compile_async(self, spec: dict[str, Any]) -> Future:
        """compile() on a background thread (llguidance drops the GIL): the engine loop goes on."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._pool.submit(self.compile, spec)

    @property
    def mask_words(self) -> int:
        """int32 words of one llguidance token mask: a bit per token."""
        return (self.vocab_size + 31) // 32

    def mask_buffer(self, rows: int) -> torch.Tensor:
        """int32 words [>= rows, mask_words], reused from step to step by the engine thread (greedy_allowed)."""
        if self._mask_buffer.shape[0] < rows:
            self._mask_buffer = torch.empty((max(rows, 2 * self._mask_buffer.shape[0]), self.mask_words),
                                            dtype=torch.int32)
        return self._mask_buffer

    def allowed_batch_async(self, states: list[GrammarState], inline: bool = False) -> PendingMasks:
        """Bit masks (int32 words [len(states), mask_words], `.result()`) for many requests at once:
        llguidance fills one buffer in parallel (its threads run without the GIL) on a helper thread,
        overlapping the forward pass; a few rows (or `inline`) are cheaper done at once than handed
        over (the hand-off costs more than their masks). Without `threads`: each row in turn, here."""
        words = torch.empty((len(states), self.mask_words), dtype=torch.int32)
        if not self.threads:
            for i, state in enumerate(states):
                state.matcher.unsafe_compute_mask_ptr(words.data_ptr() + i * self.mask_words * 4, self.mask_words * 4)
            return PendingMasks(None, words, self.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        items = [(s.matcher, i) for i, s in enumerate(states)]
        fill = partial(self._executor.unsafe_compute_mask_ptr, items, words.data_ptr(), self.mask_words * 4,
                       len(states))
        if inline or len(states) <= INLINE_ROWS:
            fill()
            return PendingMasks(None, words, self.vocab_size)
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return PendingMasks(self._mask_pool.submit(fill), words, self.vocab_size)

    def state(self, spec: dict[str, Any], resume_tokens: list[int] | None = None) -> GrammarState:
        """A fresh per-request state; `resume_tokens` were generated under this grammar already."""
        state = GrammarState(self.compile(spec).deep_copy(), self)
        if resume_tokens:
            state.sync(resume_tokens)
        return state


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars) -> None:
        self.matcher = matcher
        self.grammars = grammars  # for batched masks
        self.vocab_size = grammars.vocab_size
        self.consumed = 0  # output tokens fed to the matcher so far
        self.stopped = matcher.is_stopped()  # kept by sync(), the one place the matcher moves for good
        # How often sampling unmasked needed the mask anyway (a moving average): a model that fights
        # its grammar gets its masks computed during the forward pass instead, as before checking
        # first existed, and tries checking again every PROBE_EVERY steps.
        self.miss_rate = 0.0
        self.steps = 0

    def masks_first(self, params: Any) -> bool:
        """This step's row is masked before sampling; else a greedy row takes its masked argmax after the
        forward (greedy_allowed) and a temperature row is sampled unmasked and checked (`allows`). Where
        llguidance has its threads (a GPU engine), a greedy row's mask is made by them while the forward
        runs, not after it on the engine thread one row after another (64 rows of a 128k vocabulary would
        be milliseconds there)."""
        self.steps += 1
        if params.greedy:
            return self.grammars.threads
        return not checks_first(params) or (self.miss_rate > MISS_RATE_LIMIT and self.steps % PROBE_EVERY != 0)

    def record(self, missed: bool) -> None:
        self.miss_rate = MISS_DECAY * self.miss_rate + (1 - MISS_DECAY) * missed

    def sync(self, token_ids: list[int], start: int = 0) -> None:
        """Feed the output tokens `token_ids[start:]` the matcher has not seen (in order; the engine
        passes a request's whole token list and its prompt length, which spares a copy of the output
        every step). A token the grammar refuses (it cannot come from a masked sample) leaves the
        matcher in its error state: then every token is masked but EOS, and the request ends."""
        seen = start + self.consumed
        if seen < len(token_ids) and not self.stopped:
            self.matcher.consume_tokens(token_ids[seen:])
            self.stopped = self.matcher.is_stopped()
        self.consumed = len(token_ids) - start

    @property
    def finished(self) -> bool:
        """The grammar is complete, or failed: nothing may follow (the request should stop). Read after
        the consume that changes it (llguidance's is_stopped covers its error state too): one llguidance
        call a step fewer, and each costs ~5-10 us inside a decode step, where the weight streams have
        evicted its tables. (allowed_along's consumes are rolled back: they leave it as it was.)"""
        return self.stopped

    def take(self, token: int) -> bool:
        """Consume `token` now if the grammar allows it next (True; the engine's next sync then has nothing
        to feed), else leave the state as it was (False). One llguidance call where checking a token, or
        making the mask a greedy row's argmax is taken under, and then consuming it next step cost two:
        inside a decode step each call pays for the cache misses of tables the weight streams evicted.
        The engine appends `token` to the request's output (sync's bookkeeping assumes it)."""
        if self.stopped or not 0 <= token < self.vocab_size or self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.consumed += 1
        self.stopped = self.matcher.is_stopped()
        return True

    def allows(self, token: int) -> bool:
        """The grammar accepts `token` next (checked, not consumed): a few microseconds, against a
        whole mask's tens. A finished or failed grammar answers False (its mask decides)."""
        return 0 <= token < self.vocab_size and self.matcher.validate_tokens([token]) == 1

    def allowed(self) -> torch.Tensor:
        """Bool mask [vocab_size] of the tokens the grammar allows next."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return unpack(words.unsqueeze(0), self.vocab_size)[0]

    def allowed_along(self, draft: list[int]) -> torch.Tensor:
        """Bit masks (int32 words [k+1, W], for `mask_rows`) of the k+1 rows a speculative step verifies:
        row j under the state after draft[:j]. Rows past the first draft token the grammar refuses
        repeat that row's mask (they are never used: verification stops at the refused token)."""
        width = self.grammars.mask_words
        words = torch.empty((len(draft) + 1, width), dtype=torch.int32)
        taken = 0
        for j in range(len(draft) + 1):
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr() + j * width * 4, width * 4)
            if j == len(draft):
                break
            token = draft[j]
            # checked against the mask first: a refused token would put the matcher in its error state
            if not (0 <= token < self.vocab_size and int(words[j, token >> 5]) >> (token & 31) & 1) or \
                    not self.matcher.consume_token(token):
                words[j + 1:] = words[j]
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return words


def checks_first(params: Any) -> bool:
    """Sampled rows that can be drawn unmasked and checked afterwards (see grammar_rows.tokens):
    temperature alone. Top-k / top-p / min-p cut the distribution by its own mass, which a mask changes,
    so those rows are masked before sampling."""
    return params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0


def greedy_allowed(rows: torch.Tensor, picked: list[int], states: list[GrammarState]) -> list[int]:
    """For each of the greedy rows `picked` of `rows` (a CPU engine's), the masked argmax: each grammar's mask
    into one reused buffer, then one C pass reading only the allowed tokens (fused.masked_argmax; no row
    copied or written). 55M Llama, a narrow grammar: ~50 us a step where masking a copy of the row cost ~0.4
    ms. A grammar allowing nothing (its error state still allows EOS) would give token 0, as argmax would."""
    grammars = states[0].grammars
    words = grammars.mask_buffer(len(states))
    address, nbytes = words.data_ptr(), grammars.mask_words * 4
    for i, state in enumerate(states):
        state.matcher.unsafe_compute_mask_ptr(address + i * nbytes, nbytes)
    return [max(t, 0) for t in fused.masked_argmax(rows, picked, words, grammars.vocab_size)]


class PendingMasks:
    """Token masks being filled by llguidance on the helper thread; result() waits and returns the
    int32 bit words [N, W] for `mask_rows` on the caller's thread. The helper never runs a torch op: a
    thread that does gets an OpenMP team of its own, and with it every later decode step of the process
    ran ~40% slower, structured or not (measured: batch 16, 3600 -> 2000 tok/s after one structured batch)."""

    def __init__(self, fill: Future | None, words: torch.Tensor, vocab_size: int) -> None:
        self._fill, self._words, self.vocab_size = fill, words, vocab_size

    def result(self) -> torch.Tensor:
        if self._fill is not None:
            self._fill.result()
        return self._words


unpack = fused.unpack_bitmask


def mask_rows(logits: torch.Tensor, words: torch.Tensor, vocab_size: int, rows: list[int] | None = None) -> None:
    """In place: logits rows `rows` (default all) [.., V'] get -inf at the tokens the bit words [len(rows), W]
    forbid and at any padded column >= V: one C pass on the CPU (kernels/fused.py), torch elsewhere."""
    fused.apply_bitmask(logits, words, vocab_size, rows)
