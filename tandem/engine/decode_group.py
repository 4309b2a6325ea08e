"""Which requests of a step attend from the cache as one decode batch (`decode_group`), the rest taking the
varlen prefill path; `ModelRunner.execute` builds the step from it, padding short queries of a ragged group."""

from __future__ import annotations

from collections import Counter

from tandem.engine.scheduler import ScheduledRequest

MAX_DECODE_QUERY_LEN = 16  # larger uniform query lengths go through the varlen prefill path
MAX_PADDED_ROWS = 16  # a decode group of ragged query lengths is padded while it stays this small


def decode_group(scheduled: list[ScheduledRequest], pad: bool = True) -> tuple[int, list[ScheduledRequest]]:
    """Requests past their prompt with a small query attend from the cache in one batch of query length q;
    the rest take the varlen prefill path. Speculation makes lengths ragged: while q x the group fits
    MAX_PADDED_ROWS, q is the longest and `execute` pads short queries in front with computed tokens (not
    under a sliding window: their keys may be released); else q is the most common length."""
    def eligible(s: ScheduledRequest) -> bool:
        return s.request.num_computed_tokens > 0 and s.num_new_tokens <= MAX_DECODE_QUERY_LEN and s.samples

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
