"""Speculative decoding verification math (tandem/engine/spec_decode.py) and the ngram lookup:
greedy acceptance, distribution-preserving rejection sampling (chi-square on 50k draws, alpha = 1e-3),
sampling filters, truncation at stop conditions."""

import random

import pytest
import torch

from plugins.speculators import ngram_lookup
from tandem import SamplingParams
from tandem.engine.request import Request
from tandem.engine.spec_decode import greedy_verify, rejection_verify, truncate_at_stop, verify

ALPHA = 1e-3  # significance level of the distribution tests (fixed seeds: deterministic outcomes)


def test_greedy_verify_accepts_matching_prefix_then_target_token():
    assert greedy_verify([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([4, 6], [5]) == [4]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs. Cells expected fewer than 5 times are pooled
    into one (Cochran's rule): one draw of a 1e-5 outcome must not read as a broken sampler."""
    n = counts.sum()
    expected = probs.cpu() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    counts, expected = counts[keep], expected[keep]
    rare = expected < 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum().view(1)])
        expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("proposal", ["draft_distribution", "point_mass"])
def test_rejection_sampling_preserves_target_distribution(proposal):
    """50k verifications on a 6-token vocabulary: the first emitted token is distributed as p0 and,
    when the first draft token was accepted, the second as p1 (chi-square, alpha = 1e-3)."""
    g = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                      [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]], dtype=torch.float64)
    q = torch.tensor([[0.10, 0.10, 0.40, 0.10, 0.10, 0.20],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]], dtype=torch.float64)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(50_000):
        if proposal == "point_mass":  # ngram: always the same deterministic guess
            draft, q_used = [2, 0], None
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            q_used = q
        out = rejection_verify(p, draft, q_used, g)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
    assert _chi2_pvalue(first, p[0]) > ALPHA
    assert _chi2_pvalue(second, p[1]) > ALPHA


def test_verify_applies_the_requests_sampling_filters():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = verify(logits, [0, 1], None, params, g)
        assert out[-1] in set(torch.topk(logits[len(out) - 1], 3).indices.tolist())
    assert verify(logits, [int(logits[0].argmax()), 9], None, SamplingParams(temperature=0), None) == \
        [int(logits[0].argmax()), int(logits[1].argmax())]


def test_truncate_at_stop_token_and_max_tokens():
    req = Request("r", [0, 5, 6], SamplingParams(max_tokens=10, stop_token_ids=[42]), {1}, max_tokens=10)
    assert truncate_at_stop(req, [7, 1, 8]) == [7, 1]  # EOS
    assert truncate_at_stop(req, [7, 42, 8]) == [7, 42]  # stop token id
    req.token_ids += [9] * 8  # 8 of 10 output tokens done
    assert truncate_at_stop(req, [7, 8, 9]) == [7, 8]
    assert truncate_at_stop(Request("s", [0], SamplingParams(ignore_eos=True), {1}, 5), [1, 1]) == [1, 1]


def test_ngram_lookup_matches_brute_force():
    def brute(toks, k, max_n, min_n):
        for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
            for s in range(len(toks) - n - 1, -1, -1):
                if toks[s:s + n] == toks[-n:]:
                    return toks[s + n:s + n + k]
        return []

    rng = random.Random(0)
    for _ in range(500):
        toks = [rng.choice([0, 1, 2, 256, 65536, 70000]) for _ in range(rng.randrange(1, 30))]
        assert ngram_lookup(toks, 4, 3, 1) == brute(toks, 4, 3, 1), toks
    assert ngram_lookup([9, 1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]
