"""Bad input gets a clear ValueError/TypeError (CLI: exit 2, one line) and the engine keeps serving."""

import json
import os
import subprocess
import sys

import pytest
from tiny_models import make_checkpoint

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=100), "logprobs"),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        SamplingParams(**kwargs)


def test_wrong_types_and_unknown_keys():
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens="5")
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5})


def test_bad_prompts_leave_engine_serving(llm):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], good)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 300], good)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 100000]], good)
    with pytest.raises(TypeError):
        llm.generate([3.5], good)
    # A batch with one bad prompt queues nothing.
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [5] * 300], good)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], good)[0].token_ids) == 4
    llm.engine.check_invariants()


def test_max_tokens_clipped_to_model_len(llm):
    out = llm.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_engine_option_errors(model_path, tmp_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(model_path, max_batch=3)
    with pytest.raises(ValueError, match="cannot hold"):
        LLM(model_path, num_kv_blocks=4, max_model_len=256)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model_path, max_model_len=10**6)
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def _copy_checkpoint(src, dst, **config_changes):
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_unsupported_architecture_and_features(model_path, tmp_path):
    bad = _copy_checkpoint(model_path, str(tmp_path / "gpt"), architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(bad)
    yarn = _copy_checkpoint(model_path, str(tmp_path / "yarn"), rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        LLM(yarn)
    window = _copy_checkpoint(model_path, str(tmp_path / "sw"), architectures=["MistralForCausalLM"],
                              sliding_window=128)
    # sliding-window attention is implemented: the window no longer caps the context
    assert LLM(window, max_model_len=256, num_kv_blocks=16).engine.max_model_len == 256
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(window, max_model_len=10**6)


def test_missing_and_corrupt_weights(model_path, tmp_path):
    import shutil

    missing = str(tmp_path / "missing")
    shutil.copytree(model_path, missing)
    os.remove(os.path.join(missing, "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(missing)
    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(model_path, corrupt)
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="cannot read"):
        LLM(corrupt)
    no_tok = str(tmp_path / "notok")
    shutil.copytree(model_path, no_tok)
    os.remove(os.path.join(no_tok, "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json"):
        LLM(no_tok)


def test_cli_bad_input_exits_2_with_one_line(model_path):
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "--model", model_path, "--max-tokens", "0", "hi"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "max_tokens" in lines[0]


def test_cli_generate_streams_greedy_text(model_path, llm):
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "--model", model_path, "--max-tokens", "12",
           "--num-kv-blocks", "64", "--max-model-len", "256", "def f(x):"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    expected = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=12))[0].text
    assert res.stdout == expected + "\n"
