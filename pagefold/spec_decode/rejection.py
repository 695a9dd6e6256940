"""Verification of drafted tokens: greedy matching and distribution-preserving rejection sampling.

Layout: request ``i`` with ``m_i`` drafts ``d_0..d_{m-1}`` owns ``1 + m_i`` consecutive logits
rows ``r_0..r_m``; row ``r_j`` is the target's distribution for the token after
``context + d_0..d_{j-1}`` (so sampling metadata for row ``j`` must see ``d_0..d_{j-1}`` as
already generated: penalties and ``min_tokens`` then apply exactly as without speculation).

* Greedy rows: ``t_j = argmax(processed r_j)``; accept while ``d_j == t_j``; emit
  ``t_0..t_a`` where ``a`` is the number accepted. Identical to ``a + 1`` plain greedy steps.
* Random rows (Leviathan et al. / Chen et al.): with target ``p_j`` (after temperature,
  top-k/p, min-p) and draft ``q_j``, accept ``d_j`` with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; on the first rejection emit a token drawn from
  ``norm(max(p_j - q_j, 0))`` and stop; when all ``m`` are accepted emit a bonus token drawn
  from ``p_m``. Each emitted token is then distributed exactly as plain sampling would give it.
  ``q`` is one-hot for deterministic drafters (n-gram), so acceptance is ``p_j(d_j)`` and the
  residual is ``p_j`` with ``d_j`` removed.

A seeded request draws every uniform and every residual sample from its own generator, so its
tokens depend only on its seed, its logits and its drafts, never on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagefold.executor.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from pagefold.sampling_params import SAMPLING_EPS

__all__ = ["VerifyOutput", "processed_logits", "rejection_sample", "target_probs"]


@dataclass(slots=True)
class VerifyOutput:
    """Per request: the emitted tokens (``1..m+1``) and how many drafts were accepted.

    ``rows[i][j]`` is the logits row that produced ``tokens[i][j]`` (for logprobs).
    """

    tokens: list[list[int]]
    num_accepted: list[int]
    rows: list[list[int]]


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``logits`` after min_tokens bans and penalties (float32, a new tensor)."""
    out = logits.float().clone()
    if meta.stop_ids_to_mask:
        v = out.shape[1]
        for r, ids in meta.stop_ids_to_mask.items():
            cols = [t for t in ids if t < v]
            if cols:
                out[r, cols] = float("-inf")
    if not meta.no_penalties:
        out = apply_penalties(out, meta)
    return out


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution plain sampling draws from, per row (greedy rows: temperature 1)."""
    temp = meta.temperature.to(logits.device)
    x = logits / torch.where(temp < SAMPLING_EPS, 1.0, temp).unsqueeze(1)
    if meta.top_k is not None:
        x = apply_top_k(x, meta.top_k.to(x.device), meta.max_top_k)
    if meta.top_p is not None:
        x = apply_top_p(x, meta.top_p.to(x.device))
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p.to(x.device))
    return x.softmax(dim=1)


def _race(p: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from the (unnormalised) weights ``p`` (1-D) by an exponential race."""
    q = torch.empty_like(p).exponential_(generator=gen).clamp_(min=torch.finfo(p.dtype).tiny)
    return int((p / q).argmax())


def rejection_sample(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    drafts: Sequence[Sequence[int]],
    generators: dict[int, torch.Generator] | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> VerifyOutput:
    """Verify ``drafts`` against ``logits`` (``(sum(1 + m_i), V)``, rows grouped per request).

    ``meta`` describes the expanded rows (one per logits row). ``generators`` maps a
    *request* index to its generator. ``draft_probs[i]`` is ``(m_i, V)`` for a drafter with a
    distribution (a draft model at temperature > 0), or None for a deterministic drafter.
    """
    counts = [1 + len(d) for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts) or meta.num_rows != sum(counts):
        raise ValueError(
            f"need {sum(counts)} logits rows and metadata rows for {len(drafts)} requests, "
            f"got {tuple(logits.shape)} and {meta.num_rows}"
        )
    gens = generators or {}
    x = processed_logits(logits, meta)
    greedy_tok = x.argmax(dim=1).tolist()
    temp = meta.temperature.tolist()
    probs = None if meta.all_greedy else target_probs(x, meta)

    tokens: list[list[int]] = []
    accepted: list[int] = []
    rows_out: list[list[int]] = []
    row = 0
    for i, d in enumerate(drafts):
        m = len(d)
        rows = list(range(row, row + m + 1))
        if temp[row] < SAMPLING_EPS:
            a = 0
            while a < m and greedy_tok[row + a] == d[a]:
                a += 1
            out = [greedy_tok[row + j] for j in range(a + 1)]
        else:
            assert probs is not None
            gen = gens.get(i)
            qd = draft_probs[i] if draft_probs is not None else None
            a = 0
            if m:
                idx = torch.tensor(list(d), dtype=torch.long, device=probs.device)
                p_d = probs[row : row + m].gather(1, idx.unsqueeze(1)).squeeze(1)
                ratio = p_d if qd is None else p_d / qd.gather(1, idx.unsqueeze(1)).squeeze(1)
                u = torch.rand(m, generator=gen, device=probs.device)
                ok = (u < ratio).tolist()
                while a < m and ok[a]:
                    a += 1
            if a < m:
                p = probs[row + a]
                if qd is None:
                    resid = p.clone()
                    resid[d[a]] = 0.0
                else:
                    resid = (p - qd[a]).clamp_(min=0.0)
                if float(resid.sum()) <= 0.0:  # p == q: rejection had probability 0
                    resid = p
                last = _race(resid, gen)
            else:
                last = _race(probs[row + m], gen)
            out = list(d[:a]) + [last]
        tokens.append(out)
        accepted.append(a)
        rows_out.append(rows[: a + 1])
        row += m + 1
    return VerifyOutput(tokens, accepted, rows_out)


def expand_for_verify(
    params: Sequence, outputs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
) -> tuple[list, list[list[int]]]:
    """Row-wise params and "generated so far" lists for :meth:`SamplingMetadata.build`."""
    p_rows: list = []
    o_rows: list[list[int]] = []
    for sp, out, d in zip(params, outputs, drafts, strict=True):
        for j in range(len(d) + 1):
            p_rows.append(sp)
            o_rows.append(list(out) + list(d[:j]) if j else out)
    return p_rows, o_rows
