"""The prompt tail of prefill/decode disaggregation: what a consumer needs beyond the prefix
cache's pages so that it computes only the prompt's last token.

A prompt of ``L`` tokens is prefilled by the producer. The consumer must compute position
``L - 1`` itself (its logits give the first sampled token) and nothing before it. Prefix-cache
keys cover full blocks only (``n = (L - 1) // block_size`` of them) and state checkpoints sit
on block boundaries, so the rest travels under keys of its own, ``("tail", group, h)`` with
``h = tail_hash(req)`` (the hash chain over the prompt's first ``L - 1`` tokens, extended by
the partial block's tokens; wire name ``t<group>-<hex>``):

* an attention group's partial last block (block ``n`` of the request's table: positions
  ``n * block_size .. L - 2``; the consumer writes position ``L - 1`` itself), when
  ``(L - 1) % block_size``;
* every state group's state after ``L - 1`` tokens. The producer takes it for a
  ``do_remote_decode`` request: inside the kernels when a chunk runs past ``L - 1`` (a
  ``StateCapture``), else by a page copy after the step that ends at ``L - 1`` (the chunk is
  cut there when the kernels cannot capture, like any checkpoint target).

Tail pages are never prefix-cache entries (a partial block and a mid-block state serve only
this prompt): the producer's stay held by the request until it finishes and exports them; a
consumer loads them into the request's own pages and credits ``L - 1`` tokens. A tail is all
or nothing: when any state group could not take its tail (pool short), the export falls back
to block-aligned pages (the consumer then computes from the last block boundary on).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from pagefold.core.block_pool import BlockPool
from pagefold.core.managers import GroupManager
from pagefold.core.prefix_cache import hash_block, root_hash, update_block_hashes
from pagefold.request import Request

TAIL = "tail"

# (page key, cache group, pool rows) of an export.
ExportEntry = tuple[Hashable, int, list[int]]


def tail_len(req: Request) -> int:
    """Prompt tokens the producer's pages cover: all but the last."""
    return req.num_prompt_tokens - 1


def tail_hash(req: Request, block_size: int) -> bytes:
    """The hash naming the prompt's first ``L - 1`` tokens (with its salt and images)."""
    end = tail_len(req)
    n = end // block_size
    hashes = update_block_hashes(req, block_size)
    parent = hashes[n - 1] if n else root_hash(req.extra_keys)
    lo = n * block_size
    mm = (req.mm_inputs.hashes_in(lo, end) if req.mm_inputs is not None and end > lo else ())
    return hash_block(parent, req.prompt_token_ids[lo:end], mm)


def tail_groups(managers: list[GroupManager], req: Request, block_size: int) -> list[int]:
    """The cache groups with a tail page: every state group, and every attention group when
    the prompt's ``L - 1`` tokens end inside a block."""
    partial = tail_len(req) % block_size != 0
    return [m.index for m in managers if m.wants_checkpoints() or partial]


def wants_tail(req: Request) -> bool:
    """A producer's request whose prompt leaves for another engine (a family exports once,
    from its parent)."""
    params = req.kv_transfer_params
    return bool(params and params.get("do_remote_decode")) and req.parent_id is None


def takes_tail(managers: list[GroupManager], req: Request, block_size: int,
               keys: dict[int, Hashable], hit: int, stored: Callable[[Hashable], bool],
               pool_hit: Callable[[], int]) -> bool:
    """Whether a consumer whose connector holds the tail ``keys`` (per group) takes them with
    the attention blocks before them (it then computes only the last prompt token): the tail
    is whole, every attention block up to it can be served, and its own pool does not already
    serve all but the last token (``hit`` blocks; ``pool_hit()``: the pool's alone)."""
    if set(keys) != set(tail_groups(managers, req, block_size)):
        return False
    end = tail_len(req)
    full = end // block_size
    if full * block_size == end and hit == full and pool_hit() == full:
        return False
    return all(m.wants_checkpoints() or m.hit_lengths(req.block_hashes, full, stored) >= full
               for m in managers)


def export_entries(pool: BlockPool, managers: list[GroupManager], req: Request,
                   block_size: int) -> tuple[list[ExportEntry], int]:
    """The pages of ``req``'s prompt that leave for a consumer, and the prompt tokens they
    cover. With a whole tail: every attention group's cached blocks along the chain plus the
    tail pages (``L - 1`` tokens). Without: the blocks and each state group's deepest
    checkpoint at or below block ``n`` (the longest hit a request of this prompt can take)."""
    n = tail_len(req) // block_size
    hashes = update_block_hashes(req, block_size)[:n]
    tail = _tail_entries(managers, req, block_size)
    entries: list[ExportEntry] = []
    for m in managers:
        if m.wants_checkpoints():
            if tail is not None:
                continue
            keys = [("ckpt", m.index, h) for h in reversed(hashes)]
        else:
            keys = [(m.index, h) for h in hashes]
        for key in keys:
            e = pool.entry(key)
            if e is not None:
                entries.append((key, m.index, [b.block_id for b in e.blocks]))
                if m.wants_checkpoints():
                    break
    if tail is None:
        return entries, n * block_size
    return entries + tail, tail_len(req)


def _tail_entries(managers: list[GroupManager], req: Request, block_size: int
                  ) -> list[ExportEntry] | None:
    """The tail pages ``req`` holds, one entry per group of :func:`tail_groups`; None when
    some group has none (its state was not captured)."""
    h = tail_hash(req, block_size)
    n = tail_len(req) // block_size
    out: list[ExportEntry] = []
    for g in tail_groups(managers, req, block_size):
        m = managers[g]
        if m.wants_checkpoints():
            pages = m.tail_block_ids(req.request_id)
        else:
            table = m.req_blocks.get(req.request_id, ())
            pages = ([table[n].block_id] if len(table) > n
                     and table[n] is not m.pool.null_block else [])
        if not pages:
            return None
        out.append(((TAIL, g, h), g, pages))
    return out
