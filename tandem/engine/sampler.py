"""Sampler: turns logits rows into tokens — greedy, temperature, top-k, top-p, min-p, per-request
seeded generators — and top-n logprobs.

Greedy rows are one batched argmax. Random rows are sampled one by one with each request's own
generator, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from kernels import fused
from tandem.sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row; returns probabilities [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # The most likely tokens, in order: TOP_P_CANDIDATES of them when they hold top_p of the mass
        # (sorting a 32k vocabulary took 2.2 ms a row on a CPU; the candidates ~0.3), else all.
        k = TOP_P_CANDIDATES
        few = k < probs.shape[-1] and float(probs.max()) * k >= params.top_p  # else they cannot hold it
        sorted_p, order = probs.topk(k) if few else probs.sort(descending=True)
        if few and float(sorted_p.sum()) < params.top_p:
            sorted_p, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it already does.
        keep = order[(sorted_p.cumsum(-1) - sorted_p) < params.top_p]
        probs = torch.zeros_like(probs).index_copy_(0, keep, probs[keep])
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    return draw(filter_logits(logits.float(), params), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` [V] (non-negative, summing to ~1): the inverse CDF at one uniform draw.
    torch.multinomial drew a random number per token on a CPU (0.78 ms a row for 32k tokens); this
    ~0.05 ms. `right=True` never lands on a zero-probability token (its CDF step is empty)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator, argmax: list[int] | None = None) -> list[int]:
    """logits [N, V] (fp32, on CPU or device), one params/generator per row; `argmax`: each row's argmax, where
    the model's call that made the logits took it already (LlamaForCausalLM.fused_argmax)."""
    if all(p.greedy for p in params):
        return argmax if argmax is not None else fused.argmax_rows(logits)
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
