"""Which requests of a step attend from the cache as one decode batch (`decode_group`), the rest taking the
varlen prefill path; `ModelRunner.execute` builds the step from it, padding short queries of a ragged group.

A whole prompt of at most MAX_NEW_PROMPT tokens joins the group too: its rows are Q query tokens over a cache
that holds just their own K/V, which decode attention computes exactly (causal within the query, as for a
speculative verification), and a step of decode rows only can take the CPU's one-call path
(tandem/layers/fused_model.py). Measured (docs/PERFORMANCE.md, session 36): a 1-token prompt's step 2.8 ->
0.7 ms on the shipped model, 9.9 -> 5.9 ms on the 55M benchmark Llama; 16-token prompts were no faster (the
55M slower), so the limit is the one-call path's rows."""

from __future__ import annotations

from collections import Counter

from tandem.engine.scheduler import ScheduledRequest

MAX_DECODE_QUERY_LEN = 16  # larger uniform query lengths go through the varlen prefill path
MAX_PADDED_ROWS = 16  # a decode group of ragged query lengths is padded while it stays this small
MAX_NEW_PROMPT = 8  # a prompt this short (none of it computed) is decode-shaped: see above


def decode_group(scheduled: list[ScheduledRequest], pad: bool = True) -> tuple[int, list[ScheduledRequest]]:
    """Requests past their prompt with a small query (or a whole short prompt) attend from the cache in one
    batch of query length q; the rest take the varlen prefill path. Speculation makes lengths ragged: while q x
    the group fits MAX_PADDED_ROWS, q is the longest and `execute` pads short queries in front with computed
    tokens (not under a sliding window: their keys may be released); else q is the most common length."""
    def eligible(s: ScheduledRequest) -> bool:
        limit = MAX_DECODE_QUERY_LEN if s.request.num_computed_tokens > 0 else MAX_NEW_PROMPT
        return s.num_new_tokens <= limit and s.samples

    lens = Counter(s.num_new_tokens for s in scheduled if eligible(s))
    if not lens:
        return 0, []
    longest = max(lens)
    if pad and len(lens) > 1:
        group = [s for s in scheduled if eligible(s) and s.request.num_computed_tokens >= longest - s.num_new_tokens]
        if len(group) * longest <= MAX_PADDED_ROWS:
            return longest, group
    q = lens.most_common(1)[0][0]
    return q, [s for s in scheduled if eligible(s) and s.num_new_tokens == q]
