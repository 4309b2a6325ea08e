"""Checkpoint loading: sharded safetensors + index load to the same model; chat applies the template."""

import os

import pytest
import torch
from tiny_models import hf_greedy, make_checkpoint

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'


def test_sharded_checkpoint_matches_transformers(tmp_path):
    import transformers as tf

    single = make_checkpoint(str(tmp_path / "single"), "qwen2")
    model = tf.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(single, name), os.path.join(sharded, name))
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    prompts = [[5, 6, 7], list(range(10, 90))]
    out = LLM(sharded, num_kv_blocks=64, max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in out] == hf_greedy(single, prompts, 16)


def test_missing_shard_is_named(tmp_path):
    import transformers as tf

    single = make_checkpoint(str(tmp_path / "single"), "llama")
    sharded = str(tmp_path / "sharded")
    tf.AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(single, name), os.path.join(sharded, name))
    victim = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(sharded, victim))
    with pytest.raises(ValueError, match=victim):
        LLM(sharded)


def test_chat_applies_the_template(tmp_path):
    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    text = llm.tokenizer.apply_chat_template(messages)
    assert text == "<s><|system|>\nbe brief<|end|>\n<|user|>\nhello there<|end|>\n<|assistant|>\n"
    from transformers import AutoTokenizer

    hf_ids = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert llm.tokenizer.encode_chat(messages) == list(hf_ids)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.chat(messages, params)[0].token_ids == llm.generate([llm.tokenizer.encode_chat(messages)],
                                                                  params)[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}], params)
