"""An EAGLE head's draft vocabulary (EAGLE-3's `d2t`, tandem/models/eagle.py): every draft is one of its
tokens, in the C draft loop and in the Python passes alike, greedy output stays the target's; a map that
is not one (out of the vocabulary, out of order, the wrong length) is refused at start with a message
naming it. (Sampled output's distribution under a draft vocabulary: test_eagle.py's chi-square test,
`eagle-draft-vocab`; how tools/train_eagle.py picks one: test_train_eagle.py.)"""

import pytest
import torch
from test_speculative import check_clean, repeating_prompts
from tiny_models import assert_cli_refuses, hf_greedy, make_checkpoint, make_eagle_head

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'


def spy_on_drafts(runner) -> list[int]:
    """Every token runner proposes from now on, appended to the list returned."""
    drafted: list[int] = []
    propose = runner.propose

    def spy(requests, ks):
        tokens, probs = propose(requests, ks)
        drafted.extend(t for toks in tokens.values() for t in toks)
        return tokens, probs

    runner.propose = spy
    return drafted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.mark.parametrize("fused", [True, False], ids=["c-loop", "python-passes"])
def test_drafts_come_from_the_draft_vocabulary_and_output_is_the_targets(target, tmp_path, fused):
    prompts = repeating_prompts(seed=3)
    # The prompts' own tokens and every third other id: drafts that copy the prompt can be accepted.
    allowed = sorted({t for p in prompts for t in p} | set(range(0, 512, 3)))
    head = make_eagle_head(str(tmp_path / "head"), target, draft_ids=allowed)
    llm = LLM(target, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="eagle", draft_model=head,
              num_speculative_tokens=3)
    runner = llm.engine.speculator.runner
    assert runner.lm_head.weight.shape == (len(allowed), 64)
    assert torch.equal(runner.lm_head.weight, llm.engine.runner.model.lm_head.weight[allowed])
    if not fused:
        runner.fused = None
    drafted = spy_on_drafts(runner)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(target, prompts, 32)
    assert drafted and set(drafted) <= set(allowed)
    check_clean(llm)


def test_shipped_head_drafts_among_its_1024_tokens():
    llm = LLM(max_model_len=256, speculator="eagle")
    runner = llm.engine.speculator.runner
    ids = runner.draft_ids
    assert ids is not None and len(ids) == 1024 and runner.fused is not None and runner.fused.draft_ids is not None
    prompt = llm.engine.tokenize("def parse(self, text):\n    for line in text.splitlines():\n")
    drafted = spy_on_drafts(runner)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert drafted and set(drafted) <= set(ids.tolist())


@pytest.mark.parametrize("draft_ids, size, message", [
    ([0, 5, 600], None, "distinct target ids in ascending order within the target's 512-token vocabulary"),
    ([5, 3, 7], None, "distinct target ids in ascending order"),
    ([1, 2, 3], 4, "draft_vocab_size 4 needs a 1-d integer tensor d2t of that many offsets"),
    (None, 100, "draft_vocab_size 100 needs a 1-d integer tensor d2t"),
])
def test_a_bad_draft_vocabulary_is_refused_at_start(target, tmp_path, draft_ids, size, message):
    head = make_eagle_head(str(tmp_path / "head"), target, draft_ids=draft_ids,
                           **({} if size is None else {"draft_vocab_size": size}))
    with pytest.raises(ValueError, match=message):
        LLM(target, num_kv_blocks=64, speculator="eagle", draft_model=head)
    assert_cli_refuses(target, head, "d2t")
