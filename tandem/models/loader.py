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
    loaded: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    _collect(name, f.get_tensor(name), cfg, loaded, pending)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {file}: {exc}") from exc
    for name, parts in pending.items():
        want = 3 if ".qkv_proj." in name else 2
        if len(parts) != want:
            raise ValueError(f"checkpoint has only part of the fused weight {name}")
        loaded[name] = torch.cat([parts[i] for i in range(want)])
    return loaded


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    params = dict(model.named_parameters())
    loaded = read_weights(path, cfg)
    missing = sorted(set(params) - set(loaded) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    unexpected = sorted(set(loaded) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match {cfg.architecture}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    state = {}
    for name, tensor in loaded.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if torch.device(device).type == "cpu":  # out of the checkpoint file's 4 KiB pages into huge pages (weight_arena.py)
        state = weight_arena.pack(state)
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
