"""Speculative decoding in the engine: building the speculator, attaching its proposals to the
decoding requests of a step, and verification — which speculated tokens a request keeps, and its
counters.

One target forward pass scores k+1 positions of a request (its last real token followed by the k
speculated ones); row i holds the target's logits for the token after position i. Verification is
exact, so speculation never changes what a request can produce:

- greedy: keep draft tokens while each equals the target's argmax, then append the target's token
  at the first mismatch (or the bonus token after all k);
- temperature > 0 (Leviathan et al. / Chen et al. speculative sampling): keep draft token x_i with
  probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i));
  after k acceptances sample the bonus token from p_k. `q = None` means a deterministic proposal
  (n-gram lookup): a point mass, so acceptance is p_i(x_i) and the residual is p_i without x_i.

p is the target's distribution *after* the request's temperature/top-k/top-p/min-p, i.e. the one
plain sampling would draw from; every random draw uses the request's own generator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kernels import fused
from tandem.engine.request import Request
from tandem.engine.sampler import draw, filter_logits
from tandem.layers import fused_model
from tandem.layers.linear import SMALL_BATCH
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.interfaces.speculator import Speculator


def greedy_verify(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax has len(draft) + 1 entries; returns accepted draft tokens + one target token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return list(draft[:n]) + [target_argmax[n]]


def rejection_verify(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """target_probs [k+1, V] (rows sum to 1), draft_probs [k, V] or None (point masses).
    Consumes exactly k uniforms and one categorical draw from `generator`."""
    k = len(draft)
    idx = torch.arange(k)
    x = torch.tensor(draft, dtype=torch.long)
    p_x = target_probs[idx, x]
    q_x = draft_probs[idx, x] if draft_probs is not None else torch.ones(k)
    u = torch.rand(k, generator=generator)
    # u < p/q, written without the division so q_x == 0 (impossible for a sampled token) is safe.
    accepted = (u * q_x < p_x).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return list(draft) + [draw(target_probs[k], generator)]
    p = target_probs[n]
    if draft_probs is not None:
        residual = (p - draft_probs[n]).clamp_min(0.0)
    else:
        residual = p.clone()
        residual[draft[n]] = 0.0
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection had probability ~0
        residual = p
    return list(draft[:n]) + [draw(residual / residual.sum(), generator)]


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k+1, V] of one request -> the tokens it keeps (1 to k+1 of them)."""
    if params.greedy:  # the C argmax where it runs (torch's first-maximum rule, NaN included): ~40 us less
        return greedy_verify(fused.argmax_rows(logits), draft)
    rows = logits.float().cpu()
    p = torch.stack([filter_logits(rows[i], params) for i in range(rows.shape[0])])
    q = draft_probs.float().cpu() if draft_probs is not None else None
    return rejection_verify(p, draft, q, generator)


def truncate_at_stop(req: Request, tokens: list[int]) -> list[int]:
    """Cut an accepted run after the token that would finish the request (EOS, a stop token id,
    max_tokens): the same rules as `Request.append_token`, applied before anything is appended."""
    params = req.params
    for i, t in enumerate(tokens):
        if ((not params.ignore_eos and t in req.eos_token_ids) or t in params.stop_token_ids
                or req.num_output_tokens + i + 1 >= req.max_tokens):
            return tokens[:i + 1]
    return tokens


@dataclass(slots=True)
class SpecStats:
    """Counters over all verifications (for metrics): proposals are counted before truncation."""

    num_verifications: int = 0  # request-steps that verified at least one speculated token
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens produced by verifying steps (accepted + one each), after truncation
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: times draft position i was kept
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.num_verifications += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    def as_dict(self) -> dict:
        v = self.num_verifications
        return {
            "num_verifications": v,
            "num_drafted_tokens": self.num_drafted_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_rate": self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0,
            # Draft tokens kept per verifying step; tokens per step is this + 1.
            "mean_accepted_length": self.num_accepted_tokens / v if v else 0.0,
        }


def cut_runs_at_stop_strings(sampled: dict[str, list[int]], logits: dict[str, torch.Tensor],
                             requests: dict[str, Request], detoks: dict, texts: dict[str, str]) -> None:
    """A stop string completed inside an accepted run ends the request there, as one-token steps
    would: replay the run through a copy of the request's detokenizer token by token (only for
    requests with stop strings and a multi-token run) and cut the run before it is appended."""
    for rid, run in sampled.items():
        req, detok = requests.get(rid), detoks.get(rid)
        if len(run) < 2 or req is None or not req.params.stop or detok is None:
            continue
        sim = copy.deepcopy(detok, {id(detok.tokenizer): detok.tokenizer})  # shares only the tokenizer
        before = texts.get(rid, "")
        text, lookback = before, max(len(before) - max(map(len, req.params.stop)) + 1, 0)
        for i, t in enumerate(run[:-1]):
            text += sim.add([t])
            if any(stop in text[lookback:] for stop in req.params.stop):
                sampled[rid] = run[:i + 1]
                logits[rid] = logits[rid][:i + 1]
                break


def wants_hidden_states(config: Any) -> bool:
    """Whether the configured speculator drafts from the target's hidden states (decided before the
    KV cache is allocated: such an engine keeps them in hidden-state layers of the cache)."""
    if config.speculator is None:
        return False
    from tandem.engine.strategies import resolve_speculator

    return bool(resolve_speculator(config.speculator).wants_hidden_states)


def build_speculator(config: Any, model_config: Any, max_model_len: int, runner: Any) -> "Speculator | None":
    """Resolve the speculator by name once (never per step) and build it; None without one."""
    if config.speculator is None:
        return None
    from tandem.engine.interfaces.speculator import SpeculatorContext
    from tandem.engine.strategies import resolve_speculator

    cls = resolve_speculator(config.speculator)
    spec = cls(SpeculatorContext(config, model_config, max_model_len, config.torch_device, config.torch_dtype,
                                 target=runner))
    runner.keep_hidden = spec.wants_hidden_states
    return spec


def prompts_completed(scheduled: Sequence[Any]) -> list[Request]:
    """The requests whose prompt (or recompute after a preemption) a step completes: several rows that
    sample, not a decode row with its proposals. Read before the step's `update`."""
    return [s.request for s in scheduled if s.samples and s.num_new_tokens > 1 + len(s.spec_token_ids)]


def attach_proposals(spec: "Speculator", running: Sequence[Request], runner: Any, max_batch: int) -> bool:
    """Ask the speculator for proposals for the decoding requests; they ride along in this step's
    schedule (num_new_tokens = 1 + k) and the runner verifies them. Returns whether speculation is
    on: off while more than `max_batch` requests run (verification would cost more than it saves)."""
    # Proposals live one step: a request the token budget skipped must not carry old tokens
    # whose draft distributions are gone (they would be verified as point masses).
    runner.draft_probs = {}
    for r in running:
        r.spec_token_ids = []
    if len(running) > max_batch:
        return False
    # Decoding = everything but the last sampled token is computed (not mid-prefill).
    reqs = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and spec.num_to_propose(r) > 0]
    spec.step_limit = step_limit(runner, len(reqs), spec.k)
    try:
        if not reqs:
            return True
        proposals = spec.propose(reqs)
        probs = {}
        for r in reqs:
            toks = proposals.get(r.request_id, [])[:spec.num_to_propose(r)]
            r.spec_token_ids = toks
            if toks and r.request_id in spec.draft_probs:
                probs[r.request_id] = spec.draft_probs[r.request_id][:len(toks)]
        runner.draft_probs = probs
    finally:
        spec.step_limit = None
    return True


def step_limit(runner: Any, batch: int, k: int) -> int | None:
    """Proposals per request that keep a verifying step of `batch` requests within the rows the CPU runs as
    one C call (tandem/layers/fused_model.py: 16, or 8 where a linear reads fp32 weights); None: k fits, not
    even one proposal each would (the step leaves that path whatever k), or no such path (a GPU, no native
    kernels). Past those rows every layer's ops run one by one: the shipped model, EAGLE k=4 at batch 4 (20
    rows) ran 13.8 ms steps (0.40x no speculation); k=3 (16 rows) 6.9 ms."""
    if batch * (k + 1) <= SMALL_BATCH or runner.ops.name != "native":
        return None
    rows = fused_model.stack_rows(runner.model.model, runner.kv_caches) if hasattr(runner.model, "model") else None
    return None if rows is None or batch * (k + 1) <= rows or rows < 2 * batch else rows // batch - 1
