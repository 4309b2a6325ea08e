"""logit_bias, min_tokens and the repetition / frequency / presence penalties: the batched processor
equals a plain per-row reference (speculative rows included); greedy generation with them equals a
step-by-step transformers reference on the same weights; bad values are errors naming the field."""

from __future__ import annotations

import array
import random

import pytest
import torch

from tandem.engine import logits_processors
from tandem.sampling_params import SamplingParams


class FakeRequest:  # what the processor reads from a Request
    def __init__(self, prompt, output, params, eos=(1,)):
        self.prompt_token_ids, self.output_token_ids, self.params = prompt, output, params
        self.num_output_tokens, self.eos_token_ids = len(output), set(eos)
        self.token_ids, self.num_prompt_tokens = prompt + output, len(prompt)

    def token_array(self):
        return array.array("q", self.token_ids)


def reference_row(row, prompt, output, p, eos):
    """One row, one token at a time, the way the docs say it."""
    row = row.clone()
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    if len(output) < p.min_tokens:
        for t in (*eos, *p.stop_token_ids):
            row[t] = float("-inf")
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_batched_processor_equals_per_row_reference():
    rng, vocab = random.Random(0), 64
    reqs, extras = [], []
    for i in range(12):
        params = SamplingParams(max_tokens=50, presence_penalty=rng.choice([0.0, 0.5, -1.0]),
                                frequency_penalty=rng.choice([0.0, 0.3, 1.5]),
                                repetition_penalty=rng.choice([1.0, 1.3, 0.7]), min_tokens=rng.choice([0, 3, 9]),
                                stop_token_ids=[5] if i % 3 == 0 else [],
                                logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(i % 4)} or None)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        reqs.append(FakeRequest(prompt, output, params))
        extras.append([rng.randrange(vocab) for _ in range(rng.randint(0, 3))])  # a speculative row's drafts
    rows = torch.randn(12, vocab)
    got = logits_processors.process(rows, reqs, extras)
    for i, r in enumerate(reqs):
        want = reference_row(rows[i], r.prompt_token_ids, r.output_token_ids + extras[i], r.params, (1,))
        assert torch.allclose(got[i], want, atol=1e-5), i
    plain = [FakeRequest([1, 2], [3], SamplingParams())]
    assert logits_processors.process(rows[:1], plain) is rows[:1] or torch.equal(
        logits_processors.process(rows[:1], plain), rows[:1])  # untouched rows stay as they were


def test_native_penalty_pass_equals_torch_bit_for_bit(monkeypatch):
    """kernels/csrc/penalty_cpu.c against the torch pass it replaces on the CPU: the same floats, for
    repeated tokens, speculative rows, every penalty sign, logits at 0 and +-inf; an out-of-vocabulary
    token is an IndexError either way, with nothing written."""
    from kernels import native_cpu

    if native_cpu.library() is None:
        pytest.fail("no native CPU library: the C pass cannot be compared (a C compiler is a test dependency)")
    rng, vocab = random.Random(1), 97
    reqs, extras = [], []
    for i in range(40):
        params = SamplingParams(max_tokens=50, presence_penalty=rng.choice([0.0, 0.5, -1.25]),
                                frequency_penalty=rng.choice([0.0, 0.3, -1.7]),
                                repetition_penalty=rng.choice([1.0, 1.2, 0.7, 1.9]))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        output = [rng.choice(prompt + [rng.randrange(vocab)]) for _ in range(rng.randint(0, 25))]
        reqs.append(FakeRequest(prompt, output, params))
        extras.append([rng.randrange(vocab) for _ in range(rng.randint(0, 4))])
    rows = torch.randn(40, vocab) * 7
    rows[:, :5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-30])
    native = logits_processors.process(rows, reqs, extras)
    with monkeypatch.context() as m:
        m.setattr(logits_processors, "_penalize_native", lambda *a: False)
        reference = logits_processors.process(rows, reqs, extras)
    assert not torch.equal(native, rows)
    assert torch.equal(native.view(torch.int32), reference.view(torch.int32))  # bits, so -0.0 counts
    bad = [FakeRequest([3, vocab + 2], [], SamplingParams(repetition_penalty=1.2))]
    for torch_only in (False, True):
        with monkeypatch.context() as m, pytest.raises(IndexError):
            if torch_only:
                m.setattr(logits_processors, "_penalize_native", lambda *a: False)
            logits_processors.process(rows[:1], bad)


def test_native_penalty_pass_on_speculative_rows_equals_torch_bit_for_bit(monkeypatch):
    """A speculative step's rows: one request followed by 0, 1, .. k of its drafts (the C pass reads them from
    one shared copy of the request's tokens), beside other requests, a second request's rows whose drafts
    do not extend each other (copies of their own), and a row for another request between them."""
    rng, vocab = random.Random(2), 61
    params = [SamplingParams(max_tokens=50, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.8),
              SamplingParams(max_tokens=50, repetition_penalty=0.8, frequency_penalty=-1.1),
              SamplingParams(max_tokens=50, repetition_penalty=1.9, presence_penalty=0.6)]
    a, b, c = (FakeRequest([rng.randrange(vocab) for _ in range(20)], [rng.randrange(vocab) for _ in range(9)], p)
               for p in params)
    drafts = [rng.randrange(vocab) for _ in range(4)]
    reqs = [a] * 5 + [b, b, c, b]
    extras = [drafts[:j] for j in range(5)] + [[7], [8, 7], [], [7, 9]]
    rows = torch.randn(len(reqs), vocab) * 5
    native = logits_processors.process(rows, reqs, extras)
    with monkeypatch.context() as m:
        m.setattr(logits_processors, "_penalize_native", lambda *args: False)
        reference = logits_processors.process(rows, reqs, extras)
    assert not torch.equal(native, rows)
    assert torch.equal(native.view(torch.int32), reference.view(torch.int32))


def test_bad_values_name_the_field():
    for kw, field in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="a"), "frequency"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
                      (dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(logit_bias=[1, 2]), "logit_bias"),
                      (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={i: 1 for i in range(301)}),
                                                                  "logit_bias")]:
        with pytest.raises((ValueError, TypeError), match=field):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={"7": 2}).to_dict()["logit_bias"] == {"7": 2.0}  # wire: string keys


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.2, presence_penalty=0.6),
                                dict(repetition_penalty=1.3, presence_penalty=-0.5, logit_bias={40: 3.0, 41: -2.0}),
                                dict(min_tokens=12, logit_bias={1: 50.0})],
                         ids=["repetition", "freq+presence", "mixed+bias", "min_tokens"])
@pytest.mark.parametrize("speculator", [None, "ngram"])
def test_greedy_with_penalties_equals_transformers_reference(tmp_path_factory, kw, speculator):
    import transformers
    from tiny_models import make_checkpoint

    from tandem import LLM

    ckpt = make_checkpoint(str(tmp_path_factory.mktemp("pen") / "ckpt"))
    options = {"speculator": "ngram", "num_speculative_tokens": 3} if speculator else {}
    llm = LLM(ckpt, num_kv_blocks=256, **options)
    prompt = llm.engine.tokenizer.encode("def f(x):\n    return x + x + x + x")
    params = SamplingParams(temperature=0, max_tokens=30, **kw)
    got = llm.generate([prompt], params)[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(30):
            row = reference_row(model(torch.tensor([ids])).logits[0, -1], prompt, out, params, (1,))
            token = int(row.argmax())
            out.append(token)
            ids.append(token)
            if token == 1:
                break
    assert got == out
    if "min_tokens" in kw:  # EOS was the favourite (bias 50) but is forbidden until the 12th token
        assert len(got) == 13 and got[-1] == 1


def test_token_array_follows_the_token_list():
    """The int64 mirror the penalty pass reads grows with the list and is rebuilt for a new list (a beam
    child's copy), so a step never reads stale tokens."""
    from tandem.engine.request import Request

    req = Request("r", [5, 6, 7], SamplingParams(), {1}, max_tokens=8)
    first = req.token_array()
    assert list(first) == [5, 6, 7]
    req.append_token(9)
    req.append_token(4)
    assert req.token_array() is first and list(first) == [5, 6, 7, 9, 4]  # extended in place, not rebuilt
    req.token_ids = [5, 6, 8]  # another list (as a forked beam gets)
    assert list(req.token_array()) == [5, 6, 8]
