"""Batched token sampler for one engine step.

Input: ``logits`` of shape ``(B, V)`` (one row per request that samples this step, any float
dtype) and a :class:`SamplingMetadata` describing the rows. Output: one token per row and,
when any row asks for them, logprobs.

Order of operations (as vLLM):

1. logprobs source: ``log_softmax`` of the **raw** logits (before any processing), so reported
   logprobs are the model's own distribution;
1b. token controls: the structured-output bitmask (disallowed tokens ``-inf``),
   ``allowed_token_ids``, bad words (the last token of a bad word whose other tokens were
   just generated is banned) and ``logit_bias`` (added);
2. min_tokens: EOS / stop ids of rows that have not produced ``min_tokens`` tokens get ``-inf``;
3. penalties: repetition (tokens in prompt or output), then presence and frequency (output);
4. greedy rows take the argmax of the processed logits;
5. random rows: temperature, top-k, top-p (on the sorted probabilities, always keeping the most
   likely token), min-p, then a draw.

The draw is an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. picks index ``i``
with probability ``p_i``. Rows with a seed draw ``q`` from their own ``torch.Generator``, so a
seeded request's tokens depend only on its seed and its own logits, never on which other rows
share the batch or where it sits. Unseeded rows share one batched draw from torch's default
generator. The only per-row Python loop is the seeded rows' noise generation.

The sampler never modifies the caller's ``logits`` tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from pagefold.sampling_params import SAMPLING_EPS, SamplingParams
from pagefold.structured_output.manager import apply_token_bitmask


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request; create it once per request and keep it."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step; rows are in the order of the logits rows.

    Tensors are on the logits' device. Optional tensors are ``None`` when no row uses the
    feature, so the sampler skips that stage entirely.

    Attributes:
        temperature: ``(B,)`` float32, the request temperatures (greedy rows below 1e-5).
        all_greedy: every row is greedy (only an argmax is needed).
        all_random: no row is greedy (no argmax is needed).
        top_p: ``(B,)`` float32 in ``(0, 1]`` or ``None``.
        top_k: ``(B,)`` int64, ``0`` = off for that row, or ``None``.
        max_top_k: the largest ``top_k`` of any row (host int: no device sync to read it).
        min_p: ``(B,)`` float32 or ``None``.
        generators: row index -> generator, for the seeded random rows.
        no_penalties: no row uses a penalty; the penalty fields below are then unused.
        presence_penalties, frequency_penalties, repetition_penalties: ``(B,)`` float32.
        output_token_ids: per row, the tokens produced so far (read, never modified).
        prompt_token_ids: per row, the prompt tokens; only needed (non-None) when some row has
            a repetition penalty.
        stop_ids_to_mask: row -> token ids banned this step because the row has not reached
            its ``min_tokens`` yet.
        max_num_logprobs: the largest ``logprobs`` asked for by any row, or ``None``.
        token_bitmask: ``(B, ceil(V/32))`` int32 packed allowed tokens (structured output),
            or None; set by the model runner from the structured-output manager.
        logit_bias: row -> (token ids, values) added to the logits.
        allowed_token_ids: row -> the only token ids that row may sample.
        banned_token_ids: row -> token ids banned this step (bad words).
        logprob_token_ids: row -> the token ids whose logprobs that row asks for instead of
            its top-k (``SamplingParams.logprob_token_ids``).
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_ids: Sequence[Sequence[int]] = ()
    prompt_token_ids: Sequence[Sequence[int]] | None = None
    stop_ids_to_mask: dict[int, set[int]] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    token_bitmask: torch.Tensor | None = None
    logit_bias: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    banned_token_ids: dict[int, set[int]] = field(default_factory=dict)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def has_token_controls(self) -> bool:
        return bool(self.token_bitmask is not None or self.logit_bias
                    or self.allowed_token_ids or self.banned_token_ids)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_ids_list: Sequence[Sequence[int]],
        prompt_ids_list: Sequence[Sequence[int]] | None = None,
        generators: dict[int, torch.Generator] | None = None,
        *,
        eos_token_ids: Sequence[int | None] | int | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the metadata for rows ``0..B-1`` from the requests' own state.

        Args:
            params_list: the ``B`` requests' sampling params, in logits-row order.
            output_ids_list: per row, the output tokens so far (kept by reference: the
                caller's lists are read at sampling time and never modified).
            prompt_ids_list: per row, the prompt tokens; only read when a row uses
                ``repetition_penalty`` (may be ``None`` otherwise).
            generators: row -> generator for seeded rows (see :func:`make_generator`); rows
                with a seed but no generator here sample from the shared draw. Greedy rows'
                generators are dropped (and so not advanced).
            eos_token_ids: EOS id, one per row or one for all; banned by ``min_tokens``
                unless the row sets ``ignore_eos``.
            device: where the per-row tensors go (the logits' device).

        Cost is ``O(B)`` Python work plus a few small host-to-device copies.
        """
        b = len(params_list)
        if len(output_ids_list) != b:
            raise ValueError(f"got {b} params but {len(output_ids_list)} output id lists")
        if eos_token_ids is None or isinstance(eos_token_ids, int):
            eos_list: Sequence[int | None] = [eos_token_ids] * b
        else:
            eos_list = eos_token_ids
            if len(eos_list) != b:
                raise ValueError(f"got {b} params but {len(eos_list)} eos token ids")

        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        n_greedy = 0
        any_penalty = any_rep = False
        stop_ids_to_mask: dict[int, set[int]] = {}
        max_lp: int | None = None
        controls: tuple[dict, dict, dict] = ({}, {}, {})
        chosen_lp: dict[int, list[int]] = {}
        for i, sp in enumerate(params_list):
            greedy = sp.is_greedy
            n_greedy += greedy
            temps.append(sp.temperature)
            # Greedy rows take the argmax: their truncation settings would be wasted work.
            top_ps.append(1.0 if greedy else sp.top_p)
            top_ks.append(0 if greedy else sp.top_k)
            min_ps.append(0.0 if greedy else sp.min_p)
            if sp.uses_penalties:
                any_penalty = True
                any_rep = any_rep or sp.repetition_penalty != 1.0
            if sp.min_tokens and len(output_ids_list[i]) < sp.min_tokens:
                banned = sp.all_stop_token_ids(eos_list[i])
                if banned:
                    stop_ids_to_mask[i] = banned
            if sp.logprobs is not None:
                max_lp = sp.logprobs if max_lp is None else max(max_lp, sp.logprobs)
            if sp.logprob_token_ids:
                chosen_lp[i] = sp.logprob_token_ids
                max_lp = max_lp or 0  # the raw logprobs are needed
            if sp.uses_token_controls:
                _token_controls(i, sp, output_ids_list[i], controls)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        meta = cls(
            temperature=f32(temps),
            all_greedy=n_greedy == b,
            all_random=n_greedy == 0,
            top_p=f32(top_ps) if any(p < 1.0 for p in top_ps) else None,
            top_k=(
                torch.tensor(top_ks, dtype=torch.int64, device=device) if any(top_ks) else None
            ),
            max_top_k=max(top_ks, default=0),
            min_p=f32(min_ps) if any(min_ps) else None,
            generators={
                r: g for r, g in (generators or {}).items() if not params_list[r].is_greedy
            },
            no_penalties=not any_penalty,
            output_token_ids=output_ids_list,
            stop_ids_to_mask=stop_ids_to_mask,
            max_num_logprobs=max_lp,
            logit_bias=controls[0],
            allowed_token_ids=controls[1],
            banned_token_ids=controls[2],
            logprob_token_ids=chosen_lp,
        )
        if any_penalty:
            meta.presence_penalties = f32([sp.presence_penalty for sp in params_list])
            meta.frequency_penalties = f32([sp.frequency_penalty for sp in params_list])
            meta.repetition_penalties = f32([sp.repetition_penalty for sp in params_list])
            if any_rep:
                if prompt_ids_list is None or len(prompt_ids_list) != b:
                    raise ValueError("repetition_penalty needs prompt_ids_list for every row")
                meta.prompt_token_ids = prompt_ids_list
        return meta


def _token_controls(row: int, sp: SamplingParams, output_ids: Sequence[int],
                    controls: tuple[dict, dict, dict]) -> None:
    """Record row ``row``'s logit_bias / allowed_token_ids / bad-word bans for this step."""
    bias, allowed, banned = controls
    if sp.logit_bias:
        bias[row] = (list(sp.logit_bias), list(sp.logit_bias.values()))
    if sp.allowed_token_ids:
        allowed[row] = sp.allowed_token_ids
    for word in sp.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix)
                          and list(output_ids[len(output_ids) - len(prefix):]) == prefix):
            banned.setdefault(row, set()).add(word[-1])


def apply_token_controls(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply the bitmask, allowed ids, bans and biases (in place on ``logits``, which the
    caller owns). Ids beyond the logits width are ignored (they can never be sampled)."""
    b, v = logits.shape
    dev = logits.device
    if meta.token_bitmask is not None:
        apply_token_bitmask(logits, meta.token_bitmask)
    if meta.allowed_token_ids:
        keep = torch.zeros((b, v), dtype=torch.bool, device=dev)
        keep[[r for r in range(b) if r not in meta.allowed_token_ids]] = True
        for r, ids in meta.allowed_token_ids.items():
            keep[r, torch.tensor([t for t in ids if t < v], dtype=torch.int64, device=dev)] = True
        logits.masked_fill_(~keep, float("-inf"))
    for r, ids in meta.banned_token_ids.items():
        logits[r, torch.tensor([t for t in ids if t < v], dtype=torch.int64, device=dev)] = (
            float("-inf"))
    for r, (ids, values) in meta.logit_bias.items():
        pairs = [(t, x) for t, x in zip(ids, values) if t < v]
        if pairs:
            idx = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=dev)
            logits[r, idx] += torch.tensor([x for _, x in pairs], dtype=logits.dtype,
                                           device=dev)
    return logits


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        sampled_token_ids: ``(B,)`` int64.
        logprobs_token_ids: ``(B, 1 + k)`` int64, column 0 the sampled token, then the top-k
            tokens of the raw distribution (``k = max_num_logprobs``); ``None`` if not asked.
        logprobs: ``(B, 1 + k)`` float32, the raw logprobs of those tokens.
        ranks: ``(B,)`` int64, rank of the sampled token in the raw distribution (1 = best).
        chosen_logprobs: row -> raw logprobs of that row's ``logprob_token_ids`` (in order).
    """

    sampled_token_ids: torch.Tensor
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    chosen_logprobs: dict[int, list[float]] = field(default_factory=dict)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and rank of ``token_ids`` plus the top-``k`` alternatives.

    Args:
        logprobs: ``(N, V)`` float, a normalised log distribution per row.
        token_ids: ``(N,)`` int64, the token whose logprob and rank are wanted.
        k: number of top alternatives (``>= 0``).

    Returns ``(ids (N, 1+k), logprobs (N, 1+k), ranks (N,))``: column 0 is ``token_ids``;
    the rank counts tokens with a strictly larger logprob, plus one. Also usable for prompt
    logprobs (rows = prompt positions, ``token_ids`` = the next prompt tokens).
    """
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = token_ids.unsqueeze(1), chosen
    return ids, vals.float(), ranks


def _flatten(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Flatten ragged rows into ``(row_index, token_id)`` int64 tensors without a row loop."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return row_idx.to(device), flat.to(device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return penalised logits (new tensor); ``logits`` is ``(B, V)`` float32.

    Definitions (``c_t`` = count of token ``t`` in the row's output, ``s_t`` = ``t`` occurs in
    the prompt or the output):

    * repetition ``r``: where ``s_t``, ``l_t / r`` if ``l_t > 0`` else ``l_t * r``;
    * presence ``a``: ``l_t - a * [c_t > 0]``; frequency ``f``: ``l_t - f * c_t``.
    """
    b, v = logits.shape
    device = logits.device
    counts = torch.zeros((b, v), dtype=torch.float32, device=device)
    rows, toks = _flatten(meta.output_token_ids, device)
    if toks.numel():
        counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), True)
    out_seen = counts > 0
    assert meta.repetition_penalties is not None
    assert meta.presence_penalties is not None and meta.frequency_penalties is not None
    rep = meta.repetition_penalties.to(device).unsqueeze(1)
    if meta.prompt_token_ids is not None:
        seen = out_seen.clone()
        prow, ptok = _flatten(meta.prompt_token_ids, device)
        if ptok.numel():
            seen[prow, ptok] = True
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    logits = logits - meta.frequency_penalties.to(device).unsqueeze(1) * counts
    return logits - meta.presence_penalties.to(device).unsqueeze(1) * out_seen


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (in place) everything below each row's k-th largest logit; ``k = 0`` keeps all.

    ``max_top_k`` is the largest ``k`` in ``top_k`` (known on the host, so no device sync).
    """
    v = logits.shape[1]
    active = (top_k > 0) & (top_k < v)
    k = torch.where(active, top_k, 1)
    # One topk with the batch's largest k gives every row's threshold.
    if max_top_k <= 0:  # metadata built by hand: read it from the tensor
        max_top_k = int(top_k.max())
    kmax = min(max(max_top_k, 1), v)
    top_vals = logits.topk(kmax, dim=1).values
    thresh = top_vals.gather(1, (k - 1).unsqueeze(1))
    thresh = torch.where(active.unsqueeze(1), thresh, float("-inf"))
    return logits.masked_fill_(logits < thresh, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches ``p`` (at least one token).

    A token is dropped when the mass of the tokens sorted before it is already ``>= p``; the
    first sorted token has zero mass before it, so it always survives.
    """
    sorted_logits, order = logits.sort(dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    # Rows with p = 1 keep everything, even where rounding pushes the running mass to 1.
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill_(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max_prob`` (the best one survives)."""
    probs = logits.softmax(dim=1)
    thresh = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < thresh, float("-inf"))


def _draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential-race draw: row ``i`` returns index ``j`` with probability ``probs[i, j]``."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, g in generators.items():
        q[row].exponential_(generator=g)
    # exponential_ can in principle return 0; keep p / q finite (0 stays 0 for masked tokens).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=1)


def plain_greedy(params) -> bool:
    """True when ``params`` (a ``SamplingParams``) take the raw argmax and nothing else:
    greedy, no penalty, no token control, no ``min_tokens``, no logprobs. For rows that all
    are, :meth:`Sampler.__call__` is :meth:`Sampler.argmax` (what a runner may call alone,
    without building the metadata)."""
    return (params.is_greedy and not params.uses_penalties and not params.uses_token_controls
            and not params.min_tokens and params.logprobs is None
            and not params.logprob_token_ids)


class Sampler:
    """Stateless batched sampler; see the module docstring for the order of operations."""

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token of ``logits`` ``(B, V)`` (taken as float32), int64.
        The first index of the row's maximum, a NaN counting as the maximum (the first NaN
        wins): numpy's ``argmax`` on the CPU (SIMD, one pass: 1 x 16384 in ~2 us against
        ~10-12 for torch's ``max(dim)``, 32 x 49152 0.5 ms against 1.8, one thread), torch's
        ``max(dim).indices`` elsewhere (the same index rule; ``argmax`` is ~3x slower)."""
        x = logits.float()
        if x.device.type == "cpu" and x.dim() == 2 and not x.requires_grad:
            return torch.from_numpy(x.numpy().argmax(axis=1))
        return x.max(dim=1).indices

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``(B, V)``."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits must be (B={meta.num_rows}, V), got {tuple(logits.shape)}"
            )
        raw = logits
        logits = logits.float()
        # Everything below writes in place only on tensors this method created.
        if meta.has_token_controls:
            if logits.data_ptr() == raw.data_ptr():
                logits = logits.clone()
            logits = apply_token_controls(logits, meta)
        if meta.stop_ids_to_mask:
            if logits.data_ptr() == raw.data_ptr():
                logits = logits.clone()
            v = logits.shape[1]
            # Ids beyond the model's vocabulary can never be sampled: nothing to ban.
            pairs = [(r, t) for r, ids in meta.stop_ids_to_mask.items() for t in ids if t < v]
            rows = [r for r, _ in pairs]
            cols = [t for _, t in pairs]
            logits[
                torch.tensor(rows, dtype=torch.int64, device=logits.device),
                torch.tensor(cols, dtype=torch.int64, device=logits.device),
            ] = float("-inf")
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)

        sampled = self._sample(logits, meta)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        raw_logprobs = torch.log_softmax(raw.float(), dim=1)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        chosen = {row: raw_logprobs[row, torch.tensor(tids, device=raw_logprobs.device)].tolist()
                  for row, tids in meta.logprob_token_ids.items()}
        return SamplerOutput(sampled, logprobs_token_ids=ids, logprobs=lps, ranks=ranks,
                             chosen_logprobs=chosen)

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = None if meta.all_random else Sampler.argmax(logits)
        if meta.all_greedy:
            assert greedy_tokens is not None
            return greedy_tokens
        temp = meta.temperature.to(logits.device)
        is_greedy = temp < SAMPLING_EPS
        # Greedy rows divide by 1 (their result is discarded); a new tensor, safe to mask.
        logits = logits / torch.where(is_greedy, 1.0, temp).unsqueeze(1)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k.to(logits.device), meta.max_top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p.to(logits.device))
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p.to(logits.device))
        probs = logits.softmax(dim=1)
        random_tokens = _draw(probs, meta.generators)
        if greedy_tokens is None:
            return random_tokens
        return torch.where(is_greedy, greedy_tokens, random_tokens)
