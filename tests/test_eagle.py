"""The `eagle` speculator: greedy output identical with and without it (a random head on a tiny random
checkpoint, the shipped head on the shipped model, colocated and disaggregated), sampled output
distributed as the target's (chi-square, every speculator), the head's cache following accepted tokens
through rejections and preemption, and a head for another model refused at start."""

import re
import subprocess
import sys

import pytest
import torch
from test_spec_decode import ALPHA, _chi2_pvalue
from test_speculative import check_clean, perturbed_copy, repeating_prompts
from tiny_models import assert_cli_refuses, heldout_code, hf_greedy, make_checkpoint, make_eagle_head

from plugins.eagle import EagleRunner
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")
    return path, make_eagle_head(str(tmp_path_factory.mktemp("head")), path)


@pytest.fixture(scope="module")
def shipped():
    """The shipped target, its greedy output on held-out code (no speculation) and the prompts."""
    llm = LLM(max_model_len=512, dtype="float32")
    prompts = [llm.engine.tokenize(s) for s in heldout_code()]
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_greedy_identical_with_random_head_on_tiny_checkpoint(tiny):
    path, head = tiny
    prompts = repeating_prompts(seed=2)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="eagle", draft_model=head,
              num_speculative_tokens=3, dtype="float32")
    assert llm.engine.speculator.wants_hidden_states and llm.engine.runner.keep_hidden
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)
    stats = llm.engine.speculator_stats()
    assert stats["speculator"] == "eagle" and stats["num_verifications"] > 0
    check_clean(llm)


def test_head_takes_the_targets_dtype():
    """A bf16 target (a GPU's default) gets a bf16 head (its weights once stayed fp32: the first draft
    failed on a GPU). It drafts, is accepted, and changes no greedy token."""
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(max_model_len=256, spec_max_batch=8, speculator="eagle", dtype="bfloat16")
    head = llm.engine.speculator.runner.head
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    plain = LLM(max_model_len=256, dtype="bfloat16").generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.speculator_stats()["num_accepted_tokens"] > 0


def test_greedy_identical_with_shipped_head_and_it_accepts(shipped):
    """`speculator="eagle"` and nothing else: the shipped head for the shipped model."""
    prompts, expected = shipped
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    assert llm.engine.config.draft_model.endswith("tiny-eagle")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.speculator_stats()
    # A trained head agrees with its target far more often than chance (a broken hidden-state hook
    # or a mis-loaded head falls to ~0).
    assert stats["acceptance_rate"] > 0.3 and stats["mean_accepted_length"] > 1.0, stats
    assert llm.engine.speculator.runner.num_recomputes == 0  # every target state came from the hook
    check_clean(llm)


def test_prefill_role_keeps_hidden_states_but_builds_no_head_until_it_decodes():
    """A prefill worker never proposes: with `--speculator eagle` it writes the hidden-state layer (its
    decode workers read it) but loads no head and allocates no head cache until a switch to decoding."""
    from tandem.config import EngineConfig
    from tandem.default_model import default_model_path
    from tandem.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=default_model_path(), role="prefill", spec_max_batch=8, speculator="eagle",
                                 max_model_len=512, num_kv_blocks=64))
    assert eng.speculator is None and eng.speculator_stats() == {}
    assert eng.runner.hidden_layers == 1 and eng.kv_layout.hidden_layers == 1
    eng.ensure_speculator()
    assert eng.speculator is not None and eng.speculator_stats()["speculator"] == "eagle"
    built = eng.speculator
    eng.ensure_speculator()
    assert eng.speculator is built  # once


def test_dropped_target_states_are_read_from_the_cache(shipped):
    """A request holding more target states than max_held_states drops them (a whole prompt here) and
    its head reads them back from the target's hidden-state cache layers (no target pass): same output,
    same acceptance; one cache read more per prompt than holding them all."""
    (prompts, expected), reads = shipped, []
    for held in (1 << 20, 8):
        llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
        llm.engine.speculator.runner.max_held_states = held
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        stats = llm.engine.speculator_stats()
        assert stats["target_state_recomputes"] == 0 and stats["acceptance_rate"] > 0.3
        reads.append(stats["target_state_cache_reads"])
    assert reads[1] == reads[0] + len(prompts)
    check_clean(llm)


@pytest.mark.parametrize("kv_cache_dtype, tol", [("auto", 0.0), ("int8", 0.02)])
def test_hidden_state_layers_hold_the_targets_states(kv_cache_dtype, tol):
    """What the cache's hidden-state layers hold for a prompt (written by a chunked prefill, read back
    through its block table) is the target's final hidden states from a cache-free pass: exactly, or
    within int8 quantization error."""
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", kv_cache_dtype=kv_cache_dtype,
              max_num_batched_tokens=32, dtype="float32")  # tol 0: fp32 (a GPU's auto is bf16)
    eng, runner = llm.engine, llm.engine.runner
    assert runner.hidden_layers == 1 and eng.kv_layout.hidden_layers == 1  # hidden 256 = 2 x 4 heads x 32
    assert eng.kv_layout.num_layers == eng.model_config.num_layers + 1
    prompt = eng.tokenize(heldout_code()[0])[:100]
    req = eng.make_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
    eng.track(req)
    eng.scheduler.add(req)
    while req.num_computed_tokens < len(prompt):
        eng.step()
    got = runner.cached_hidden_states(req.block_ids, 0, len(prompt))
    want = runner.hidden_states(prompt)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= tol + 1e-6, err
    assert runner.cached_hidden_states(req.block_ids, 40, 72).equal(got[40:72])
    assert LLM(max_model_len=512, dtype="float32").engine.kv_layout.hidden_layers == 0  # no speculator: no extra layer


def test_head_cache_follows_accepted_tokens(shipped):
    """After every verification the incremental head must propose what a head rebuilding each request
    from scratch in one pass (target states recomputed by a cache-free pass) proposes, once it drafts."""
    prompts, _ = shipped
    llm = LLM(max_model_len=512, spec_max_batch=8, speculator="eagle", dtype="float32")
    eng, spec = llm.engine, llm.engine.speculator
    fresh = EagleRunner(eng.config.draft_model, target=eng.runner, target_config=eng.model_config, dtype=torch.float32,
                        device=eng.runner.device, block_size=16, max_model_len=512, k=4, max_seqs=8)
    fresh.catch_up = lambda requests, budget=0, wanted=None: EagleRunner.catch_up(fresh, requests, 1 << 30, wanted)
    incremental, calls = spec.runner.propose, []

    def checked(requests, ks):
        for rid in list(fresh.seqs):
            fresh.release(rid)
        expected, _ = fresh.propose(requests, ks)
        got, probs = incremental(requests, ks)
        calls.extend(got[r.request_id] == expected.get(r.request_id) for r in requests if r.request_id in got)
        return got, probs

    spec.runner.propose = checked
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = eng.speculator_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]  # accepted and rejected
    # fp32 sums in another order (one catch-up pass vs incremental steps) may flip a near tie: allow 1.
    assert len(calls) > 30 and calls.count(False) <= 1, calls
    assert fresh.num_cache_reads > 0 and fresh.num_recomputes == 0
    check_clean(llm)


def test_preemption_keeps_output_identical(shipped):
    """A pool so small that requests are preempted and recomputed (with prefix-cache hits, so part of
    the target states are never handed to the head again): output equals the non-speculative run."""
    prompts, _ = shipped
    many = prompts * 2
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = LLM(max_model_len=512, num_kv_blocks=48, dtype="float32").generate(many, params)
    llm = LLM(max_model_len=512, num_kv_blocks=48, spec_max_batch=8, speculator="eagle", dtype="float32")
    outs = llm.generate(many, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.speculator_stats()["num_accepted_tokens"] > 0
    check_clean(llm)


@pytest.mark.parametrize("speculator", ["ngram", "draft_model", "eagle", "eagle-draft-vocab"])
def test_sampled_tokens_follow_the_target_distribution(speculator, tmp_path):
    """The engine-level counterpart of test_spec_decode's rejection-sampling test, for every speculator:
    temperature 1, an 8-token vocabulary, 4000 seeded requests. Each samples its first token plainly,
    its second by verifying a sampled (draft_model, eagle) or deterministic (ngram) proposal; the
    (first, second) pairs must follow p(x) * p(y | x) of the target (chi-square over 64 cells,
    alpha = 1e-3, fixed seeds). eagle-draft-vocab: a head drafting among 5 of the 8 tokens only."""
    path = make_checkpoint(str(tmp_path / "t"), "llama", vocab_size=8, initializer_range=0.3)
    draft = perturbed_copy(path, str(tmp_path / "d"), scale=0.3) if speculator == "draft_model" else None
    # A small scale: the head's distributions are broad (a near point mass would hide a wrong q).
    head = make_eagle_head(str(tmp_path / "h"), path, scale=0.05, draft_ids=[0, 2, 3, 5, 6] if speculator.endswith(
        "vocab") else None) if speculator.startswith("eagle") else None
    speculator = speculator.removesuffix("-draft-vocab")
    prompt, n = [0, 5, 6, 7, 5, 6, 3], 4000
    llm = LLM(path, num_kv_blocks=1024, max_model_len=64, max_num_seqs=512, spec_max_batch=512,
              speculator=speculator, draft_model=draft or head, num_speculative_tokens=2, dtype="float32")
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
                                       for s in range(n)])
    stats = llm.engine.speculator_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"], stats  # both paths taken
    target = LLM(path, num_kv_blocks=64, max_model_len=64, dtype="float32").engine.runner
    p_first = _probs(target, prompt)
    expected = torch.stack([p_first[x] * _probs(target, prompt + [x]) for x in range(8)]).flatten()
    counts = torch.zeros(64, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0] * 8 + o.token_ids[1]] += 1
    assert _chi2_pvalue(counts, expected.double()) > ALPHA


@torch.inference_mode()
def _probs(runner, tokens: list[int]) -> torch.Tensor:
    """The target's next-token distribution after `tokens` at temperature 1."""
    return torch.softmax(runner.model.compute_logits(runner.hidden_states(tokens)[-1:]).float(), -1)[0, :8]


def test_shipped_head_is_packaged_with_vllm_names():
    """The head ships as package data (pyproject's globs cover it) in bf16 with vLLM EAGLE names."""
    import fnmatch
    import json
    from pathlib import Path

    import tomllib
    from safetensors import safe_open

    from tandem import default_model

    head = Path(default_model.default_eagle_path())
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in names - {"d2t"})
        # its draft vocabulary, EAGLE-3's way: draft id i drafts target token i + d2t[i]
        draft_ids = torch.arange(cfg["draft_vocab_size"]) + f.get_tensor("d2t")
    assert cfg["draft_vocab_size"] == 1024 and bool((draft_ids[1:] > draft_ids[:-1]).all())
    assert "fc.weight" in names and all(n in ("fc.weight", "d2t") or n.startswith("layers.0.") for n in names)
    assert "layers.0.input_layernorm.weight" not in names
    root = head.parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tandem"]
    files = [*head.iterdir(), head.parent / "eagle_train_stats.json"]
    shipped = [p.relative_to(root / "tandem").as_posix() for p in files]
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in shipped), shipped
    r = subprocess.run([sys.executable, str(root / "tools" / "train_eagle.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--unroll" in r.stdout


def test_head_for_another_model_is_refused(tiny, tmp_path):
    path, _ = tiny
    wide = make_eagle_head(str(tmp_path / "wide"), path, hidden_size=128)
    with pytest.raises(ValueError, match="hidden_size 128 but the target model's hidden size is 64"):
        LLM(path, num_kv_blocks=64, speculator="eagle", draft_model=wide, dtype="float32")
    vocab = make_eagle_head(str(tmp_path / "vocab"), path, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 1000 but the target model's vocabulary has 512"):
        LLM(path, num_kv_blocks=64, speculator="eagle", draft_model=vocab, dtype="float32")
    with pytest.raises(ValueError, match="hidden_size 256"):  # the shipped head is the shipped model's
        LLM(path, num_kv_blocks=64, speculator="eagle", dtype="float32")
    with pytest.raises(ValueError, match="not an EAGLE head"):  # a full checkpoint is not a head
        LLM(path, num_kv_blocks=64, speculator="eagle", draft_model=path, dtype="float32")
    assert_cli_refuses(path, wide, "hidden_size 128")


def test_disaggregated_decode_worker_drafts_with_eagle(shipped, tmp_path):
    """P and D both run `--speculator eagle`: the prompt's target hidden states cross with its KV (the
    cache's hidden-state layer), so D's head drafts from them without ever running the target over the
    prompt; output equals the colocated run and D's drafts are accepted. A P without the speculator
    has another cache layout: D's handshake refuses it, naming the difference, and D computes the
    prompts itself — same output, nothing lost."""
    from service_procs import Client, start_worker, stop_all, worker_stats
    from test_observability import scrape, total

    from tandem.default_model import default_model_path

    prompts, expected = shipped
    model = default_model_path()
    prefill, p_addr = start_worker("prefill", model, tmp_path, "--kv-connector", "zmq", "--speculator", "eagle")
    plain, plain_addr = start_worker("prefill", model, tmp_path, "--kv-connector", "zmq", name="plain")
    decode, d_addr = start_worker("decode", model, tmp_path, "--kv-connector", "zmq", "--local-prefill-threshold",
                                  "0", "--speculator", "eagle", "--spec-max-batch", "8")  # the prompts run at once
    try:
        client = Client(d_addr["control"])
        greedy = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
        for i, p in enumerate(prompts):
            client.add(f"r{i}", p, p_addr["control"], greedy)
        got = client.collect([f"r{i}" for i in range(len(prompts))])
        assert [got[f"r{i}"] for i in range(len(prompts))] == expected
        stats = worker_stats(d_addr["control"])
        assert stats["remote_prefills"] == len(prompts) and stats["fallbacks"] == 0
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", d_addr["metrics"])
        metrics = scrape(d_addr["metrics"])
        assert total(metrics, "tandem_spec_accepted_tokens_total") > 0
        assert total(metrics, "tandem_spec_target_state_recomputes_total") == 0  # D never ran the prompts

        for i, p in enumerate(prompts):
            client.add(f"s{i}", p, plain_addr["control"], greedy)
        got = client.collect([f"s{i}" for i in range(len(prompts))])
        assert [got[f"s{i}"] for i in range(len(prompts))] == expected
        stats = worker_stats(d_addr["control"])
        assert stats["fallbacks"] == len(prompts) and "hidden_layers" in stats["last_fallback_reason"], stats
    finally:
        stop_all([decode, prefill, plain])
