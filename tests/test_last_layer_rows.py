"""The last layer computes only the rows that sample (AttentionMetadata.out_rows): every row's K/V is
stored, then attention, o_proj and the MLP run for the sampled rows alone, each as a one-token query
over the cache. Exact against transformers with chunked prefill (middle chunks sample nothing, so
their last layer stops at K/V), mixed prefill + decode steps, a sliding window, GQA and preemption;
off where every row's final hidden state is kept (EAGLE)."""

import random

import pytest
from tiny_models import hf_greedy, make_checkpoint, make_eagle_head

from tandem import LLM, SamplingParams
from tandem.layers import attention

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

NEW = 24


@pytest.fixture
def narrowed(monkeypatch):
    """(rows the last layer was asked for, rows in the step) of every narrowed call."""
    calls: list[tuple[int, int]] = []
    real = attention.Attention._out_rows

    def spy(self, q, ops, cache, scales, meta):
        calls.append((len(meta.out_rows), q.shape[0]))
        return real(self, q, ops, cache, scales, meta)

    monkeypatch.setattr(attention.Attention, "_out_rows", spy)
    return calls


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # mistral: window 32; qwen2: GQA + bias
def test_only_sampled_rows_past_the_last_kv_and_tokens_stay_transformers(arch, tmp_path, narrowed):
    path = make_checkpoint(str(tmp_path / arch), arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 97, 150, 233)]
    # 48-token steps: long prompts run in chunks beside other requests' decode rows.
    llm = LLM(path, num_kv_blocks=256, max_model_len=512, dtype="float32", max_num_batched_tokens=48)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(path, prompts, NEW)
    assert any(0 < k < t for k, t in narrowed)  # prompt rows beside other requests' decode rows
    assert all(k < t for k, t in narrowed)
    narrowed.clear()
    alone = [[rng.randrange(3, 512) for _ in range(233)]]  # a new long prompt by itself: middle chunks sample nothing
    assert [o.token_ids for o in llm.generate(alone, greedy)] == hf_greedy(path, alone, NEW)
    assert (0, 48) in narrowed and (1, 233 - 4 * 48) in narrowed
    llm.engine.check_invariants()


def test_preemption_and_prefix_hits_through_narrowed_steps(tmp_path, narrowed):
    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(64)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (60, 90, 120, 150, 180, 200)]
    llm = LLM(path, num_kv_blocks=36, max_model_len=512, dtype="float32", max_num_batched_tokens=64)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(path, prompts, NEW)
    assert llm.engine.scheduler.num_preemptions > 0 and narrowed


def test_a_speculator_that_keeps_hidden_states_gets_every_row(tmp_path, narrowed):
    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    head = make_eagle_head(str(tmp_path / "head"), path)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, dtype="float32", spec_max_batch=8, speculator="eagle",
              draft_model=head, num_speculative_tokens=3)
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 9]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(path, prompts, 16)
    assert narrowed == []
