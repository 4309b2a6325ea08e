"""Decode steps whose queries differ in length (speculation: 1 + each request's proposals) run as one
padded decode batch (tandem/engine/decode_group.py; tandem/engine/model_runner.py pads short queries in
front with computed tokens whose K/V are not written again). Greedy output stays token-identical to transformers,
the padding really happens, and no step changes the K/V of positions computed before it."""

import pytest
import torch
from test_speculative import check_clean, repeating_prompts
from tiny_models import hf_greedy, make_checkpoint

import tandem.engine.decode_group as decode_group
import tandem.engine.model_runner as model_runner
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def kv_of(eng, positions: dict[str, int]) -> dict[str, torch.Tensor]:
    """The cached K/V (every layer) of each running request's first positions[rid] positions."""
    bs, out = eng.config.block_size, {}
    for r in eng.scheduler.running:
        n = positions.get(r.request_id, r.num_computed_tokens)
        out[r.request_id] = torch.stack([c[r.block_ids[p // bs], :, p % bs] for c in eng.runner.kv_caches
                                         for p in range(n)])
    return out


def run(path: str, prompts: list[list[int]], monkeypatch, max_rows: int) -> tuple[list, list, int]:
    """(outputs, each step's decode-group query lengths and q, positions checked unchanged across a step)."""
    monkeypatch.setattr(decode_group, "MAX_PADDED_ROWS", max_rows)
    groups: list[list[int]] = []
    group = decode_group.decode_group

    def spy(scheduled, pad=True):
        q, chosen = group(scheduled, pad)
        groups.append(sorted(s.num_new_tokens for s in chosen) + [q])
        return q, chosen

    monkeypatch.setattr(model_runner, "decode_group", spy)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, spec_max_batch=8, speculator="ngram",
              num_speculative_tokens=4)
    eng, checked = llm.engine, [0]
    step = eng.step

    def step_keeping_computed_kv():  # positions computed before a step hold the same K/V after it
        before = kv_of(eng, {})
        outs = step()
        after = kv_of(eng, {rid: len(kv) // len(eng.runner.kv_caches) for rid, kv in before.items()})
        for rid, kv in before.items():
            if rid in after:
                assert torch.equal(after[rid], kv), f"{rid}: a step rewrote K/V of positions it did not compute"
                checked[0] += len(kv)
        return outs

    eng.step = step_keeping_computed_kv
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    check_clean(llm)
    return outs, groups, checked[0]


def test_ragged_speculative_batch_is_padded_and_exact(path, monkeypatch):
    prompts = repeating_prompts(seed=3)[:3]
    outs, groups, checked = run(path, prompts, monkeypatch, max_rows=16)
    assert outs == hf_greedy(path, prompts, 32) and checked > 0
    padded = [g for g in groups if len(set(g[:-1])) > 1]  # requests of different query lengths in one group
    assert padded, f"no ragged decode group was padded: {groups}"
    assert all(g[-1] == max(g[:-1]) for g in padded)
    # Padding off: the most common length, the rest varlen; the same tokens.
    ref_outs, ref_groups, _ = run(path, prompts, monkeypatch, max_rows=0)
    assert ref_outs == outs and not [g for g in ref_groups if len(set(g[:-1])) > 1]
