"""Built-in speculators: `ngram` (prompt lookup), `draft_model` (a small checkpoint run by tandem's
own model code; the machinery lives in plugins/draft_model.py) and `eagle` (a draft head over the
target's own hidden states; plugins/eagle.py).

The interface and its contract with the engine are in `tandem.engine.interfaces.speculator`
(`Speculator`, `SpeculatorContext`, re-exported here under their old `plugins.speculators.*` names for
existing plugins).
"""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from tandem.engine.interfaces.speculator import Speculator, SpeculatorContext
from tandem.engine.request import Request

__all__ = ["BUILTIN_SPECULATORS", "SPECULATORS", "DraftModelSpeculator", "EagleSpeculator", "NgramSpeculator",
           "Speculator", "SpeculatorContext", "ngram_lookup"]


class NgramSpeculator(Speculator):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it. Costs no model call."""

    def __init__(self, ctx: SpeculatorContext, max_n: int = 3, min_n: int = 1) -> None:
        super().__init__(ctx)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        out = {}
        for req in requests:
            k = self.num_to_propose(req)
            if k > 0:
                toks = ngram_lookup(req.token_ids, k, self.max_n, self.min_n)
                if toks:
                    out[req.request_id] = toks
        return out


def ngram_lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of tokens[-n:], largest n first."""
    size = len(tokens)
    # Tokens as 4-byte words so bytes.rfind does the scanning in C; a hit must be word-aligned.
    data = array("I", tokens).tobytes()
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = data[(size - n) * 4:]
        end = (size - 1) * 4  # a match must end before the last token: at least one token follows it
        while (pos := data.rfind(pattern, 0, end)) >= 0:
            if pos % 4 == 0:
                start = pos // 4 + n
                return tokens[start:start + k]
            end = pos + len(pattern) - 1  # an unaligned hit: look further left
    return []


class DraftModelSpeculator(Speculator):
    """A smaller checkpoint with the target's tokenizer drafts k tokens autoregressively, with its
    own paged KV cache that follows each request's accepted tokens (see plugins/draft_model.py)."""

    def __init__(self, ctx: SpeculatorContext) -> None:
        super().__init__(ctx)
        from plugins.draft_model import DraftModelRunner  # loads torch model code only when chosen

        cfg = ctx.config
        if not cfg.draft_model:
            raise ValueError("the draft_model speculator needs --draft-model PATH (a Hugging Face checkpoint "
                             "directory sharing the target's tokenizer)")
        self.runner = DraftModelRunner(
            cfg.draft_model, target_path=cfg.model, target_vocab_size=ctx.model_config.vocab_size,
            dtype=ctx.dtype, device=ctx.device, block_size=cfg.block_size, max_model_len=ctx.max_model_len,
            k=self.k, max_seqs=cfg.spec_max_batch, seed=cfg.seed,
            graphs=ctx.target is not None and ctx.target.use_graphs)  # a GPU's, not under --enforce-eager

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        ks = [self.num_to_propose(r) for r in requests]
        todo = [(r, k) for r, k in zip(requests, ks) if k > 0]
        tokens, probs = self.runner.propose([r for r, _ in todo], [k for _, k in todo])
        self.draft_probs = probs
        return tokens

    def on_request_finished(self, request_id: str) -> None:
        self.runner.release(request_id)

    def warm_modules(self) -> list[torch.nn.Module]:
        return [self.runner.model.model.layers]  # as the target's: not the lm_head (one row a prompt)


class EagleSpeculator(Speculator):
    """An EAGLE head (--draft-model DIR, default: the shipped head for the shipped target) drafts k
    tokens from the target's final hidden states, with its own paged cache (see plugins/eagle.py)."""

    wants_hidden_states = True

    def __init__(self, ctx: SpeculatorContext) -> None:
        super().__init__(ctx)
        from plugins.eagle import EagleRunner  # loads torch model code only when chosen

        cfg = ctx.config
        if not cfg.draft_model:
            raise ValueError("the eagle speculator needs --draft-model PATH (an EAGLE head checkpoint directory)")
        if ctx.target is None:
            raise ValueError("the eagle speculator reads the target model's hidden states: it needs ctx.target")
        self.runner = EagleRunner(
            cfg.draft_model, target=ctx.target, target_config=ctx.model_config, dtype=ctx.dtype,
            device=ctx.device, block_size=cfg.block_size, max_model_len=ctx.max_model_len, k=self.k,
            max_seqs=cfg.spec_max_batch, seed=cfg.seed)

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        todo = [(r, k) for r in requests if (k := self.num_to_propose(r)) > 0]
        tokens, probs = self.runner.propose([r for r, _ in todo], [k for _, k in todo])
        self.draft_probs = probs
        return tokens

    def observe_hidden_states(self, hidden: dict[str, tuple[int, torch.Tensor]]) -> None:
        self.runner.observe(hidden)

    def catch_up(self, requests: Sequence[Request]) -> None:
        self.runner.catch_up([r for r in requests if self.num_to_propose(r) > 0])  # not one about to end

    def warm_modules(self) -> list[torch.nn.Module]:
        return [self.runner.head]  # fc and its layer: its catch-up over a new prompt runs them at the prompt's size

    def stats(self) -> dict[str, int]:
        return {"target_state_cache_reads": self.runner.num_cache_reads,
                "target_state_recomputes": self.runner.num_recomputes}

    def on_request_finished(self, request_id: str) -> None:
        self.runner.release(request_id)


# Published through the `tandem_speculators()` hook by plugins/builtin.py (which reads SPECULATORS).
BUILTIN_SPECULATORS: dict[str, type[Speculator]] = {"ngram": NgramSpeculator, "draft_model": DraftModelSpeculator,
                                                    "eagle": EagleSpeculator}
SPECULATORS = BUILTIN_SPECULATORS
