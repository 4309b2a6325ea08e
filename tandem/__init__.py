"""tandem: an LLM serving engine with disaggregated prefill and decode.

`from tandem import LLM, SamplingParams` works as before, but the names are imported on first
access (PEP 562): importing a light submodule such as `tandem.sampling_params` or `tandem.protocol`
(the router does) must not pull in torch and the whole engine through this package's __init__.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# tandem does not use numpy (KV bytes move as ctypes views), so torch's import-time complaint that
# it is missing is noise on every command of an install without it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

if TYPE_CHECKING:
    from tandem.llm import LLM
    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.sampling_params import BeamSearchParams, SamplingParams

# Public name -> the submodule that defines it.
_LAZY = {
    "LLM": "tandem.llm",
    "SamplingParams": "tandem.sampling_params",
    "BeamSearchParams": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
}

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
