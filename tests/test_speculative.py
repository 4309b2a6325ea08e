"""Speculative decoding in the engine: greedy output identical with and without the ngram and
draft_model speculators on the four architectures (and equal to transformers), the draft's cache
following accepted tokens, stop conditions inside accepted runs, seeded sampling, dynamic switching,
counters, configuration errors, and KV invariants after every scenario. The verification math
itself is tested in tests/test_spec_decode.py."""

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, make_checkpoint, write_tokenizer

from plugins.speculators import BUILTIN_SPECULATORS
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 24


def perturbed_copy(src: str, dst: str, scale: float, seed: int = 1) -> str:
    """The target plus small noise: a draft that agrees often but not always (random tiny models
    trained on nothing give a draft with unrelated weights ~0% acceptance)."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(f"{src}/model.safetensors")
    noisy = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(noisy, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


def repeating_prompts(seed: int) -> list[list[int]]:
    """Prompts whose text repeats (so the continuation can repeat it too) and plain random ones."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, 512) for _ in range(12)]
    return [[0] + phrase * 3, [0] + phrase + [rng.randrange(3, 512) for _ in range(5)] + phrase[:6],
            [rng.randrange(3, 512) for _ in range(40)], [0, 5]]


def check_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_invariants()
    assert eng.kv.pool.num_used == 0
    runner = getattr(eng.speculator, "runner", None)
    if runner is not None:  # the draft's own cache: nothing held once every request finished
        assert runner.seqs == {} and runner.kv.pool.num_used == 0


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)
    draft = perturbed_copy(path, str(tmp_path_factory.mktemp(request.param + "-draft") / "d"), scale=0.002)
    prompts = repeating_prompts(seed=len(request.param))
    return path, draft, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("speculator", ["none", "ngram", "draft_model"])
def test_greedy_identical_with_and_without_speculation(arch_case, speculator):
    path, draft, prompts, expected = arch_case
    opts = {} if speculator == "none" else dict(speculator=speculator, draft_model=draft, num_speculative_tokens=3,
                                                spec_max_batch=8)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, **opts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    if speculator != "none":
        stats = llm.engine.speculator_stats()
        assert stats["num_verifications"] > 0 and stats["num_accepted_tokens"] > 0, stats
    check_clean(llm)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")
    return path, perturbed_copy(path, str(tmp_path_factory.mktemp("llama-draft") / "d"), scale=0.003)


def test_ngram_accepts_on_repeating_text(llama):
    path, _ = llama
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="ngram",
              num_speculative_tokens=4)
    llm.generate(repeating_prompts(seed=3)[:2], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    stats = llm.engine.speculator_stats()
    assert stats["num_accepted_tokens"] > 0 and stats["mean_accepted_length"] > 0
    assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
    assert stats["num_emitted_tokens"] == stats["num_accepted_tokens"] + stats["num_verifications"]
    check_clean(llm)


def test_preemption_stop_tokens_and_logprobs_under_speculation(llama):
    """A pool small enough to preempt; a stop token and max_tokens inside accepted runs; logprobs of
    every emitted token equal the non-speculative engine's."""
    path, draft = llama
    prompts = repeating_prompts(seed=5) * 2
    base_llm = LLM(path, num_kv_blocks=128, max_model_len=128)
    base = base_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop = base[0].token_ids[17]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)] + \
        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 5
    ref = base_llm.generate(prompts, params)
    for name in ("ngram", "draft_model"):
        llm = LLM(path, num_kv_blocks=14, max_model_len=128, spec_max_batch=8, speculator=name, draft_model=draft)
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert len(outs[2].token_ids) == 13 and outs[1].token_ids[-1] == stop
        for got, want in zip(outs[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
        check_clean(llm)


def test_stop_string_inside_an_accepted_run_cuts_tokens_too(llama):
    """The stop string is the output text up to the first token of a multi-token accepted run, so it
    completes mid-run; tokens and text must equal the non-speculative run's."""
    path, draft = llama
    prompt = repeating_prompts(seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="ngram")
    eng, runs = llm.engine, []
    eng.add_request(None, prompt, greedy)
    while eng.has_unfinished_requests():
        runs += [o.new_token_ids for o in eng.step()]
    toks = [t for run in runs for t in run]
    decode = eng.tokenizer.decode
    starts = [sum(map(len, runs[:i])) for i, run in enumerate(runs) if len(run) > 1]
    stop = next(decode(toks[:a + 1]) for a in starts if not decode(toks[:a + 1]).endswith("\ufffd")
                and len(decode(toks[:a + 1])) > len(decode(toks[:a])))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    want = LLM(path, num_kv_blocks=128, max_model_len=256).generate([prompt], params)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 48
    for name in ("ngram", "draft_model"):
        spec_llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator=name, draft_model=draft)
        got = spec_llm.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")


def test_tight_token_budget_drops_speculation_without_changing_output(llama):
    """A budget of 8 tokens cannot verify every request's 1 + 4 tokens: some run without their
    proposal or are skipped for a step; output stays the non-speculative one."""
    path, draft = llama
    prompts = repeating_prompts(seed=17)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, num_kv_blocks=128, max_model_len=256).generate(prompts, params)]
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=8, spec_max_batch=8,
              speculator="draft_model", draft_model=draft)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.speculator_stats()["num_verifications"] > 0
    check_clean(llm)


def test_sampling_with_speculation_is_reproducible_per_seed(llama):
    path, draft = llama
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=s, ignore_eos=True) for s in (1, 2)]
    for name in ("ngram", "draft_model"):
        runs = []
        for _ in range(2):
            llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator=name, draft_model=draft)
            runs.append([o.token_ids for o in llm.generate(repeating_prompts(seed=7)[:2], params)])
            assert llm.engine.speculator_stats()["num_verifications"] > 0
            check_clean(llm)
        assert runs[0] == runs[1] and all(len(t) == 30 for t in runs[0])


def _draft_kv(runner, request_id: str, n: int) -> torch.Tensor:
    bt, bs = runner.seqs[request_id].block_ids, runner.block_size
    rows = [bt[p // bs] * bs + p % bs for p in range(n)]
    return torch.stack([c.transpose(0, 1).reshape(2, -1, *c.shape[3:])[:, rows] for c in runner.kv_caches])


def test_draft_cache_follows_accepted_tokens(llama):
    """After rejections the draft's incremental cache must give the same proposals as a draft that
    recomputes every request from scratch; a draft identical to the target is always accepted."""
    from plugins.draft_model import DraftModelRunner

    path, draft = llama
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="draft_model", draft_model=draft)
    spec = llm.engine.speculator
    fresh = DraftModelRunner(draft, target_path=path, target_vocab_size=512, dtype=torch.float32,
                             device=torch.device("cpu"), block_size=16, max_model_len=256, k=4, max_seqs=8)
    incremental = spec.runner.propose

    def checked(requests, ks):
        for rid in list(fresh.seqs):
            fresh.release(rid)
        expected, _ = fresh.propose(requests, ks)
        got, probs = incremental(requests, ks)
        assert got == expected
        for r, k in zip(requests, ks):  # the cached K/V of every real token + fed-back draft token
            n = r.num_tokens + k - 1
            torch.testing.assert_close(_draft_kv(spec.runner, r.request_id, n), _draft_kv(fresh, r.request_id, n),
                                       atol=1e-4, rtol=1e-4)
        return got, probs

    spec.runner.propose = checked
    llm.generate(repeating_prompts(seed=13)[:3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stats = llm.engine.speculator_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]  # rejections happened
    check_clean(llm)

    same = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="draft_model", draft_model=path)
    same.generate(repeating_prompts(seed=13), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert same.engine.speculator_stats()["acceptance_rate"] == 1.0
    check_clean(same)


def test_speculation_defaults_to_batch_one_on_a_cpu(llama):
    """Measured on a 2-core CPU, every speculator is slower than none from batch 2 on (ngram 0.87x,
    eagle 0.57x, draft_model 0.40x: docs/PERFORMANCE.md), so by default a CPU engine speculates
    only for a lone request; a GPU keeps 8; an explicit value stands."""
    from tandem.config import EngineConfig

    path, _ = llama
    assert EngineConfig(model=path, speculator="ngram", device="cpu").spec_max_batch == 1
    assert EngineConfig(model=path, speculator="ngram", device="cuda").spec_max_batch == 8
    assert EngineConfig(model=path, speculator="ngram", spec_max_batch=3).spec_max_batch == 3
    with pytest.raises(ValueError, match="spec_max_batch"):
        EngineConfig(model=path, speculator="ngram", spec_max_batch=0)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, speculator="ngram", device="cpu")
    llm.generate(repeating_prompts(seed=9)[:2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.engine.runner.spec_stats.num_verifications == 0  # two at once: never speculated
    llm.generate(repeating_prompts(seed=9)[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.engine.runner.spec_stats.num_verifications > 0  # alone: it does


def test_dynamic_speculation_switches_off_above_threshold(llama):
    path, _ = llama
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, speculator="ngram", spec_max_batch=2)
    eng = llm.engine
    for i, n in enumerate([8, 10, 30, 40]):  # two finish early, leaving a batch of 2
        eng.add_request(None, repeating_prompts(seed=9)[0],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    seen_off = seen_on_after = False
    while eng.has_unfinished_requests():
        batch = len(eng.scheduler.running)
        before = eng.runner.spec_stats.num_verifications
        eng.step()
        verified = eng.runner.spec_stats.num_verifications > before
        if batch > 2:
            assert not eng.spec_active and not verified
            seen_off = True
        elif seen_off:
            assert eng.spec_active
            seen_on_after |= verified
        eng.check_invariants()
    assert seen_off and seen_on_after and eng.speculator_stats()["num_switches"] >= 2
    check_clean(llm)


def test_bad_speculator_configuration(llama, tmp_path):
    path, _ = llama
    with pytest.raises(ValueError, match="unknown speculator"):
        LLM(path, num_kv_blocks=64, speculator="nope")
    # No --draft-model: the shipped draft is used, and refused for this target's different tokenizer.
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(path, num_kv_blocks=64, speculator="draft_model")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, num_kv_blocks=64, speculator="ngram", num_speculative_tokens=0)
    other = make_checkpoint(str(tmp_path / "other"), "llama")
    write_tokenizer(other, vocab_size=400)  # a different tokenizer: ids mean other tokens
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(path, num_kv_blocks=64, speculator="draft_model", draft_model=other)


def test_cli_flags_and_builtins():
    import argparse

    from tandem.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculator", "draft_model", "--num-speculative-tokens", "3",
                              "--draft-model", "/d", "--spec-max-batch", "4"])
    cfg = engine_config_from_args(args, model="/m")
    got = (cfg.speculator, cfg.num_speculative_tokens, cfg.draft_model, cfg.spec_max_batch)
    assert got == ("draft_model", 3, "/d", 4)
    assert set(BUILTIN_SPECULATORS) == {"ngram", "draft_model", "eagle"}


def test_greedy_matches_transformers_with_llama3_rope_and_draft(tmp_path):
    """Not in ARCHS above (llama3 rope scaling is a llama variant): one quick check anyway."""
    path = make_checkpoint(str(tmp_path / "t"), "llama3")
    draft = perturbed_copy(path, str(tmp_path / "d"), scale=0.002)
    prompts = repeating_prompts(seed=11)[:2]
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, spec_max_batch=8, speculator="draft_model", draft_model=draft)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 16)
    check_clean(llm)
