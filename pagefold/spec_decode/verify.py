"""Verification of a speculative step and its state commit. The forward over ``1 + k``
tokens per drafted request is the runner's own (``ModelRunner``'s verify path); this module
receives its hidden rows and per-token states.

Invariants:

* Attention layers write KV for all ``1 + k`` positions; a rejected draft's slot lies beyond
  the request's computed length and is overwritten when that position is computed again.
* State layers (GDN, Mamba-2 and their conv windows) never store during a verify step: they
  return the state after every token (``ForwardContext.spec_states``), and
  :func:`commit_states` writes, per request, the state after its last *kept* token (the last
  accepted draft, or the chunk's last token for a request without drafts) into the request's
  own pages. A rejected token therefore never touches the canonical state; nothing is
  recomputed.
"""

from __future__ import annotations

import numpy as np
import torch

from pagefold.core.sched_output import VerifiedTokens
from pagefold.distributed.parallel_state import broadcast_ints, tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import StepInputs
from pagefold.executor.runner_state import StepBatch
from pagefold.executor.sampler import SamplingMetadata, gather_logprobs
from pagefold.spec_decode.drafting import DraftResult
from pagefold.spec_decode.rejection import VerifyOutput, expand_for_verify, rejection_sample

__all__ = ["commit_states", "verify_drafts"]


def commit_states(ctx: ForwardContext, cu_seqlens: torch.Tensor, keep: list[int]) -> None:
    """Write the state after token ``cu[s] + keep[s] - 1`` of every request into its pages."""
    if not ctx.spec_states:
        return
    idx = (cu_seqlens[:-1] + torch.tensor(keep, dtype=torch.long, device=cu_seqlens.device)
           - 1)
    for layer, per_token in ctx.spec_states.items():
        ctx.store_states(layer, {name: t.index_select(0, idx) for name, t in per_token.items()})


def verify_drafts(runner, batch: StepBatch, drafts: list[list[int]],
                  drafted: DraftResult | None, inp: StepInputs, ctx: ForwardContext,
                  hidden: torch.Tensor) -> dict[str, VerifiedTokens]:
    """Accept or reject the drafts of a verify forward the runner ran
    (``ModelRunner``'s verify path: ``drafts[i]`` after request ``i``'s last token, state
    layers keeping the state after every token in ``ctx.spec_states``), commit the kept
    tokens' states and the proposer's, and return the verified tokens of every request whose
    step reached the end of its tokens. ``drafted`` is the proposer's result (None without a
    proposer); accepted drafts are written into the runner's copy of their request."""
    reqs, starts, counts = batch.reqs, batch.starts, batch.counts
    proposer = runner.proposer
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    sample = inp.sample_req_idx
    keep = list(counts)  # tokens whose state is committed, per request
    if not sample:
        commit_states(ctx, _cu_tensor(cu, runner.device), keep)
        if proposer is not None:
            proposer.commit(runner, batch, drafted, keep, inp, ctx.drafter_hidden(hidden), {})
        return {}
    rows = np.concatenate([np.arange(cu[i + 1] - 1 - len(drafts[i]), cu[i + 1]) for i in sample])
    logits = runner.model.compute_logits(hidden[torch.from_numpy(rows).to(runner.device)])
    sreqs = [reqs[i] for i in sample]
    sdrafts = [drafts[i] for i in sample]
    gens = {}
    for j, r in enumerate(sreqs):
        g = runner.generator_for(r)
        if g is not None:
            gens[j] = g
    p_rows, o_rows = expand_for_verify([r.sampling_params for r in sreqs],
                                       [r.output_token_ids for r in sreqs], sdrafts)
    reps = [1 + len(d) for d in sdrafts]
    prompt_rows = [r.prompt_token_ids for r, n in zip(sreqs, reps, strict=True)
                   for _ in range(n)]
    eos_rows = [r.eos_token_id for r, n in zip(sreqs, reps, strict=True) for _ in range(n)]
    meta = SamplingMetadata.build(p_rows, o_rows, prompt_rows, eos_token_ids=eos_rows,
                                  device=runner.device)
    qprobs = None
    if drafted is not None and any(drafted.probs[i] is not None for i in sample):
        qprobs = [drafted.probs[i] for i in sample]
    res = rejection_sample(logits, meta, sdrafts, gens, qprobs)
    _agree(res, sdrafts)
    for j, i in enumerate(sample):
        if drafts[i]:
            a = res.num_accepted[j]
            keep[i] = 1 + a
            # Accepted drafts are computed tokens the scheduler will not send again.
            reqs[i].write(starts[i] + 1, list(drafts[i][:a]))
    commit_states(ctx, _cu_tensor(cu, runner.device), keep)
    if proposer is not None:
        proposer.commit(runner, batch, drafted, keep, inp, ctx.drafter_hidden(hidden),
                        {i: res.tokens[j] for j, i in enumerate(sample)})

    lp_rows = None
    if meta.max_num_logprobs is not None:
        raw = torch.log_softmax(logits.float(), dim=1)
        flat_rows = [rw for rs in res.rows for rw in rs]
        flat_toks = [t for ts in res.tokens for t in ts]
        ids, lps, ranks = gather_logprobs(
            raw[torch.tensor(flat_rows, dtype=torch.long, device=raw.device)],
            torch.tensor(flat_toks, dtype=torch.long, device=raw.device),
            meta.max_num_logprobs)
        lp_rows = (ids.tolist(), lps.tolist(), ranks.tolist())
    out: dict[str, VerifiedTokens] = {}
    pos = 0
    for j, r in enumerate(sreqs):
        toks = res.tokens[j]
        lp = None
        k = r.sampling_params.logprobs
        if k is not None and lp_rows is not None:
            lp = [(lp_rows[0][pos + t][: 1 + k], lp_rows[1][pos + t][: 1 + k], lp_rows[2][pos + t])
                  for t in range(len(toks))]
        pos += len(toks)
        out[r.req_id] = VerifiedTokens(toks, res.num_accepted[j], lp)
    return out


def _agree(res: VerifyOutput, drafts: list[list[int]]) -> None:
    """Under tensor parallelism, make every rank's verdict rank 0's (accepted counts and the
    token sampled after them: random draws differ between processes); a no-op alone."""
    if tp_size() == 1:
        return
    n = len(drafts)
    got = broadcast_ints(list(res.num_accepted) + [t[-1] for t in res.tokens])
    for j in range(n):
        a = got[j]
        res.num_accepted[j] = a
        res.tokens[j] = list(drafts[j][:a]) + [got[n + j]]
        res.rows[j] = list(range(res.rows[j][0], res.rows[j][0] + a + 1))


def _cu_tensor(cu: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(cu).to(device)
