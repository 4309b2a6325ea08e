"""The EAGLE draft loop in C (plugins/eagle_fused.py, kernels/csrc/eagle_draft_cpu.c) against the Python
passes it replaces: the same drafts, bitwise the same head-cache K/V, the same output — at batch 1 (every
pass in C), for a batch whose catch-ups differ in length (padded in front to one decode pass, in C and in
Python), and on a random tiny checkpoint and head; padding that writes nothing and changes no draft; and a
block table outside the head's cache refused before anything is written."""

import pytest
import torch
from test_speculative import repeating_prompts
from tiny_models import heldout_code, make_checkpoint, make_eagle_head

from plugins.draft_model import padded
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'


def run(llm: LLM, prompts: list[list[int]], fused: bool, max_tokens: int, batch: int, penalty: float = 1.0) -> tuple:
    """(outputs, every proposal in order, the head's K/V after each, [C calls that drafted, of them padded])."""
    runner = llm.engine.speculator.runner
    drafter = runner.fused
    runner.fused = drafter if fused else None
    proposals, kv, calls = [], [], [0, 0]
    propose, draft = runner.propose, drafter.draft

    def spy_propose(requests, ks):
        tokens, probs = propose(requests, ks)
        # request ids differ between runs (a counter); their order is the submission order
        order = sorted(tokens, key=lambda rid: int(rid.rsplit("-", 1)[1]))
        proposals.append([tokens[rid] for rid in order])
        # the head cache's K/V of every position up to the last draft, in position order (block ids differ
        # between runs: the block manager's free list is in another order after the first)
        by_id = {r.request_id: r for r in requests}
        for rid in order:
            n, bt = by_id[rid].num_tokens + len(tokens[rid]) - 2, runner.seqs[rid].block_ids
            bs = runner.block_size
            kv.append([torch.stack([c[bt[p // bs], :, p % bs] for p in range(n)]) for c in runner.kv_caches])
        return tokens, probs

    def spy_draft(*args):
        out = draft(*args)
        calls[0] += out is not None
        calls[1] += out is not None and len(args) > 6 and args[6] is not None  # pads
        return out

    runner.propose, drafter.draft = spy_propose, spy_draft
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=penalty)
        outs = []
        for first in range(0, len(prompts), batch):
            outs += [o.token_ids for o in llm.generate(prompts[first:first + batch], params)]
    finally:
        del runner.propose
        del drafter.draft
        runner.fused = drafter
    return outs, proposals, kv, calls


def check_same(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int, penalty: float = 1.0) -> list[int]:
    # Once first, so that both runs below hit the prefix cache alike: a prompt's tail recomputed after a hit
    # gives the target's hidden states (the head's input) in other bits than a whole-prompt prefill.
    run(llm, prompts, False, max_tokens, batch, penalty)
    outs, proposals, caches, calls = run(llm, prompts, True, max_tokens, batch, penalty)
    ref_outs, ref_proposals, ref_caches, ref_calls = run(llm, prompts, False, max_tokens, batch, penalty)
    assert ref_calls[0] == 0 and outs == ref_outs
    assert proposals == ref_proposals  # every draft of every step
    assert len(caches) == len(ref_caches) and all(  # drafted positions' K/V included
        torch.equal(a, b) for step, ref in zip(caches, ref_caches) for a, b in zip(step, ref))
    return calls


@pytest.fixture(scope="module")
def shipped_llm():
    llm = LLM(spec_max_batch=8, speculator="eagle", max_model_len=512)
    return llm, [llm.engine.tokenize(s) for s in heldout_code()]


def test_batch_one_drafts_every_pass_in_c_as_python_does(shipped_llm):
    llm, prompts = shipped_llm
    calls, padded = check_same(llm, prompts, 48, batch=1)
    stats = llm.engine.speculator_stats()
    assert stats["num_accepted_tokens"] > 0 and calls >= 4 * 48 // 5 and padded == 0  # nearly every proposal


def test_repetition_penalty_drafts_the_same_in_c_and_python_and_is_applied(shipped_llm):
    """The shipped model serves with repetition_penalty 1.2: drafts follow the penalized argmax (the C loop
    scales the seen columns and marks each draft; the Python passes alike), bitwise the same drafts; and a
    column the penalty scales far down is not drafted."""
    llm, prompts = shipped_llm
    assert check_same(llm, prompts, 40, batch=2, penalty=1.2)[0] > 0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    alone = [o.token_ids for o in LLM(max_model_len=512).generate(prompts, params)]  # no speculation
    assert run(llm, prompts, True, 40, 2, penalty=1.2)[0] == alone
    runner = llm.engine.speculator.runner
    states = torch.randn(2, runner.head.config.hidden_size)
    base = runner.fused.draft([5, 6], states, [0], [[0]], 3)
    marks = torch.zeros((1, runner.fused.vocab_size), dtype=torch.uint8)
    marks[0, torch.searchsorted(runner.draft_ids, torch.tensor(base[0][0]))] = 1  # the first draft's column
    again = runner.fused.draft([5, 6], states, [0], [[0]], 3, ([1e6], marks))
    assert again[0][0] != base[0][0]  # a token the penalty scales far down is not drafted


def test_batch_with_unequal_catch_ups_drafts_the_same(shipped_llm):
    llm, prompts = shipped_llm
    # Requests accept different numbers of drafts, so their next catch-ups differ in length: padded to one
    # decode pass (C) where the rows fit (3 x 5), else varlen in Python (4 x 5), the later passes in C;
    # max_tokens near the end trims k (Python).
    calls, padded = check_same(llm, prompts, 30, batch=3)
    assert calls > 0 and padded > 0
    assert check_same(llm, prompts, 30, batch=4)[0] > 0


def test_random_head_on_tiny_checkpoint_drafts_the_same(tmp_path):
    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    head = make_eagle_head(str(tmp_path / "head"), path)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="eagle", draft_model=head,
              num_speculative_tokens=3)
    assert check_same(llm, repeating_prompts(seed=5), 24, batch=1)[0] > 0


def test_block_outside_the_head_cache_is_refused_before_writing(shipped_llm):
    llm, _ = shipped_llm
    runner = llm.engine.speculator.runner
    before = [c.clone() for c in runner.kv_caches]
    hidden = runner.head.config.hidden_size
    num_blocks = runner.kv_caches[0].shape[0]
    states = torch.randn(2, hidden)
    assert runner.fused.draft([5, 6], states, [0], [[0]], 3) is not None  # in range: drafts (and writes)
    for c, b in zip(runner.kv_caches, before):
        c.copy_(b)
    for table, start in (([num_blocks], 0), ([-1], 0), ([0], 15)):  # bad block; position past the table
        assert runner.fused.draft([5, 6], states, [start], [table], 3) is None
        assert all(torch.equal(c, b) for c, b in zip(runner.kv_caches, before))
    assert runner.fused.draft([runner.vocab_size + 7, 6], states, [0], [[0]], 3) is None  # token not embedded




def test_padding_writes_nothing_and_changes_no_draft(shipped_llm):
    """A catch-up of 2 rows drafts as the same 2 rows padded in front by a computed position fed a junk token and
    state (padding attends, writes no K/V): the same drafts, the head cache bitwise the same — the padded
    position's K/V included; without the pad mark its junk K/V would be written there."""
    llm, _ = shipped_llm
    runner = llm.engine.speculator.runner
    caches = runner.kv_caches
    states = torch.randn(4, runner.head.config.hidden_size)
    assert runner.fused.draft([5, 6, 7, 8], states, [0], [[0]], 1) is not None  # positions 0-3 computed
    before = [c.clone() for c in caches]
    plain = runner.fused.draft([7, 8], states[2:].contiguous(), [2], [[0]], 3)
    plain_caches = [c.clone() for c in caches]
    for c, b in zip(caches, before):
        c.copy_(b)
    junk = torch.cat([torch.randn(1, states.shape[1]), states[2:]])
    assert runner.fused.draft([9, 7, 8], junk, [1], [[0]], 3, None, [1]) == plain
    assert all(torch.equal(c, p) for c, p in zip(caches, plain_caches))
    for c, b in zip(caches, before):
        c.copy_(b)
    runner.fused.draft([9, 7, 8], junk, [1], [[0]], 3)  # the same rows unmarked: position 1 overwritten
    assert not all(torch.equal(c, p) for c, p in zip(caches, plain_caches))


def test_a_verifying_step_stays_within_the_one_call_rows(shipped_llm):
    """Four decoding requests drafting k = 4 would verify 20 rows, past the 16 a CPU step runs as one C call
    (every layer's ops one by one: 2x slower steps): each then proposes at most 3 (spec_decode.step_limit),
    while two requests still propose 4; the outputs stay plain greedy decoding's."""
    llm, prompts = shipped_llm
    runner, steps = llm.engine.runner, []  # (requests verifying, most drafts, rows)
    execute = runner.execute

    def recorded_execute(out):
        drafted = [len(s.spec_token_ids) for s in out.scheduled if s.spec_token_ids]
        if drafted:
            steps.append((len(drafted), max(drafted), sum(s.num_new_tokens for s in out.scheduled)))
        return execute(out)

    runner.execute = recorded_execute
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    try:
        outs = [[o.token_ids for o in llm.generate(batch, params)] for batch in (prompts, prompts[:2])]
    finally:
        del runner.execute
    four = [s for s in steps if s[0] == 4]
    assert four and max(d for _, d, _ in four) == 3 and max(rows for _, _, rows in four) <= 16
    assert max(d for n, d, _ in steps if n == 2) == 4
    plain = LLM(max_model_len=512)
    assert outs == [[o.token_ids for o in plain.generate(batch, params)] for batch in (prompts, prompts[:2])]


def test_padded_catch_ups():
    """plugins/draft_model.padded: equal catch-ups as they are; unequal ones padded in front to the longest
    (copies of the first row, started as many positions earlier); None where the rows pass 16, a catch-up
    passes one decode query, or a head has computed fewer positions than its padding."""
    def feed(*spans):  # (rows, first position) -> (request, tokens, states, first position)
        return [(f"r{i}", list(range(10 * i, 10 * i + n)), torch.arange(float(n)).repeat(2, 1).T + i, c)
                for i, (n, c) in enumerate(spans)]

    same = feed((3, 40), (3, 7))
    assert padded(same) == (same, [0, 0])
    out, pads = padded(feed((1, 40), (4, 9), (2, 5)))
    assert pads == [3, 0, 2]
    assert [(toks, c) for _, toks, _, c in out] == [([0, 0, 0, 0], 37), ([10, 11, 12, 13], 9), ([20, 20, 20, 21], 3)]
    assert torch.equal(out[2][2][:, 0], torch.tensor([2.0, 2, 2, 3]))  # the first row thrice, then its own two
    for spans in (((5, 40), (1, 40), (5, 40), (5, 40)),  # 4 x 5 rows > 16
                  ((17, 40), (17, 40)),  # past one decode query
                  ((4, 40), (1, 2))):  # 3 rows of padding before position 2
        assert padded(feed(*spans))[1] is None
