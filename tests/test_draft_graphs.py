"""The greedy draft chains for a GPU (plugins/draft_graphs.py), run eagerly over their static buffers on the CPU
(`capture=False`: what a CUDA graph would capture, without the capture) against the Python passes they replace.
EAGLE: the same drafts at every step, the same head-cache K/V, the same output; padding requests (a batch of 3
runs as 4) that write nothing and change no draft; and the calls it leaves to the Python passes. A draft model:
the same drafts and output, its catch-up as one decode pass where the Python passes run it as a prefill."""

import pytest
import torch
from test_speculative import repeating_prompts
from tiny_models import heldout_code, make_checkpoint, make_eagle_head

from plugins.draft_graphs import DraftGraphs, draft_model_chains, eagle_chains
from tandem import LLM, SamplingParams
from tandem.default_model import default_draft_path

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same ops as the Python passes: fp32 rounding at most (a GPU's bf16: torch's default tolerance)."""
    torch.testing.assert_close(a, b, **(dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else {}))


def chain_for(runner) -> DraftGraphs:
    """The runner's chains (an EagleRunner's or a DraftModelRunner's), captured on a GPU: the same checks there."""
    make = eagle_chains if hasattr(runner, "head") else draft_model_chains
    return make(runner, runner.kv_caches[0].shape[0], capture=runner.device.type == "cuda")


def run(llm: LLM, prompts: list[list[int]], chain: bool, max_tokens: int, batch: int) -> tuple:
    """(outputs, every proposal in order, the drafter's K/V of every position up to the last draft after each
    proposal, the (requests, first-pass rows, padded) of each proposal the chain drafted), drafting through the
    chain (`chain`) or the Python passes (neither uses the CPU's C loop)."""
    runner = llm.engine.speculator.runner
    eagle = hasattr(runner, "head")
    fused, graphs = getattr(runner, "fused", None), runner.graphs
    if eagle:
        runner.fused = fused if chain else None
    runner.graphs = chain_for(runner) if chain else None
    proposals, kv, drafted = [], [], []
    propose = runner.propose
    if chain:
        draft = runner.graphs.draft

        def spy_draft(tokens, states, starts, tables, steps, pads=None):
            out = draft(tokens, states, starts, tables, steps, pads)
            if out is not None:
                drafted.append((len(starts), len(tokens) // len(starts), pads is not None))
            return out

        runner.graphs.draft = spy_draft

    def spy_propose(requests, ks):
        tokens, probs = propose(requests, ks)
        order = sorted(tokens, key=lambda rid: int(rid.rsplit("-", 1)[1]))  # submission order
        proposals.append([tokens[rid] for rid in order])
        by_id, bs = {r.request_id: r for r in requests}, runner.block_size
        for rid in order:  # in position order: block ids differ between runs
            # written: a head up to the next-to-last draft's position, a draft model up to the last's
            n, bt = by_id[rid].num_tokens + len(tokens[rid]) - (2 if eagle else 1), runner.seqs[rid].block_ids
            kv.append([torch.stack([c[bt[p // bs], :, p % bs] for p in range(n)]) for c in runner.kv_caches])
        return tokens, probs

    runner.propose = spy_propose
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = []
        for first in range(0, len(prompts), batch):
            outs += [o.token_ids for o in llm.generate(prompts[first:first + batch], params)]
    finally:
        del runner.propose
        runner.graphs = graphs
        if eagle:
            runner.fused = fused
    return outs, proposals, kv, drafted


def check_same(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int) -> list[tuple[int, int, bool]]:
    """The (requests, first-pass rows, padded) of each proposal the chain drafted. On a GPU the graph reads a
    full-width block table and pads the batch, which changes the attention kernel's partitioning and the GEMMs'
    row counts: its drafts may then differ from the Python passes' on near-ties, and its K/V by rounding; the
    outputs never do."""
    run(llm, prompts, False, max_tokens, batch)  # both runs below then hit the prefix cache alike
    outs, proposals, caches, drafted = run(llm, prompts, True, max_tokens, batch)
    ref_outs, ref_proposals, ref_caches, _ = run(llm, prompts, False, max_tokens, batch)
    assert outs == ref_outs
    if llm.engine.runner.device.type == "cuda":
        assert sum(a == b for a, b in zip(proposals, ref_proposals)) >= 0.8 * len(ref_proposals)
        return drafted
    assert proposals == ref_proposals and len(caches) == len(ref_caches)
    for step, ref in zip(caches, ref_caches):  # drafted positions' K/V included
        for a, b in zip(step, ref):
            close(a, b)
    return drafted


@pytest.fixture(scope="module")
def shipped_llm():
    llm = LLM(spec_max_batch=8, speculator="eagle", max_model_len=512)
    return llm, [llm.engine.tokenize(s) for s in heldout_code()]


def test_batch_one_chain_drafts_as_the_python_passes(shipped_llm):
    llm, prompts = shipped_llm
    drafted = check_same(llm, prompts, 40, batch=1)
    assert len(drafted) >= 4 * 40 // 5 and not any(p for _, _, p in drafted)  # nearly every proposal, unpadded


def test_equal_batch_and_ragged_batch(shipped_llm):
    """Two requests run as one chain of size 2; three as size 4 (one padding request). Requests that accepted
    different numbers of drafts catch up over different numbers of rows, the short ones padded in front (rows
    that attend and write no K/V): the same drafts and K/V as the Python passes."""
    llm, prompts = shipped_llm
    assert 2 in {b for b, _, _ in check_same(llm, prompts, 24, batch=2)}
    drafted = check_same(llm, prompts, 30, batch=3)
    assert any(b == 3 for b, _, _ in drafted)  # size 4, one padding request
    assert any(p for _, _, p in drafted)  # and a ragged batch's padded first pass


def test_repetition_penalty_is_left_to_the_python_passes(shipped_llm):
    """The chain has no penalties: penalized requests draft in Python (as verification scores), and their
    outputs are those of decoding without speculation."""
    llm, prompts = shipped_llm
    runner = llm.engine.speculator.runner
    graphs, accepted = runner.graphs, llm.engine.speculator_stats()["num_accepted_tokens"]
    runner.graphs = chain = chain_for(runner)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2)
    try:
        outs = [o.token_ids for o in llm.generate(prompts[:2], params)]
    finally:
        runner.graphs = graphs
    assert chain.replays == 0 and llm.engine.speculator_stats()["num_accepted_tokens"] > accepted  # it speculated
    assert outs == [o.token_ids for o in LLM(max_model_len=512).generate(prompts[:2], params)]


def test_random_head_without_draft_vocabulary(tmp_path):
    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    head = make_eagle_head(str(tmp_path / "head"), path)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="eagle", draft_model=head,
              num_speculative_tokens=3)
    assert llm.engine.speculator.runner.draft_ids is None
    assert check_same(llm, repeating_prompts(seed=5), 24, batch=1)


def test_padding_requests_write_nothing_and_change_no_draft(shipped_llm):
    """Three requests (a chain of size 4: one padding request) draft what each drafts alone, and the head cache
    changes only at the positions the three own: the padding request's rows write no K/V (slot -1)."""
    llm, _ = shipped_llm
    runner = llm.engine.speculator.runner
    chain, caches = chain_for(runner), runner.kv_caches
    hidden = runner.head.config.hidden_size
    g = torch.Generator().manual_seed(0)
    states = torch.randn(6, hidden, generator=g).to(runner.device, chain.states.dtype)
    tokens, starts, tables = [5, 6, 70, 71, 300, 301], [0, 3, 7], [[1], [2], [3]]
    before = [c.clone() for c in caches]
    alone = [chain.draft(tokens[2 * i:2 * i + 2], states[2 * i:2 * i + 2], [starts[i]], [tables[i]], 4)[0]
             for i in range(3)]
    single = [c.clone() for c in caches]
    for c, b in zip(caches, before):
        c.copy_(b)
    together = chain.draft(tokens, states, starts, tables, 4)
    if runner.device.type == "cpu":  # a GPU's GEMMs over 4 rows round otherwise than over 1 (check_same's doc)
        assert together == alone
        for c, s in zip(caches, single):
            close(c, s)
    for c, b in zip(caches, before):
        changed = (c != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [1, 2, 3]  # the requests' blocks; block 0 (the padding's) untouched
        for blk, start in zip((1, 2, 3), starts):  # positions start .. start + 2 + 3 written, no other
            rows = (c[blk] != b[blk]).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
            assert rows == list(range(start, start + 5))


def test_what_the_chain_leaves_to_the_python_passes(shipped_llm):
    llm, _ = shipped_llm
    runner = llm.engine.speculator.runner
    chain = chain_for(runner)
    hidden = runner.head.config.hidden_size
    states = torch.randn(2, hidden).to(runner.device, chain.states.dtype)
    assert chain.draft([5, 6], states, [0], [[0]], 3) is not None
    assert chain.draft([5, 6], states.double(), [0], [[0]], 3) is None  # another dtype than the buffers'
    assert chain.draft([5, 6], states[:1], [0], [[0]], 3) is None  # a state per row
    assert chain.draft([5, 6], states, [0], [[0] * (chain.tables.shape[1] + 1)], 3) is None  # a table too wide
    many = 17
    assert chain.draft([5] * many, torch.randn(many, hidden).to(states), list(range(many)), [[0]] * many, 2) is None
    rows = torch.randn(17, hidden).to(states)
    assert chain.draft(list(range(17)), rows, [0], [[0, 1]], 2) is None  # a first pass above 16 rows
    assert chain.draft([5, 6], states, [0], [[0]], 0) is None  # no draft asked for
    bs = runner.block_size
    assert chain.draft([5, 6], states, [bs - 5], [[0]], 4) is not None  # last pass at position bs - 1: block 0's
    assert chain.draft([5, 6], states, [bs - 4], [[0]], 4) is None  # position bs: past the request's one block


def test_chains_captured_at_start_cover_every_first_pass_length(shipped_llm):
    """At start a GPU's runner captures the chain of every first-pass length (1 to k + 1 rows: the drafts a
    request accepted, plus one) and draft count (1 to k) at every padded size up to spec_max_batch, so no
    proposal waits for a capture."""
    llm, _ = shipped_llm
    chain = chain_for(llm.engine.speculator.runner)
    expected = {(1, q, k) for q in range(1, 6) for k in range(1, 5)}  # k lowered near max_tokens: 1 to 4 drafts
    assert chain.capture_all(4, 1) == 20 and set(chain.chains) == expected
    assert chain.capture_all(4, 3) == 60 and {size for size, _, _ in chain.chains} == {1, 2, 4}
    assert chain.capture_all(4, 8) == 80


def test_draft_model_chain_drafts_as_the_python_passes():
    """The shipped draft model's proposals through its chain — its catch-up of 1 or 2 tokens as one decode pass,
    then the one-token passes — equal the Python passes' (whose catch-up runs as a prefill pass): every draft,
    the draft cache's K/V up to the last draft, the output; alone and three requests at a time (one padding
    request); a catch-up longer than the 2 tokens captured at start (a prompt) stays with the Python passes."""
    llm = LLM(speculator="draft_model", draft_model=default_draft_path(), max_model_len=512, spec_max_batch=8)
    prompts = [llm.engine.tokenize(s) for s in heldout_code()][:4]
    short = [prompts[0][:8]]  # its first proposal catches up 8 tokens: the Python passes'
    alone, three = check_same(llm, short + prompts, 40, batch=1), check_same(llm, prompts[1:], 40, batch=3)
    assert {q for _, q, _ in alone} == {1, 2} and len(alone) > 4 * 40 // 5 // 2
    assert {b for b, _, _ in three} >= {3} and all(q <= 2 for _, q, _ in alone + three)
