"""The step contract: what the scheduler sends a model runner, and what comes back.

One engine step is three calls::

    out = scheduler.schedule()                      # SchedulerOutput: the whole step
    sampled = runner.execute(out)                   # {request id: SampledToken}
    outputs = scheduler.update_from_output(out, sampled)

``SchedulerOutput`` is self-contained: a runner in another process (a tensor-parallel rank)
needs nothing else, and it is plain data (picklable, msgspec-encodable; ``encode_step`` /
``decode_step`` are the wire format). The runner keeps its own copy of each request it has
seen (tokens, sampling parameters, block tables), built from the message alone:

* ``new_reqs``: requests the runner does not hold (first scheduling, or scheduled again after a
  preemption): every token known so far, sampling parameters and full block tables.
* ``cached_reqs``: requests the runner already holds: the tokens to compute this step (written
  at ``num_computed_tokens``; they may replace the runner's copy of an uncomputed token, as beam
  search's token swap does) and, per cache group, a table diff ``(i, ids)``: the table becomes
  ``table[:i] + ids`` (``None``: unchanged). Appends are the common case; copy-on-write and a
  sliding window's released blocks rewrite from their index.
* ``num_scheduled``: ``{request id: tokens this step}`` in layout order; a request is sampled
  when ``num_computed_tokens + n`` reaches every token the runner knows of it.
* ``copies`` then ``swaps``: page copies and host swaps to run before the forward (swap-outs,
  then copies in list order, then swap-ins). This is the step's only copy point; the cache
  manager keeps every copied page pinned until ``update_from_output``.
* ``captures``: state checkpoints the state layers write from inside this step's forward (a
  checkpoint target strictly inside a request's chunk: the state after its first
  ``num_tokens`` tokens goes to ``pages``); the pages are held by the cache manager, which
  registers them as cache entries in ``update_from_output``.
* ``kv_ops``: the KV connector's page moves (``core/kv_connector.py``: drops, saves out of
  the pool, loads into it), run first, before the copies and swaps.
* ``finished_ids`` / ``preempted_ids``: drop these requests' state first (a finished request's
  sampling generator too; a preempted one comes back later as a new request).

Extending it (speculative decoding): a request may be scheduled for ``1 + k`` tokens whose tail
is draft tokens; the runner then returns several tokens per request. A decode burst
(``decode_burst``) schedules ``k`` tokens of which only the first is known: the runner samples
the rest itself, one forward at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagefold.core.kv_connector import ConnectorOutput, KVOps
from pagefold.core.managers import PageCopy, StateCapture
from pagefold.core.swap import SwapOp
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.sampling_params import SamplingParams

TableDiff = tuple[int, list[int]] | None


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet. ``prompt_token_ids + output_token_ids`` are
    all its tokens; ``block_ids[g]`` is its whole table in cache group ``g``."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[list[int]]
    num_computed_tokens: int
    # The request's images (None: text only); the runner encodes them when a step first
    # reaches their placeholder tokens.
    mm_inputs: MultiModalInputs | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner holds: this step's tokens from ``num_computed_tokens`` on, and
    per group a table diff (see the module docstring)."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    new_block_ids: list[TableDiff]


@dataclass(slots=True)
class SchedulerOutput:
    """One step, as a message. ``num_scheduled`` preserves the order inputs are laid out in."""

    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    swaps: list[SwapOp] = field(default_factory=list)
    captures: list[StateCapture] = field(default_factory=list)
    # KV connector work (offload tiers): drops, saves, loads, run before everything above.
    kv_ops: KVOps = field(default_factory=KVOps)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step
    preempted_ids: list[str] = field(default_factory=list)  # preempted by this schedule
    # Structured output: request id -> its packed int32 allowed-token row (little-endian
    # bytes, ceil(V/32) words) for the requests that sample this step; filled by the engine
    # from its grammar matchers (structured_output/manager.py), applied by the sampler.
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # Speculative decoding: a decoding request's drafts; its count is 1 + len(drafts) and its
    # tokens this step are its last token (``new_token_ids``) followed by these. Drafts are
    # never written into the runner's copy of the request.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A decode burst (``core/decode_burst.py``): every scheduled request decodes its count of
    # tokens one forward at a time, each sampled token the next forward's input; the runner
    # returns them as one ``VerifiedTokens`` (all accepted) per request.
    decode_burst: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled.values())

    @property
    def has_tokens(self) -> bool:
        return bool(self.num_scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for a runner to do (no tokens, no page moves)."""
        return not (self.num_scheduled or self.copies or self.swaps or self.kv_ops)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # (token ids, logprobs) of the sampled token followed by the top-k alternatives; and rank.
    logprobs: tuple[list[int], list[float], int] | None = None
    # With SamplingParams.prompt_logprobs, on the request's first sampled token: per prompt
    # token after the first, (ids, logprobs, rank) as in ``logprobs``.
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None


@dataclass(slots=True)
class VerifiedTokens:
    """A speculative step's result for one request: the emitted tokens (accepted drafts, then
    one sampled token), how many drafts were accepted, and per emitted token its logprobs
    entry when asked for."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[tuple[list[int], list[float], int]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    parent_id: str | None = None  # parallel sampling: the family's request id
    index: int = 0  # the child's index in its family
    # On a request's first output only, when it asked for prompt logprobs.
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # On a request's first output only: time.monotonic() when it was first scheduled (the
    # clock is system-wide, so the API process times queue vs prefill with it).
    scheduled_time: float | None = None
    # On a finished prefill that asked for ``do_remote_decode`` (prefill/decode
    # disaggregation): what the decoding engine needs to pull its pages.
    kv_transfer_params: dict | None = None


class RunnerOutput(dict):
    """What ``runner.execute`` returns when the step had KV connector ops: the usual
    ``{request id: SampledToken | VerifiedTokens}`` plus the connector's report (vLLM's
    ``kv_connector_output``), so a step stays three calls."""

    kv_connector_output: ConnectorOutput | None = None


_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def encode_step(out: SchedulerOutput) -> bytes:
    return _encoder.encode(out)


def decode_step(data: bytes) -> SchedulerOutput:
    return _step_decoder.decode(data)
