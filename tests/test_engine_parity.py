"""Greedy output of the engine is token-identical to transformers on the four architectures, also
with prefix caching off, with chunked prefill on a small budget, and with a block pool small
enough to force preemption (recompute)."""

import random

import pytest
from tiny_models import hf_greedy, make_checkpoint

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
LENGTHS = [1, 3, 17, 32, 64, 130, 257, 300]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)
    rng = random.Random(hash(request.param) % 1000)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


VARIANTS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_64": dict(max_num_batched_tokens=64),
    "preempt": dict(num_kv_blocks=36, max_model_len=512),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_transformers(case, variant):
    path, prompts, expected = case
    # fp32 everywhere: on a GPU too (where dtype "auto" would be bf16), so the tokens must be transformers'
    options = dict(num_kv_blocks=256, max_model_len=512, dtype="float32") | VARIANTS[variant]
    llm = LLM(path, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
        assert out.finish_reason == "length"
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used == 0
