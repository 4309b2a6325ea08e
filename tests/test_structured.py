"""Grammar masks (tandem/engine/structured.py) on the shipped tokenizer: every walk that only takes
allowed tokens ends in text the grammar describes (JSON schema, regex, choice, Lark); the masks of a
speculative step equal the masks of the same tokens taken one by one; bad specs name their field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from tandem.default_model import ASSETS_DIR, TARGET_NAME
from tandem.engine import structured
from tandem.engine.structured import Grammars, check_spec
from tandem.tokenizer import Tokenizer

TARGET = ASSETS_DIR / TARGET_NAME
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}}}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    config = json.loads((TARGET / "config.json").read_text())
    return Grammars((TARGET / "tokenizer.json").read_text(), config["vocab_size"], [config["eos_token_id"]])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(TARGET))


def walk(grammars: Grammars, spec: dict, seed: int, max_steps: int = 200) -> list[int]:
    """Random tokens among the allowed ones until the grammar is complete (EOS taken when allowed, half the time)."""
    rng, state, out = random.Random(seed), grammars.state(spec), []
    eos = grammars.tokenizer.eos_token
    for _ in range(max_steps):
        allowed = state.allowed().nonzero().flatten().tolist()
        assert allowed, "the grammar left no token to take"
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return out
        token = rng.choice([t for t in allowed if t != eos])
        out.append(token)
        state.sync(out)
        if state.finished:
            return out
    raise AssertionError(f"no end after {max_steps} tokens")


@pytest.mark.parametrize("seed", range(12))
def test_json_schema_walks_validate(grammars, tokenizer, seed):
    text = tokenizer.decode(walk(grammars, {"json": SCHEMA}, seed))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in text.replace('"', "").split(":")[0]  # no free whitespace between tokens of the structure


@pytest.mark.parametrize("seed", range(6))
def test_regex_choice_and_lark_walks_match(grammars, tokenizer, seed):
    pattern = r"(ab|cd)[0-9]{2,4}-x"
    assert re.fullmatch(pattern, tokenizer.decode(walk(grammars, {"regex": pattern}, seed)))
    choices = ["def", "class", "import os"]
    assert tokenizer.decode(walk(grammars, {"choice": choices}, seed)) in choices
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", tokenizer.decode(walk(grammars, {"grammar": lark}, seed)))



def test_json_object_allows_objects_only(grammars, tokenizer):
    state = grammars.state({"json_object": True})
    assert not state.allowed()[tokenizer.encode("[", add_special_tokens=False)[0]]  # an array is not an object
    ids = tokenizer.encode('{"a":[1,2],"b":"x"}', add_special_tokens=False)
    for j, token in enumerate(ids):
        assert state.allowed()[token], tokenizer.decode(ids[:j + 1])
        state.sync(ids[:j + 1])
    assert state.allowed()[grammars.tokenizer.eos_token]  # complete: the request may end here


def test_speculative_masks_equal_stepwise_masks(grammars, tokenizer):
    spec = {"regex": r"(ab|cd)[0-9]{2,4}-x"}
    good = tokenizer.encode("ab12", add_special_tokens=False)
    state = grammars.state(spec)
    before = state.allowed()
    draft = good + [tokenizer.encode("zz", add_special_tokens=False)[0]] + good[:1]
    masks = structured.unpack(state.allowed_along(draft), grammars.vocab_size)
    assert len(masks) == len(draft) + 1
    assert bool((state.allowed() == before).all())  # the state is back where it was (rollback)
    step = grammars.state(spec)
    for j, token in enumerate(good):  # valid prefix: each row's mask is the stepwise one
        assert bool((masks[j] == step.allowed()).all()), j
        step.sync(good[:j + 1])
    assert bool((masks[len(good)] == step.allowed()).all())
    assert not masks[len(good)][draft[len(good)]]  # the invalid draft token is masked: it will be rejected
    assert bool((masks[len(good) + 1] == masks[len(good)]).all())  # rows past it repeat its mask


def test_cache_resume_and_bad_specs(grammars, tokenizer):
    spec = {"choice": ["yes", "no"]}
    assert grammars.compile(spec) is grammars.compile({"choice": ["yes", "no"]})  # compiled once
    assert grammars.compile_async(spec).result(timeout=10) is grammars.compile(spec)
    ids = tokenizer.encode("ye", add_special_tokens=False)
    initial = grammars.state({"regex": "yes|yellow"}).allowed()
    resumed = grammars.state({"regex": "yes|yellow"}, resume_tokens=ids)  # e.g. after a migration
    assert bool((grammars.state({"regex": "yes|yellow"}).allowed() == initial).all())  # the cached one never moves
    assert not bool((resumed.allowed() == initial).all())
    fresh = grammars.state({"regex": "yes|yellow"})
    fresh.sync(ids)
    assert bool((resumed.allowed() == fresh.allowed()).all()) and resumed.consumed == len(ids)
    for bad, field in [({"regex": "("}, "structured_outputs.regex"), ({"choice": []}, "structured_outputs.choice"),
                       ({"json": 5}, "structured_outputs.json"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                       ({"grammar": "start: nope"}, "structured_outputs.grammar"), ({"jsn": {}}, "exactly one"),
                       ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
                        "structured_outputs.json")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            grammars.compile(check_spec(bad))


def test_batched_masks_equal_single_masks_and_torch_stays_on_the_caller(grammars, tokenizer, monkeypatch):
    """Many rows go to the helper thread; their masks equal each state's own, and no torch op runs on
    the helper (it only fills int32 words): a helper thread that ran torch ops got an OpenMP team of its
    own, which left every later decode step ~40% slower. Applying the words to logits gives the same
    rows in the C kernel and in the torch reference, padded columns included."""
    import threading

    import torch

    from kernels import fused
    from tandem.engine import structured

    states, texts = [], ["", "ab", "abc", "a b", "zz", "q", "hello wor", "x y z"]
    for text in texts * 2:
        state = grammars.state({"regex": "[a-z ]*x?[0-9]{0,3}"})
        state.sync(tokenizer.encode(text, add_special_tokens=False))
        states.append(state)
    assert len(states) > structured.INLINE_ROWS  # the helper thread's path
    threads = []
    for name in ("unpack_bitmask", "apply_bitmask"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real: threads.append(threading.current_thread()) or real(*a))
    words = grammars.allowed_batch_async(states).result()
    assert threads == []
    masks = structured.unpack(words, grammars.vocab_size)
    assert masks.shape == (len(states), grammars.vocab_size)
    for state, mask in zip(states, masks):
        assert bool((mask == state.allowed()).all())
    logits = torch.randn(len(states), grammars.vocab_size + 7)  # a padded vocabulary
    expected = torch.cat([logits[:, :grammars.vocab_size].masked_fill(~masks, float("-inf")),
                          torch.full((len(states), 7), float("-inf"))], dim=1)
    picked = [len(states) - 1, 0, 3]  # a subset of rows, in any order, masked in place
    for native in (True, False):  # the C kernel, then the torch reference
        monkeypatch.setattr(fused, "ALLOWED", native)
        out = logits.clone()
        structured.mask_rows(out, words, grammars.vocab_size)
        assert torch.equal(out, expected)
        out = logits.clone()
        structured.mask_rows(out, words[picked], grammars.vocab_size, picked)
        rest = [i for i in range(len(states)) if i not in picked]
        assert torch.equal(out[picked], expected[picked]) and torch.equal(out[rest], logits[rest])
    assert threads and set(threads) == {threading.current_thread()}


def _words(allowed: list[set[int]], vocab: int):
    """llguidance's bit layout for token sets: int32 words [rows, ceil(vocab / 32)], bit b of word w is token
    32 w + b."""
    import torch

    words = [[0] * ((vocab + 31) // 32) for _ in allowed]
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r][t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def test_masked_argmax_is_the_argmax_of_the_masked_row_in_c_and_torch():
    """fused.masked_argmax (the greedy pick under a grammar) equals argmax over the row masked to -inf:
    ties by lowest index, a NaN among the allowed tokens winning, NaN and large values outside the mask
    ignored, padded columns past the vocabulary never picked, rows picked out of order, sparse and whole
    words; where the masked argmax would leave the grammar (allowed tokens all -inf) it gives the first
    allowed token, and -1 where nothing is allowed. The C pass and the torch fallback (a GPU's) agree, and
    so do their apply_bitmask (mixed words blended, a last word partly past the vocabulary)."""
    import torch

    from kernels import fused

    gen = torch.Generator().manual_seed(0)
    vocab, cols = 150, 160  # 5 words, the last partly past the vocabulary; 10 padded columns
    for trial in range(300):
        rows = torch.randint(0, 6, (3, cols), generator=gen).float()
        rows[:, vocab:] = 100.0  # padded columns: never a token
        if trial % 5 == 0:
            rows[0, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")
        if trial % 7 == 0:
            rows[1] = float("-inf")
        dense = trial % 3 == 0  # every token allowed in row 2: whole words, the vector path
        sizes = torch.randint(1, vocab, (3,), generator=gen).tolist()
        allowed = [set(range(vocab)) if dense and r == 2 else
                   set(torch.randperm(vocab, generator=gen)[:sizes[r]].tolist()) for r in range(3)]
        picked = [2, 0, 1]
        words = _words([allowed[r] for r in picked], vocab)
        expect = []
        for r in picked:
            masked = torch.full((cols,), float("-inf"))
            masked[sorted(allowed[r])] = rows[r, sorted(allowed[r])]
            expect.append(min(allowed[r]) if bool(masked.max() == float("-inf")) else int(masked.argmax()))
        masked = rows.clone()
        for i, r in enumerate(picked):  # what apply_bitmask must write: -inf off the mask and past the vocabulary
            masked[r, [t for t in range(cols) if t >= vocab or t not in allowed[r]]] = float("-inf")
        for native in (True, False):
            fused.ALLOWED, saved = native, fused.ALLOWED
            try:
                assert fused.masked_argmax(rows, picked, words, vocab) == expect
                out = rows.clone()
                fused.apply_bitmask(out, words, vocab, picked)
                assert torch.equal(out.nan_to_num(7.0), masked.nan_to_num(7.0))
            finally:
                fused.ALLOWED = saved
    tie = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0]])
    for native in (True, False):
        fused.ALLOWED, saved = native, fused.ALLOWED
        try:
            assert fused.masked_argmax(tie, [0], _words([{2, 3, 4}], 5), 5) == [3]  # the first of equal maxima
            assert fused.masked_argmax(tie, [0], _words([{0, 2}], 5), 5) == [2]  # the maximum refused
            assert fused.masked_argmax(tie, [0], _words([set()], 5), 5) == [-1]
            assert fused.masked_argmax(tie, [], _words([{1}], 5), 5) == []
        finally:
            fused.ALLOWED = saved


def test_greedy_allowed_follows_llguidance_masks(grammars):
    """structured.greedy_allowed (real grammar states' masks into the reused buffer, then the one pass)
    picks, for each state, the argmax over exactly the tokens its grammar's own mask allows; a batch
    larger than the buffer grows it."""
    import torch

    specs = [{"regex": "[a-c]+"}, {"choice": ["yes", "no"]}, {"json_object": True}] * 3
    states = [grammars.state(spec) for spec in specs]
    logits = torch.randn(len(states) + 2, grammars.vocab_size + 8, generator=torch.Generator().manual_seed(1))
    picked = list(range(2, len(states) + 2))
    got = structured.greedy_allowed(logits, picked, states)
    assert grammars.mask_buffer(1).shape[0] >= len(states)
    for state, row, token in zip(states, picked, got):
        allowed = state.allowed()
        masked = logits[row, :grammars.vocab_size].masked_fill(~allowed, float("-inf"))
        assert token == int(masked.argmax()) and bool(allowed[token])


def test_a_model_that_fights_its_grammar_gets_masks_first(grammars):
    """Checking after sampling pays off only when the model mostly follows its grammar: after a run
    of misses a temperature row's state masks first (probing every PROBE_EVERY steps), and recovers after
    hits. A greedy row is masked before the forward where llguidance has threads (a GPU engine's masks
    are made while the forward runs) and takes greedy_allowed after it where not (a CPU engine)."""
    from tandem.engine.structured import PROBE_EVERY
    from tandem.sampling_params import SamplingParams

    state, sampled = grammars.state({"regex": "[a-z]+"}), SamplingParams(temperature=1.0)
    assert not state.masks_first(sampled) and state.masks_first(SamplingParams(temperature=1.0, top_p=0.9))
    for _ in range(10):
        state.record(True)
    plan = [state.masks_first(sampled) for _ in range(2 * PROBE_EVERY)]
    assert plan.count(False) == 2  # masks first, but for one probe in every PROBE_EVERY steps
    for _ in range(10):
        state.record(False)
    assert not state.masks_first(sampled)
    greedy = SamplingParams(temperature=0, top_p=0.5)  # greedy: the cut does not matter
    config = json.loads((TARGET / "config.json").read_text())
    cpu = Grammars((TARGET / "tokenizer.json").read_text(), config["vocab_size"], [config["eos_token_id"]],
                   threads=False)
    assert grammars.state({"regex": "[a-z]+"}).masks_first(greedy)
    assert not cpu.state({"regex": "[a-z]+"}).masks_first(greedy)


def test_without_threads_masks_are_the_same_and_no_thread_computes_them(grammars, tokenizer):
    """A CPU engine's Grammars(threads=False) computes a batch's masks on the caller's thread, one
    matcher after another (llguidance's pool beside the forward's OpenMP threads set off ThreadBackoff),
    and gets the same words as llguidance's executor."""
    config = json.loads((TARGET / "config.json").read_text())
    serial = Grammars((TARGET / "tokenizer.json").read_text(), config["vocab_size"], [config["eos_token_id"]],
                      threads=False)
    both = []
    for g in (grammars, serial):
        states = []
        for text in ["", "ab", "a b c", "zz9", "hello", "x1"] * 2:
            state = g.state({"regex": "[a-z ]*[0-9]?"})
            state.sync(tokenizer.encode(text, add_special_tokens=False))
            states.append(state)
        both.append(g.allowed_batch_async(states).result())
    assert len(both[0]) > structured.INLINE_ROWS
    assert both[0].equal(both[1])
    assert serial._executor is None and serial._mask_pool is None
