"""The capacity report against what the engine really allocates (issue 44).

``test_capacity.py`` checks the report's arithmetic; here the oracle is the allocator itself.
For each layer kind the planner sizes, the engine's own scheduler and cache manager (the ones
``EngineCore`` builds; a stand-in plays the model, so no forward runs) serve requests that
compute exactly ``n`` tokens, and the test records the pool's peak of blocks held:

* one request alone peaks at exactly the report's ``blocks_per_request`` for ``n``;
* in a pool sized from that *observed* peak to hold ``R`` such requests and one block short of
  ``R + 1``, the report promises ``R``; ``R`` requests run side by side without preemption, and
  ``R + 1`` do not all fit (a preemption, or one of them waits).

The expectation comes from the observed allocation, never from the planner, so a planner
whose sliding-window, state-page or chunk arithmetic is off by one block fails here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch

from pagefold.core.capacity import capacity_report
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, MLASpec, SlidingWindowSpec, StateSpec
from pagefold.core.sched_output import SampledToken, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.entrypoints.capacity_cmd import add_parser, build_report
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.engine import SpecDecoder
from pagefold.testing.tiny_models import arch_config_kwargs

BS = 16
F32 = torch.float32
DECODE = 6  # decode steps of every request (drafts need a few)
MAX_LEN = 1024
BIG = 1 << 24  # room for one request of every case (a huge pool only slows the test)


@dataclass
class Run:
    peak_blocks: int  # most blocks held at once (allocated, not free or cached-free)
    preemptions: int
    admitted_at_once: int  # requests running after the first step's scheduling
    finished: int
    drafted: int = 0  # draft tokens scheduled for verification


def _drive(specs, *, num_tokens: int, num_requests: int, memory: int, budget: int,
           caching: bool, drafts: int = 0, in_kernel: bool = False) -> Run:
    """Serve ``num_requests`` requests that each compute ``num_tokens`` tokens (prompt
    ``num_tokens - DECODE + 1``, ``DECODE`` sampled, the last never computed) in the pool the
    engine plans for ``memory`` bytes."""
    cfg = plan_pagefold(specs, BS, memory)
    kv = KVCacheManager(cfg, enable_prefix_caching=caching, capture_in_kernel=in_kernel)
    s = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=256, max_model_len=MAX_LEN)
    if drafts:  # the engine's drafter; draft-model / MTP drafts are placeholders here
        has_state = any(isinstance(g.spec, StateSpec) for g in cfg.groups)
        s.drafter = SpecDecoder(SpeculativeConfig("mtp", drafts), MAX_LEN, has_state)
    prompt = num_tokens - DECODE + 1
    for i in range(num_requests):  # distinct prompts: no prefix hits between them
        ids = [(1000 * i + j) % 50000 + 1 for j in range(prompt)]
        s.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=DECODE, ignore_eos=True)))
    used = lambda: kv.pool.num_usable - kv.pool.num_free  # noqa: E731
    run = Run(0, 0, 0, 0)
    for _ in range(20 * num_tokens * num_requests):
        if not s.has_unfinished():
            break
        out = s.schedule()
        run.peak_blocks = max(run.peak_blocks, used())
        run.drafted += sum(map(len, out.spec_token_ids.values()))
        if not run.admitted_at_once:
            run.admitted_at_once = len(s.running)
        sampled = {}
        for rid, n in out.num_scheduled.items():
            r = s.requests[rid]
            if r.num_computed_tokens + n < r.num_tokens:
                continue  # a prefill chunk short of the prompt's end
            d = out.spec_token_ids.get(rid)
            sampled[rid] = VerifiedTokens([7] * (len(d) + 1), len(d)) if d else SampledToken(7)
        outs = s.update_from_output(out, sampled)
        run.finished += sum(o.finish_reason is not None for o in outs)
        run.peak_blocks = max(run.peak_blocks, used())
    assert not s.has_unfinished(), "the scheduler stopped making progress"
    run.preemptions = s.num_preemptions
    kv.check_whole()
    return run


def _report_for(specs, n: int, memory: int, *, budget: int, caching: bool,
                drafts: int = 0) -> dict:
    r = capacity_report(specs, memory_bytes=memory, max_model_len=n, block_size=BS,
                        enable_prefix_caching=caching, num_speculative_tokens=drafts,
                        lengths=(), max_num_batched_tokens=budget)
    (point,) = r["concurrency"]
    assert point["tokens"] == n and point["blocks_per_request"] == r["blocks_per_request"]
    return point


def _config_specs(arch: str, model_type: str, **kw) -> dict:
    cfg = dict(arch_config_kwargs(arch), model_type=model_type)
    return layer_specs_from_config(cfg, model_dtype=F32, **kw)


def _window(w: int) -> dict:
    """Two full-attention and two sliding-window layers of one page size."""
    full, slide = FullAttentionSpec(2, 16, F32), SlidingWindowSpec(2, 16, F32, w)
    return {"a0": full, "s0": slide, "a1": full, "s1": slide}


def _specs(case: str) -> dict:
    if case == "full":
        return _config_specs("llama", "llama")
    if case == "full_fp8":
        return _config_specs("qwen3", "qwen3", kv_cache_dtype="fp8")
    if case.startswith("window"):
        return _window(int(case.removeprefix("window")))
    if case == "gemma3":  # sliding 5:1, window 11
        return _config_specs("gemma3", "gemma3_text")
    if case == "gpt_oss":  # alternating, window 9
        return _config_specs("gpt_oss", "gpt_oss")
    if case == "mla":
        return {f"m{i}": MLASpec(48, F32) for i in range(3)}
    if case == "gdn":
        return _config_specs("qwen3_5", "qwen3_5_text")
    if case == "gdn_tp2":
        return _config_specs("qwen3_5", "qwen3_5_text", tensor_parallel_size=2)
    if case == "mamba2":  # 3 pages per state
        return _config_specs("nemotron_h", "nemotron_h")
    if case == "mamba2_only":  # no attention: the page is the largest state
        return _config_specs("mamba2", "mamba2")
    if case == "mamba2_tp2":
        return _config_specs("nemotron_h", "nemotron_h", tensor_parallel_size=2)
    if case == "mamba1":  # jamba: 2 pages per state
        return _config_specs("jamba", "jamba")
    if case == "shortconv":
        return _config_specs("lfm2", "lfm2")
    if case == "kda_mla":  # kimi linear: MLA + KDA states
        return _config_specs("kimi_linear", "kimi_linear")
    raise AssertionError(case)


# (case, tokens per request, step budget, prefix caching). Windows of 11, 17, 18 and 33 are
# not multiples of the block size; budget 1 is decode-like steps (the smallest window
# footprint), 4096 one-chunk prefills (the whole prompt's pages at once), and 16 with window 18
# a chunk that reaches the window's worst page alignment.
CASES = [
    ("full", 100, 64, False),
    ("full", 97, 4096, True),
    ("full_fp8", 75, 32, False),
    ("window16", 120, 1, False),
    ("window11", 120, 1, False),
    ("window17", 120, 1, True),
    ("window33", 150, 1, False),
    ("window11", 120, 4096, False),
    ("window18", 120, 16, False),
    ("gemma3", 90, 1, False),
    ("gemma3", 90, 4096, True),
    ("gpt_oss", 70, 1, False),
    ("mla", 60, 64, True),
    ("gdn", 70, 64, False),
    ("gdn", 70, 64, True),
    ("gdn_tp2", 70, 4096, True),
    ("mamba2", 80, 64, False),
    ("mamba2", 80, 64, True),
    ("mamba2_tp2", 50, 16, True),
    ("mamba2_only", 40, 16, False),  # with caching the checkpoint is best-effort
    ("mamba1", 60, 64, True),
    ("shortconv", 60, 64, True),
    ("kda_mla", 60, 64, True),
]


def _block_bytes(specs) -> int:
    cfg = plan_pagefold(specs, BS, BIG)
    return cfg.layers_per_group * cfg.page_bytes


def _check_peak(specs, n: int, budget: int, caching: bool, memory: int = BIG) -> int:
    """One request alone: its observed peak, which the report must give for ``n`` tokens."""
    alone = _drive(specs, num_tokens=n, num_requests=1, memory=BIG, budget=budget,
                   caching=caching)
    assert alone.preemptions == 0 and alone.finished == 1
    point = _report_for(specs, n, memory, budget=budget, caching=caching)
    assert point["blocks_per_request"] == alone.peak_blocks, (point, alone)
    return alone.peak_blocks


@pytest.mark.parametrize("case,n,budget,caching", CASES,
                         ids=[f"{c}-{n}-b{b}-{'pc' if p else 'nopc'}" for c, n, b, p in CASES])
def test_report_equals_what_the_engine_allocates(case, n, budget, caching):
    specs = _specs(case)
    _check_peak(specs, n, budget, caching)
    # Concurrency, with a budget that prefills every prompt in the first step so the requests
    # move in lockstep and reach their peaks on the same step (else a staggered finish frees
    # blocks before the last request peaks, and "R + 1 do not fit" would prove nothing).
    R = 3
    lockstep = (R + 1) * n
    peak = _check_peak(specs, n, lockstep, caching)
    # A pool of R requests' observed peak, one block short of R + 1 (plus the null block).
    memory = (1 + (R + 1) * peak - 1) * _block_bytes(specs)
    point = _report_for(specs, n, memory, budget=lockstep, caching=caching)
    assert (point["blocks_per_request"], point["max_requests"]) == (peak, R)
    # The promise holds: R admitted at once, none preempted, the pool's peak R times one
    # request's ...
    fits = _drive(specs, num_tokens=n, num_requests=R, memory=memory, budget=lockstep,
                  caching=caching)
    assert fits == Run(R * peak, 0, R, R)
    # ... and one more does not fit at once.
    over = _drive(specs, num_tokens=n, num_requests=R + 1, memory=memory, budget=lockstep,
                  caching=caching)
    assert over.finished == R + 1
    assert over.preemptions > 0 or over.admitted_at_once < R + 1, over


@pytest.mark.parametrize("w", [9, 11, 16, 17, 18, 33])
@pytest.mark.parametrize("budget", [1, 5, 8, 16, 23, 64, 4096])
def test_report_never_undercounts_a_window(w, budget):
    """Every budget, aligned or not: the observed peak never exceeds the report (the chunk
    boundaries of one request may not reach the worst alignment the report allows for)."""
    specs = _window(w)
    for n in (w + 3, 70, 131):
        alone = _drive(specs, num_tokens=n, num_requests=1, memory=BIG, budget=budget,
                       caching=False)
        point = _report_for(specs, n, BIG, budget=budget, caching=False)
        assert alone.peak_blocks <= point["blocks_per_request"], (n, alone, point)
        # ... and by at most the window's alignment slack: one page per window group.
        assert point["blocks_per_request"] - alone.peak_blocks <= 2, (n, alone, point)


@pytest.mark.parametrize("case,n", [("gdn", 64), ("mamba2", 80), ("mamba1", 96), ("full", 80)])
def test_speculative_lookahead_matches_the_cli_report(case, n, tmp_path):
    """Three drafts per decoding step (verify chunks of 4 tokens): the peak equals what
    ``pagefold capacity --num-speculative-tokens 3`` (pagefold layout) reports, i.e. the
    engine keeps the verify states outside the pool and never drafts past the request (the
    lengths are block multiples: one draft slot too many would take one more block)."""
    import json

    arch, model_type = {"gdn": ("qwen3_5", "qwen3_5_text"),
                        "mamba2": ("nemotron_h", "nemotron_h"),
                        "mamba1": ("jamba", "jamba"), "full": ("llama", "llama")}[case]
    cfg = dict(arch_config_kwargs(arch), model_type=model_type, architectures=[])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    specs = layer_specs_from_config(cfg, model_dtype=F32)  # what EngineCore builds
    alone = _drive(specs, num_tokens=n, num_requests=1, memory=BIG, budget=64, caching=True,
                   drafts=3)
    assert alone.finished == 1 and alone.drafted > 0
    # The CLI's own parser: options added later take their defaults.
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args([
        "capacity", str(tmp_path), "--dtype", "float32", "--max-model-len", str(n),
        "--num-speculative-tokens", "3", "--layout", "pagefold", "--kv-cache-memory", str(BIG),
        "--block-size", str(BS), "--enable-prefix-caching", "--max-num-batched-tokens", "64"])
    report = build_report(args)
    assert report["blocks_per_request"] == alone.peak_blocks, (report["groups"], alone)
