"""Prefix caching: a shared prefix is computed once, hits are reported, output is unchanged, and
freed blocks keep their content until reused (a later request revives them)."""

import random

import pytest
from tiny_models import make_checkpoint

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def _prompts():
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(200)]
    return [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (9, 23)]


def test_shared_prefix_hits_and_same_output(model_path):
    a, b = _prompts()
    cached = LLM(model_path, num_kv_blocks=128, max_model_len=512)
    first = cached.generate([a], GREEDY)[0]
    second = cached.generate([b], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 192  # 12 full blocks of the 200-token prefix
    stats = cached.engine.kv.stats()
    assert stats.prefix_hit_tokens == second.num_cached_tokens
    assert stats.prefix_queried_tokens == len(a) + len(b)
    plain = LLM(model_path, num_kv_blocks=128, max_model_len=512, enable_prefix_caching=False)
    assert plain.generate([b], GREEDY)[0].token_ids == second.token_ids
    assert plain.generate([b], GREEDY)[0].num_cached_tokens == 0
    cached.engine.check_invariants()
    plain.engine.check_invariants()


def test_identical_prompt_recomputes_only_last_token(model_path):
    a, _ = _prompts()
    llm = LLM(model_path, num_kv_blocks=128, max_model_len=512)
    one = llm.generate([a], GREEDY)[0]
    two = llm.generate([a], GREEDY)[0]
    # All full blocks hit, but at least one prompt token is always recomputed for its logits.
    assert two.num_cached_tokens == (len(a) - 1) // 16 * 16
    assert one.token_ids == two.token_ids
    llm.engine.check_invariants()


def test_evicted_blocks_are_not_hits(model_path):
    a, _ = _prompts()
    rng = random.Random(3)
    llm = LLM(model_path, num_kv_blocks=40, max_model_len=512)
    llm.generate([a], GREEDY)
    # Fill the pool with unrelated prompts so every cached block of `a` is reused.
    llm.generate([[rng.randrange(3, 512) for _ in range(300)] for _ in range(2)], GREEDY)
    again = llm.generate([a], GREEDY)[0]
    assert again.num_cached_tokens < 192
    llm.engine.check_invariants()


def test_concurrent_shared_prefix_in_one_batch(model_path):
    a, b = _prompts()
    llm = LLM(model_path, num_kv_blocks=128, max_model_len=512)
    together = llm.generate([a, b, a], GREEDY)
    alone = LLM(model_path, num_kv_blocks=128, max_model_len=512, enable_prefix_caching=False)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone.generate([a, b, a], GREEDY)]
    llm.engine.check_invariants()


def test_unchunked_long_prompt_is_admitted_beside_running_streams(model_path):
    # Without chunking, a max_model_len-sized prompt must not wait for running decodes to finish.
    llm = LLM(model_path, num_kv_blocks=256, max_model_len=512, enable_chunked_prefill=False,
              max_num_batched_tokens=64)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"s{i}", [5 + i] * 10, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()
    eng.add_request("long", [9] * 510, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert eng.scheduler.requests["long"].num_computed_tokens == 510
    assert all(eng.scheduler.requests[f"s{i}"].num_output_tokens == 2 for i in range(4))
    for rid in ["long"] + [f"s{i}" for i in range(4)]:
        eng.abort_request(rid)
    eng.check_invariants()
