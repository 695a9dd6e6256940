"""Memory benchmark: internal fragmentation of pagefold's pool vs vLLM's hybrid layout.

    python -m benchmarks.memory [--config PATH ... | --arch qwen3_5] [--num-requests 64]

Two parts, both on one mixed-length workload (lengths drawn uniformly from
``--min-len..--max-len`` with ``--seed``):

1. **Analytic** (no weights): for real model shapes (built in: a Qwen3.5-27B-style config at
   TP 2 with an FP8 KV cache and 52.89 GiB per GPU, and Nemotron-H-8B at TP 1, bf16 KV, same
   budget; or each ``--config`` given), per request: the bytes it really needs vs the bytes its
   blocks take from the pool in pagefold's layout (16-token pages, a state spans whole pages)
   and in vLLM's (one giant attention block whose page holds a whole state, the state padded up
   to it). Also how many requests of this length mix fit in the pool at once under each layout.
2. **Measured** on a tiny real engine (``--arch``): the workload runs through ``LLM``; once every
   request is running with its whole prompt computed, the pool's block tables are read
   (``llm.engine.kv.managers[g].req_blocks``) and the waste per request per group is computed
   from the pages each request actually holds and its ``num_computed_tokens``. vLLM's layout for
   the same requests comes from ``plan_vllm`` on the engine's own specs.

Definitions (per request, per TP rank, prefix caching off in both layouts, so no checkpoints):

* need: ``tokens * bytes_per_token`` per full-attention layer (``min(tokens, window)`` for a
  sliding window) plus the *unpadded* state bytes (sum of component bytes) per state layer.
* allocated: blocks held x ``layers_per_group`` x page: a block reserves a page in every shared
  layer tensor, so an undersized group's empty layer slots count as allocated too (reported
  separately as ``slot pad``).
* waste = allocated - need (internal fragmentation). ``waste pages/group``: per group, the
  unused part of each layer's pages, in that layout's pages and in 16-token pages
  (``small pages``). pagefold's invariant: under one page per group for every request.
* fit: requests taken in workload order (cycling) until the next one no longer fits the usable
  blocks; ``ideal``: pool bytes / mean need (zero fragmentation).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import bench_model

GIB = 2**30
DEFAULT_MEMORY = int(52.89 * GIB)


# ---------------------------------------------------------------------------- model shapes
def qwen35_27b_config() -> dict:
    """Qwen3.5-27B-shaped config.json: 64 layers, every 4th full attention (4 KV heads x 256),
    Gated DeltaNet with 16 key / 48 value heads of 128, conv kernel 4, float32 SSM state."""
    n = 64
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "dtype": "bfloat16", "hidden_size": 5120,
            "num_hidden_layers": n, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                            for i in range(n)],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "mamba_ssm_dtype": "float32",
        },
    }  # fmt: skip


def nemotron_h_8b_config() -> dict:
    """Nemotron-H-8B-Base-8K-shaped config.json: 52 layers (24 Mamba-2, 4 attention with 8 KV
    heads x 128, 24 MLP); Mamba-2 with 128 heads x 64, 8 groups, state 128, conv kernel 4."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "hidden_size": 4096, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 8, "attention_head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """One analytic case: a config dict and how it is served (per TP rank)."""

    name: str
    config: dict
    tp: int
    kv_cache_dtype: str
    memory_bytes: int


BUILTIN = (
    Setup("Qwen3.5-27B-style, TP 2, FP8 KV, 52.89 GiB", qwen35_27b_config(), 2, "fp8",
          DEFAULT_MEMORY),
    Setup("Nemotron-H-8B-style, TP 1, bf16 KV, 52.89 GiB", nemotron_h_8b_config(), 1, "auto",
          DEFAULT_MEMORY),
)


def specs_for(config: dict, tp: int, kv_cache_dtype: str) -> dict:
    from pagefold.core.config_fields import config_model_dtype
    from pagefold.core.spec_from_config import layer_specs_from_config

    dtype = getattr(torch, config_model_dtype(config) or "bfloat16")
    return layer_specs_from_config(config, model_dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                   tensor_parallel_size=tp)


# ---------------------------------------------------------------------------- arithmetic
@dataclass(frozen=True)
class GroupCost:
    """One request's footprint in one cache group. ``pages`` = block ids it holds there."""

    kind: str
    layers: int  # real layers in the group
    pages: int
    page_bytes: int
    layers_per_group: int
    need_bytes: int  # what the group's layers really store for this request

    @property
    def alloc_bytes(self) -> int:
        return self.pages * self.layers_per_group * self.page_bytes

    @property
    def slot_pad_bytes(self) -> int:
        return self.pages * (self.layers_per_group - self.layers) * self.page_bytes

    @property
    def waste_bytes(self) -> int:
        return self.alloc_bytes - self.need_bytes

    @property
    def waste_pages(self) -> float:
        """Unused part of each layer's pages (slot padding excluded), in this layout's pages."""
        held = self.pages * self.layers * self.page_bytes
        return (held - self.need_bytes) / (self.layers * self.page_bytes)


def layer_need(spec, num_tokens: int) -> int:
    """Bytes one layer really stores for a sequence of ``num_tokens`` tokens."""
    from pagefold.core.kv_cache_spec import SlidingWindowSpec, StateSpec

    if isinstance(spec, StateSpec):
        return spec.unpadded_bytes
    if isinstance(spec, SlidingWindowSpec):
        return min(num_tokens, spec.window) * spec.bytes_per_token
    return num_tokens * spec.bytes_per_token


def _kind(spec) -> str:
    from pagefold.core.vllm_layout import spec_kind

    return spec_kind(spec)


class Layouts:
    """pagefold's and vLLM's pools for one set of specs and budget; per-request costs."""

    def __init__(self, specs: dict, memory_bytes: int, block_size: int = 16) -> None:
        from pagefold.core.kv_cache_planner import plan_pagefold, usable_blocks
        from pagefold.core.vllm_layout import plan_vllm

        self.specs, self.memory, self.block_size = specs, memory_bytes, block_size
        self.pf = plan_pagefold(specs, block_size, memory_bytes)
        self.pf_usable = usable_blocks(self.pf)
        self.vllm = plan_vllm(specs, memory_bytes=memory_bytes, max_model_len=block_size,
                              enable_prefix_caching=False, block_size=block_size)
        self._cache: dict[tuple[str, int], list[GroupCost]] = {}

    def pagefold(self, n: int) -> list[GroupCost]:
        from pagefold.core.kv_cache_planner import group_pages_for_request

        key = ("pagefold", n)
        if key not in self._cache:
            cfg = self.pf
            self._cache[key] = [
                GroupCost(_kind(g.spec), len(g.layer_names),
                          group_pages_for_request(g, cfg.block_size, n,
                                                  enable_prefix_caching=False),
                          cfg.page_bytes, cfg.layers_per_group,
                          len(g.layer_names) * layer_need(g.spec, n))
                for g in cfg.groups
            ]
        return self._cache[key]

    def vllm_(self, n: int) -> list[GroupCost]:
        from pagefold.core.vllm_layout import plan_vllm

        key = ("vllm", n)
        if key not in self._cache:
            v = plan_vllm(self.specs, memory_bytes=self.memory, max_model_len=n,
                          enable_prefix_caching=False, block_size=self.block_size)
            self._cache[key] = [
                GroupCost(g.kind, len(g.layer_names), g.blocks_per_request, v.page_size_bytes,
                          v.layers_per_group, len(g.layer_names) * layer_need(g.spec, n))
                for g in v.groups
            ]
        return self._cache[key]

    def costs(self, layout: str, n: int) -> list[GroupCost]:
        return self.pagefold(n) if layout == "pagefold" else self.vllm_(n)

    def usable(self, layout: str) -> int:
        return self.pf_usable if layout == "pagefold" else self.vllm.num_blocks

    def block_bytes(self, layout: str) -> int:
        if layout == "pagefold":
            return self.pf.layers_per_group * self.pf.page_bytes
        return self.vllm.layers_per_group * self.vllm.page_size_bytes

    def small_page_bytes(self) -> int:
        """pagefold's page: the unit ``small pages`` columns count in."""
        return self.pf.page_bytes

    def fit(self, layout: str, lengths: list[int]) -> int:
        """Requests of ``lengths`` (cycled, in order) that fit the usable blocks at once."""
        left, count = self.usable(layout), 0
        while True:
            blocks = sum(g.pages for g in self.costs(layout, lengths[count % len(lengths)]))
            if blocks > left:
                return count
            left -= blocks
            count += 1


def summarize(per_request: list[list[GroupCost]], small_page: int) -> dict[str, Any]:
    """Totals over requests: need/alloc/waste (mean, max, %), worst waste per group."""
    need = [sum(g.need_bytes for g in r) for r in per_request]
    alloc = [sum(g.alloc_bytes for g in r) for r in per_request]
    waste = [a - b for a, b in zip(alloc, need)]
    pct = [100 * w / b for w, b in zip(waste, need)]
    pages = [g.waste_pages for r in per_request for g in r]
    small = [g.waste_pages * g.page_bytes / small_page for r in per_request for g in r]
    groups = []
    for gi, g0 in enumerate(per_request[0]):
        col = [r[gi] for r in per_request]
        groups.append({
            "kind": g0.kind, "layers": g0.layers,
            "mean waste pages": sum(g.waste_pages for g in col) / len(col),
            "max waste pages": max(g.waste_pages for g in col),
            "max waste small pages": max(g.waste_pages * g.page_bytes / small_page for g in col),
            "max waste B": max(g.waste_bytes for g in col),
        })
    return {
        "requests": len(per_request),
        "mean need B": sum(need) / len(need),
        "mean alloc B": sum(alloc) / len(alloc),
        "total need B": sum(need), "total alloc B": sum(alloc),
        "mean waste B": sum(waste) / len(waste), "max waste B": max(waste),
        "mean waste %": sum(pct) / len(pct), "max waste %": max(pct),
        "total waste %": 100 * (sum(alloc) - sum(need)) / sum(need),
        "slot pad B": sum(g.slot_pad_bytes for r in per_request for g in r),
        "max waste pages/group": max(pages),
        "max waste small pages/group": max(small),
        "groups": groups,
    }


def draw_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


# ---------------------------------------------------------------------------- part 1: analytic
def analyze(setup: Setup, lengths: list[int], block_size: int) -> dict[str, Any]:
    specs = specs_for(setup.config, setup.tp, setup.kv_cache_dtype)
    lay = Layouts(specs, setup.memory_bytes, block_size)
    out: dict[str, Any] = {"name": setup.name, "layouts": {}}
    for layout in ("pagefold", "vllm"):
        s = summarize([lay.costs(layout, n) for n in lengths], lay.small_page_bytes())
        s["fit"] = lay.fit(layout, lengths)
        s["ideal fit"] = int(lay.usable(layout) * lay.block_bytes(layout) // s["mean need B"])
        s["usable blocks"] = lay.usable(layout)
        s["block B"] = lay.block_bytes(layout)
        out["layouts"][layout] = s
    v, pf = lay.vllm, lay.pf
    pps = max((g.pages_per_state for g in pf.groups), default=0)
    out.update(layers_per_group=pf.layers_per_group, pf_page=pf.page_bytes, pf_pages_per_state=pps,
               vllm_block_tokens=v.attention_block_size, vllm_page=v.page_size_bytes,
               vllm_padding=v.padding_bytes, state_bytes=v.state_page_bytes,
               groups=[f"{_kind(g.spec)} x{len(g.layer_names)}" for g in pf.groups])
    return out


def print_analytic(r: dict[str, Any], lengths: list[int]) -> None:
    print(f"\n== {r['name']}")
    print(f"   groups: {', '.join(r['groups'])} ({r['layers_per_group']} layer slots per block)")
    print(f"   state per layer (unpadded): {r['state_bytes']:,} B")
    print(f"   pagefold: page {r['pf_page']:,} B (16 tokens), a state = "
          f"{r['pf_pages_per_state']} pages")
    print(f"   vLLM:     block {r['vllm_block_tokens']:,} tokens, page {r['vllm_page']:,} B, "
          f"state padded by {r['vllm_padding']:,} B")
    print(f"   workload: {len(lengths)} requests, lengths {min(lengths)}..{max(lengths)}, "
          f"mean {sum(lengths) / len(lengths):,.1f} tokens")
    _print_layout_table(r["layouts"])
    _print_group_table(r["layouts"])


def _print_layout_table(layouts: dict[str, dict]) -> None:
    cols = [("layout", None), ("mean need", "mean need B"), ("mean alloc", "mean alloc B"),
            ("mean waste", "mean waste B"), ("mean %", "mean waste %"),
            ("max waste", "max waste B"), ("max %", "max waste %"),
            ("total %", "total waste %"), ("slot pad", "slot pad B"),
            ("max pages/grp", "max waste pages/group"),
            ("max small pages/grp", "max waste small pages/group"),
            ("fit", "fit"), ("ideal fit", "ideal fit")]
    rows = [[name] + [_cell(s.get(k)) for _, k in cols[1:]] for name, s in layouts.items()]
    _table([c for c, _ in cols], rows)


def _print_group_table(layouts: dict[str, dict]) -> None:
    head = ["layout", "group", "kind", "layers", "mean waste pages", "max waste pages",
            "max small pages", "max waste B"]
    rows = []
    for name, s in layouts.items():
        for gi, g in enumerate(s["groups"]):
            rows.append([name, str(gi), g["kind"], str(g["layers"]),
                         f"{g['mean waste pages']:.4f}", f"{g['max waste pages']:.4f}",
                         f"{g['max waste small pages']:.4f}", f"{g['max waste B']:,}"])
    _table(head, rows)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("   " + "  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("   " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))


# ---------------------------------------------------------------------------- part 2: measured
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload through a tiny engine and read the real block tables mid-flight."""
    from transformers import AutoConfig

    from pagefold import LLM, SamplingParams
    from pagefold.core.kv_cache_planner import pages_for_request, plan_pagefold
    from pagefold.core.spec_from_config import layer_specs_from_config
    from pagefold.request import RequestStatus

    model = args.model or str(bench_model(args.arch, args.hidden, args.layers,
                                          cache_dir=args.cache_dir))
    hf = AutoConfig.from_pretrained(model)
    vocab = int(getattr(getattr(hf, "text_config", None) or hf, "vocab_size", 512))
    lengths = draw_lengths(args.engine_requests, args.min_len, args.engine_max_len, args.seed)
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
    max_model_len = args.engine_max_len + args.decode_room

    # Size the pool to hold every request at max_model_len: no preemption, nothing evicted.
    planned = plan_pagefold(layer_specs_from_config(hf, model_dtype=getattr(torch, args.dtype)),
                            args.block_size, 1 << 20)
    blocks = len(lengths) * pages_for_request(planned, max_model_len,
                                              enable_prefix_caching=False) + 1
    memory = blocks * planned.layers_per_group * planned.page_bytes

    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, kv_cache_memory=memory, max_model_len=max_model_len,
              max_num_seqs=len(lengths), enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    core = llm.engine
    # The engine's own specs (its dtype and config), for vLLM's layout of the same requests.
    specs = layer_specs_from_config(core.hf_config, model_dtype=core.dtype)
    sp = [SamplingParams(temperature=0, max_tokens=max_model_len - n, ignore_eos=True,
                         detokenize=False) for n in lengths]
    ids = [llm.add_request({"prompt_token_ids": p}, s) for p, s in zip(prompts, sp)]
    steps = 0

    def all_prefilled() -> bool:
        reqs = [core.scheduler.requests.get(i) for i in ids]
        return all(r is not None and r.status == RequestStatus.RUNNING
                   and r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)

    while not all_prefilled():
        llm.step()
        steps += 1
        if any(i not in core.scheduler.requests for i in ids):
            raise RuntimeError("a request finished before all were running; raise --decode-room")
    seconds = time.perf_counter() - t0
    if core.scheduler.num_preemptions:
        raise RuntimeError("the engine preempted a request; the snapshot would be partial")

    # Snapshot: every request's held pages per group, from the block tables.
    kv, kvc = core.kv, core.kv_config
    null = kv.pool.null_block
    lay = Layouts(specs, memory, kvc.block_size)
    measured, vllm_rows, held_total = [], [], 0
    planned_ok = lay.pf == kvc  # the planner's pool is the one the engine built
    for rid in ids:
        r = core.scheduler.requests[rid]
        n = r.num_computed_tokens
        row = []
        for m, g in zip(kv.managers, kvc.groups):
            pages = sum(1 for b in m.req_blocks.get(rid, ()) if b is not null)
            held_total += pages
            row.append(GroupCost(_kind(g.spec), len(g.layer_names), pages, kvc.page_bytes,
                                 kvc.layers_per_group, len(g.layer_names) * layer_need(g.spec, n)))
        planned_ok &= [c.pages for c in row] == [c.pages for c in lay.pagefold(n)]
        measured.append(row)
        vllm_rows.append(lay.vllm_(n))
    in_use = kv.pool.num_usable - kv.pool.num_free
    tokens = [core.scheduler.requests[i].num_computed_tokens for i in ids]
    llm.abort(ids)
    kv.check_whole()

    small = kvc.page_bytes
    res = {
        "model": model, "dtype": str(core.dtype).removeprefix("torch."),
        "requests": len(ids), "prompt lengths": lengths, "computed tokens": tokens,
        "steps": steps, "seconds": seconds, "pool bytes": memory,
        "pool blocks in use": in_use, "blocks in tables": held_total,
        "planner matches tables": planned_ok,
        "pf_page": kvc.page_bytes, "layers_per_group": kvc.layers_per_group,
        "vllm_block_tokens": lay.vllm.attention_block_size, "vllm_page": lay.vllm.page_size_bytes,
        "groups": [f"{_kind(g.spec)} x{len(g.layer_names)}" for g in kvc.groups],
        "layouts": {"pagefold (measured)": summarize(measured, small),
                    "vllm (same requests)": summarize(vllm_rows, small)},
    }
    for name, rows in (("pagefold (measured)", measured), ("vllm (same requests)", vllm_rows)):
        layout = "pagefold" if name.startswith("pagefold") else "vllm"
        res["layouts"][name]["blocks held"] = sum(c.pages for r in rows for c in r)
        s = res["layouts"][name]
        s["fit"] = lay.fit(layout, tokens)
        s["ideal fit"] = int(lay.usable(layout) * lay.block_bytes(layout) // s["mean need B"])
    return res


def print_measured(r: dict[str, Any]) -> None:
    lens = r["computed tokens"]
    print(f"\n== measured: tiny engine {r['model']} ({r['dtype']})")
    print(f"   groups: {', '.join(r['groups'])} ({r['layers_per_group']} layer slots per block)")
    print(f"   pagefold page {r['pf_page']:,} B; vLLM block {r['vllm_block_tokens']:,} tokens, "
          f"page {r['vllm_page']:,} B")
    print(f"   {r['requests']} requests all running after {r['steps']} steps "
          f"({r['seconds']:.1f} s); computed tokens {min(lens)}..{max(lens)}, "
          f"mean {sum(lens) / len(lens):,.1f}; pool {r['pool bytes']:,} B")
    print(f"   pool blocks in use {r['pool blocks in use']:,}, blocks in request tables "
          f"{r['blocks in tables']:,}; planner's page counts match the tables: "
          f"{r['planner matches tables']}; fit = requests of these lengths that this pool holds")
    _print_layout_table(r["layouts"])
    _print_group_table(r["layouts"])


# ---------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[],
                   help="config.json to analyse instead of the built-in shapes (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size for --config")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV dtype for --config")
    p.add_argument("--memory", default="52.89GiB", help="KV budget per GPU for --config")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="qwen3_5", help="tiny model for the measured part")
    p.add_argument("--model", default=None, help="model dir for the measured part")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--engine-requests", type=int, default=None,
                   help="requests for the measured part (default --num-requests)")
    p.add_argument("--engine-max-len", type=int, default=512,
                   help="longest prompt of the measured part (CPU time)")
    p.add_argument("--decode-room", type=int, default=512,
                   help="max_model_len - --engine-max-len: no request may finish early")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--cache-dir", default=None, help="where tiny models are built")
    p.add_argument("--skip-analytic", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    if args.engine_requests is None:
        args.engine_requests = args.num_requests
    if not args.min_len <= args.max_len or args.min_len < 1:
        p.error("need 1 <= --min-len <= --max-len")

    from pagefold.config import parse_bytes

    results: dict[str, Any] = {"analytic": [], "measured": None}
    if not args.skip_analytic:
        setups = [Setup(path, json.loads(Path(path).read_text()), args.tp, args.kv_cache_dtype,
                        parse_bytes(args.memory)) for path in args.config] or list(BUILTIN)
        lengths = draw_lengths(args.num_requests, args.min_len, args.max_len, args.seed)
        for s in setups:
            r = analyze(s, lengths, args.block_size)
            print_analytic(r, lengths)
            results["analytic"].append(r)
    if not args.skip_engine:
        results["measured"] = measure(args)
        print_measured(results["measured"])
    return results


if __name__ == "__main__":
    main()
