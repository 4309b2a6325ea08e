"""Load a Hugging Face checkpoint directory (single or sharded safetensors) into LlamaForCausalLM.

Separate q/k/v and gate/up weights are concatenated into the fused projections. A missing or
unexpected weight is an error that names it: a checkpoint never loads half-way.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import SafetensorError, safe_open

from tandem.models import weight_arena
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_PART = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = [os.path.join(path, "model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        names = ", ".join(os.path.basename(m) for m in missing)
        raise ValueError(f"checkpoint {path!r} is missing weight file(s): {names}")
    return files


def read_weights(path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory under tandem's names (q/k/v and gate/up fused)."""
    return {name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in read_parts(path, cfg).items()}


def read_parts(path: str, cfg: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Every tensor of a checkpoint directory under tandem's names, a fused one as its parts in order (q, k, v;
    gate, up: rows of the fused weight), each part still in the checkpoint file's mapping."""
    loaded: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    _collect(name, f.get_tensor(name), cfg, loaded, pending)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {file}: {exc}") from exc
    parts = {name: [tensor] for name, tensor in loaded.items()}
    for name, by_index in pending.items():
        want = 3 if ".qkv_proj." in name else 2
        if len(by_index) != want:
            raise ValueError(f"checkpoint has only part of the fused weight {name}")
        parts[name] = [by_index[i] for i in range(want)]
    return parts


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    params = dict(model.named_parameters())
    loaded = read_parts(path, cfg)
    missing = sorted(set(params) - set(loaded) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    unexpected = sorted(set(loaded) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match {cfg.architecture}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, parts in loaded.items():
        shape = parts[0].shape if len(parts) == 1 else (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts) or tuple(shape) != tuple(params[name].shape):
            got = " + ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"weight {name} has shape {got}, expected {tuple(params[name].shape)}")
    if torch.device(device).type == "cpu":
        # Straight from the checkpoint file's 4 KiB pages into one huge-page block (weight_arena.py), widened
        # or narrowed to `dtype` and fused parts placed as they are copied: no other copy is made.
        state = weight_arena.allocate({name: (tuple(params[name].shape), dtype) for name in loaded})
        for name, parts in loaded.items():
            row = 0
            for part in parts:  # a fused weight's parts are its rows in order
                (state[name] if len(parts) == 1 else state[name][row:row + part.shape[0]]).copy_(part)
                row += part.shape[0] if len(parts) > 1 else 0
    else:
        state = {name: (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device=device, dtype=dtype)
                 for name, parts in loaded.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (rotary cos/sin) were created on meta: rebuild them for real.
    model.model.rotary = type(model.model.rotary)(cfg.head_dim, max_positions, cfg.rope_theta,
                                                  cfg.rope_scaling).to(device)
    return model.eval()


def _collect(name: str, tensor: torch.Tensor, cfg: ModelConfig, loaded: dict, pending: dict) -> None:
    if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return
    m = _PART.match(name)
    if m is None:
        loaded[name] = tensor
        return
    fused, idx = _FUSED[m.group(2)]
    pending.setdefault(f"{m.group(1)}.{fused}.{m.group(3)}", {})[idx] = tensor
