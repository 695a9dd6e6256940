"""The runner side of a speculative step: one forward over ``1 + k`` tokens per drafted
request, verification, and the state commit.

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
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import build_inputs
from pagefold.executor.runner_state import StepBatch
from pagefold.executor.sampler import SamplingMetadata, gather_logprobs
from pagefold.spec_decode.rejection import expand_for_verify, rejection_sample

__all__ = ["commit_states", "execute_verify"]


def commit_states(ctx: ForwardContext, cu_seqlens: torch.Tensor, keep: list[int]) -> None:
    """Write the state after token ``cu[s] + keep[s] - 1`` of every request into its pages."""
    if not ctx.spec_states:
        return
    idx = (cu_seqlens[:-1] + torch.tensor(keep, dtype=torch.long, device=cu_seqlens.device)
           - 1)
    for layer, per_token in ctx.spec_states.items():
        ctx.store_states(layer, {name: t.index_select(0, idx) for name, t in per_token.items()})


@torch.inference_mode()
def execute_verify(runner, batch: StepBatch, spec_token_ids: dict[str, list[int]]
                   ) -> dict[str, VerifiedTokens]:
    """``ModelRunner`` forward + verification for a step where some requests carry drafts.

    A drafted request is decoding: its count is ``1 + len(drafts)`` and its tokens are its
    last token followed by the drafts (which never enter the runner's copy of the request).
    Returns the verified tokens of every request whose step reached the end of its tokens.
    """
    reqs, starts, counts = batch.reqs, batch.starts, batch.counts
    drafts = [spec_token_ids.get(r.req_id, []) for r in reqs]
    proposer = runner.proposer
    drafted = None
    if proposer is not None:  # a draft model / MTP fills the placeholders (spec_decode.drafting)
        drafted = proposer.propose(runner, batch, drafts)
        drafts = drafted.drafts
    elif any(t < 0 for d in drafts for t in d):
        raise ValueError("drafts to fill in the runner, but the runner has no proposer")
    tokens = []
    for r, s, n, d in zip(reqs, starts, counts, drafts, strict=True):
        if d:
            if n != 1 + len(d) or s + 1 != len(r.token_ids):
                raise ValueError(f"request {r.req_id}: drafts need a decode step of 1 + k")
            tokens.append(r.token_ids[s : s + 1] + list(d))
        else:
            tokens.append(r.token_ids[s : s + n])
    totals = [len(r.token_ids) + len(d) for r, d in zip(reqs, drafts, strict=True)]
    per_group = [[r.block_ids[g] for r in reqs] for g in range(len(runner.kv_config.groups))]
    inp = build_inputs(runner.kv_config, tokens, starts, counts, totals, per_group,
                       runner.device)
    spec_rows = torch.tensor([bool(d) for d in drafts], device=runner.device)
    for m in inp.state_meta:
        if m is not None:
            m.spec_rows = spec_rows
    runner.num_forward_tokens += int(inp.input_ids.numel())
    ctx = ForwardContext(runner.cache, inp.attn_meta, inp.state_meta, spec_states={})
    hidden = runner.model(inp.input_ids, inp.positions, ctx)

    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    sample = inp.sample_req_idx
    keep = list(counts)  # tokens whose state is committed, per request
    if not sample:
        commit_states(ctx, _cu_tensor(cu, runner.device), keep)
        if proposer is not None:
            proposer.commit(runner, batch, drafted, keep, inp, hidden, {})
        return {}
    rows = np.concatenate([np.arange(cu[i + 1] - 1 - len(drafts[i]), cu[i + 1]) for i in sample])
    logits = runner.model.compute_logits(hidden[torch.from_numpy(rows).to(runner.device)])
    sreqs = [reqs[i] for i in sample]
    sdrafts = [drafts[i] for i in sample]
    gens = {}
    for j, r in enumerate(sreqs):
        g = runner._generator(r)
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
    for j, i in enumerate(sample):
        if drafts[i]:
            a = res.num_accepted[j]
            keep[i] = 1 + a
            # Accepted drafts are computed tokens the scheduler will not send again.
            reqs[i].write(starts[i] + 1, list(drafts[i][:a]))
    commit_states(ctx, _cu_tensor(cu, runner.device), keep)
    if proposer is not None:
        proposer.commit(runner, batch, drafted, keep, inp, hidden,
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


def _cu_tensor(cu: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(cu).to(device)
