"""Capacity report: what a KV-cache memory budget buys, in pagefold's layout or in vLLM's.

``capacity_report`` returns a JSON-ready dict; ``render_report`` turns it into a table that
explains every number; ``log_capacity`` is what the engine logs at start-up.

Units: a *page* is one layer's share of a block; a *block* is one page in each of the
``layers_per_group`` shared tensors, so ``block_bytes = layers_per_group * page_size_bytes``.
All figures are per tensor-parallel rank (the specs already hold per-rank shapes).

pagefold layout (the pool the engine builds, via ``plan_pagefold``): attention pages hold
``block_size`` tokens, a state spans ``pages_per_state`` whole pages, block 0 is the null block
(``usable_blocks = num_blocks - 1``). A sequence of n tokens takes ``cdiv(n, block_size)``
pages per full-attention group and ``pages_per_state`` per state group, twice that with prefix
caching (one checkpoint kept for reuse). ``kv_cache_size_tokens`` is
``int(max_concurrency * max_model_len)`` with the concurrency from those real page counts.

vLLM layout: see :mod:`pagefold.core.vllm_layout`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from pagefold.core.kv_cache_planner import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    NUM_NULL_BLOCKS,
    group_pages_for_request,
    pages_for_request,
    plan_pagefold,
    usable_blocks,
)
from pagefold.core.kv_cache_spec import LayerSpec, StateSpec, is_attention
from pagefold.core.vllm_layout import VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS, plan_vllm, spec_kind

LAYOUTS = ("pagefold", "vllm")
DEFAULT_LENGTHS = (1024, 4096, 32768)


def _too_small(memory: int, need: int, blocks: int, usable: int, length: int) -> ValueError:
    return ValueError(
        f"the KV cache budget of {memory:,} bytes gives {usable:,} usable blocks, but one "
        f"request of max_model_len {length:,} takes {blocks:,} blocks: the pool needs "
        f"{need:,} bytes for one request of max_model_len {length:,}; raise kv_cache_memory "
        "or lower max_model_len"
    )


def capacity_report(
    layer_specs: dict[str, LayerSpec],
    *,
    layout: str = "pagefold",
    memory_bytes: int,
    max_model_len: int,
    block_size: int = 16,
    enable_prefix_caching: bool = False,
    num_speculative_tokens: int = 0,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    max_num_batched_tokens: int | None = None,
) -> dict[str, Any]:
    """The capacity of ``memory_bytes`` of KV cache for ``layer_specs`` (one TP rank).

    ``layer_specs`` must be built with the same ``num_speculative_tokens`` (their conv rows);
    the vLLM layout also charges one state block per speculative token per state group, the
    pagefold layout keeps speculative states outside the pool. Raises ``ValueError`` when one
    request of ``max_model_len`` does not fit. Concurrency is reported at each of ``lengths``
    below ``max_model_len`` and at ``max_model_len``. ``max_num_batched_tokens`` (the engine's
    step budget, the longest prefill chunk) sizes what sliding-window and chunked-local groups
    hold, in either layout; None: each engine's own default (pagefold
    ``DEFAULT_MAX_NUM_BATCHED_TOKENS``, vLLM ``VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS if layout == "pagefold"
                                  else VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    if memory_bytes < 1:
        raise ValueError(f"kv_cache_memory must be positive, got {memory_bytes}")
    points = sorted({n for n in lengths if 0 < n < max_model_len} | {max_model_len})
    counts = Counter(spec_kind(s) for s in layer_specs.values())
    state_specs = [s for s in layer_specs.values() if isinstance(s, StateSpec)]
    has_attention = any(is_attention(s) for s in layer_specs.values())

    if layout == "pagefold":
        cfg = plan_pagefold(layer_specs, block_size, memory_bytes)
        page, per_group_layers = cfg.page_bytes, cfg.layers_per_group
        usable = usable_blocks(cfg)
        groups = [
            {
                "kind": spec_kind(g.spec),
                "num_layers": len(g.layer_names),
                "pages_per_state": g.pages_per_state,
                "blocks_per_request": group_pages_for_request(
                    g,
                    block_size,
                    max_model_len,
                    enable_prefix_caching=enable_prefix_caching,
                    max_num_batched_tokens=max_num_batched_tokens,
                ),
            }
            for g in cfg.groups
        ]
        per_request = {
            n: pages_for_request(
                cfg,
                n,
                enable_prefix_caching=enable_prefix_caching,
                max_num_batched_tokens=max_num_batched_tokens,
            )
            for n in points
        }
        biggest = max(state_specs, key=lambda s: s.state_bytes, default=None)
        state_page = biggest.state_bytes if biggest else 0
        pages_per_state = max((g.pages_per_state for g in cfg.groups), default=0)
        padding = pages_per_state * page - state_page if biggest else 0
        attn_block = block_size if has_attention else None
        num_blocks, null_blocks = cfg.num_blocks, NUM_NULL_BLOCKS
        raw_state = sum(s.state_bytes for s in state_specs)
    else:
        v = plan_vllm(
            layer_specs,
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            num_speculative_tokens=num_speculative_tokens,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        page, per_group_layers = v.page_size_bytes, v.layers_per_group
        usable = v.num_blocks
        groups = [
            {
                "kind": g.kind,
                "num_layers": len(g.layer_names),
                "pages_per_state": 1 if isinstance(g.spec, StateSpec) else 0,
                "blocks_per_request": g.blocks_per_request,
            }
            for g in v.groups
        ]
        per_request = {n: v.blocks_for_length(n) for n in points}
        state_page, padding = v.state_page_bytes, v.padding_bytes
        pages_per_state = 1 if state_specs else 0
        attn_block = v.attention_block_size
        num_blocks, null_blocks = v.num_blocks, 0
        raw_state = sum(s.unpadded_bytes for s in state_specs)

    block_bytes = per_group_layers * page
    bpr = per_request[max_model_len]
    if usable < bpr:
        need = (bpr + null_blocks) * block_bytes
        raise _too_small(memory_bytes, need, bpr, usable, max_model_len)
    max_concurrency = usable / bpr
    state_blocks = sum(g["blocks_per_request"] for g in groups if g["pages_per_state"])
    full_groups = sum(1 for g in groups if g["kind"] == "full_attention")
    bytes_per_token = full_groups * block_bytes / attn_block if attn_block else 0.0
    fixed_state = state_blocks * block_bytes
    return {
        "layout": layout,
        "memory_bytes": memory_bytes,
        "max_model_len": max_model_len,
        "enable_prefix_caching": enable_prefix_caching,
        "num_speculative_tokens": num_speculative_tokens,
        "max_num_batched_tokens": max_num_batched_tokens,
        "layer_counts": dict(counts),
        "attention_block_size": attn_block,
        "state_page_bytes": state_page,
        "pages_per_state": pages_per_state,
        "page_size_bytes": page,
        "padding_bytes": padding,
        "layers_per_group": per_group_layers,
        "group_sizes": [g["num_layers"] for g in groups],
        "padding_layers": per_group_layers * len(groups) - len(layer_specs),
        "groups": groups,
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "usable_blocks": usable,
        "pool_bytes": num_blocks * block_bytes,
        "blocks_per_request": bpr,
        "max_concurrency": max_concurrency,
        "kv_cache_size_tokens": int(max_concurrency * max_model_len),
        "state_bytes_per_sequence": raw_state,
        "fixed_state_blocks_per_sequence": state_blocks,
        "fixed_state_bytes_per_sequence": fixed_state,
        "bytes_per_token": bytes_per_token,
        "state_equivalent_tokens": int(fixed_state / bytes_per_token) if bytes_per_token else 0,
        "concurrency": [
            {
                "tokens": n,
                "blocks_per_request": per_request[n],
                "max_concurrency": usable / per_request[n],
                "max_requests": usable // per_request[n],
            }
            for n in points
        ],
    }


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``; binary units, as memory budgets are given."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def render_report(report: dict[str, Any]) -> str:
    """A readable table of ``capacity_report``'s numbers, each with what it means."""
    r = report
    pagefold = r["layout"] == "pagefold"
    page, block = r["page_size_bytes"], r["block_bytes"]
    attn_block = r["attention_block_size"]
    layers = ", ".join(f"{n} {kind}" for kind, n in r["layer_counts"].items())
    out = [
        f"KV cache capacity, {r['layout']} layout, per GPU (tensor-parallel rank)",
        "",
        "Pool",
    ]
    rows = [
        ("memory budget", f"{format_bytes(r['memory_bytes'])} ({r['memory_bytes']:,} bytes)"),
        ("cached layers", layers),
        (
            "groups",
            f"{_n(len(r['groups']), 'group')} of {_n(r['layers_per_group'], 'layer')} "
            f"({', '.join(g['kind'] for g in r['groups'])})"
            + (f"; {r['padding_layers']} padding layer slots" if r["padding_layers"] else ""),
        ),
    ]
    if attn_block:
        per_tok = page // attn_block
        what = f"{page:,} bytes = KV of {attn_block:,} tokens ({per_tok:,} B each)"
        rows.append(("page (one layer)", what))
    else:
        rows.append(("page (one layer)", f"{page:,} bytes = one state"))
    if r["state_page_bytes"]:
        pct = 100 * r["padding_bytes"] / (r["state_page_bytes"] + r["padding_bytes"])
        if pagefold:
            what = (
                f"{r['state_page_bytes']:,} bytes per layer, split into "
                f"{_n(r['pages_per_state'], 'page')}; {r['padding_bytes']:,} bytes ({pct:.2f}%) "
                "of the last page unused"
            )
        elif attn_block:
            what = (
                f"{r['state_page_bytes']:,} bytes per layer in one page, padded by "
                f"{r['padding_bytes']:,} bytes ({pct:.2f}%) to the attention page"
            )
        else:
            what = f"{r['state_page_bytes']:,} bytes per layer, one page"
        rows.append(("state", what))
    rows.append(
        ("block", f"one page in each of {r['layers_per_group']} layers = {format_bytes(block)}")
    )
    null = " (block 0 is the null block)" if pagefold else ""
    rows.append(
        ("blocks", f"{r['num_blocks']:,} in the pool, {r['usable_blocks']:,} usable{null}")
    )
    out += _rows(rows)

    out += ["", "Per sequence"]
    rows = []
    if r["bytes_per_token"]:
        rows.append(
            (
                "attention",
                f"{format_bytes(r['bytes_per_token'])} of pool per token; one block per "
                f"{attn_block:,} tokens in each full-attention group",
            )
        )
    if r["fixed_state_blocks_per_sequence"]:
        if pagefold:
            copies = "running state"
            if r["enable_prefix_caching"]:
                copies += " + 1 prefix-cache checkpoint"
            copies += f", {_n(r['pages_per_state'], 'page')} each"
        else:
            copies = "2 blocks" if r["enable_prefix_caching"] else "1 block"
            copies += " per state group"
            if r["num_speculative_tokens"]:
                copies += f" + {r['num_speculative_tokens']} for speculative tokens"
        eq = (
            f", as much pool as {r['state_equivalent_tokens']:,} tokens of attention KV"
            if r["state_equivalent_tokens"]
            else ""
        )
        rows.append(
            (
                "fixed state",
                f"{_n(r['fixed_state_blocks_per_sequence'], 'block')} = "
                f"{format_bytes(r['fixed_state_bytes_per_sequence'])} whatever the length "
                f"({copies}){eq}",
            )
        )
        rows.append(("raw state", f"{format_bytes(r['state_bytes_per_sequence'])} over all layers"))
    out += _rows(rows)

    out += ["", "Concurrency (requests of one length that fit at once)"]
    table = [("tokens/request", "blocks/request", "concurrency", "whole requests")]
    for c in r["concurrency"]:
        table.append(
            (
                f"{c['tokens']:,}",
                f"{c['blocks_per_request']:,}",
                f"{c['max_concurrency']:,.2f}x",
                f"{c['max_requests']:,}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    out += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
    out += [
        "",
        f"KV cache size: {r['kv_cache_size_tokens']:,} tokens = {r['max_concurrency']:.2f} "
        f"requests x max_model_len {r['max_model_len']:,}",
    ]
    if r["fixed_state_blocks_per_sequence"]:
        out.append(
            "  (a count of max-length requests times their length, not of token slots: "
            "shorter requests still pay the fixed state)"
        )
    return "\n".join(out)


def log_capacity(logger: logging.Logger, report: dict[str, Any]) -> None:
    """Start-up log: the pool and vLLM-comparable summary at INFO, the full table at DEBUG."""
    r = report
    block = r["attention_block_size"]
    logger.info(
        "KV cache (%s layout): %s blocks of %s (%s layers x %s bytes), %s usable%s",
        r["layout"],
        f"{r['num_blocks']:,}",
        format_bytes(r["block_bytes"]),
        r["layers_per_group"],
        f"{r['page_size_bytes']:,}",
        f"{r['usable_blocks']:,}",
        f"; {block} tokens per attention block" if block else "",
    )
    if r["fixed_state_blocks_per_sequence"]:
        logger.info(
            "KV cache: each sequence holds %s state blocks (%s) whatever its length",
            r["fixed_state_blocks_per_sequence"],
            format_bytes(r["fixed_state_bytes_per_sequence"]),
        )
    logger.info(
        "KV cache size: %s tokens, maximum concurrency for %s tokens per request: %.2fx",
        f"{r['kv_cache_size_tokens']:,}",
        f"{r['max_model_len']:,}",
        r["max_concurrency"],
    )
    logger.debug("%s", render_report(report))
