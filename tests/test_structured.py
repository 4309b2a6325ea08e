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


class _Allow:
    """A grammar state stand-in that allows a fixed set of tokens (best_allowed asks nothing else)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def allows(self, token: int) -> bool:
        return token in self.allowed


def test_best_allowed_is_the_masked_argmax_or_declines():
    """A greedy row's best candidates give exactly the masked argmax (the argmax itself when allowed),
    ties by lowest index, and decline (None: the row gets a mask) only when no candidate is allowed;
    the C pass and the torch order (the fallback) agree."""
    import torch

    from kernels import fused
    from tandem.engine.structured import CANDIDATES, best_allowed

    gen = torch.Generator().manual_seed(0)
    found_some = 0
    for _ in range(200):  # random rows with many ties: compare with argmax over the masked row
        row = torch.randint(0, 6, (1, 40), generator=gen).float()
        allowed = set(torch.randperm(40, generator=gen)[:int(torch.randint(1, 40, (1,), generator=gen))].tolist())
        masked = torch.full_like(row, float("-inf"))
        masked[0, sorted(allowed)] = row[0, sorted(allowed)]
        order = torch.sort(row[0], descending=True, stable=True).indices.tolist()  # argmax's order, ties by index
        expect = int(masked.argmax()) if int(masked.argmax()) in order[:CANDIDATES] else None
        assert best_allowed(row, [0], [_Allow(allowed)]) == [expect]
        found_some += expect is not None
    assert found_some > 50
    flat = torch.ones(1, 3 * CANDIDATES)
    flat[0, -1] = 2.0  # the argmax, refused; every other token ties: lowest index first
    assert best_allowed(flat, [0], [_Allow({3 * CANDIDATES - 1, 0})]) == [3 * CANDIDATES - 1]  # the argmax, allowed
    assert best_allowed(flat, [0], [_Allow({0})]) == [0]
    assert best_allowed(flat, [0], [_Allow({CANDIDATES - 1, 3})]) == [3]
    assert best_allowed(flat, [0], [_Allow({CANDIDATES})]) == [None]  # past the K
    flat[0, 5] = float("nan")  # argmax is the first NaN: no candidate can stand for the masked one
    assert best_allowed(flat, [0], [_Allow({0})]) == [None]
    assert best_allowed(torch.tensor([[3.0, 1.0, 3.0]]), [0], [_Allow({2, 1})]) == [2]  # k covers the row
    two = torch.tensor([[0.0, 5.0, 1.0], [7.0, 2.0, 9.0]])  # rows picked out of order, each its own state
    assert best_allowed(two, [1, 0], [_Allow({0, 1}), _Allow({2})]) == [0, 2]
    rows = torch.randint(0, 4, (6, 50), generator=gen).float()
    native = fused.topk_rows(rows, [4, 0, 2], CANDIDATES)
    fused.ALLOWED, saved = False, fused.ALLOWED
    try:
        assert fused.topk_rows(rows, [4, 0, 2], CANDIDATES) == native
        assert fused.topk_rows(rows, [], CANDIDATES) == []  # the torch path (a GPU's) with no greedy row
    finally:
        fused.ALLOWED = saved


def test_a_model_that_fights_its_grammar_gets_masks_first(grammars):
    """Checking after sampling pays off only when the model mostly follows its grammar: after a run
    of misses a state masks first (probing every PROBE_EVERY steps), and recovers after hits."""
    from tandem.engine.structured import PROBE_EVERY
    from tandem.sampling_params import SamplingParams

    state, greedy = grammars.state({"regex": "[a-z]+"}), SamplingParams(temperature=0)
    assert not state.masks_first(greedy) and state.masks_first(SamplingParams(temperature=1.0, top_p=0.9))
    for _ in range(10):
        state.record(True)
    plan = [state.masks_first(greedy) for _ in range(2 * PROBE_EVERY)]
    assert plan.count(False) == 2  # masks first, but for one probe in every PROBE_EVERY steps
    for _ in range(10):
        state.record(False)
    assert not state.masks_first(greedy)


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
