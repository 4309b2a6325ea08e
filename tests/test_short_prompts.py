"""A whole prompt of at most MAX_NEW_PROMPT tokens runs as decode rows (tandem/engine/decode_group.py): its
query attends over a cache holding just its own K/V. Greedy output stays token-identical to transformers —
alone, beside running decodes, under a sliding window shorter than the prompt, with speculation — and the
step really took the decode path (the group holds the new prompt), while a longer prompt keeps the varlen one."""

import pytest
from tiny_models import hf_greedy, make_checkpoint

import tandem.engine.decode_group as decode_group
import tandem.engine.model_runner as model_runner
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def spy_groups(monkeypatch) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each step's (q, [(computed, new) of every request in its decode group])."""
    seen: list[tuple[int, list[tuple[int, int]]]] = []
    group = decode_group.decode_group

    def spy(scheduled, pad=True):
        q, chosen = group(scheduled, pad)
        seen.append((q, [(s.request.num_computed_tokens, s.num_new_tokens) for s in chosen]))
        return q, chosen

    monkeypatch.setattr(model_runner, "decode_group", spy)
    return seen


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": 3})])
def test_short_prompts_take_the_decode_path_exactly(tmp_path, monkeypatch, arch, overrides) -> None:
    path = make_checkpoint(str(tmp_path / arch), arch, **overrides)
    prompts = [[7], [5, 9, 11], [3, 4, 5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27], [8] * 9]
    seen = spy_groups(monkeypatch)
    llm = LLM(path, max_model_len=128)
    outs = []
    for p in prompts:  # one at a time: the first step holds the new prompt alone
        seen.clear()
        outs.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
        first_q, first_group = seen[0]
        if len(p) <= decode_group.MAX_NEW_PROMPT:
            assert (first_q, first_group) == (len(p), [(0, len(p))]), seen[0]
        else:
            assert first_group == [], seen[0]  # 9 tokens: the varlen prefill path
    assert outs == hf_greedy(path, prompts, GREEDY.max_tokens)
    llm.engine.check_invariants()


def test_a_short_prompt_joins_running_decodes(tmp_path, monkeypatch) -> None:
    path = make_checkpoint(str(tmp_path / "llama"), "llama", seed=4)
    long_prompts = [list(range(10, 40)), list(range(50, 70))]
    short = [33, 34, 35, 36]
    seen = spy_groups(monkeypatch)
    llm = LLM(path, max_model_len=128)
    eng = llm.engine
    ids = [eng.add_request(None, p, GREEDY) for p in long_prompts]
    for _ in range(3):  # both prompts computed, a few tokens decoded
        eng.step()
    ids.append(eng.add_request(None, short, GREEDY))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    seen.clear()
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    # the step that took the new prompt: one padded group of query length 4 with the two decodes
    assert any(q == 4 and sorted(g)[0] == (0, 4) and len(g) == 3 for q, g in seen), seen[:3]
    assert [tokens[i] for i in ids] == hf_greedy(path, long_prompts + [short], GREEDY.max_tokens)
    eng.check_invariants()


def test_short_prompts_with_speculation(tmp_path) -> None:
    path = make_checkpoint(str(tmp_path / "llama"), "llama", seed=2)
    prompts = [[4, 5, 4, 5], [9], [6, 7, 8, 6, 7, 8, 6, 7]]
    llm = LLM(path, max_model_len=128, speculator="ngram", num_speculative_tokens=3, spec_max_batch=8)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == hf_greedy(path, prompts, GREEDY.max_tokens)
    llm.engine.check_invariants()


@pytest.mark.parametrize("speculator", ["eagle", "draft_model"])
def test_short_prompts_with_the_shipped_speculators(speculator) -> None:
    """The shipped model with its EAGLE head / draft model: a 1-token prompt leaves the head its first
    position only; greedy output equals the same model's without speculation."""
    prompts = [[5], [5, 6, 7], [100, 200, 300, 400, 500, 600, 700, 800]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM().generate(prompts, params)]
    llm = LLM(speculator=speculator, spec_max_batch=8)  # (the CPU default, 1, would switch it off here)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.speculator_stats()["num_drafted_tokens"] > 0
    llm.engine.check_invariants()
