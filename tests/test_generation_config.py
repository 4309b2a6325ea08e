"""A checkpoint's generation_config.json supplies default sampling values (as transformers and vLLM
read it) for the fields a request leaves unset — offline (`LLM(...).generate(prompts)` with no
params), over HTTP and over gRPC — while a request's own values win. The shipped model's sets a
repetition penalty that keeps its greedy demo output from looping."""

from __future__ import annotations

import json
import sys

import pytest
from service_procs import Proc, grpc_stub, post, router_endpoints, start_router, stop_all, wait_workers
from tiny_models import make_checkpoint

from tandem import LLM, SamplingParams
from tandem.default_model import default_model_path
from tandem.sampling_params import model_defaults


def test_defaults_are_read_and_checked(tmp_path):
    assert model_defaults(default_model_path()) == {"repetition_penalty": 1.2}
    assert model_defaults(str(tmp_path)) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_new_tokens": 5}))
    assert model_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        model_defaults(str(tmp_path))


def test_end_tokens_listed_only_in_generation_config_stop_generation(tmp_path):
    """As in transformers' generate: an id generation_config.json lists as eos_token_id ends a request
    though config.json does not name it (Qwen instruct models list <|endoftext|> only there)."""
    import torch
    import transformers as tf

    path = make_checkpoint(str(tmp_path / "ckpt"))
    llm = LLM(path, num_kv_blocks=64)
    ids = llm.tokenizer.encode("def f(x):")
    free = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[4]  # a token greedy decoding reaches: make it an end token
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    got = LLM(path, num_kv_blocks=64).generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert got.token_ids == free[:free.index(stop) + 1] and got.finish_reason == "stop"
    hf = tf.AutoModelForCausalLM.from_pretrained(path).generate(torch.tensor([ids]), max_new_tokens=12,
                                                                do_sample=False)
    assert hf[0, len(ids):].tolist() == got.token_ids


@pytest.mark.slow
def test_shipped_model_demo_does_not_loop():
    llm = LLM()
    plain = llm.generate(["class Config"], SamplingParams(temperature=0, max_tokens=40))[0].text
    shipped = llm.generate(["class Config"], SamplingParams(**{**llm.sampling_defaults, "temperature": 0,
                                                              "max_tokens": 40}))[0].text
    loop = "The default argument is a string, the file is a string"
    assert plain.count(loop) == 2  # the loop the penalty is there for
    assert shipped != plain and loop not in shipped
    assert llm.get_default_sampling_params().repetition_penalty == 1.2


@pytest.mark.slow
def test_router_applies_the_defaults_a_request_leaves_unset(tmp_path):
    from tandem.protocol import generation_pb2 as pb

    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.8}))
    llm = LLM(ckpt, num_kv_blocks=256)
    router = start_router("router", ckpt, tmp_path)
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(Proc("d1", [sys.executable, "-m", "tandem.cli", "decode", "--model", ckpt, "--kv-connector",
                                 "none", "--listen", "tcp://127.0.0.1:0", "--router", ep["listen"],
                                 "--num-kv-blocks", "256"], tmp_path))
        wait_workers(ep["http"], decode=1)
        prompt = "def f(x):\n    return x + x"
        with_default, without = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                                       repetition_penalty=rp))[0].text
                                 for rp in (1.8, 1.0))
        assert with_default != without  # the default changes this prompt's answer
        for body, want in (({}, with_default), ({"repetition_penalty": 1.0}, without)):
            status, _, out = post(f"{ep['http']}/v1/completions",
                                  {"prompt": prompt, "max_tokens": 24, "temperature": 0, **body})
            assert status == 200 and out["choices"][0]["text"] == want, body
        text = "".join(r.text for r in grpc_stub(ep["grpc"]).Generate(pb.GenerateRequest(
            text=prompt, sampling=pb.SamplingParams(max_tokens=24, temperature=0)), timeout=60))
        assert text == with_default
    finally:
        stop_all(procs)
