"""Shared test setup: offline Hugging Face, Triton in interpreter mode when there is no GPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    if not torch.cuda.is_available():
        # Must be set before triton is imported anywhere in the test process.
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
