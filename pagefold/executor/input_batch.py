"""Builds one step's flat inputs and per-group cache metadata from the scheduler's decision.

Host-side index math runs in numpy (a few microseconds per op, against several for a small
torch op) over whole arrays: tokens, positions and slots are vectorised; the Python loops are
the flattening of the requests' token lists and block tables (one pass each) and the prefill
rows. The results are moved to ``device`` once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec, StateSpec
from pagefold.executor.forward_context import StateMetadata
from pagefold.ops.attention import AttentionMetadata, PrefillRow

_i64 = np.int64
# On the CPU, every row of a request's chunk of at most this many tokens (a speculative verify
# step's 1 + k, a short prefill chunk) attends as a decode row: one query over the keys up to
# its own position, already in the cache. The same kernel and arithmetic as the decode steps it
# stands for, so with the row-independent bf16 linears a verify step computes bit for bit what
# those steps would (greedy speculation keeps bf16 tokens), and the reads are theirs.
SHORT_CHUNK_AS_DECODE = 16
# A CPU step of this many decode rows at most (no captures, no image spans) is built from
# Python lists (:func:`_small_decode`): the same tensors as the general path's, in a third of
# its ~50 small numpy and torch calls (a batch-1 decode step's fixed cost).
SMALL_DECODE_ROWS = 8


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_meta: list[AttentionMetadata | None]
    state_meta: list[StateMetadata | None]
    logits_rows: torch.Tensor  # (S,) flat rows whose logits are sampled
    sample_req_idx: list[int]  # request index (in batch order) of each sampled row


def _tables(block_ids: list[list[int]]) -> np.ndarray:
    """Block tables padded with 0 (the null block) to the longest: (n, max(1, longest))."""
    lens = np.fromiter((len(b) for b in block_ids), dtype=_i64, count=len(block_ids))
    width = max(int(lens.max()) if len(lens) else 0, 1)
    flat = np.fromiter(chain.from_iterable(block_ids), dtype=_i64, count=int(lens.sum()))
    t = np.zeros((len(block_ids), width), dtype=_i64)
    if flat.size:
        # Row-major fill: the mask of (row, col < len) cells in order is the flat list's order.
        t[np.arange(width)[None, :] < lens[:, None]] = flat
    return t


def build_inputs(
    kv_config: KVCacheConfig,
    token_lists: list[list[int]],
    starts: list[int],
    counts: list[int],
    totals: list[int],
    group_block_ids: list[list[list[int]]],
    device: torch.device | str | None = None,
    captures: dict[int, list[tuple[int, int, list[int]]]] | None = None,
    image_spans: list[tuple[int, int, int]] | None = None,
) -> StepInputs:
    """``token_lists[i]`` are request i's new tokens at positions ``starts[i]...``;
    ``totals[i]`` is the request's token count (a row is sampled when the step reaches it);
    ``group_block_ids[g][i]`` is request i's block table in group g; ``captures[g]``: state
    checkpoints ``(request index, prefix length, pages)`` to take inside this step;
    ``image_spans``: ``(request index, first position, end position)`` of the image tokens
    of this step that attend to each other both ways (``AttentionMetadata.image_rows``).
    Every tensor of the result is on ``device`` (default CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    bs = kv_config.block_size
    n_req = len(counts)
    if (dev.type == "cpu" and 0 < n_req <= SMALL_DECODE_ROWS and not captures
            and not image_spans and all(c == 1 for c in counts)):
        return _small_decode(kv_config, token_lists, starts, totals, group_block_ids)
    count = np.asarray(counts, dtype=_i64)
    start = np.asarray(starts, dtype=_i64)
    cu = np.zeros(n_req + 1, dtype=_i64)
    np.cumsum(count, out=cu[1:])
    n_tok = int(cu[-1])
    all_decode = n_tok == n_req
    if all_decode:
        req_of_tok = np.arange(n_req, dtype=_i64)
        positions = start
        ids = np.fromiter((t[0] for t in token_lists), dtype=_i64, count=n_req)
    else:
        req_of_tok = np.repeat(np.arange(n_req, dtype=_i64), count)
        positions = np.arange(n_tok, dtype=_i64) - cu[:-1][req_of_tok] + start[req_of_tok]
        ids = np.fromiter(chain.from_iterable(token_lists), dtype=_i64, count=n_tok)

    def put(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

    cu_t = put(cu)
    per_token = count <= (SHORT_CHUNK_AS_DECODE if dev.type == "cpu" else 1)
    pre_rows = np.flatnonzero(~per_token).tolist()
    if all_decode:
        decode_tok, dec_req, dec_pos = cu_t[:-1], None, start
    else:
        dtok = np.flatnonzero(per_token[req_of_tok])  # flat tokens attending as decode rows
        decode_tok, dec_req, dec_pos = put(dtok), req_of_tok[dtok], positions[dtok]
    attn_meta: list[AttentionMetadata | None] = []
    state_meta: list[StateMetadata | None] = []
    has_init = start > 0
    init_t = None  # has_init as a tensor, one for every state group (read only)
    for gi, group in enumerate(kv_config.groups):
        spec = group.spec
        if isinstance(spec, StateSpec):
            attn_meta.append(None)
            pages = np.fromiter(chain.from_iterable(group_block_ids[gi]), dtype=_i64,
                                count=n_req * group.pages_per_state)
            if init_t is None:
                init_t = put(has_init)
                any_init, all_init = bool(has_init.any()), bool(has_init.all())
            meta = StateMetadata(
                page_ids=put(pages.reshape(n_req, group.pages_per_state)), cu_seqlens=cu_t,
                has_initial_state=init_t, all_decode=all_decode,
                any_initial_state=any_init, all_initial_state=all_init)
            caps = captures.get(gi) if captures else None
            if caps:
                # The state after prefix length p is the one after flat token cu[i] + p - s - 1.
                assert all(starts[i] < p < starts[i] + counts[i] for i, p, _ in caps)
                meta.capture_after = put(np.array([cu[i] + p - starts[i] - 1 for i, p, _ in caps],
                                                  dtype=_i64))
                meta.capture_pages = put(np.array([pg for _, _, pg in caps], dtype=_i64))
            state_meta.append(meta)
            continue
        state_meta.append(None)
        window = spec.window if isinstance(spec, SlidingWindowSpec) else None
        tables = _tables(group_block_ids[gi])
        slots = tables[req_of_tok, positions // bs] * bs + positions % bs
        dec_tables = tables if all_decode else tables[dec_req]
        seq_lens = dec_pos + 1
        kv_start = np.maximum(seq_lens - window, 0) if window else None
        # Chunked local attention: every row reads from its first query's chunk start (the
        # layer masks the later chunks' queries itself; the blocks before are freed).
        chunk = spec.chunk if isinstance(spec, ChunkedLocalAttentionSpec) else None
        if chunk:
            kv_start = dec_pos - dec_pos % chunk
        prefills = []
        for i in pre_rows:
            s, n = starts[i], counts[i]
            lo = max(0, s - window + 1) if window else (s - s % chunk if chunk else 0)
            kp = np.arange(lo, s + n, dtype=_i64)
            prefills.append(PrefillRow(
                tok_start=int(cu[i]), tok_end=int(cu[i + 1]), ctx_len=s, kv_start=lo,
                kv_slots=put(tables[i, kp // bs] * bs + kp % bs)))
        image_rows = []
        for i, a, b in image_spans or ():
            if chunk:
                raise ValueError("image tokens attending both ways with chunked local "
                                 "attention are not supported")
            lo = max(0, a - window + 1) if window else 0
            kp = np.arange(lo, b, dtype=_i64)
            first = int(cu[i]) + a - starts[i]
            image_rows.append(PrefillRow(
                tok_start=first, tok_end=first + b - a, ctx_len=a, kv_start=lo,
                kv_slots=put(tables[i, kp // bs] * bs + kp % bs)))
        attn_meta.append(AttentionMetadata(
            slot_mapping=put(slots), decode_tok=decode_tok, decode_tables=put(dec_tables),
            decode_seq_lens=put(seq_lens),
            decode_kv_start=put(kv_start) if kv_start is not None else None,
            block_size=bs, prefills=prefills, image_rows=image_rows, sliding_window=window,
            all_decode=all_decode))

    sample_req_idx = [i for i in range(n_req) if starts[i] + counts[i] >= totals[i]]
    if all_decode and len(sample_req_idx) == n_req:  # every row: rows 0..n-1, cu[:-1]
        logits_rows = decode_tok
    else:
        logits_rows = put(cu[1:][np.asarray(sample_req_idx, dtype=_i64)] - 1)
    return StepInputs(put(ids), put(positions), attn_meta, state_meta, logits_rows,
                      sample_req_idx)


def _decode_rows(spec, bs: int, tables: list[list[int]], starts: list[int]
                 ) -> tuple[list[int], list[int], list[int] | None]:
    """Per request decoding at position ``starts[i]`` of an attention group: the new token's
    slot, the keys' count and the first key read (None: 0 for every row; a sliding window's
    or a chunk's start otherwise), the rule :func:`_small_decode` and
    :func:`advance_small_decode` share."""
    seq_lens = [s + 1 for s in starts]
    kv_start = None
    window = spec.window if isinstance(spec, SlidingWindowSpec) else None
    if window:
        kv_start = [max(q - window, 0) for q in seq_lens]
    chunk = spec.chunk if isinstance(spec, ChunkedLocalAttentionSpec) else None
    if chunk:
        kv_start = [s - s % chunk for s in starts]
    return [t[s // bs] * bs + s % bs for t, s in zip(tables, starts)], seq_lens, kv_start


def _small_decode(kv_config: KVCacheConfig, token_lists: list[list[int]], starts: list[int],
                  totals: list[int], group_block_ids: list[list[list[int]]]) -> StepInputs:
    """:func:`build_inputs` for a CPU step where every request computes one token (no
    captures, no image spans), from Python lists: equal tensors (values, dtypes, shapes), the
    state groups sharing one ``has_initial_state`` and the attention groups one
    ``decode_tok`` (read only)."""
    bs = kv_config.block_size
    n = len(starts)

    def i64(values, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        # From numpy: ~1 us, torch.tensor(list) ~5; a numpy reshape is cheaper than torch's.
        a = np.array(values, dtype=_i64)
        return torch.from_numpy(a if shape is None else a.reshape(shape))

    rows = torch.from_numpy(np.arange(n + 1, dtype=_i64))  # cu_seqlens; first n: decode rows
    decode_tok = rows[:-1]
    init = [s > 0 for s in starts]
    init_t = None
    attn_meta: list[AttentionMetadata | None] = []
    state_meta: list[StateMetadata | None] = []
    for gi, group in enumerate(kv_config.groups):
        spec = group.spec
        if isinstance(spec, StateSpec):
            attn_meta.append(None)
            if init_t is None:
                init_t = torch.from_numpy(np.array(init, dtype=np.bool_))
            state_meta.append(StateMetadata(
                page_ids=i64(group_block_ids[gi], (n, group.pages_per_state)),
                cu_seqlens=rows,
                has_initial_state=init_t, all_decode=True, any_initial_state=any(init),
                all_initial_state=all(init)))
            continue
        state_meta.append(None)
        width = max(1, max(len(t) for t in group_block_ids[gi]))
        tables = [t + [0] * (width - len(t)) for t in group_block_ids[gi]]  # 0: the null block
        slots, seq_lens, kv_start = _decode_rows(spec, bs, tables, starts)
        attn_meta.append(AttentionMetadata(
            slot_mapping=i64(slots), decode_tok=decode_tok, decode_tables=i64(tables),
            decode_seq_lens=i64(seq_lens),
            decode_kv_start=i64(kv_start) if kv_start is not None else None, block_size=bs,
            prefills=[], image_rows=[],
            sliding_window=spec.window if isinstance(spec, SlidingWindowSpec) else None,
            all_decode=True))
    sample_req_idx = [i for i in range(n) if starts[i] + 1 >= totals[i]]
    logits_rows = decode_tok if len(sample_req_idx) == n else i64(sample_req_idx)
    return StepInputs(i64([t[0] for t in token_lists]), i64(starts), attn_meta, state_meta,
                      logits_rows, sample_req_idx)


def advance_small_decode(inp: StepInputs, kv_config: KVCacheConfig, token_ids: list[int],
                         starts: list[int], group_block_ids: list[list[list[int]]]) -> None:
    """Turn ``inp``, made by :func:`build_inputs` for a small CPU decode step
    (:func:`_small_decode`: every request one token, every row sampled, no captures, no
    image spans), into the next decode step's inputs in place: request ``i``'s token
    ``token_ids[i]`` at position ``starts[i]``, the block tables unchanged (they already
    hold that position). Afterwards every tensor of ``inp`` equals what ``_small_decode``
    makes for those arguments, at the same addresses (a decode burst's later forwards reuse
    the per-step lookups made from them)."""
    bs = kv_config.block_size
    inp.input_ids.numpy()[:] = token_ids
    inp.positions.numpy()[:] = starts
    for group, meta, tables in zip(kv_config.groups, inp.attn_meta, group_block_ids):
        if meta is None:  # a state group: its pages, lengths and flags stay as they are
            continue
        meta.forget_derived()
        slots, seq_lens, kv_start = _decode_rows(group.spec, bs, tables, starts)
        meta.slot_mapping.numpy()[:] = slots
        meta.decode_seq_lens.numpy()[:] = seq_lens
        if kv_start is not None:
            meta.decode_kv_start.numpy()[:] = kv_start


def can_advance(inp: StepInputs, n: int) -> bool:
    """``inp`` is a small CPU decode step's inputs of ``n`` rows, all sampled (what
    :func:`advance_small_decode` takes)."""
    return (inp.input_ids.device.type == "cpu" and inp.input_ids.shape[0] == n
            and len(inp.sample_req_idx) == n and n <= SMALL_DECODE_ROWS
            and all(m is None or (not m.prefills and not m.image_rows) for m in inp.attn_meta)
            and all(m is None or m.capture_after is None for m in inp.state_meta))
