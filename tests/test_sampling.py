"""Sampling and stopping: seeds, top-k/top-p/min-p, stop strings and ids, logprobs, streaming text."""

import math

import pytest
import torch
from tiny_models import make_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine.sampler import filter_logits

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # fp32: checked against transformers in fp32 (a GPU's auto dtype is bf16)
    return LLM(make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama"), num_kv_blocks=128, max_model_len=512,
               dtype="float32")


PROMPTS = ["def main():", "import os\nimport sys", "class Foo:\n    pass"]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                                     SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True)])
    assert batched[0].token_ids == alone
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != alone
    llm.engine.check_invariants()


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))
    assert (filter_logits(logits, SamplingParams(top_k=2)) > 0).tolist() == [True, True, False, False, False]
    # top_p 0.8: 0.5 + 0.25 = 0.75 < 0.8 so the third token is still needed.
    assert (filter_logits(logits, SamplingParams(top_p=0.8)) > 0).tolist() == [True, True, True, False, False]
    assert (filter_logits(logits, SamplingParams(top_p=0.75)) > 0).tolist() == [True, True, False, False, False]
    # min_p 0.3: keep p >= 0.15.
    assert (filter_logits(logits, SamplingParams(min_p=0.3)) > 0).tolist() == [True, True, True, False, False]
    probs = filter_logits(logits, SamplingParams(temperature=0.5))
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_stop_token_ids_end_generation(llm):
    base = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_stop_strings_truncate_text(llm):
    base = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)
    llm.engine.check_invariants()


def test_eos_ends_unless_ignored(llm):
    eos = 1  # tiny_models: eos_token_id=1
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    # Force EOS through a stop-id-free path: a seeded sampler over a distribution where eos is certain
    # is not available on a random model, so check the Request rule directly.
    from tandem.engine.request import Request

    req = Request("r", [5], SamplingParams(max_tokens=8), {eos}, 8)
    assert req.append_token(eos) and req.finish_reason == "stop"
    req2 = Request("r2", [5], SamplingParams(max_tokens=8, ignore_eos=True), {eos}, 8)
    assert not req2.append_token(eos)


def test_logprobs(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 6
    for tok, lp in zip(out.token_ids, lps):
        assert tok in lp
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
        assert len(lp) >= 3


def test_streaming_deltas_add_up_to_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    deltas = [o.text_delta for o in llm.stream(PROMPTS[0], params)]
    final = llm.generate([PROMPTS[0]], params)[0]
    assert "".join(deltas) == final.text
    assert len([d for d in deltas if d]) > 1


def test_streamed_outputs_share_one_prompt_list_and_snapshot_their_tokens(llm):
    """Every output of a request carries the same prompt list (made once, not sliced per step: O(prompt) per
    running request per step) and its own snapshot of the tokens so far (an earlier output does not grow)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = list(llm.stream(PROMPTS[0], params))
    assert len(outs) >= 12
    assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(PROMPTS[0])
    assert [len(o.token_ids) for o in outs] == sorted(len(o.token_ids) for o in outs)
    assert len(outs[0].token_ids) < len(outs[-1].token_ids) == 12
    assert outs[-1].token_ids[:len(outs[0].token_ids)] == outs[0].token_ids


def test_multibyte_characters_split_across_tokens_stream_whole(llm):
    from tandem.tokenizer import IncrementalDetokenizer

    tok = llm.tokenizer
    text = " ünïcode ✓ 日本語 テキスト 😀 done"
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE: some characters span several tokens; every delta must be whole characters.
    assert any("\ufffd" in tok.decode([i]) for i in ids), "corpus should split some multi-byte chars"
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_greedy_logprob_sum_matches_score(llm):
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True))[0]
    scored = llm.score([5, 6, 7, 8] + out.token_ids)
    generated = [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.token_ids)]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scored[-5:], generated))


def test_prompt_logprobs_equal_transformers_also_from_the_prefix_cache(llm):
    """SamplingParams.prompt_logprobs: per prompt token (None for the first) the token's logprob given
    its prefix and the top-n, equal to transformers' log_softmax on the same weights; a second request
    whose prompt is all in the prefix cache still gets every position."""
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # > one 16-token block
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first, cached = (llm.generate([prompt], params)[0] for _ in range(2))
    assert cached.num_cached_tokens >= 16  # the second one's KV came from the cache
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.config.model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for out in (first, cached):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            want = set(ref[pos].topk(3).indices.tolist()) | {prompt[pos + 1]}
            assert set(entry) == want
            assert all(math.isclose(entry[t], float(ref[pos, t]), abs_tol=1e-4) for t in want)


def test_top_p_over_a_large_vocabulary_keeps_what_the_full_sort_keeps():
    """filter_logits takes the nucleus from the TOP_P_CANDIDATES best tokens when they hold top_p of
    the mass (a peaked row) and sorts the whole row otherwise (a flat one): both keep exactly the
    smallest most-likely set whose mass reaches top_p."""
    from tandem.engine import sampler

    from_candidates = 0
    for seed, scale in [(0, 0.5), (1, 8.0), (2, 3.0)]:
        row = torch.randn(20000, generator=torch.Generator().manual_seed(seed)) * scale
        probs = torch.softmax(row, -1)
        sp, order = probs.sort(descending=True)
        for top_p in (0.5, 0.9, 0.99):
            from_candidates += float(sp[:sampler.TOP_P_CANDIDATES].sum()) >= top_p
            drop = torch.zeros(20000, dtype=torch.bool).scatter(0, order, (sp.cumsum(0) - sp) >= top_p)
            want = probs.masked_fill(drop, 0.0)
            torch.testing.assert_close(filter_logits(row, SamplingParams(top_p=top_p)), want / want.sum(),
                                       atol=1e-7, rtol=0)
    assert 0 < from_candidates < 9  # both routes taken


def test_a_draw_follows_the_distribution_and_never_takes_a_zero():
    from tandem.engine.sampler import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(20000):
        counts[draw(probs, g)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    live = probs > 0
    expected = probs[live] * 20000
    assert float(((counts[live] - expected) ** 2 / expected).sum()) < 13.8  # chi-square, 2 dof, p = 0.001
