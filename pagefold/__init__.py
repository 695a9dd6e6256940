"""pagefold: an LLM inference and serving engine built first for hybrid models."""

from pagefold.beam_search import BeamSearchOutput, BeamSearchParams
from pagefold.llm import LLM
from pagefold.lora.request import LoRARequest
from pagefold.outputs import CompletionOutput, Logprob, RequestOutput
from pagefold.sampling_params import SamplingParams

__all__ = [
    "LLM", "BeamSearchParams", "BeamSearchOutput", "SamplingParams", "RequestOutput",
    "CompletionOutput", "Logprob", "LoRARequest",
]
__version__ = "0.1.0"
