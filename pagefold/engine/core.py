"""EngineCore: the scheduler + model busy loop. Knows token ids, never text.

``step()`` is three calls (the step contract of ``core/sched_output.py``): the scheduler makes
the step's message, the runner executes it, the scheduler applies the sampled tokens (appends
them, applies the token-level stop rules, caches, frees finished requests on the same step).
Text-level stops (stop strings) are found by the output processor, which aborts. Under
pipeline parallelism the same calls run with up to one message per stage in flight
(``engine/batch_queue.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from pagefold.architectures import ARCHITECTURES, tensor_parallel_architectures
from pagefold.checkpoint import generation_eos_ids, load_hf_config, load_tokenizer, text_config
from pagefold.config import EngineConfig, kv_dtype, pool_bytes, resolve_dtype
from pagefold.core.capacity import capacity_report, log_capacity
from pagefold.core.decode_burst import MAX_STEPS, BurstPolicy
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import KVCacheConfig, plan_pagefold
from pagefold.core.kv_cache_spec import StateSpec
from pagefold.core.model_len import resolve_max_model_len
from pagefold.core.sched_output import EngineCoreOutput
from pagefold.core.scheduler import Scheduler
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.core.swap import PreemptionCost
from pagefold.csrc import gemv_choice
from pagefold.distributed.executor import TPExecutor
from pagefold.distributed.parallel_state import (
    expert_parallel_enabled,
    set_expert_parallel,
    set_tensor_parallel,
    tp_rank,
    tp_size,
)
from pagefold.distributed.pipeline import plan_pipeline
from pagefold.distributed.worker import WorkerInit
from pagefold.engine.batch_queue import BatchQueue, batches_in_flight
from pagefold.executor.runner_builder import build_runner
from pagefold.kernels import dispatch
from pagefold.layers.attention_block import split_heads
from pagefold.lora.manager import LoRAModelManager, adapter_checker
from pagefold.lora.request import LoRARequest
from pagefold.models.registry import model_class
from pagefold.models.weights import apply_checkpoint_kv_scales
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.offload.setup import OffloadPlan, attach_offload, offload_plan
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams
from pagefold.spec_decode.config import check_model_supports
from pagefold.spec_decode.draft_model import draft_layer_specs
from pagefold.spec_decode.eagle import eagle_layer_specs, load_eagle_config
from pagefold.spec_decode.engine import SpecDecoder
from pagefold.spec_decode.mtp import mtp_layer_specs
from pagefold.spec_decode.proposers import build_proposer
from pagefold.spec_decode.verify_support import check_verify_support
from pagefold.structured_output.manager import StructuredOutputManager
from pagefold.transfer.setup import TransferPlan, attach_transfer, transfer_plan

logger = logging.getLogger("pagefold")

def check_tensor_parallel(arch: str, hf_config, tp: int, expert_parallel: bool = False) -> None:
    """Raise a ValueError when ``arch`` cannot run on ``tp`` ranks: an architecture without
    shards (naming the part), or a field that does not divide (naming the field); with
    ``expert_parallel``, an architecture whose experts cannot be placed whole (naming why) or
    an expert count that does not divide (naming both numbers).

    Divisibility is checked the way the ranks will meet it: rank 0's shard of the model is
    built on the meta device (no memory) in this process, so every layer's own check runs
    here, before any worker starts."""
    entry = ARCHITECTURES.get(arch)
    if entry is not None and entry.model is not None and entry.tensor_parallel is not True:
        raise ValueError(f"tensor_parallel_size {tp} is not supported for {arch}: "
                         f"{entry.tensor_parallel}; use tensor_parallel_size 1")
    supported = tensor_parallel_architectures()
    if arch not in supported:
        raise ValueError(f"tensor_parallel_size {tp} is not supported for {arch} yet; "
                         f"supported: {', '.join(supported)}")
    if expert_parallel and isinstance(entry.expert_parallel, str):
        raise ValueError(f"enable_expert_parallel is not supported for {arch}: "
                         f"{entry.expert_parallel}; use tensor parallelism without it")
    tcfg = text_config(hf_config)
    heads = getattr(tcfg, "num_attention_heads", None)
    if heads:
        split_heads(heads, getattr(tcfg, "num_key_value_heads", None) or heads, tp)
    prev, prev_ep = (tp_rank(), tp_size()), expert_parallel_enabled()
    set_tensor_parallel(0, tp)
    set_expert_parallel(expert_parallel)
    try:
        with torch.device("meta"):
            model_class(arch)(tcfg, max_positions=2)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - not a sharding error; the ranks will tell
        logger.debug("meta-device shard check of %s skipped: %s", arch, e)
    finally:
        set_tensor_parallel(*prev)
        set_expert_parallel(prev_ep)


def lora_options(config: EngineConfig) -> tuple[int, int, int] | None:
    """(max_loras, max_lora_rank, max_cpu_loras) with LoRA enabled, else None."""
    if not config.enable_lora:
        return None
    return (config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)


def start_tensor_parallel(config: EngineConfig, arch: str, dtype, max_positions: int, device,
                          kv_config: KVCacheConfig, cache_fill, host_blocks: int, warm: int,
                          warm_len: int, offload: OffloadPlan | None = None,
                          stage_layers: tuple = (), stage_kv_configs: tuple = (),
                          transfer: TransferPlan | None = None, spec_specs: dict | None = None):
    """The worker ranks: ``tensor_parallel_size`` per pipeline stage (``stage_layers`` and
    ``stage_kv_configs`` give each stage's layers and pool; empty without a pipeline)."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    threads = config.threads_per_rank or max(1, torch.get_num_threads() // world)
    init = WorkerInit(config.model, arch, dtype, max_positions, str(device), kv_config,
                      cache_fill, host_blocks, threads, warm, warm_len, config.quantization,
                      cpu_gemv_kernel=config.cpu_gemv_kernel, offload=offload,
                      expert_parallel=config.enable_expert_parallel,
                      pipeline_parallel_size=config.pipeline_parallel_size,
                      stage_layers=tuple(stage_layers),
                      stage_kv_configs=tuple(stage_kv_configs), transfer=transfer,
                      lora=lora_options(config), speculative=config.speculative_config,
                      spec_specs=spec_specs or {})
    return TPExecutor(init, world)


__all__ = ["EngineCore", "EngineCoreOutput"]


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


class EngineCore:
    def __init__(self, config: EngineConfig, *, cache_fill: float | None = None) -> None:
        self.config = config
        self.device = config.resolve_device()
        arch, hf_config = load_hf_config(config.model)
        tcfg = text_config(hf_config)
        self.hf_config = hf_config
        self.arch = arch
        self.dtype = resolve_dtype(config.dtype, getattr(tcfg, "dtype", None)
                                   or getattr(hf_config, "dtype", None))
        max_pos = getattr(tcfg, "max_position_embeddings", None) or 4096
        self.max_model_len = resolve_max_model_len(
            config.max_model_len, tcfg, allow_long=config.allow_long_max_model_len)
        self.max_num_batched_tokens = config.max_num_batched_tokens or 4096
        self.eos_token_id = self._eos_id(hf_config)

        self.tp = config.tensor_parallel_size
        self.pp = config.pipeline_parallel_size
        self.world = self.tp * self.pp  # worker ranks (1: the runner lives in this process)
        if self.tp > 1:  # before anything is sized: an unsplittable part or field is named
            check_tensor_parallel(arch, hf_config, self.tp, config.enable_expert_parallel)
        elif config.enable_expert_parallel:
            logger.info("enable_expert_parallel with tensor_parallel_size 1: every expert "
                        "stays on the one rank")
        specs = layer_specs_from_config(
            hf_config, model_dtype=self.dtype, kv_cache_dtype=config.kv_cache_dtype,
            mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype, tensor_parallel_size=self.tp)
        spec_specs = self._speculative_specs(hf_config, specs)
        specs = {**specs, **spec_specs}  # a draft model's / MTP's caches share the pool
        memory = pool_bytes(config, self.device, request_bytes=self._request_bytes(specs))
        if config.kv_cache_memory is None:
            logger.info("block pool: %.1f MiB (gpu_memory_utilization %s on %s)",
                        memory / 2**20, config.gpu_memory_utilization, self.device.type)
        self.stage_layers, stage_kv_configs = [], []
        if self.pp > 1:
            # Each stage's pool over its own layers; the scheduler's block tables address all.
            self.stage_layers, self.kv_config, stage_kv_configs = plan_pipeline(
                arch, tcfg, specs, config.block_size, int(memory), self.pp, self.tp)
            for i, ((a, b), c) in enumerate(zip(self.stage_layers, stage_kv_configs)):
                logger.info("pipeline stage %d: layers %d-%d, %d blocks x %d tensors of %d-byte "
                            "pages", i, a, b - 1, c.num_blocks, c.layers_per_group, c.page_bytes)
            # The whole-model report over the blocks every stage holds.
            memory = (self.kv_config.num_blocks * self.kv_config.layers_per_group
                      * self.kv_config.page_bytes)
        else:
            self.kv_config = plan_pagefold(specs, config.block_size, int(memory))
        check_pool_fits(self.kv_config, int(memory), self.max_model_len)
        self.kv = KVCacheManager(self.kv_config,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 checkpoint_interval=config.state_checkpoint_interval)
        log_capacity(logger, capacity_report(
            specs, layout="pagefold", memory_bytes=int(memory), max_model_len=self.max_model_len,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=self.max_num_batched_tokens))
        logger.info("%s: %s weights, kv cache %s, max_model_len %d, max_num_batched_tokens %d",
                    arch, self.dtype, kv_dtype(config.kv_cache_dtype, self.dtype),
                    self.max_model_len, self.max_num_batched_tokens)
        host_blocks = config.swap_space // (self.kv_config.layers_per_group
                                            * self.kv_config.page_bytes)
        max_positions = max(self.max_model_len, max_pos)
        offload = offload_plan(config, self.kv_config, model_dtype=self.dtype)
        transfer = transfer_plan(config, self.kv_config, model_dtype=self.dtype)
        warm = self.max_num_batched_tokens if config.warm_up else 0
        warm_len = min(self.max_model_len, 256)
        gemv_choice.set_forced(config.cpu_gemv_kernel)  # before the linears are routed
        if self.world == 1:
            self.runner = build_runner(config.model, hf_config, arch, self.dtype,
                                       max_positions, self.device, self.kv_config,
                                       cache_fill=cache_fill, num_host_blocks=host_blocks,
                                       quantization=config.quantization)
            self.model = self.runner.model
            self.runner.proposer = build_proposer(
                config.speculative_config, config.model, self.model, hf_config, self.dtype,
                max_positions, self.device, spec_specs)
            if config.speculative_config is not None:
                state_layers = {n for n, s in specs.items() if isinstance(s, StateSpec)}
                check_verify_support(self.model, state_layers)
                draft = getattr(self.runner.proposer, "model", None)
                if draft is not None:
                    check_verify_support(draft, state_layers, "the draft model")
            if self.device.type == "cuda" and dispatch.use_triton(self.device):
                # Decode steps replayed from CUDA graphs (captured per bucket on first use).
                self.runner.enable_cuda_graphs(min(config.max_num_seqs, 256),
                                               self.max_model_len)
        else:
            self.model = None  # the ranks hold the shards
            self.runner = start_tensor_parallel(
                config, arch, self.dtype, max_positions, self.device, self.kv_config,
                cache_fill, host_blocks, warm, warm_len, offload, self.stage_layers,
                stage_kv_configs, transfer, spec_specs)
            logger.info("tensor parallel %d x pipeline parallel %d: %d ranks (pids %s)",
                        self.tp, self.pp, self.world, self.runner.pids)
        # Image inputs: a vision tower was built and loaded (on every rank under tensor
        # parallelism; not across pipeline stages).
        self.takes_images = self.pp == 1 and bool(
            self.runner.encoders is not None if self.world == 1
            else getattr(self.runner, "takes_images", False))
        self.loras = None  # the host cache of checked adapters (LoRA on)
        if config.enable_lora:
            _, rank, cpu = lora_options(config)
            self.loras = adapter_checker(arch, hf_config, self.model, rank, cpu)
            if self.world == 1:
                self.runner.lora = LoRAModelManager(
                    self.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                    cache=self.loras)
                self.runner.graphs = None  # decode graphs would hold no adapter terms
        if config.kv_cache_dtype == "fp8" and self.world == 1:
            n = apply_checkpoint_kv_scales(Path(config.model), self.runner.cache)
            logger.info("fp8 kv cache: %d layers take the checkpoint's k/v scales, the others "
                        "calibrate on the first batch", n)
        # Checkpoints inside the state layers' kernels when every state layer can take them
        # (on every rank); otherwise prefill chunks end at checkpoint targets.
        self.kv.capture_in_kernel = (config.state_checkpoints_in_kernel
                                     and self.runner.captures_in_kernel)
        self.kv.attach_swap(host_blocks, config.preemption_mode,
                            PreemptionCost(flops_per_token=2.0 * self.runner.weight_elements))
        # Offload tiers (host memory, disk) for the prefix cache: a KV connector.
        self.offload = attach_offload(offload, self.kv, self.runner)
        # Prefill/decode disaggregation: pages pulled from / exported to another engine.
        self.transfer = attach_transfer(transfer, config, self.kv, self.runner)
        if host_blocks:
            logger.info("swap space: %d host blocks (%.2f GiB), preemption mode %s",
                        host_blocks, config.swap_space / 2**30, config.preemption_mode)
        self.structured = self._structured_output_manager()
        self._warn_if_caching_impossible(self.kv.min_blocks_for(self.max_model_len))
        self.spec = None
        if config.speculative_config is not None:
            self.spec = SpecDecoder(
                config.speculative_config, self.max_model_len,
                has_state=any(isinstance(g.spec, StateSpec) for g in self.kv_config.groups))
            logger.info("speculative decoding: %s", config.speculative_config.to_dict())
        self.scheduler = Scheduler(
            self.kv, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            policy=config.scheduling_policy)
        self.scheduler.drafter = self.spec  # drafts before, counters after each step
        self.scheduler.max_loras = config.max_loras if config.enable_lora else None
        self.scheduler.structured = self.structured
        self.scheduler.burst = BurstPolicy(self._burst_budget())
        # Pipeline parallelism: up to one step message per stage in flight (batch_queue.py).
        self.batches = (BatchQueue(self.scheduler, self.runner, batches_in_flight(self.pp))
                        if self.pp > 1 else None)
        if warm and self.world == 1:
            secs = self.runner.warm_up(warm, seq_len=warm_len)
            logger.info("warm-up: one %d-token forward in %.2f s (first batches start warm)",
                        warm, secs)

    @contextmanager
    def single_steps(self):
        """One token per request per step while inside: decode bursts off (a driver that
        reads every token as it comes, as the offline beam search does), restored after."""
        policy = self.scheduler.burst
        self.scheduler.burst = BurstPolicy()
        try:
            yield
        finally:
            self.scheduler.burst = policy

    def _burst_budget(self) -> float:
        """Seconds a decode burst may take (``core/decode_burst.py``): ``decode_burst_ms``,
        or 0 (no bursts) with speculative decoding, several ranks or a KV connector (their
        steps exchange per-token state a burst would skip)."""
        config = self.config
        if (config.decode_burst_ms <= 0 or self.spec is not None or self.world > 1
                or self.offload is not None or self.transfer is not None):
            return 0.0
        logger.info("decode bursts: up to %d decode steps in one message while they fit "
                    "%.1f ms and nothing waits", MAX_STEPS, config.decode_burst_ms)
        return config.decode_burst_ms / 1e3

    def _speculative_specs(self, hf_config, specs) -> dict:
        """The cache specs a draft model, MTP or EAGLE heads add to the pool (``{}`` for n-gram);
        raises ``ValueError`` when the model cannot use the configured method."""
        sc = self.config.speculative_config
        if sc is None:
            return {}
        check_model_supports(sc, hf_config)
        if sc.method == "ngram":
            return {}
        if sc.method == "mtp":
            return mtp_layer_specs(specs, text_config(hf_config))
        if not Path(sc.model).is_dir():
            raise ValueError(f"speculative_config 'model' {sc.model!r} is not a local model "
                             f"folder")
        if sc.method in ("eagle", "eagle3"):
            return eagle_layer_specs(specs, load_eagle_config(sc.model), sc.method,
                                     kv_dtype(self.config.kv_cache_dtype, self.dtype),
                                     self.config.block_size, self.tp)
        draft_arch, draft_cfg = load_hf_config(sc.model)
        check_model_supports(sc, hf_config, draft_cfg)
        if self.tp > 1:  # the draft is sharded like the target: its fields must divide too
            check_tensor_parallel(draft_arch, draft_cfg, self.tp)
        dspecs = layer_specs_from_config(
            draft_cfg, model_dtype=self.dtype, kv_cache_dtype=self.config.kv_cache_dtype,
            mamba_ssm_cache_dtype=self.config.mamba_ssm_cache_dtype,
            tensor_parallel_size=self.tp)
        return draft_layer_specs(specs, dspecs, self.config.block_size)

    def save_prefixes(self) -> None:
        """With offload tiers and no request left: save every prefix the pool caches (the
        tiers hold what was evicted already), so a restart on the same directory finds them."""
        if self.offload is not None and not self.scheduler.requests:
            self.flush()  # checkpoint copies still queued land (and unpin) first
            self.kv.offload_cached()
            self.offload.request_drain()  # every rank's queued disk writes land in it
            self.flush()

    def shutdown(self) -> None:
        """Save the pool's cached prefixes to the offload tiers (``save_prefixes``), then stop
        the tensor-parallel ranks (nothing to do in one process)."""
        self.save_prefixes()
        store = getattr(self.runner, "connector", None)  # TP 1: the offload I/O thread
        if store is not None:
            store.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _structured_output_manager(self) -> StructuredOutputManager:
        cfg = self.config
        stops = [t for t in [self.eos_token_id, *generation_eos_ids(cfg.model)] if t is not None]
        return StructuredOutputManager(lambda: load_tokenizer(cfg.tokenizer or cfg.model),
                                       text_config(self.hf_config).vocab_size,
                                       sorted(set(stops)))

    def _request_bytes(self, specs) -> int:
        """Pool bytes one request of max_model_len tokens holds (null block included)."""
        probe = plan_pagefold(specs, self.config.block_size, 1 << 40)
        blocks = KVCacheManager(dataclasses.replace(probe, num_blocks=2)).min_blocks_for(
            self.max_model_len)
        return (blocks + 1) * probe.layers_per_group * probe.page_bytes

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
                    arrival_time: float | None = None,
                    cache_salt: str | None = None,
                    mm_inputs: MultiModalInputs | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue. Raises ValueError (nothing is queued) on bad input.

        ``cache_salt`` keys the request's prefix-cache chain (block hashes and therefore state
        checkpoints): requests with different salts never share a cached block, so one tenant
        cannot learn whether another sent a prompt (vLLM's semantics)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.check_lora(lora_request)
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
        bad = [t for t in params.logprob_token_ids or () if t >= vocab]
        if bad:
            raise ValueError(f"logprob_token_ids out of range [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} {value} is above this engine's max_logprobs "
                                 f"({self.config.max_logprobs})")
        self.structured.check(params)  # compiles (cached) or raises ValueError
        if mm_inputs is not None and mm_inputs.features:
            self._check_images(mm_inputs, prompt_token_ids)
        else:
            mm_inputs = None
        transfer = self._transfer_params(params)
        kw = {} if arrival_time is None else {"arrival_time": arrival_time}
        family = max(params.n, params.best_of or 1)
        if family > 1:
            params = params.clone()
            if params.best_of > params.n and params.logprobs is None:
                params.logprobs = 0  # ranking by cumulative logprob needs each token's logprob
            params.n = params.best_of = 1
            kw.update(fork_children=family - 1, fork_at=n - 1)
        extra: tuple = ()
        if cache_salt is not None:
            extra = ("cache_salt", cache_salt)
        if lora_request is not None:  # an adapter's prefixes are its own (blocks and states);
            # name and path too: offload tiers on disk outlive this process's ids
            extra += ("lora", lora_request.lora_int_id, lora_request.lora_name,
                      str(lora_request.lora_path))
        if extra:
            kw["extra_keys"] = extra
        req = Request(request_id, list(prompt_token_ids), params,
                      eos_token_id=self.eos_token_id, priority=priority, mm_inputs=mm_inputs,
                      lora_request=lora_request, **kw)
        if transfer and transfer.get("do_remote_prefill"):
            self.transfer.expect(req, transfer)  # refused: a warning, then a local prefill
        self.scheduler.add_request(req)
        return req

    def _check_images(self, mm: MultiModalInputs, prompt_token_ids: list[int]) -> None:
        """Images need a vision tower here, and each feature must cover placeholder tokens
        of this prompt (ValueError otherwise)."""
        if not self.takes_images:
            raise ValueError(f"{self.arch} as loaded takes no image inputs"
                             + (" at pipeline_parallel_size > 1" if self.pp > 1 else ""))
        if getattr(self.runner, "proposer", None) is not None:
            raise ValueError("image inputs with draft-model / MTP speculation are not "
                             "supported (their drafters see no images)")
        token = getattr(self.hf_config, "image_token_id", None)
        for i, f in enumerate(mm.features):
            if mm.bidirectional and f.length > self.max_num_batched_tokens:
                raise ValueError(f"image {i} has {f.length} tokens, above "
                                 f"max_num_batched_tokens {self.max_num_batched_tokens}: "
                                 f"{self.arch}'s image tokens attend to each other both ways, "
                                 "so an image is computed in one chunk")
            span = prompt_token_ids[f.offset:f.offset + f.length]
            if f.length < 1 or len(span) != f.length or any(t != token for t in span):
                raise ValueError(f"image {i}: tokens {f.offset}..{f.offset + f.length - 1} "
                                 "are not all image placeholder tokens of the prompt")

    def _transfer_params(self, params: SamplingParams) -> dict | None:
        """``extra_args["kv_transfer_params"]``, checked; ValueError when this engine has no
        ``kv_transfer_config`` to honour it."""
        extra = params.extra_args
        if extra is None:
            return None
        if not isinstance(extra, dict):
            raise ValueError("extra_args must be a dict")
        transfer = extra.get("kv_transfer_params")
        if transfer is None:
            return None
        if not isinstance(transfer, dict):
            raise ValueError("kv_transfer_params must be an object")
        if self.transfer is None and (transfer.get("do_remote_prefill")
                                      or transfer.get("do_remote_decode")):
            raise ValueError("kv_transfer_params needs an engine started with "
                             "--kv-transfer-config (prefill/decode disaggregation)")
        return transfer

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check ``lora_request``'s adapter (cached on the host); a ValueError
        (``LoRAError``) naming what does not fit, or LoRA being off."""
        if self.loras is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} given but LoRA is not "
                             f"enabled; start the engine with enable_lora=True "
                             f"(--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        self.loras.get(lora_request)

    def remove_lora(self, lora_id: int) -> None:
        """Forget adapter ``lora_id`` in the host cache and the runner's slots (TP 1; the
        ranks' own caches keep it until evicted: one id names one adapter)."""
        if self.loras is not None:
            self.loras.drop(lora_id)
        if getattr(self.runner, "lora", None) is not None:
            self.runner.lora.evict(lora_id)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; a parallel-sampling family id aborts all its children too."""
        reqs = self.scheduler.requests
        for rid in request_ids:
            family = [rid] + [c for c, r in reqs.items() if r.parent_id == rid]
            for cid in family:
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)

    # Beam search's operations between steps (the scheduler's).
    def fork_request(self, parent_id: str, child_id: str) -> Request:
        child = self.scheduler.fork_request(parent_id, child_id)
        if self.spec is not None:  # driven token by token from outside: never speculated
            self.spec.exclude(child_id)
        return child

    def replace_last_token(self, request_id: str, token_id: int) -> None:
        r = self.scheduler.requests[request_id]
        self.scheduler.replace_last_token(request_id, token_id)
        if r.sampling_params.structured_outputs is not None:
            self.structured.rollback(r, 1)  # the matcher took the old token
            self.structured.accept(r, token_id)

    def set_paused(self, request_id: str, paused: bool) -> None:
        self.scheduler.set_paused(request_id, paused)
        if self.spec is not None:  # driven token by token from outside: never speculated
            self.spec.exclude(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batches)

    def flush(self) -> None:
        """When no request is left: run the token-free step that copies what the last steps
        queued (a finished request's final state checkpoint), so the pool is whole again."""
        while not self.scheduler.requests and self.has_unfinished():
            self.step()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        if self.batches is not None:  # pipeline parallelism: several messages in flight
            return self.batches.step()
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        return self.scheduler.update_from_output(out, sampled)
