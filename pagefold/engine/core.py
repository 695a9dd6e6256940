"""EngineCore: the scheduler + model busy loop. Knows token ids, never text.

``step()`` schedules, runs the model, appends sampled tokens, applies the token-level stop rules
(eos, stop_token_ids, max_tokens, max_model_len) and frees finished requests' blocks on the same
step. Text-level stops (stop strings) are found by the output processor, which aborts.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagefold.config import EngineConfig, kv_dtype, resolve_dtype
from pagefold.core.capacity import capacity_report, log_capacity
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import KVCacheConfig, plan_pagefold
from pagefold.core.kv_cache_spec import is_attention
from pagefold.core.scheduler import Scheduler
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.core.swap import PreemptionCost
from pagefold.executor.model_runner import ModelRunner
from pagefold.models.registry import (
    load_model,
    read_config_dict,
    resolve_architecture,
    text_config,
)
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

logger = logging.getLogger("pagefold")


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    parent_id: str | None = None  # parallel sampling: the family's request id
    index: int = 0  # the child's index in its family


def load_hf_config(model: str):
    from transformers import AutoConfig

    path = Path(model)
    cfg_dict = read_config_dict(path)
    arch = resolve_architecture(cfg_dict)
    return arch, AutoConfig.from_pretrained(str(path))


def check_pool_fits(kv_config: KVCacheConfig, memory: int, max_model_len: int) -> None:
    """Raise a ValueError naming kv_cache_memory and max_model_len when one request of
    ``max_model_len`` tokens cannot fit the pool. Runs before the pool exists (BlockPool
    refuses under 2 blocks with a message that names neither). The bytes asked for include
    block 0, the null block, which is never handed out."""
    usable = max(0, kv_config.num_blocks - 1)
    probe = KVCacheManager(dataclasses.replace(kv_config, num_blocks=2))  # nothing allocated
    one_request = probe.min_blocks_for(max_model_len)
    if one_request > usable:
        need = (one_request + 1) * kv_config.layers_per_group * kv_config.page_bytes
        raise ValueError(
            f"kv_cache_memory {memory} bytes holds {usable} usable blocks, but one request of "
            f"max_model_len {max_model_len} needs {one_request} blocks ({need} bytes with the "
            f"reserved null block); raise kv_cache_memory or lower max_model_len")


def _captures_in_kernel(model: torch.nn.Module, kv_config: KVCacheConfig) -> bool:
    """True when every state layer of ``model`` takes state checkpoints inside its kernels
    (a module with that ``layer_name`` and ``captures_checkpoints``); any other state layer
    keeps the chunks cut at checkpoint targets."""
    state_layers = {name for g in kv_config.groups if not is_attention(g.spec)
                    for name in g.layer_names}
    able = {getattr(m, "layer_name", None) for m in model.modules()
            if getattr(m, "captures_checkpoints", False)}
    return state_layers <= able


class EngineCore:
    def __init__(self, config: EngineConfig, *, cache_fill: float | None = None) -> None:
        self.config = config
        self.device = config.resolve_device()
        arch, hf_config = load_hf_config(config.model)
        tcfg = text_config(hf_config)
        self.hf_config = hf_config
        self.dtype = resolve_dtype(config.dtype, getattr(tcfg, "dtype", None)
                                   or getattr(hf_config, "dtype", None))
        max_pos = getattr(tcfg, "max_position_embeddings", None) or 4096
        self.max_model_len = config.max_model_len or max_pos
        self.max_num_batched_tokens = config.max_num_batched_tokens or 4096
        self.eos_token_id = self._eos_id(hf_config)

        self.model = load_model(Path(config.model), hf_config, arch, self.dtype,
                                max(self.max_model_len, max_pos), self.device)
        specs = layer_specs_from_config(
            hf_config, model_dtype=self.dtype, kv_cache_dtype=config.kv_cache_dtype,
            mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype)
        memory = config.kv_cache_memory or config.DEFAULT_KV_CACHE_MEMORY
        self.kv_config = plan_pagefold(specs, config.block_size, int(memory))
        check_pool_fits(self.kv_config, int(memory), self.max_model_len)
        self.kv = KVCacheManager(self.kv_config,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 checkpoint_interval=config.state_checkpoint_interval,
                                 capture_in_kernel=config.state_checkpoints_in_kernel
                                 and _captures_in_kernel(self.model, self.kv_config))
        log_capacity(logger, capacity_report(
            specs, layout="pagefold", memory_bytes=int(memory), max_model_len=self.max_model_len,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching))
        logger.info("%s: %s weights, kv cache %s, max_model_len %d, max_num_batched_tokens %d",
                    arch, self.dtype, kv_dtype(config.kv_cache_dtype, self.dtype),
                    self.max_model_len, self.max_num_batched_tokens)
        host_blocks = config.swap_space // (self.kv_config.layers_per_group
                                            * self.kv_config.page_bytes)
        self.runner = ModelRunner(self.model, self.kv_config, self.device, cache_fill=cache_fill,
                                  num_host_blocks=host_blocks)
        self.kv.attach_swap(host_blocks, config.preemption_mode,
                            PreemptionCost(flops_per_token=2.0 * self.runner.num_params))
        if host_blocks:
            logger.info("swap space: %d host blocks (%.2f GiB), preemption mode %s",
                        host_blocks, config.swap_space / 2**30, config.preemption_mode)
        self._warn_if_caching_impossible(self.kv.min_blocks_for(self.max_model_len))
        self.scheduler = Scheduler(
            self.kv, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            policy=config.scheduling_policy)
        if config.warm_up:
            warm = self.max_num_batched_tokens
            secs = self.runner.warm_up(warm, seq_len=min(self.max_model_len, 256))
            logger.info("warm-up: one %d-token forward in %.2f s (first batches start warm)",
                        warm, secs)

    def _warn_if_caching_impossible(self, one_request: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.kv_config.block_size
        if self.max_model_len <= bs:
            logger.warning("prefix caching can never hit: max_model_len %d is not above "
                           "block_size %d (hits need a full block before the last token)",
                           self.max_model_len, bs)
        elif self.kv.pool.num_usable < 2 * one_request:
            logger.warning("prefix caching will rarely hit: the pool (%d blocks) holds under two "
                           "requests of max_model_len (%d blocks each), so cached blocks and "
                           "state checkpoints are evicted almost at once; raise kv_cache_memory",
                           self.kv.pool.num_usable, one_request)

    @staticmethod
    def _eos_id(hf_config) -> int | None:
        eos = getattr(text_config(hf_config), "eos_token_id", None)
        if eos is None:
            eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue. Raises ValueError (nothing is queued) on bad input."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}; the prompt "
                f"must be shorter than max_model_len to leave room for one output token")
        vocab = text_config(self.hf_config).vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        kw = {} if arrival_time is None else {"arrival_time": arrival_time}
        family = max(params.n, params.best_of or 1)
        if family > 1:
            params = params.clone()
            if params.best_of > params.n and params.logprobs is None:
                params.logprobs = 0  # ranking by cumulative logprob needs each token's logprob
            params.n = params.best_of = 1
            kw.update(fork_children=family - 1, fork_at=n - 1)
        req = Request(request_id, list(prompt_token_ids), params,
                      eos_token_id=self.eos_token_id, priority=priority, **kw)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; a parallel-sampling family id aborts all its children too."""
        reqs = self.scheduler.requests
        for rid in request_ids:
            family = [rid] + [c for c, r in reqs.items() if r.parent_id == rid]
            for cid in family:
                if self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED) is not None:
                    self.runner.drop_request(cid)

    def fork_request(self, parent_id: str, child_id: str) -> Request:
        """A new request continuing ``parent_id`` token for token (beam search): attention
        blocks shared copy-on-write, states copied. Call between steps."""
        parent = self.scheduler.requests[parent_id]
        if child_id in self.scheduler.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        if parent.status == RequestStatus.RUNNING and not self.kv.can_fork(parent, 1):
            raise RuntimeError("no free blocks to fork a request; lower beam_width or n")
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params.clone(),
                        eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
                        priority=parent.priority, all_token_ids=list(parent.all_token_ids),
                        output_token_ids=list(parent.output_token_ids),
                        extra_keys=parent.extra_keys, num_cached_tokens=parent.num_cached_tokens,
                        cumulative_logprob=parent.cumulative_logprob)
        self.scheduler.fork_now(parent, child)
        return child

    def replace_last_token(self, request_id: str, token_id: int) -> None:
        """Swap the newest sampled token (not computed yet, so nothing in the cache changes)."""
        r = self.scheduler.requests[request_id]
        if not r.output_token_ids or r.num_computed_tokens >= r.num_tokens:
            raise ValueError(f"request {request_id!r} has no uncomputed sampled token")
        r.output_token_ids[-1] = token_id
        r.all_token_ids[-1] = token_id
        if len(r.block_hashes) * self.kv.block_size >= r.num_tokens:
            r.block_hashes.pop()  # that hash covered the replaced token

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Hold a request out of scheduling (its driver decides its next token first)."""
        self.scheduler.requests[request_id].paused = paused

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._unschedulable()
        reqs = sched.requests
        counts = [sched.num_scheduled[r.request_id] for r in reqs]
        block_ids = [self.kv.block_ids(r.request_id) for r in reqs]
        self.kv.plan_captures(reqs, counts)
        sampled = self.runner.execute(reqs, counts, block_ids, self.kv.take_copies(),
                                      self.kv.take_swaps(), captures=self.kv.take_captures())
        self.kv.release_pins()
        outputs, finished = [], []
        for r, n in zip(reqs, counts):
            r.num_computed_tokens += n
            tok = sampled.get(r.request_id)
            if tok is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            r.append_token(tok.token_id)
            out = EngineCoreOutput(r.request_id, [tok.token_id],
                                   num_cached_tokens=max(r.num_cached_tokens, 0),
                                   parent_id=r.parent_id, index=r.index)
            if tok.logprobs is not None:
                out.new_logprobs.append(tok.logprobs)
                r.cumulative_logprob += tok.logprobs[1][0]
            status = self._check_stop(r, tok.token_id)
            if status is not None:
                finished.append((r, status))
                out.finish_reason = status.finish_reason
                out.stop_reason = r.stop_reason
            outputs.append(out)
        # Cache what this step made reusable (before finished requests free their pages).
        for r in reqs:
            self.kv.after_step(r)
        self.runner.copy_pages(self.kv.take_copies())
        self.kv.release_pins()
        for r, status in finished:
            self.scheduler.finish_request(r.request_id, status)
            self.runner.drop_request(r.request_id)
        return outputs

    def _check_stop(self, r: Request, token: int) -> RequestStatus | None:
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token == r.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                r.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and r.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if r.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _unschedulable(self) -> list[EngineCoreOutput]:
        """Nothing ran although requests wait: the head request cannot fit in an empty pool."""
        s = self.scheduler
        if s.num_running or not s.num_waiting:
            return []
        head = s.waiting.peek()
        logger.error("request %s needs more blocks than the whole pool; aborting it",
                     head.request_id)
        s.finish_request(head.request_id, RequestStatus.FINISHED_LENGTH)
        self.runner.drop_request(head.request_id)
        return [EngineCoreOutput(head.request_id, [], finish_reason="length")]
