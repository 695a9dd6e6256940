"""Runs one scheduled step: flat inputs -> model forward -> logits of sampling rows -> sampler."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import StateSpec, cdiv
from pagefold.core.managers import PageCopy, StateCapture
from pagefold.core.swap import SwapOp
from pagefold.csrc import cpu_ops
from pagefold.executor.cache_tensors import CacheTensors, wide_rows
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import build_inputs
from pagefold.executor.sampler import Sampler, SamplingMetadata, make_generator
from pagefold.request import Request


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # (token ids, logprobs) of the sampled token followed by the top-k alternatives; and rank.
    logprobs: tuple[list[int], list[float], int] | None = None


# A CPU step whose work (tokens x parameters) is below this runs on one thread: its ops are
# too small for a parallel region to pay, and on a loaded machine every parallel region waits
# for a thread the OS may have descheduled (spinning, for milliseconds).
SMALL_STEP_WORK = 1 << 26


@contextmanager
def _threads_for(device: torch.device, work: int):
    """One torch thread for a CPU step whose ``work`` (tokens x parameters) is below
    ``SMALL_STEP_WORK``; the caller's thread count is restored afterwards."""
    threads = torch.get_num_threads()
    small = device.type == "cpu" and threads > 1 and work < SMALL_STEP_WORK
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if small:
            torch.set_num_threads(threads)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_config: KVCacheConfig, device: torch.device,
                 cache_fill: float | None = None, num_host_blocks: int = 0) -> None:
        self.model = model
        self.num_params = sum(p.numel() for p in model.parameters())
        if device.type == "cpu":  # bf16 linears: GEMV for 1-2 rows, else pre-reordered oneDNN
            cpu_ops.use_fast_linears(model)
        self.kv_config = kv_config
        self.device = device
        self.cache = CacheTensors(kv_config, device, fill=cache_fill)
        # Host pool for swapped-out pages: same geometry, CPU memory (pinned with a GPU).
        pin = device.type == "cuda"
        self.host = [torch.zeros((num_host_blocks, kv_config.page_bytes), dtype=torch.uint8,
                                 pin_memory=pin)
                     for _ in range(kv_config.layers_per_group if num_host_blocks else 0)]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.num_forward_tokens = 0

    def warm_up(self, num_tokens: int, seq_len: int) -> float:
        """One forward of ``num_tokens`` prompt tokens (sequences of at most ``seq_len``) and
        the logits of their last rows, before serving, so that the first real batch of that
        size does not pay one-time costs (oneDNN primitives for that row count, the kernels'
        buffers, the allocator's first touch); vLLM's start-up profile run does the same.

        Every block table points at the null block (block 0); its bytes in every shared tensor
        are saved first and restored afterwards, so no cache content changes. No request,
        counter or generator sees the run. Returns the seconds it took."""
        if num_tokens < 1:
            return 0.0
        t = time.perf_counter()
        seq_len = max(1, min(seq_len, num_tokens))
        counts = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            counts.append(num_tokens % seq_len)
        bs = self.kv_config.block_size
        per_group = []
        for group in self.kv_config.groups:
            width = group.pages_per_state if isinstance(group.spec, StateSpec) else None
            per_group.append([[0] * (width or cdiv(n, bs)) for n in counts])
        saved = [t_[0].clone() for t_ in self.cache.shared]
        try:
            with _threads_for(self.device, num_tokens * self.num_params), \
                    torch.inference_mode():
                tokens = [[1] * n for n in counts]
                inp = build_inputs(self.kv_config, tokens, [0] * len(counts), counts, counts,
                                   per_group, self.device)
                ctx = ForwardContext(self.cache, inp.attn_meta, inp.state_meta)
                hidden = self.model(inp.input_ids, inp.positions, ctx)
                self.model.compute_logits(hidden[inp.logits_rows])
        finally:
            for t_, row in zip(self.cache.shared, saved):
                t_[0].copy_(row)
        return time.perf_counter() - t

    def drop_request(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.is_greedy:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = self._generators[req.request_id] = make_generator(seed, self.device)
        return g

    @torch.inference_mode()
    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy whole pages within the pool, in every layer of each copy's group."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for c in copies:
            src, dst = by_group.setdefault(c.group, ([], []))
            src.extend(c.src)
            dst.extend(c.dst)
        for g, (src, dst) in by_group.items():
            s = torch.tensor(src, dtype=torch.int64, device=self.device)
            d = torch.tensor(dst, dtype=torch.int64, device=self.device)
            for si in range(len(self.kv_config.groups[g].layer_names)):
                t = wide_rows(self.cache.shared[si])  # words, not bytes: ~10x faster
                t.index_copy_(0, d, t.index_select(0, s))

    @torch.inference_mode()
    def swap(self, ops: list[SwapOp]) -> None:
        """Move whole pages between the device pool and the host pool, in op order."""
        for op in ops:
            dev = torch.tensor(op.device, dtype=torch.int64, device=self.device)
            host = torch.tensor(op.host, dtype=torch.int64)
            for si in range(len(self.kv_config.groups[op.group].layer_names)):
                pool, hpool = wide_rows(self.cache.shared[si]), wide_rows(self.host[si])
                if op.to_host:
                    hpool.index_copy_(0, host, pool.index_select(0, dev).to("cpu"))
                else:
                    pool.index_copy_(0, dev, hpool.index_select(0, host).to(self.device))

    def execute(self, reqs: list[Request], counts: list[int], block_ids: list[list[list[int]]],
                copies: list[PageCopy] | None = None,
                swaps: list[SwapOp] | None = None,
                captures: list[StateCapture] | None = None) -> dict[str, SampledToken]:
        """``block_ids[i][g]``: request i's table in group g. Returns tokens of sampled rows.

        Before the forward: swap-outs (their device pages may be reused this step), then page
        copies (prefix-hit restores, forks, copy-on-write), then swap-ins. ``captures``: state
        checkpoints the state layers write during the forward.

        On the CPU a small step (see ``SMALL_STEP_WORK``) runs with one torch thread; the
        caller's thread count is restored afterwards."""
        with _threads_for(self.device, sum(counts) * self.num_params):
            return self._execute(reqs, counts, block_ids, copies, swaps, captures)

    @torch.inference_mode()
    def _execute(self, reqs: list[Request], counts: list[int],
                 block_ids: list[list[list[int]]], copies: list[PageCopy] | None,
                 swaps: list[SwapOp] | None,
                 captures: list[StateCapture] | None = None) -> dict[str, SampledToken]:
        swaps = swaps or []
        self.swap([op for op in swaps if op.to_host])
        if copies:
            self.copy_pages(copies)
        self.swap([op for op in swaps if not op.to_host])
        starts = [r.num_computed_tokens for r in reqs]
        tokens = [r.all_token_ids[s : s + n] for r, s, n in zip(reqs, starts, counts)]
        per_group = [[b[g] for b in block_ids] for g in range(len(self.kv_config.groups))]
        by_group: dict[int, list[tuple[int, int, list[int]]]] = {}
        if captures:
            index = {r.request_id: i for i, r in enumerate(reqs)}
            for c in captures:
                by_group.setdefault(c.group, []).append((index[c.request_id], c.num_tokens,
                                                         c.pages))
        inp = build_inputs(self.kv_config, tokens, starts, counts,
                           [r.num_tokens for r in reqs], per_group, self.device, by_group)
        self.num_forward_tokens += int(inp.input_ids.numel())
        ctx = ForwardContext(self.cache, inp.attn_meta, inp.state_meta)
        hidden = self.model(inp.input_ids, inp.positions, ctx)
        if not inp.sample_req_idx:
            return {}
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        sreqs = [reqs[i] for i in inp.sample_req_idx]
        gens = {}
        for row, r in enumerate(sreqs):
            g = self._generator(r)
            if g is not None:
                gens[row] = g
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sreqs],
            [r.output_token_ids for r in sreqs],
            [r.prompt_token_ids for r in sreqs],
            gens,
            eos_token_ids=[r.eos_token_id for r in sreqs],
            device=self.device,
        )
        out = self.sampler(logits, meta)
        ids = out.sampled_token_ids.tolist()
        result = {}
        lp_ids = out.logprobs_token_ids.tolist() if out.logprobs_token_ids is not None else None
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        ranks = out.ranks.tolist() if out.ranks is not None else None
        for row, r in enumerate(sreqs):
            lp = None
            k = r.sampling_params.logprobs
            if k is not None and lp_ids is not None:
                lp = (lp_ids[row][: 1 + k], lps[row][: 1 + k], ranks[row])
            result[r.request_id] = SampledToken(ids[row], lp)
        return result
