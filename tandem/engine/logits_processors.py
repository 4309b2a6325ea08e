"""Per-request logits processing before sampling: logit_bias, min_tokens, and the repetition,
frequency and presence penalties (vLLM's and OpenAI's semantics), batched over the rows that use them.

Order (as vLLM's sampler): logit_bias is added and, below min_tokens, EOS and the stop token ids
are forbidden; then the penalties: repetition (over prompt + output tokens: a positive logit is
divided by it, a negative one multiplied), frequency (minus f x the token's count in the output)
and presence (minus p if it occurs in the output). Temperature, top-k/p and the grammar mask come
after. Every row a request samples is processed with the tokens it has at that row — a speculative
step's row j counts the first j draft tokens as generated, so speculation stays exact.
Rows of requests without any of these pass through untouched (no copy).
"""

from __future__ import annotations

from typing import Any

import torch


def active(params: Any) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty)


def process(rows: torch.Tensor, reqs: list[Any], extra: list[list[int]] | None = None) -> torch.Tensor:
    """rows [N, V'] of logits, one per (request, extra generated tokens) pair; returns the processed
    rows (the input when no request needs processing)."""
    todo = [i for i, r in enumerate(reqs) if active(r.params)]
    if not todo:
        return rows
    rows = rows.clone()
    vocab = rows.shape[1]
    dev = rows.device
    for i in todo:  # the per-row parts that are a few indices each
        r, p = reqs[i], reqs[i].params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            rows[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=rows.dtype, device=dev)
        generated = r.num_output_tokens + (len(extra[i]) if extra else 0)
        if generated < p.min_tokens:
            banned = [t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < vocab]
            rows[i, banned] = float("-inf")
    pen = [i for i in todo if _penalized(reqs[i].params)]
    if pen:  # the vocabulary-wide parts, vectorized over the rows
        out_counts = torch.zeros((len(pen), vocab), dtype=rows.dtype, device=dev)
        seen = torch.zeros((len(pen), vocab), dtype=torch.bool, device=dev)
        for k, i in enumerate(pen):
            r = reqs[i]
            out = r.output_token_ids + (extra[i] if extra else [])
            if out:
                ids = torch.tensor(out, dtype=torch.long, device=dev)
                out_counts[k].scatter_add_(0, ids, torch.ones_like(ids, dtype=rows.dtype))
            seen[k, torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
        seen |= out_counts > 0
        params = [reqs[i].params for i in pen]
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=rows.dtype, device=dev).unsqueeze(1)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=rows.dtype, device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=rows.dtype, device=dev).unsqueeze(1)
        sub = rows[pen]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(rows.dtype)
        rows[pen] = sub
    return rows


def _penalized(params: Any) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty or params.presence_penalty)
