"""Decode steps through tandem/engine/cuda_graphs.py: the static buffers, the padding to a captured
batch size and which steps may replay a graph. On this CPU the graphs run eagerly (capture=False) over
the very buffers a GPU graph reads, so greedy output must stay transformers' token for token while
batches of 3, 5 and 6 requests are padded to 4 and 8 with rows that must neither write K/V nor
disturb the real rows; with a GPU the same test captures and replays real graphs."""

import pytest
from tiny_models import hf_greedy, make_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine import cuda_graphs

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

NEW = 20


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: a sliding window of 32 (released blocks)
def path(request, tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


def _llm(path: str, **options) -> LLM:
    llm = LLM(path, num_kv_blocks=96, max_model_len=256, dtype="float32", **options)
    llm.engine.runner.use_graphs = True  # on by default on a GPU only
    return llm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graph_steps_match_transformers(path, kv_cache_dtype):
    lengths = [5, 40, 17, 70, 3, 33]
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    llm = _llm(path, kv_cache_dtype=kv_cache_dtype)
    sizes = []
    run = cuda_graphs.DecodeGraphs.run

    def spy(self, input_ids, *args):
        sizes.append(len(input_ids))
        return run(self, input_ids, *args)

    cuda_graphs.DecodeGraphs.run = spy
    try:
        greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        outs = llm.generate(prompts[:3], greedy) + llm.generate(prompts[3:] + prompts[:2], greedy)
    finally:
        cuda_graphs.DecodeGraphs.run = run
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.replays == len(sizes) > 0
    assert {3, 5} <= set(sizes), sizes  # padded to 4 and 8: pad rows really ran
    assert {(4, 1), (8, 1)} <= set(graphs.graphs) and {size for size, _ in graphs.graphs} <= set(cuda_graphs.SIZES)
    if kv_cache_dtype == "auto":  # transformers runs the unquantized cache
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts + prompts[:2], NEW)
    else:  # int8: the same tokens as the eager path on the same cache (the graphs' buffers carry the scales)
        eager = LLM(path, num_kv_blocks=96, max_model_len=256, dtype="float32", kv_cache_dtype="int8")
        same = eager.generate(prompts[:3], greedy) + eager.generate(prompts[3:] + prompts[:2], greedy)
        assert [o.token_ids for o in outs] == [o.token_ids for o in same]
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used == 0


def test_speculative_steps_replay_and_hooked_steps_do_not(path):
    """ngram verification steps (Q = 1 + proposals, ragged groups padded to one Q) replay graphs of
    their own (size, Q) with transformers' tokens; a layer hook (P/D's per-layer send) keeps every
    step eager, since a graph would skip it."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [3, 4] * 9]  # repeating: ngram proposes
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm = _llm(path, spec_max_batch=8, speculator="ngram", num_speculative_tokens=3)
    hooked, replayed = [], []
    run = cuda_graphs.DecodeGraphs.run

    def spy(self, *args):
        replayed.append(args[-1])  # the query length
        return run(self, *args)

    llm.engine.runner.layer_hook = hooked.append
    cuda_graphs.DecodeGraphs.run = spy
    try:
        eager = [o.token_ids for o in llm.generate(prompts, greedy)]
        assert hooked and not replayed  # every layer reported, never a graph
        llm.engine.runner.layer_hook = None
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
    finally:
        cuda_graphs.DecodeGraphs.run = run
    assert outs == eager == hf_greedy(path, prompts, NEW)
    assert any(q > 1 for q in replayed), replayed  # verification steps replayed
    assert llm.engine.runner.spec_stats.num_accepted_tokens > 0


def test_eagle_steps_replay_with_the_hidden_state_cache():
    """EAGLE's target steps keep hidden states (the spans it drafts from, and the cache layers that
    carry them): a graph holds those writes too. A second turn whose prompt is the first turn's prompt
    and answer hits the prefix cache, so the head drafts from states that graph steps cached. Same
    tokens and the same accepted drafts as eager, so the head saw the same states."""
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config", "    def __init__(self"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    run = cuda_graphs.DecodeGraphs.run
    for graphs in (False, True):
        llm = LLM(spec_max_batch=8, speculator="eagle", dtype="float32")
        llm.engine.runner.use_graphs = graphs
        replayed: list[int] = []
        cuda_graphs.DecodeGraphs.run = lambda self, *args, seen=replayed: seen.append(args[-1]) or run(self, *args)
        try:
            first = llm.generate(prompts, greedy)
            second = llm.generate([o.prompt_token_ids + o.token_ids + [13] for o in first], greedy)
        finally:
            cuda_graphs.DecodeGraphs.run = run
        outs = [o.token_ids for o in first + second]
        runs.append((outs, llm.engine.runner.spec_stats.num_accepted_tokens, replayed))
    (eager, accepted_eager, none), (graphed, accepted, used) = runs
    assert not none and any(q > 1 for q in used), used  # verification steps replayed graphs
    assert graphed == eager and accepted == accepted_eager > 0


def test_a_capture_that_fails_falls_back_to_eager(path, monkeypatch):
    """An op that cannot be captured (a plugin reading a value back mid-forward, say) must cost speed,
    not requests: the first capture fails, graphs go off for these caches with a warning, every step
    runs eagerly and the tokens are transformers'."""
    prompts = [[(5 * j) % 400 + 3 for j in range(n)] for n in (9, 30, 14)]
    llm = _llm(path)
    runner = llm.engine.runner
    tries = []

    def refuse(self, ids, pos, meta):
        tries.append(ids.shape[0])
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_record", refuse)
    runner.decode_graphs = cuda_graphs.DecodeGraphs(runner.forward, runner.ops, runner.kv_caches, runner.kv_scales,
                                                    runner.device, runner.max_blocks_per_seq, capture=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW)
    assert len(tries) == 1 and runner.decode_graphs.failed and runner.decode_graphs.replays == 0
    llm.engine.check_invariants()

