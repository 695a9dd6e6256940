"""Builds one step's flat inputs and per-group cache metadata from the scheduler's decision.

Everything is vectorised over tokens; the only Python loops are over requests (to read their
token ids and block tables) and over prefill rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import SlidingWindowSpec, StateSpec
from pagefold.executor.forward_context import StateMetadata
from pagefold.layers.attention.backend import AttentionMetadata, PrefillRow

_i64 = torch.int64


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_meta: list[AttentionMetadata | None]
    state_meta: list[StateMetadata | None]
    logits_rows: torch.Tensor  # (S,) flat rows whose logits are sampled
    sample_req_idx: list[int]  # request index (in batch order) of each sampled row


def _tables(block_ids: list[list[int]]) -> torch.Tensor:
    width = max((len(b) for b in block_ids), default=0) or 1
    t = torch.zeros((len(block_ids), width), dtype=_i64)
    for i, b in enumerate(block_ids):
        if b:
            t[i, : len(b)] = torch.tensor(b, dtype=_i64)
    return t


def build_inputs(
    kv_config: KVCacheConfig,
    token_lists: list[list[int]],
    starts: list[int],
    counts: list[int],
    totals: list[int],
    group_block_ids: list[list[list[int]]],
) -> StepInputs:
    """``token_lists[i]`` are request i's new tokens at positions ``starts[i]...``;
    ``totals[i]`` is the request's token count (a row is sampled when the step reaches it);
    ``group_block_ids[g][i]`` is request i's block table in group g."""
    bs = kv_config.block_size
    n_req = len(counts)
    ids = torch.tensor([t for lst in token_lists for t in lst], dtype=_i64)
    start_t = torch.tensor(starts, dtype=_i64)
    count_t = torch.tensor(counts, dtype=_i64)
    cu = torch.zeros(n_req + 1, dtype=_i64)
    torch.cumsum(count_t, 0, out=cu[1:])
    req_of_tok = torch.repeat_interleave(torch.arange(n_req), count_t)
    positions = torch.arange(int(cu[-1])) - cu[:-1][req_of_tok] + start_t[req_of_tok]

    is_decode = count_t == 1
    dec_rows = torch.nonzero(is_decode).flatten()
    attn_meta: list[AttentionMetadata | None] = []
    state_meta: list[StateMetadata | None] = []
    for gi, group in enumerate(kv_config.groups):
        spec = group.spec
        if isinstance(spec, StateSpec):
            attn_meta.append(None)
            pages = torch.tensor(group_block_ids[gi], dtype=_i64).view(n_req, group.pages_per_state)
            has_init = start_t > 0
            state_meta.append(StateMetadata(
                page_ids=pages, cu_seqlens=cu, has_initial_state=has_init,
                all_decode=bool(is_decode.all()), any_initial_state=bool(has_init.any())))
            continue
        state_meta.append(None)
        window = spec.window if isinstance(spec, SlidingWindowSpec) else None
        tables = _tables(group_block_ids[gi])
        slots = tables[req_of_tok, positions // bs] * bs + positions % bs
        # Decode rows: every block holding a key of the row (inside the window), row by row.
        seq_len = start_t[dec_rows] + 1
        lo_blk = (torch.clamp(seq_len - window, min=0) // bs if window
                  else torch.zeros_like(seq_len))
        hi_blk = (seq_len + bs - 1) // bs
        nblk = hi_blk - lo_blk
        row = torch.repeat_interleave(torch.arange(len(dec_rows)), nblk)
        bcu = torch.zeros(len(dec_rows) + 1, dtype=_i64)
        torch.cumsum(nblk, 0, out=bcu[1:])
        blk_idx = torch.arange(int(bcu[-1])) - bcu[:-1][row] + lo_blk[row]
        dec_blocks = tables[dec_rows[row], blk_idx]
        kpos = blk_idx.unsqueeze(1) * bs + torch.arange(bs).unsqueeze(0)  # (Nb, bs)
        valid = kpos < seq_len[row].unsqueeze(1)
        if window:
            valid &= kpos > (seq_len[row] - 1 - window).unsqueeze(1)
        mask = None if bool(valid.all()) else valid
        width = int(nblk.max()) if len(dec_rows) else 0
        row_blocks = torch.full((len(dec_rows), width), int(bcu[-1]), dtype=_i64)
        col = torch.arange(int(bcu[-1])) - bcu[:-1][row]
        row_blocks[row, col] = torch.arange(int(bcu[-1]))
        prefills = []
        for i in torch.nonzero(~is_decode).flatten().tolist():
            s, n = starts[i], counts[i]
            lo = max(0, s - window + 1) if window else 0
            kp = torch.arange(lo, s + n)
            prefills.append(PrefillRow(
                tok_start=int(cu[i]), tok_end=int(cu[i + 1]), ctx_len=s, kv_start=lo,
                kv_slots=tables[i, kp // bs] * bs + kp % bs))
        attn_meta.append(AttentionMetadata(
            slot_mapping=slots, decode_tok=cu[:-1][dec_rows], decode_blocks=dec_blocks,
            decode_block_row=row, decode_block_mask=mask, decode_row_blocks=row_blocks,
            prefills=prefills,
            sliding_window=window))

    sample_req_idx = [i for i in range(n_req) if starts[i] + counts[i] >= totals[i]]
    logits_rows = cu[1:][torch.tensor(sample_req_idx, dtype=_i64)] - 1
    return StepInputs(ids, positions, attn_meta, state_meta, logits_rows, sample_req_idx)
