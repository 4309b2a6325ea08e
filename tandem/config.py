"""EngineConfig: every engine option in one validated dataclass (CLI flags map 1:1 onto its fields)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

ROLES = ("both", "prefill", "decode")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 | int8 (resolved by the quantizer plugins)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_num_batched_tokens: int = 2048
    # 128 as `vllm serve` on a CPU: with 64, a burst of 80 left 16 prompts waiting for a seat, TTFT p99 1.42-1.47x
    # vLLM's; with 128 0.83-0.85x (docs/PERFORMANCE.md, session 28).
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eviction: str = "lru"
    role: str = "both"
    seed: int = 0
    # Speculative decoding (plugins/speculators.py): a speculator name, tokens proposed per step,
    # the draft checkpoint for `draft_model` (or the head for `eagle`), and the running-batch size
    # above which it switches off.
    speculator: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    spec_max_batch: int | None = None  # None: 1 on a CPU (every speculator loses from batch 2 there), 8 on a GPU
    enforce_eager: bool = False  # no CUDA graphs for decode steps (tandem/engine/cuda_graphs.py); CPU: no effect

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        # k + 1 query tokens must fit the runner's decode group (MAX_DECODE_QUERY_LEN = 16).
        if not 1 <= self.num_speculative_tokens <= 15:
            raise ValueError(f"num_speculative_tokens must be in [1, 15], got {self.num_speculative_tokens}")
        if self.spec_max_batch is None:  # docs/PERFORMANCE.md: on a 2-core CPU ngram makes 0.87x at batch 2
            self.spec_max_batch = 1 if self.torch_device.type == "cpu" else 8
        if self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1, got {self.spec_max_batch}")
        if self.speculator == "draft_model" and not self.draft_model:
            from tandem.default_model import default_draft_path  # the shipped draft pairs the shipped target

            self.draft_model = default_draft_path()
        if self.speculator == "eagle" and not self.draft_model:
            from tandem.default_model import default_eagle_path  # the shipped head reads the shipped target

            self.draft_model = default_eagle_path()
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
