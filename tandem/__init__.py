"""tandem: an LLM serving engine with disaggregated prefill and decode."""

from tandem.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
