"""Sliding-window attention in the engine: greedy output token-identical to transformers for prompts
of several windows and outputs past the window — with a window that is not a block multiple, chunked
prefill, prefix hits, preemption and a model mixing full and sliding layers — while a request never
holds more than its window's blocks (+1, + a chunk), and only the window's blocks cross from P to D.
"""

from __future__ import annotations

import random

import pytest
from service_procs import Client, start_worker, stop_all, worker_stats
from tiny_models import hf_greedy, make_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine.kv_cache_manager import NULL_BLOCK

pytestmark = pytest.mark.slow  # real models (and, for P/D, real processes)

WINDOW, BS, CHUNK = 21, 16, 32  # a window that is not a multiple of the block size
NEW = 40  # output tokens: decoding runs well past the window


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("mistral_sw")), "mistral", sliding_window=WINDOW)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3 * WINDOW, 6 * WINDOW))] for _ in range(n)]


def _watch_blocks(llm: LLM) -> list[int]:
    """After every scheduler update: the pool's invariant holds and each request holds at most the
    window's blocks + 1 + a chunk's; returns the most any request held."""
    sched, most = llm.engine.scheduler, [0]
    bound = -(-WINDOW // BS) + 1 + -(-CHUNK // BS) + 1
    update = sched.update

    def checked(out, sampled):
        changed = update(out, sampled)
        llm.engine.check_invariants()
        for req in sched.running:
            held = sum(b != NULL_BLOCK for b in req.block_ids)
            assert held <= bound, f"{req.request_id} holds {held} blocks (bound {bound})"
            most[0] = max(most[0], held)
        return changed

    sched.update = checked
    return most


def test_greedy_matches_transformers_chunked_and_bounded(mistral):
    prompts = _prompts(4, seed=1)
    llm = LLM(mistral, num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    assert llm.engine.kv.window == WINDOW
    most = _watch_blocks(llm)
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == hf_greedy(mistral, prompts, NEW)
    assert 0 < most[0] < -(-(len(prompts[0]) + NEW) // BS)  # fewer blocks than full attention needs
    llm.engine.check_invariants()
    assert llm.engine.kv.stats().used_blocks == 0


def test_prefix_hit_needs_only_the_window_blocks(mistral):
    """The first blocks of a finished prompt are evicted; a longer prompt sharing it still hits the
    blocks its window reaches (a full-attention prefix cache would miss at block 0)."""
    base = [random.Random(2).randrange(3, 512) for _ in range(100)]
    follow = base + [5, 6, 7, 8, 9]
    llm = LLM(mistral, num_kv_blocks=24, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    llm.generate([base], greedy(8))
    kv = llm.engine.kv
    # Take every empty block and two more: LRU evicts the base's first two blocks (released first).
    taken = kv.pool.allocate(len(kv.pool.free_empty) + 2)
    kv.pool.free(taken)
    probe = llm.engine.make_request("probe", follow, greedy(1))
    kv._update_hashes(probe, len(base) // BS * BS)
    cached = [kv.pool.lookup(h) is not None for h in probe.block_hashes]
    assert cached == [False, False, True, True, True, True], cached
    out = llm.generate([follow], greedy())[0]
    assert out.num_cached_tokens >= (len(base) // BS - 1) * BS
    assert out.token_ids == hf_greedy(mistral, [follow], NEW)[0]
    llm.engine.check_invariants()


def test_preemption_recomputes_within_the_window(mistral):
    prompts = _prompts(6, seed=4)
    llm = LLM(mistral, num_kv_blocks=14, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    _watch_blocks(llm)
    outs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all at once"
    assert [o.token_ids for o in outs] == hf_greedy(mistral, prompts, NEW)


def test_unchunked_prefill_and_speculation(mistral):
    prompts = _prompts(2, seed=5)
    expected = hf_greedy(mistral, prompts, NEW)
    whole = LLM(mistral, num_kv_blocks=64, max_model_len=1024, enable_chunked_prefill=False, dtype="float32")
    assert [o.token_ids for o in whole.generate(prompts, greedy())] == expected
    spec = LLM(mistral, num_kv_blocks=64, max_model_len=1024, spec_max_batch=8, speculator="ngram",
               num_speculative_tokens=3, dtype="float32")
    assert [o.token_ids for o in spec.generate(prompts, greedy())] == expected


@pytest.mark.parametrize("first_sliding_layer", [1, 0])
def test_qwen2_sliding_layers(tmp_path, first_sliding_layer):
    """Qwen2 slides only in layers >= max_window_layers: with a full-attention layer every block is
    kept (masks per layer); with every layer sliding, blocks are released."""
    path = make_checkpoint(str(tmp_path / "qwen2"), "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=first_sliding_layer)
    prompts = _prompts(2, seed=6)
    llm = LLM(path, num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    assert llm.engine.model_config.layer_windows == [None if i < first_sliding_layer else WINDOW for i in range(2)]
    assert llm.engine.kv.window == (WINDOW if first_sliding_layer == 0 else None)
    assert [o.token_ids for o in llm.generate(prompts, greedy())] == hf_greedy(path, prompts, NEW)


def test_disaggregated_ships_only_the_window(mistral, tmp_path):
    prompts = _prompts(4, seed=7)
    expected = hf_greedy(mistral, prompts, 12)
    prefill, p_addr = start_worker("prefill", mistral, tmp_path)
    decode, d_addr = start_worker("decode", mistral, tmp_path, "--local-prefill-threshold", "0")
    try:
        client = Client(d_addr["control"])
        for i, p in enumerate(prompts):
            client.add(f"w{i}", p, p_addr["control"])
        got = client.collect([f"w{i}" for i in range(len(prompts))])
        assert [got[f"w{i}"] for i in range(len(prompts))] == expected
        stats = worker_stats(d_addr["control"])
        assert stats["remote_prefills"] == len(prompts) and stats["fallbacks"] == 0
        # each prompt sends the blocks its first decode step's window reaches: 2 or 3, not all
        assert stats["transferred_blocks"] <= len(prompts) * (-(-WINDOW // BS) + 1)
        assert stats["kv_blocks_used"] == 0
    finally:
        stop_all([decode, prefill])


def test_triton_kernels_in_the_engine(mistral, monkeypatch):
    """The same engine path through the Triton kernels (interpreted on CPU, compiled on a GPU): released blocks' table
    entries are never read, and the windowed masks give transformers' tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TANDEM_KERNELS", "triton")
    prompts = _prompts(2, seed=8)
    llm = LLM(mistral, num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    assert llm.engine.runner.ops.name == "triton"
    _watch_blocks(llm)
    outs = llm.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == hf_greedy(mistral, prompts, 24)


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_under_the_window(mistral, width):
    """Beam groups fork hypotheses whose early blocks were released (NULL_BLOCK): the beams equal
    transformers' beam search on the same sliding-window model, and the pool stays consistent."""
    import torch
    import transformers as tf

    from tandem import BeamSearchParams

    prompts = _prompts(2, seed=9)
    llm = LLM(mistral, num_kv_blocks=128, max_model_len=1024, max_num_batched_tokens=CHUNK, dtype="float32")
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=30, ignore_eos=True))
    model = tf.AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                                 num_return_sequences=width, max_new_tokens=30, early_stopping=True,
                                 eos_token_id=None, pad_token_id=2)
        assert [s.output_token_ids for s in out.sequences] == [seq[len(prompt):].tolist() for seq in ref]
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used == 0
