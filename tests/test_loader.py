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



def _mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry holding `addr`: its path ('' for anonymous memory) and its fields."""
    mappings: list[dict] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head[0].endswith(":"):  # a field of the mapping above ("Rss:", "THPeligible:", ...)
                mappings[-1][head[0][:-1]] = head[1]
            else:  # a mapping's first line: range, perms, offset, dev, inode, path
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                mappings.append({"lo": lo, "hi": hi, "path": " ".join(head[5:])})
    hits = [m for m in mappings if m["lo"] <= addr < m["hi"]]
    assert len(hits) == 1, f"address {addr:#x} is in {len(hits)} mappings"
    return hits[0]


def test_cpu_weights_leave_the_checkpoint_file_for_huge_pages(tmp_path):
    """Every weight of a CPU model is copied out of the safetensors file's mapping into one anonymous
    block advised to huge pages (tandem/models/weight_arena.py), with the file's values."""
    from safetensors.torch import load_file

    from tandem.models.loader import load_model

    ckpt = make_checkpoint(str(tmp_path / "llama"), "llama")
    model = load_model(ckpt, torch.float32, torch.device("cpu"), 256)
    on_disk = load_file(os.path.join(ckpt, "model.safetensors"))
    params = dict(model.named_parameters())
    assert torch.equal(params["lm_head.weight"], on_disk["lm_head.weight"])
    assert torch.equal(params["model.layers.0.self_attn.o_proj.weight"],
                       on_disk["model.layers.0.self_attn.o_proj.weight"])
    attn = "model.layers.1.self_attn"  # a fused weight: its parts' rows, in order, copied into place
    parts = [on_disk[f"{attn}.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(params[f"{attn}.qkv_proj.weight"], torch.cat(parts))
    blocks = {m["lo"]: m for m in (_mapping_of(p.data_ptr()) for p in params.values())}
    assert len(blocks) == 1, "the weights are not in one block"
    block = next(iter(blocks.values()))
    assert block["path"] == "", f"weights still mapped from {block['path']}"
    assert min(p.data_ptr() for p in params.values()) % (2 << 20) == 0  # the block starts on a huge page
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_off = "[never]" in f.read()
    assert block["THPeligible"] == ("0" if thp_off else "1")
