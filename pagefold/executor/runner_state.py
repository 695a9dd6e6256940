"""The runner's own copy of each request, kept up to date from the step messages alone.

A runner (in the engine process or on another rank) never sees the scheduler's ``Request``
objects. It learns a request from ``NewRequestData`` and follows it through the
``CachedRequestData`` of later steps (see ``core/sched_output.py``). Invariant after ``apply``:
for every request it holds, ``token_ids``, ``output_token_ids`` and ``block_ids`` equal the
scheduler's at the time the message was made, except that tokens past the scheduled ones are
the runner's last known (the scheduler never sends a token it will not schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefold.core.sched_output import SchedulerOutput
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + outputs, as far as the runner knows
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[list[int]]  # per cache group
    # Prompt logprobs computed so far (SamplingParams.prompt_logprobs): entry p is
    # (ids, logprobs, rank) of prompt token p + 1 given tokens 0..p.
    prompt_logprobs: list = field(default_factory=list)
    mm_inputs: MultiModalInputs | None = None  # the request's images (None: text only)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    def write(self, start: int, tokens: list[int]) -> None:
        """Tokens ``tokens`` at positions ``start...`` (replacing or extending)."""
        end = start + len(tokens)
        self.token_ids[start:end] = tokens
        p = len(self.prompt_token_ids)
        lo = max(start, p)
        if end > lo:
            self.output_token_ids[lo - p : end - p] = self.token_ids[lo:end]


@dataclass(slots=True)
class StepBatch:
    """One step's requests in layout order, with their first position and token count;
    ``captures[g]``: the step's state checkpoints in cache group ``g`` as ``(request index,
    prefix length, pages)`` (see ``SchedulerOutput.captures``)."""

    reqs: list[CachedRequestState]
    starts: list[int]
    counts: list[int]
    captures: dict[int, list[tuple[int, int, list[int]]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


class RunnerRequests:
    """Request id -> state, plus the sampling generators of seeded requests (which survive a
    preemption and end with the request)."""

    def __init__(self) -> None:
        self.states: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}

    def apply(self, out: SchedulerOutput) -> StepBatch:
        for rid in out.finished_ids:
            self.states.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_ids:
            self.states.pop(rid, None)
        starts: dict[str, int] = {}
        for nr in out.new_reqs:
            self.states[nr.req_id] = CachedRequestState(
                nr.req_id, nr.prompt_token_ids, nr.prompt_token_ids + nr.output_token_ids,
                list(nr.output_token_ids), nr.sampling_params, nr.eos_token_id,
                [list(b) for b in nr.block_ids], mm_inputs=nr.mm_inputs,
                lora_request=nr.lora_request)
            starts[nr.req_id] = nr.num_computed_tokens
        for cr in out.cached_reqs:
            st = self.states[cr.req_id]
            st.write(cr.num_computed_tokens, cr.new_token_ids)
            for table, diff in zip(st.block_ids, cr.new_block_ids):
                if diff is not None:
                    i, ids = diff
                    table[i:] = ids
            starts[cr.req_id] = cr.num_computed_tokens
        rids = list(out.num_scheduled)
        captures: dict[int, list[tuple[int, int, list[int]]]] = {}
        if out.captures:
            index = {r: i for i, r in enumerate(rids)}
            for c in out.captures:
                captures.setdefault(c.group, []).append((index[c.request_id], c.num_tokens,
                                                         list(c.pages)))
        return StepBatch([self.states[r] for r in rids], [starts[r] for r in rids],
                         list(out.num_scheduled.values()), captures)
