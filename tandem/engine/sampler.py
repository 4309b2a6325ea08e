"""Sampler: turns logits rows into tokens — greedy, temperature, top-k, top-p, min-p, per-request
seeded generators — and top-n logprobs.

Greedy rows are one batched argmax. Random rows are sampled one by one with each request's own
generator, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from kernels import fused
from tandem.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row; returns probabilities [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it already does.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits.float(), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> list[int]:
    """logits [N, V] (fp32, on CPU or device), one params/generator per row."""
    if all(p.greedy for p in params):
        return fused.argmax_rows(logits)
    cpu = logits.cpu()
    return [sample_row(cpu[i], p, g or default_generator) for i, (p, g) in enumerate(zip(params, generators))]


def top_logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> dict[int, float]:
    """{token: logprob} for the chosen token and the n most likely ones (raw model distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = {}
    if n > 0:
        vals, idx = logp.topk(n)
        out = dict(zip(idx.tolist(), vals.tolist()))
    for t in tokens:
        out[t] = float(logp[t])
    return out
