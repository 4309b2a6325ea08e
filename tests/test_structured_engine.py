"""Structured outputs in the engine (offline `LLM`): constrained greedy equals the argmax of
transformers' logits masked by the same grammar; every seeded temperature-1 output validates (with
and without n-gram / draft-model speculation); masked sampling draws from the renormalised masked
distribution (chi-squared); a grammar that cannot compile is a clear error."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from tiny_models import make_checkpoint

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["a", "b", "c"]}}}
SPECS = [({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
         ({"regex": r"[a-f]{2,5}-[0-9]{1,3}"}, lambda t: re.fullmatch(r"[a-f]{2,5}-[0-9]{1,3}", t) is not None),
         ({"choice": ["return", "yield", "pass"]}, lambda t: t in ("return", "yield", "pass"))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("structured") / "ckpt"))


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt, num_kv_blocks=512, dtype="float32")  # checked against transformers in fp32 (a GPU's auto: bf16)


@pytest.mark.parametrize("spec", [s for s, _ in SPECS], ids=["json", "regex", "choice"])
def test_constrained_greedy_equals_masked_transformers_argmax(ckpt, llm, spec):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    prompt = llm.engine.tokenizer.encode("def parse(text):\n    return ")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))[0]
    state, ids, expected = llm.engine.grammars.state(spec), list(prompt), []
    eos = llm.engine.tokenizer.eos_token_id
    with torch.no_grad():
        for _ in range(40):
            logits = model(torch.tensor([ids])).logits[0, -1]
            allowed = state.allowed()
            token = int(torch.where(allowed, logits[:allowed.shape[0]], float("-inf")).argmax())
            expected.append(token)
            ids.append(token)
            state.sync(expected)
            if token == eos or state.finished:
                break
    assert out.token_ids == expected


@pytest.mark.parametrize("speculator", [None, "ngram", "draft"])
def test_every_seeded_sample_validates(ckpt, tmp_path_factory, speculator):
    options = {}
    if speculator == "ngram":
        options = {"speculator": "ngram", "num_speculative_tokens": 3, "spec_max_batch": 16}
    elif speculator == "draft":
        draft = make_checkpoint(str(tmp_path_factory.mktemp("draft") / "draft"), seed=7, num_hidden_layers=1)
        options = {"speculator": "draft_model", "draft_model": draft, "num_speculative_tokens": 3, "spec_max_batch": 16}
    llm = LLM(ckpt, num_kv_blocks=512, **options)
    prompts = ["x = ", "# config\n", "def f():\n    "]
    for spec, valid in SPECS:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=spec) for s in range(12)]
        outs = llm.generate([prompts[i % 3] for i in range(12)], params)
        for o in outs:
            assert o.finish_reason == "stop", (spec, o.text)
            assert valid(o.text), (spec, o.text)
    if speculator is not None:  # all twelve at once, verifying drafts under the grammar
        assert llm.engine.runner.spec_stats.num_verifications > 0


@pytest.mark.parametrize("cut", [{}, {"min_p": 1e-12}], ids=["checked-after", "masked-before"])
def test_masked_sampling_draws_the_renormalised_distribution(ckpt, llm, cut):
    """First tokens under {"regex": "[a-z]+"}: chi-squared against softmax(logits) restricted to the
    allowed tokens and renormalised. Temperature alone samples unmasked and redraws a refused token
    from the masked row; an (inert) min-p sends the rows through the mask-before-sampling path."""
    import transformers

    spec = {"regex": r"[a-z]+"}
    prompt = llm.engine.tokenizer.encode("value = ")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    allowed = llm.engine.grammars.state(spec).allowed()
    probs = torch.softmax(torch.where(allowed, logits[:allowed.shape[0]], float("-inf")), -1)
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=1, ignore_eos=True,
                                                      structured_outputs=spec, **cut) for s in range(n)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=probs.shape[0]).double()
    assert bool((counts[~allowed] == 0).all())  # never a token the grammar forbids
    expected = probs.double() * n
    big = expected >= 5  # pool the rare tokens into one cell, as a chi-squared test needs
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    stat = float(((observed - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    df = int(big.sum())  # cells - 1
    critical = df + 4.0 * math.sqrt(2 * df)  # far in the upper tail (about p < 0.001 for these df)
    assert stat < critical, (stat, df)


def test_bad_grammar_is_a_clear_error(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        SamplingParams(structured_outputs={"choice": []})
    assert llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids  # still serving


def test_a_cpu_engine_computes_masks_on_its_own_thread(llm):
    """Rows masked before sampling (top-p under a grammar), more than INLINE_ROWS of them: on a CPU the
    engine computes their masks itself — no llguidance pool or helper thread beside its OpenMP threads,
    which made ThreadBackoff drop the engine to one thread after such a batch (~30% slower for everyone);
    a GPU engine keeps the pool, whose threads overlap the forward."""
    from tandem.engine import structured

    spec, check = SPECS[1]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=3, structured_outputs=spec)
    outs = llm.generate(["a", "b", "c", "d", "e", "f", "g", "h"], params)
    assert len(outs) > structured.INLINE_ROWS and all(check(o.outputs[0].text) for o in outs)
    grammars, cpu = llm.engine.grammars, llm.engine.config.torch_device.type == "cpu"
    assert grammars.threads is not cpu
    assert (grammars._executor is None and grammars._mask_pool is None) is cpu


@pytest.mark.parametrize("speculator", [None, "ngram"])
def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(ckpt, llm, speculator):
    """Where the grammar is complete (a choice made, a bounded regex matched), the request stops there with
    finish_reason "stop", even under ignore_eos (EOS is not what ends it): the grammar state's `finished`
    must follow every consumed token. The output is one of the choices, not choice + EOS-masked filler up to
    max_tokens."""
    engine = llm if speculator is None else LLM(ckpt, num_kv_blocks=512, dtype="float32", speculator="ngram",
                                                num_speculative_tokens=3)
    prompt = llm.engine.tokenizer.encode("def parse(text):\n    return ")
    for spec, valid in ((SPECS[2][0], lambda t: t in ("return", "yield", "pass")),
                        ({"regex": "[a-c]{3}"}, lambda t: re.fullmatch("[a-c]{3}", t) is not None)):
        outs = engine.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True,
                                                             structured_outputs=spec) for s in range(3)])
        for out in outs:
            assert valid(out.text) and out.finish_reason == "stop" and len(out.token_ids) < 30, \
                (spec, out.text, out.finish_reason, len(out.token_ids))


def test_grammar_rows_and_free_rows_in_one_step_each_match_their_run_alone(llm):
    """On a CPU a small decode step takes every row's argmax in its C call, a grammar row's under the mask
    made for it before the forward (AttentionMetadata.argmax_masks: an address per row of the step, 0 for a
    free row), and the free rows take theirs too. Mixed in one batch, each request equals its run alone: a
    mask on the wrong row, or on a free row, changes some output; the grammar rows' outputs are all their
    grammar accepts (24 tokens: a prefix)."""
    prompts = [llm.engine.tokenizer.encode(t) for t in ("def parse(text):\n    return ", "import os\n", "x = ",
                                                        "class A:\n")]
    specs = [SPECS[0], None, SPECS[1], None]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=s and s[0]) for s in specs]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    free = [o.text for o, s in zip(alone, specs) if s is None]
    assert not any(check(t) for t in free for _, check in SPECS[1:])  # so a mask on a free row would show
    for out, spec in zip(together, specs):
        if spec is not None:
            assert not llm.engine.grammars.state(spec[0], out.token_ids).matcher.is_error()
