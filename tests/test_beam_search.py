"""Beam search in the engine (tandem/engine/beam_group.py): every hypothesis, in order, equals
transformers' `generate(num_beams=w, num_return_sequences=w)` on the same fp32 weights, with EOS
ending hypotheses mid-search, with prefix-cache hits and under preemption; the block pool's ref
counts hold after every step and forks copy their tail block (copy-on-write); bad input is a
ValueError and the engine keeps serving."""

import json
import os
import random

import pytest
import torch
from tiny_models import make_checkpoint

from tandem import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

EOS = [1, 243]  # 243: a token these prompts' beams produce, so hypotheses end mid-search
MAX_TOKENS = 12
PAD = 2  # transformers' filler after a hypothesis' end (0 would make it use the EOS)


def beam_checkpoint(tmp_path_factory) -> str:
    """A tiny random Llama whose EOS ids are EOS (so hypotheses end mid-search)."""
    path = make_checkpoint(str(tmp_path_factory.mktemp("beam")), "llama")
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = EOS
            with open(file, "w") as f:
                json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return beam_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def prompts_of(lengths, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of((5, 16, 23))  # 16: the prompt fills its block exactly (no tail to copy at the fork)


def hf_beams(model, prompt, width, length_penalty, early_stopping, ignore_eos):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                           num_return_sequences=width, max_new_tokens=MAX_TOKENS, early_stopping=early_stopping,
                           length_penalty=length_penalty, eos_token_id=None if ignore_eos else EOS, pad_token_id=PAD,
                           output_scores=True, return_dict_in_generate=True)
    if width == 1:  # transformers runs greedy search then: score it from the step logits
        out = g.sequences[0, len(prompt):].tolist()
        n = next((i + 1 for i, t in enumerate(out) if not ignore_eos and t in EOS), len(out))
        cum = sum(float(torch.log_softmax(g.scores[i][0].float(), -1)[out[i]]) for i in range(n))
        return [(out, cum / n ** length_penalty)]
    return [(seq[len(prompt):].tolist(), float(score)) for seq, score in zip(g.sequences, g.sequences_scores)]


def assert_same(ours, theirs, length_penalty):
    assert len(ours.sequences) == len(theirs)
    for rank, (s, (ref, ref_score)) in enumerate(zip(ours.sequences, theirs)):
        out = s.output_token_ids
        # transformers pads hypotheses that ended early up to the longest one
        assert out == ref[:len(out)] and all(t == PAD for t in ref[len(out):]), f"hypothesis {rank}: {out} != {ref}"
        assert s.cum_logprob / len(out) ** length_penalty == pytest.approx(ref_score, abs=1e-4)


CASES = [(1, 1.0, True, False), (2, 1.0, True, False), (4, 1.0, True, False), (4, 0.5, True, False),
         (4, 2.0, False, False), (4, 1.0, "never", False), (2, 1.0, True, True), (4, 1.0, True, True)]


@pytest.mark.parametrize("width,length_penalty,early_stopping,ignore_eos", CASES)
def test_beams_match_transformers(ckpt, hf_model, width, length_penalty, early_stopping, ignore_eos):
    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, dtype="float32")
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    expected = [hf_beams(hf_model, p, width, length_penalty, early_stopping, ignore_eos) for p in PROMPTS]
    for _ in range(2):  # the second run reads the prompts (and shared full blocks) from the prefix cache
        outs = llm.beam_search(PROMPTS, params)
        for out, ref in zip(outs, expected):
            assert_same(out, ref, length_penalty)
    assert llm.engine.kv.hit_tokens > 0
    if (width, ignore_eos) == (2, False):  # here the EOS ends top hypotheses (elsewhere they rank lower)
        reasons = {s.finish_reason for o in outs for s in o.sequences}
        assert "stop" in reasons, "the EOS token was meant to end some hypotheses"
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used == 0


def test_shared_prefix_and_mixed_batch(ckpt, hf_model):
    """Two prompts with a common 32-token prefix, plus a plain request in the same batch."""
    base = prompts_of((32,), seed=7)[0]
    prompts = [base + [5, 6, 7], base + [9]]
    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, dtype="float32")
    llm.beam_search([base + [11]], BeamSearchParams(beam_width=2, max_tokens=4))
    hits = llm.engine.kv.hit_tokens
    plain = llm.engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, early_stopping=True))
    assert llm.engine.kv.hit_tokens - hits >= 2 * 32
    for out, p in zip(outs, prompts):
        assert_same(out, hf_beams(hf_model, p, 4, 1.0, True, False), 1.0)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert plain not in llm.engine.scheduler.requests
    llm.engine.check_invariants()


def test_group_preempted_whole_gives_the_same_beams(ckpt, hf_model):
    """A pool too small for all groups at once: groups are preempted and recompute, output unchanged."""
    llm = LLM(ckpt, num_kv_blocks=24, max_model_len=128, block_size=8, dtype="float32")
    prompts = prompts_of((21, 22, 23, 24), seed=11)
    plain = [llm.engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
             for p in prompts_of((40, 41), seed=12)]  # they hold blocks the groups need
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, early_stopping=True))
    assert llm.engine.beams.num_preemptions > 0, "the pool was meant to force preemption"
    for out, p in zip(outs, prompts):
        assert_same(out, hf_beams(hf_model, p, 4, 1.0, True, False), 1.0)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert not any(rid in llm.engine.scheduler.requests for rid in plain)
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: the per-token scales are copied too
def test_invariant_every_step_and_copy_on_write(ckpt, kv_cache_dtype):
    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, block_size=8, kv_cache_dtype=kv_cache_dtype, dtype="float32")
    engine = llm.engine
    for p in PROMPTS:
        engine.enqueue(engine.make_beam_request(None, p, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS,
                                                                          ignore_eos=True)))
    caches = [*engine.runner.kv_caches, *(engine.runner.kv_scales or [])]
    assert len(caches) == (4 if kv_cache_dtype == "int8" else 2)
    checked_forks = 0
    while engine.has_unfinished_requests():
        before = engine.beams.live_requests()  # references held: ids stay unique
        old = {id(r) for r in before}
        engine.step()
        engine.check_invariants()
        live = engine.beams.live_requests()
        for g in engine.beams.groups.values():
            tails = [r.block_ids[-1] for r in g.beams if r.num_computed_tokens % 8]
            assert len(tails) == len(set(tails)), "two hypotheses write into one partial block"
        # copy-on-write: a fork's tail holds its parent's K/V; writing it leaves the parent's untouched
        for child in live:
            n_done = child.num_computed_tokens
            parent = next((r for r in live if r is not child and r.num_computed_tokens == n_done and id(r) in old
                           and r.token_ids[:n_done] == child.token_ids[:n_done]), None)
            if parent is None or id(child) in old or child.num_computed_tokens % 8 == 0:
                continue
            n = child.num_computed_tokens % 8
            pb, cb = parent.block_ids[-1], child.block_ids[-1]
            assert parent.block_ids[:-1] == child.block_ids[:-1] and pb != cb  # full blocks shared, tail copied
            for cache in caches:
                assert torch.equal(cache[cb, :, :n], cache[pb, :, :n])
            saved = [cache[pb].clone() for cache in caches]
            for cache in caches:
                cache[cb, :, n - 1] = 123
            for cache, s in zip(caches, saved):
                assert torch.equal(cache[pb], s), "writing the fork's tail changed its parent's K/V"
                cache[cb, :, n - 1] = s[:, n - 1]  # restore, so the search continues unchanged
            checked_forks += 1
    assert checked_forks > 0
    assert engine.beams.num_forks > 0
    assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize("bad", [dict(beam_width=0), dict(beam_width=17), dict(temperature=0.7),
                                 dict(early_stopping="sometimes"), dict(max_tokens=0), dict(beam_width=True)])
def test_bad_params_are_value_errors(ckpt, bad):
    with pytest.raises((ValueError, TypeError)):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


def test_engine_keeps_serving_after_bad_input(ckpt):
    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, dtype="float32")
    with pytest.raises(TypeError):
        llm.beam_search(PROMPTS, SamplingParams())
    with pytest.raises(ValueError):
        llm.beam_search([PROMPTS[0], [5] * 600], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):  # 16 hypotheses x 505 tokens cannot fit 256 blocks
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=16, max_tokens=500))
    assert not llm.engine.has_unfinished_requests()
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(out[0].sequences) == 2


def test_beam_search_with_a_speculator_is_refused_naming_the_field(ckpt):
    """The message starts with the HTTP field, so the router's 400 names `use_beam_search`."""
    from router_svc.errors import BadRequest

    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, spec_max_batch=8, speculator="ngram", dtype="float32")
    with pytest.raises(ValueError, match="speculator") as err:
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))
    assert BadRequest.from_exception(err.value).param == "use_beam_search"
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids


def test_abort_frees_the_group(ckpt):
    llm = LLM(ckpt, num_kv_blocks=256, max_model_len=512, dtype="float32")
    engine = llm.engine
    for rid in ("a", "b"):
        engine.enqueue(engine.make_beam_request(rid, PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS,
                                                                                  ignore_eos=True)))
    out_b = engine.abort_request("b")  # its root still waits in the scheduler
    assert out_b is not None and out_b.finished and out_b.finish_reason == "abort"
    for _ in range(4):
        engine.step()
    assert len(engine.beams.groups["a"].beams) == 4
    out_a = engine.abort_request("a")  # mid-search: the group's hypotheses hold blocks
    assert out_a is not None and out_a.finish_reason == "abort"
    engine.check_invariants()
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()
