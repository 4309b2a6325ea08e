"""Shared test setup: offline Hugging Face, Triton in interpreter mode when there is no GPU, and how many
pytest-xdist workers `-n auto` (pyproject's addopts) starts."""

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


MAX_WORKERS = 4  # each worker's tests start whole clusters of processes; more than 4 at once only contend


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may run on (its affinity mask, as tandem up counts them), at most
    MAX_WORKERS. With PYTEST_XDIST_AUTO_NUM_WORKERS set, xdist's own hook reads it (and warns on a bad value)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))
