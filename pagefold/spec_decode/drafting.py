"""What the runner-side proposers (a draft model, MTP heads) share: the placeholder the
scheduler sends, one forward pass over some requests' tokens, and drafting one token.

A speculative step for a proposer that runs *in the runner* is scheduled like any other: the
scheduler gives the request ``1 + k`` tokens and ``SchedulerOutput.spec_token_ids`` carries
``k`` placeholders (:data:`PLACEHOLDER`); the runner's proposer replaces them with drafted ids
before the verify forward (``ModelRunner``'s verify path). A proposer never changes
``k`` (the scheduler allocated the slots for it).

Drafting rule (what rejection sampling needs): a greedy request drafts the argmax of the
proposer's logits (a deterministic proposal: ``q`` is one-hot, passed as None); a request
with temperature > 0 draws the draft from ``q = softmax(logits / T)`` with its own generator
and keeps ``q`` for :func:`pagefold.spec_decode.rejection.rejection_sample`, which then
accepts with ``min(1, p / q)`` and resamples from ``max(p - q, 0)``: the emitted tokens are
distributed exactly as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefold.distributed.parallel_state import broadcast_ints
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import StepInputs, build_inputs
from pagefold.executor.runner_state import CachedRequestState, StepBatch
from pagefold.sampling_params import SAMPLING_EPS

__all__ = ["PLACEHOLDER", "DraftResult", "Proposer", "draft_tokens", "forward_pass"]

# A draft id the runner's proposer fills in (never a real token id).
PLACEHOLDER = -1


@dataclass(slots=True)
class DraftResult:
    """Per request of the step (batch order): its drafts (possibly empty) and, for drafts
    sampled at temperature > 0, their distributions ``(k, V)`` (None: one-hot)."""

    drafts: list[list[int]]
    probs: list[torch.Tensor | None]
    state: object = None  # the proposer's own bookkeeping between propose and commit


class Proposer:
    """Runner-side proposer interface (see the module docstring).

    * :meth:`propose` before a verify forward: fill the placeholders.
    * :meth:`commit` after it: the proposer's caches must end the step holding exactly the
      tokens the target kept (``keep[i]`` tokens of request i from its start).
    * :meth:`sync` after a step without drafts: the proposer processes the same tokens.
    * :meth:`forget` drops a request's bookkeeping (finished or preempted).

    ``reads_sampled``: :meth:`sync` reads the tokens sampled this step (``emitted``), so under
    tensor parallelism the ranks that do not sample receive rank 0's.
    """

    reads_sampled: bool = False

    def propose(self, runner, batch: StepBatch, drafts: list[list[int]]) -> DraftResult:
        raise NotImplementedError

    def commit(self, runner, batch: StepBatch, res: DraftResult, keep: list[int],
               inp: StepInputs, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        raise NotImplementedError

    def sync(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             emitted: dict[int, list[int]]) -> None:
        raise NotImplementedError

    def forget(self, request_ids: list[str]) -> None:
        return None


def forward_pass(model, runner, reqs: list[CachedRequestState], tokens: list[list[int]],
                 starts: list[int], *, verify: bool = False,
                 initial: dict[str, dict[str, torch.Tensor]] | None = None,
                 **model_kw) -> tuple[torch.Tensor, StepInputs, ForwardContext]:
    """One forward of ``model`` over ``tokens[i]`` at positions ``starts[i]...`` of
    ``reqs[i]``, through the runner's cache. ``verify``: state layers keep the state after
    every token (``ctx.spec_states``) and store nothing; ``initial``: their initial states."""
    counts = [len(t) for t in tokens]
    totals = [s + n for s, n in zip(starts, counts, strict=True)]
    per_group = [[r.block_ids[g] for r in reqs] for g in range(len(runner.kv_config.groups))]
    inp = build_inputs(runner.kv_config, tokens, starts, counts, totals, per_group,
                       runner.device)
    if verify:
        rows = torch.ones(len(reqs), dtype=torch.bool, device=runner.device)
        for m in inp.state_meta:
            if m is not None:
                m.spec_rows = rows
    ctx = ForwardContext(runner.cache, inp.attn_meta, inp.state_meta,
                         spec_states={} if verify else None, initial_states=initial)
    hidden = model(inp.input_ids, inp.positions, ctx, **model_kw)
    return hidden, inp, ctx


def draft_tokens(logits: torch.Tensor, reqs: list[CachedRequestState], generator_of
                 ) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft per row of ``logits`` (row j belongs to ``reqs[j]``): the argmax for a
    greedy request, else a draw from ``softmax(logits / T)`` (returned, float32). A
    collective under tensor parallelism (every rank takes rank 0's drafts)."""
    greedy = logits.argmax(dim=1).tolist()
    toks: list[int] = []
    probs: list[torch.Tensor | None] = []
    for j, r in enumerate(reqs):
        t = r.sampling_params.temperature
        if t < SAMPLING_EPS:
            toks.append(greedy[j])
            probs.append(None)
            continue
        q = torch.softmax(logits[j].float() / t, dim=0)
        e = torch.empty_like(q).exponential_(generator=generator_of(r))
        toks.append(int((q / e.clamp_(min=torch.finfo(q.dtype).tiny)).argmax()))
        probs.append(q)
    # Under tensor parallelism every rank drafts the same tokens: rank 0's (an unseeded
    # draw comes from each process's own generator).
    return broadcast_ints(toks), probs
