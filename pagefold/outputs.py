"""User-facing results, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt
    # token its logprob entry (the token itself and the top-k), as vLLM returns them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A finished prefill on a kv_producer engine (prefill/decode disaggregation): what the
    # decoding engine needs to pull its pages (vLLM's ``kv_transfer_params``).
    kv_transfer_params: dict | None = None
