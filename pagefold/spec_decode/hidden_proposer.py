"""Drafting from the target's hidden states: the proposer shared by MTP heads
(:mod:`pagefold.spec_decode.mtp`) and EAGLE / EAGLE-3 heads (:mod:`pagefold.spec_decode.eagle`).

A head's row at position ``p`` takes the target's hidden state at ``p`` (its output, or for
EAGLE-3 the inputs of chosen layers) and the *next* token ``t_{p+1}``, runs at position ``p``
through its own attention layers (full-attention KV in the pool) and gives ``g_p``, whose
logits draft ``t_{p+2}``.

Invariant of :class:`HiddenStateProposer`: at the end of every step the head has computed the
same positions as the target (row ``p`` needs ``t_{p+1}``: a prompt token, a kept draft, or
the token sampled this step), so cached blocks hold valid head KV. Its output at the last
kept position drafts ``d_1`` for the next step (kept per request with ``g``); a verify step
then drafts ``d_{j+1}`` from the row at ``s + j - 1`` fed ``d_j`` and the previous ``g``
(the target's hidden there is not computed yet), and after verification the head reruns
every verify row with the target's hidden states (rows past the kept ones are rejected
positions, overwritten later). A request the proposer holds nothing for (swapped back in,
forked) drafts its last token repeated: a deterministic proposal, verified like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import StepInputs
from pagefold.executor.runner_state import StepBatch
from pagefold.spec_decode.drafting import (
    PLACEHOLDER,
    DraftResult,
    Proposer,
    draft_tokens,
    forward_pass,
)

__all__ = ["HiddenStateProposer"]


class HiddenStateProposer(Proposer):
    """Drafts with a head over the target's hidden states (see the module docstring).

    ``head(input_ids, positions, ctx, *, hidden, step)`` returns ``g`` (T, H); ``step == 0``
    means ``hidden`` rows are the target's (``ctx.drafter_hidden``), ``step >= 1`` that they
    are the head's own ``g`` from the previous position. ``logits(g)`` gives the draft
    logits over the target's vocabulary. ``aux_layers``: the target layers whose inputs the
    head consumes (EAGLE-3), None to take the target's output."""

    reads_sampled = True  # a row's next token is the one sampled after it

    def __init__(self, head: nn.Module, logits: Callable[[torch.Tensor], torch.Tensor],
                 aux_layers: tuple[int, ...] | None = None) -> None:
        self.head = head
        self.logits = logits
        self.aux_layers = aux_layers
        # request id -> (d_1, its q or None, g at the last kept position (H,))
        self.pending: dict[str, tuple[int, torch.Tensor | None, torch.Tensor]] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def propose(self, runner, batch: StepBatch, drafts: list[list[int]]) -> DraftResult:
        reqs, starts = batch.reqs, batch.starts
        drafts = [list(d) for d in drafts]
        probs: list[list[torch.Tensor | None]] = [[] for _ in reqs]
        want = [i for i, d in enumerate(drafts) if d and d[0] == PLACEHOLDER]
        g: dict[int, torch.Tensor] = {}
        for i in want:
            p = self.pending.get(reqs[i].req_id)
            if p is None:  # nothing held: a deterministic stand-in proposal
                drafts[i] = [reqs[i].token_ids[starts[i]]] * len(drafts[i])
                continue
            drafts[i][0] = p[0]
            probs[i].append(p[1])
            g[i] = p[2]
        live = list(g)
        j = 1
        while True:
            live = [i for i in live if len(drafts[i]) > j]
            if not live:
                break
            hid = torch.stack([g[i] for i in live])
            out, _, _ = forward_pass(
                self.head, runner, [reqs[i] for i in live], [[drafts[i][j - 1]] for i in live],
                [starts[i] + j - 1 for i in live], hidden=hid, step=j)
            toks, qs = draft_tokens(self.logits(out), [reqs[i] for i in live],
                                    runner.generator_for)
            for n, i in enumerate(live):
                drafts[i][j] = toks[n]
                probs[i].append(qs[n])
                g[i] = out[n]
            j += 1
        out_probs = [torch.stack(p) if p and all(q is not None for q in p) else None
                     for p in probs]
        return DraftResult(drafts, out_probs)

    def commit(self, runner, batch: StepBatch, res: DraftResult, keep: list[int],
               inp: StepInputs, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        nxt: list[int] = []
        for i, (r, s, n) in enumerate(zip(batch.reqs, batch.starts, batch.counts,
                                          strict=True)):
            d = res.drafts[i]
            if d:
                row = list(d) + [d[-1]]
                row[keep[i] - 1] = emitted[i][-1]  # the token sampled after the kept ones
            else:
                row = self._next_tokens(r, s, n, emitted.get(i))
            nxt.extend(row)
        self._run(runner, batch, inp, hidden, nxt, keep, emitted)

    def sync(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             emitted: dict[int, list[int]]) -> None:
        nxt: list[int] = []
        for i, (r, s, n) in enumerate(zip(batch.reqs, batch.starts, batch.counts,
                                          strict=True)):
            nxt.extend(self._next_tokens(r, s, n, emitted.get(i)))
        self._run(runner, batch, inp, hidden, nxt, batch.counts, emitted)

    @staticmethod
    def _next_tokens(r, s: int, n: int, emitted: list[int] | None) -> list[int]:
        """``t_{p+1}`` for the rows at ``s..s+n-1``: known tokens, then the sampled one."""
        known = r.token_ids[s + 1 : s + n + 1]
        if len(known) < n:
            known = known + [emitted[-1] if emitted else r.token_ids[s + n - 1]]
        return known

    def _run(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             nxt: list[int], keep: list[int], emitted: dict[int, list[int]]) -> None:
        ids = torch.tensor(nxt, dtype=torch.long, device=inp.input_ids.device)
        ctx = ForwardContext(runner.cache, inp.attn_meta, inp.state_meta)
        g = self.head(ids, inp.positions, ctx, hidden=hidden, step=0)
        sampled = sorted(emitted)
        if not sampled:
            return
        starts = torch.cumsum(torch.tensor([0] + batch.counts[:-1]), 0)
        rows = torch.tensor([int(starts[i]) + keep[i] - 1 for i in sampled],
                            dtype=torch.long, device=g.device)
        last = g.index_select(0, rows)
        sreqs = [batch.reqs[i] for i in sampled]
        toks, qs = draft_tokens(self.logits(last), sreqs,
                                runner.generator_for)
        for n, r in enumerate(sreqs):
            self.pending[r.req_id] = (toks[n], qs[n], last[n])
