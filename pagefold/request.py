"""A request as the engine core sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


@dataclass(eq=False)
class Request:
    """Engine-side request.

    ``all_token_ids`` is prompt + output so far. ``num_computed_tokens`` counts the leading
    tokens whose cache entries are written; the last sampled token is never computed yet, so a
    decoding request has ``num_tokens - num_computed_tokens == 1``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Cumulative logprob of sampled tokens (filled when logprobs are requested or for best_of).
    cumulative_logprob: float = 0.0
    # Prefix caching: chained hashes of full blocks, and what keys the chain (cache salt...).
    block_hashes: list[bytes] = field(default_factory=list)
    extra_keys: tuple = ()
    # Parallel sampling: children still to fork off once ``fork_at`` tokens are computed
    # (the prompt minus its last token: the prompt is prefilled once, each child computes the
    # last prompt token itself and samples its first token with its own seed).
    fork_children: int = 0
    fork_at: int = -1
    parent_id: str | None = None
    index: int = 0
    # Held by its driver (beam search) between steps: the scheduler skips it.
    paused: bool = False
    # time.monotonic() when first scheduled (queue time ends, prefill starts); metrics only.
    first_scheduled_time: float | None = None
    # Images of the prompt (placeholder spans, content hashes, encoder inputs, M-RoPE
    # positions); None for a text-only request.
    mm_inputs: MultiModalInputs | None = None
    # Indices of the images the runner holds encoder outputs of (since the last preemption).
    mm_encoded: set[int] = field(default_factory=set)
    # The LoRA adapter the request runs with (None: the base model); its id is in extra_keys.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def kv_transfer_params(self) -> dict | None:
        """vLLM's ``kv_transfer_params`` (in ``SamplingParams.extra_args``): prefill/decode
        disaggregation, see ``pagefold.transfer``."""
        extra = self.sampling_params.extra_args
        return extra.get("kv_transfer_params") if extra else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def ready_to_fork(self) -> bool:
        return self.fork_children > 0 and self.num_computed_tokens == self.fork_at

    def spawn_child(self, index: int) -> Request:
        """Child ``index`` of a parallel-sampling family (seed + index, as vLLM does)."""
        params = self.sampling_params.clone()
        if params.seed is not None:
            params.seed += index
        return Request(f"{self.request_id}#{index}", self.prompt_token_ids, params,
                       eos_token_id=self.eos_token_id, arrival_time=self.arrival_time,
                       priority=self.priority, all_token_ids=list(self.all_token_ids),
                       extra_keys=self.extra_keys, parent_id=self.request_id, index=index,
                       num_cached_tokens=self.num_cached_tokens, status=self.status,
                       mm_inputs=self.mm_inputs, lora_request=self.lora_request)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
