"""EAGLE's head over a new prompt runs in the step that computed the prompt (`Speculator.catch_up`), not in
the first decode step: alone, after the prefill step the head holds positions 0..n-3, the first proposal
feeds one row (every pass in C), and its drafts and head K/V are those of a head that caught up inside
`propose` as before. Beside another stream it runs at most CATCH_UP_TOKENS positions a step: the request
catches up over the next steps, undrafted, then proposes from the positions still behind, with the same
head K/V and outputs as one pass; prompts that arrive together with nothing else running catch up whole in
their prefill step. With speculation off (more requests than spec_max_batch) nothing runs."""

import pytest
import torch
from tiny_models import heldout_code

from plugins.eagle import CATCH_UP_TOKENS, EagleRunner
from tandem import LLM, SamplingParams
from tandem.engine.decode_group import MAX_DECODE_QUERY_LEN

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def head_kv(runner, rid: str, n: int) -> list[torch.Tensor]:
    """The head cache's K/V of positions 0..n-1 of a request, in position order."""
    bt, bs = runner.seqs[rid].block_ids, runner.block_size
    return [torch.stack([c[bt[p // bs], :, p % bs] for p in range(n)]) for c in runner.kv_caches]


def spy(runner) -> dict:
    """Record the rows of the head's Python passes, each catch-up pass's rows per request, and how many tokens
    each C draft call starts from."""
    seen: dict = {"forward": [], "shares": [], "drafted_from": []}
    forward, draft, catch_up = runner._forward, runner.fused.draft, runner.catch_up

    def counted_forward(feed, decode, pads=None):
        seen["forward"].append(sum(len(toks) for _, toks, _, _ in feed))
        if seen.get("catching_up"):
            seen["shares"].append({r.request_id: len(toks) for r, toks, _, _ in feed})
        return forward(feed, decode, pads)

    def recorded_draft(tokens, *args):
        seen["drafted_from"].append(len(tokens))
        return draft(tokens, *args)

    def flagged_catch_up(*args, **kwargs):
        seen["catching_up"] = True
        try:
            return catch_up(*args, **kwargs)
        finally:
            seen["catching_up"] = False

    runner._forward, runner.fused.draft, runner.catch_up = counted_forward, recorded_draft, flagged_catch_up
    return seen


def one_pass(runner) -> None:
    """The head catches up inside propose, the whole prompt in one pass (as before the per-step share)."""
    runner.catch_up = lambda requests, budget=0, wanted=None: EagleRunner.catch_up(runner, requests, 1 << 30, wanted)


def test_prompt_is_caught_up_in_its_prefill_step():
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    old = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    old.engine.speculator.catch_up = lambda requests: None  # the head catches up inside propose, as before
    one_pass(old.engine.speculator.runner)
    prompts = [llm.engine.tokenize(s)[:n] for s, n in zip(heldout_code(), (200, 120, 64, 19))]
    runs = {}
    for name, engine in (("new", llm.engine), ("old", old.engine)):
        runner, seen = engine.speculator.runner, spy(engine.speculator.runner)
        for prompt in prompts:
            rid = engine.add_request(None, prompt, PARAMS)
            engine.step()  # the prefill: first token sampled
            req = engine.scheduler.requests[rid]
            assert req.num_tokens == len(prompt) + 1
            caught_up = runner.seqs[rid].num_computed_tokens if rid in runner.seqs else 0
            forwards = len(seen["forward"])
            engine.step()  # the first decode step: propose, verify
            runs.setdefault(name, []).append((caught_up, len(seen["forward"]) - forwards, seen["drafted_from"][-1],
                                              req.token_ids[len(prompt):], head_kv(runner, rid, len(prompt) - 1)))
            while engine.has_unfinished_requests():
                engine.step()
        engine.check_invariants()
    for prompt, new, old_run in zip(prompts, runs["new"], runs["old"]):
        # 0..n-3 in the prefill's step (n = prompt + first token), unless that is short enough for one decode row
        assert new[0] == (len(prompt) - 1 if len(prompt) - 1 > 16 else 0)
        assert old_run[0] == 0
        if len(prompt) - 1 > 16:
            assert new[1:3] == (0, 1)  # no Python pass: one row into the C draft loop
            assert old_run[1] == 1  # the whole prompt through the head's Python pass first
        assert new[3] == old_run[3]  # same tokens after the first decode step (drafts verified alike)
        for a, b in zip(new[4], old_run[4]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == [o.token_ids for o in old.generate(prompts, PARAMS)]


def test_beside_another_stream_a_prompt_is_caught_up_a_share_a_step():
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    old = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    one_pass(old.engine.speculator.runner)
    text = llm.engine.tokenize("".join(heldout_code()))
    companion, prompt = text[:19], text[19:19 + 2 * CATCH_UP_TOKENS + 20]
    runs = {}
    for name, engine in (("new", llm.engine), ("old", old.engine)):
        runner, seen = engine.speculator.runner, spy(engine.speculator.runner)
        proposed, propose = [], runner.propose

        def recorded_propose(requests, ks):
            tokens, probs = propose(requests, ks)
            proposed.append(set(tokens))
            return tokens, probs

        runner.propose = recorded_propose
        outputs: dict = {}

        def step():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

        other = engine.add_request(None, companion, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
        for _ in range(4):
            step()
        assert other in proposed[-1]  # the companion is drafting
        rid = engine.add_request(None, prompt, PARAMS)
        step()  # the companion's decode step and the prompt's prefill
        caught_up, steps = runner.seqs[rid].num_computed_tokens, 0
        seen["shares"].clear()
        while rid not in proposed[-1]:
            step()
            steps += 1
        shares = [share[rid] for share in seen["shares"] if rid in share]
        runs[name] = (caught_up, steps, shares, head_kv(runner, rid, len(prompt) - 1))
        while engine.has_unfinished_requests():
            step()
        runs[name] += (outputs,)
        engine.check_invariants()
    new, old_run = runs["new"], runs["old"]
    assert new[0] == CATCH_UP_TOKENS and max(new[2]) == CATCH_UP_TOKENS  # a share, in the prefill step too
    assert old_run[0] == len(prompt) - 1  # one pass
    left, rows = len(prompt) - 1 - new[0], []  # behind n-2 at the first decode step
    while left > MAX_DECODE_QUERY_LEN:  # a share a step; the step that comes within one decode query proposes
        rows.append(min(left, CATCH_UP_TOKENS))
        left -= rows[-1]
        if left > MAX_DECODE_QUERY_LEN:
            left += 1  # the next step's n-2 is one further on
    assert new[2] == rows and new[1] == len(rows) and old_run[1] == 1
    for a, b in zip(new[3], old_run[3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert new[4] == old_run[4] and list(map(len, new[4].values())) == [80, PARAMS.max_tokens]


def test_prompts_arriving_together_alone_are_caught_up_whole():
    """Two prompts admitted in one step with nothing else running: no stream to protect, so each is caught up
    whole in the prefill step (shares of CATCH_UP_TOKENS would leave them behind), and outputs are unchanged."""
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    engine, runner = llm.engine, llm.engine.speculator.runner
    prompts = [engine.tokenize(s)[:n] for s, n in zip(heldout_code(), (2 * CATCH_UP_TOKENS + 9, CATCH_UP_TOKENS + 40))]
    ids = [engine.add_request(None, prompt, PARAMS) for prompt in prompts]
    engine.step()
    assert [runner.seqs[rid].num_computed_tokens for rid in ids] == [len(p) - 1 for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    plain = LLM(max_model_len=512, dtype="float32").generate(prompts, PARAMS)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == [o.token_ids for o in plain]


def test_nothing_is_caught_up_where_no_proposal_follows():
    """Two prompts in one step with spec_max_batch 1: speculation is off, so is the head's catch-up. One
    prompt alone whose max_tokens leaves no room for a draft (2: the first token, then one more) is not
    caught up either; with max_tokens 3 it is."""
    llm = LLM(max_model_len=512, spec_max_batch=1, speculator="eagle", dtype="float32")
    engine, seqs = llm.engine, llm.engine.speculator.runner.seqs
    prompts = [engine.tokenize(s)[:100] for s in heldout_code()[:2]]
    ids = [engine.add_request(None, prompt, PARAMS) for prompt in prompts]
    engine.step()
    # the target states were handed over (observe); the head ran on none
    assert len(engine.scheduler.running) == 2 and sorted(seqs) == sorted(ids)
    assert all(seq.num_computed_tokens == 0 and not seq.block_ids for seq in seqs.values())
    for rid in ids:
        engine.abort_request(rid)
    for max_tokens, caught_up in ((2, 0), (3, len(prompts[0]) - 1)):
        rid = engine.add_request(None, prompts[0], SamplingParams(temperature=0, max_tokens=max_tokens))
        engine.step()
        assert seqs[rid].num_computed_tokens == caught_up
        while engine.has_unfinished_requests():
            engine.step()
