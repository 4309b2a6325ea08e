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
    block = _one_huge_page_block(params.values())
    assert min(p.data_ptr() for p in params.values()) == block["lo"] + -block["lo"] % (2 << 20)  # on a huge page


def _one_huge_page_block(tensors) -> dict:
    """The one anonymous mapping that holds every tensor given, checked THP-eligible exactly when the kernel
    lets a madvise'd mapping have huge pages."""
    blocks = {m["lo"]: m for m in (_mapping_of(t.data_ptr()) for t in tensors)}
    assert len(blocks) == 1, f"the tensors are in {len(blocks)} mappings"
    block = next(iter(blocks.values()))
    assert block["path"] == "", f"tensors mapped from {block['path']}"
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_off = "[never]" in f.read()
    assert block["THPeligible"] == ("0" if thp_off else "1")
    return block


def test_bf16_copies_of_fp32_served_weights_are_in_huge_pages():
    """A bf16 checkpoint served in fp32 (the shipped model): the bf16 copies a decode step streams
    (tandem/layers/linear.py) are in huge pages too, and hold the weights' values."""
    from tandem.default_model import default_model_path
    from tandem.layers.linear import Linear
    from tandem.models.loader import load_model

    model = load_model(default_model_path(), torch.float32, torch.device("cpu"), 256)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    copies = [lin.small_batch_plan()[4] for lin in linears]
    assert all(c is not None and c.dtype == torch.bfloat16 for c in copies)
    assert all(torch.equal(c.float(), lin.weight) for c, lin in zip(copies, linears))
    # Each in a block advised to huge pages (they are carved from shared 32 MiB blocks: how many this model's
    # ~10 MB spans depends on what this process copied before, so one block per copy is what is asserted).
    for c in copies:
        _one_huge_page_block([c])


def test_cpu_kv_cache_is_in_huge_pages_zeroed_and_committed_at_start():
    """An engine's CPU KV cache (every layer's tensor, an int8 cache's scales, a speculator's own cache) lies
    in one block advised to huge pages (decode attention reads blocks scattered over all of it), reads as
    zeros, and every page of it is resident already — as torch.zeros commits it: an oversized cache fails
    at start, not under load."""
    from kvtransfer.base import CacheLayout, allocate_kv_caches
    from tandem.default_model import default_model_path

    llm = LLM(default_model_path(), num_kv_blocks=64)
    caches = llm.engine.runner.kv_caches
    assert len(caches) == llm.engine.kv_layout.num_layers and all(c.shape[0] == 64 for c in caches)
    block = _one_huge_page_block(caches)
    nbytes = sum(c.numel() * c.element_size() for c in caches)
    assert int(block["Rss"]) * 1024 >= nbytes, (block["Rss"], nbytes)
    assert all(int(c.count_nonzero()) == 0 for c in caches)
    head = LLM(default_model_path(), num_kv_blocks=64, speculator="eagle").engine.speculator.runner.kv_caches
    _one_huge_page_block(head)  # the EAGLE head's own paged cache (and a draft model's: plugins/draft_model.py)
    assert all(int(c.count_nonzero()) == 0 for c in head)
    quantized = CacheLayout("m", "float32", "int8", block_size=16, num_layers=2, num_kv_heads=2, head_dim=32)
    kv, scales = allocate_kv_caches(quantized, 8)
    assert scales is not None and len(scales) == 2 and scales[0].dtype == torch.float32
    _one_huge_page_block(kv + scales)
