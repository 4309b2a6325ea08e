"""ModelConfig: the parts of a Hugging Face `config.json` the model code needs, validated.

Anything we do not implement is refused here with a message naming what is supported, so a
checkpoint can never load into silently wrong math.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's `attention_bias`)
    o_proj_bias: bool  # Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2 biases only q/k/v
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool
    sliding_window: int | None  # the window of the layers that slide (None: no layer does)
    layer_windows: list[int | None]  # per layer: its attention window, None = full attention
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{path!r} is not a Hugging Face checkpoint directory: config.json not found")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path} is not valid JSON: {exc}") from exc
        config = cls.from_dict(raw)
        # generation_config.json may list more end tokens (Qwen instruct models: <|endoftext|> beside
        # <|im_end|>); transformers' generate and vLLM stop on them too.
        config.eos_token_ids += [t for t in _generation_eos(path) if t not in config.eos_token_ids]
        return config

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; tandem supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope(raw)
        layer_windows = _layer_windows(raw, arch)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=next((w for w in layer_windows if w), None),
            layer_windows=layer_windows,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def every_layer_slides(self) -> bool:
        """Every layer attends within the same window: blocks that leave it are never read again."""
        return bool(self.layer_windows) and all(w == self.sliding_window for w in self.layer_windows) \
            and self.sliding_window is not None

    def resolve_max_model_len(self, requested: int | None, default_cap: int) -> int:
        """The context length to serve: `requested`, or the model's limit capped at `default_cap`;
        a request beyond what the model supports is a ValueError."""
        limit = self.max_position_embeddings
        if requested is None:
            return min(limit, default_cap)
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings ({limit})")
        return requested


def _rope(raw: dict) -> tuple[float, dict | None]:
    """transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; tandem supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in params]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}")
        return theta, {k: params[k] for k in need}
    return theta, None


def _layer_windows(raw: dict, arch: str) -> list[int | None]:
    """Each layer's sliding window, the way transformers reads the config: Mistral slides in every
    layer when `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`, in the layers
    `layer_types` marks "sliding_attention" (by default those at or above `max_window_layers`);
    Llama never slides."""
    n = raw["num_hidden_layers"]
    window = int(raw["sliding_window"]) if raw.get("sliding_window") else None
    if arch == "LlamaForCausalLM" or window is None:
        return [None] * n
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    if arch == "MistralForCausalLM":
        return [window] * n
    if not raw.get("use_sliding_window", False):
        return [None] * n
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return [window if t == "sliding_attention" else None for t in types]


def _generation_eos(path: str) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list), [] without the file or the key."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0]
