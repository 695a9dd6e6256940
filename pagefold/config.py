"""Engine configuration: one dataclass, validated up front with messages that say what to change."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagefold.json_option import json_object
from pagefold.sampling_params import MAX_LOGPROBS
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.transfer.config import KVTransferConfig

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse ``4GiB``, ``512MiB``, ``1e9``, ``52.89GiB`` or an int into bytes."""
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a memory size from {value!r}; use e.g. 4GiB, 512MiB, 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | str | None) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if isinstance(config_dtype, torch.dtype):
            return config_dtype
        if isinstance(config_dtype, str) and config_dtype in DTYPES:
            return DTYPES[config_dtype]
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    return DTYPES[kv_cache_dtype]


def _mm_limits(value) -> dict | None:
    """``limit_mm_per_prompt`` checked: a dict (or JSON object) of modality -> count >= 0."""
    if value is None:
        return None
    value = json_object(value, "limit_mm_per_prompt")
    for key, n in value.items():
        if key != "image":
            raise ValueError(f"limit_mm_per_prompt: unsupported modality {key!r} (only image)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be an integer >= 0, got {n!r}")
    return dict(value)


@dataclass
class EngineConfig:
    """Everything the engine decides from user input.

    ``kv_cache_memory`` is the byte budget of the block pool; when None the engine sizes it
    with :func:`pool_bytes` from ``gpu_memory_utilization``: on a GPU that fraction of the
    device's memory minus what the weights use (0.9 when not given); on the CPU, when given,
    that fraction of the host's available memory, capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use, else ``DEFAULT_KV_CACHE_MEMORY``.
    ``max_model_len`` None means the model's ``max_position_embeddings``.
    Every field is a ``pagefold serve`` / ``generate`` flag (``entrypoints/engine_args.py``).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # Weight quantization (vLLM's --quantization): None = as the checkpoint stores it (its
    # quantization_config, if any); fp8 / int8 / int4 quantize a plain checkpoint on load.
    quantization: str | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Preemption: "recompute", "swap", or "auto" (per request, by cost); swap needs swap_space.
    preemption_mode: str = "auto"
    swap_space: int | str = 0
    # Offload tiers for the prefix cache (vLLM's --kv-offloading-size, in GiB): blocks and
    # state checkpoints evicted from the pool go to host memory (None/0: no host tier) ...
    kv_offloading_size: float | None = None
    # ... and to page files under this directory (None: no disk tier), capped at
    # kv_offloading_disk_size bytes (least recently used pages deleted first).
    kv_offloading_dir: str | None = None
    kv_offloading_disk_size: int | str = "8GiB"
    # Prefill/decode disaggregation, vLLM's dict (or its JSON): {"kv_connector":
    # "PagefoldConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip",
    # "kv_port", ...}; parsed into a pagefold.transfer.config.KVTransferConfig (None: off).
    kv_transfer_config: Any = None
    # Hybrids: also checkpoint linear-layer states every this many tokens of long prefills.
    state_checkpoint_interval: int = 256
    # Hybrids: take checkpoints inside the state layers' kernels instead of ending prefill
    # chunks at checkpoint targets (same bytes, no extra steps); off only to compare.
    state_checkpoints_in_kernel: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str = "auto"
    mamba_ssm_cache_dtype: str | None = None
    # One forward of max_num_batched_tokens dummy tokens at start-up (cache untouched), so the
    # first real batch does not pay one-time costs.
    warm_up: bool = True
    # Sampling defaults: "auto" (the checkpoint's generation_config.json), "vllm" (neutral),
    # or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Most logprobs per token (and prompt logprobs) a request may ask for.
    max_logprobs: int = 20
    # Tensor parallelism: that many worker processes, one rank each; kv_cache_memory is then
    # per rank (each rank's pool holds its shard of every page).
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the decoder layers split into that many contiguous stages, each of
    # tensor_parallel_size ranks (P x T worker processes); kv_cache_memory is per rank (each
    # stage's pool holds its own layers' pages and states).
    pipeline_parallel_size: int = 1
    # Torch threads per tensor-parallel rank (None: this process's threads / ranks).
    threads_per_rank: int | None = None
    # Expert parallelism (vLLM's flag): MoE layers place whole experts on the tensor-parallel
    # ranks (EP size = tensor_parallel_size; the expert count must divide) instead of splitting
    # every expert's intermediate dimension; shared experts and dense layers stay split.
    enable_expert_parallel: bool = False
    # Speculative decoding, vLLM's dict (or its JSON): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}; parsed into
    # a pagefold.spec_decode.config.SpeculativeConfig (None: off).
    speculative_config: Any = None
    # max_model_len above the model's positions (rope scaling included) is refused unless
    # this is set (or PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN=1), see ``core.model_len``.
    allow_long_max_model_len: bool = False
    # CPU bf16 linears' few-row GEMV for every weight: a kernel (amx, avx512bf16, fma, scalar),
    # flags (the CPU flags' pick, no timing), torch (none), auto (measured per weight shape);
    # none: PAGEFOLD_GEMV, else auto. Larger products keep their GEMM path either way.
    cpu_gemv_kernel: str | None = None
    # Decode bursts: while every running request decodes and nothing waits, up to 16 decode
    # steps run in one engine step as long as they fit this many milliseconds at the measured
    # step time (a small model's per-step overhead paid once); 0 turns them off. Tokens are
    # the same; a request arriving meanwhile waits at most about this long.
    decode_burst_ms: float = 10.0
    # Most multimodal items per prompt, vLLM's dict (or its JSON), e.g. {"image": 2}; only
    # "image" is known. None: 8 images for a checkpoint with a vision tower.
    limit_mm_per_prompt: dict | None = None
    # vLLM's --allowed-local-media-path: chat image_url parts may be file:// URLs of files
    # under this directory (symlinks resolved). None: file URLs are refused (a client must
    # not read the server's files).
    allowed_local_media_path: str | None = None
    # Multi-LoRA serving (vLLM's flags): PEFT adapters per request (LoRARequest), up to
    # max_loras distinct adapters in a step, each of rank up to max_lora_rank; the host keeps
    # max_cpu_loras read adapters (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    DEFAULT_KV_CACHE_MEMORY = 1 << 30

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_user(self.speculative_config)
        self.limit_mm_per_prompt = _mm_limits(self.limit_mm_per_prompt)
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).expanduser()
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} "
                                 "is not a directory")
            self.allowed_local_media_path = str(root.resolve())
        self.kv_transfer_config = KVTransferConfig.from_user(self.kv_transfer_config)
        if self.kv_transfer_config is not None and not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config moves prefix-cache pages between engines; it "
                             "needs enable_prefix_caching")
        if self.cpu_gemv_kernel is not None:
            from pagefold.csrc.gemv_choice import check_option

            self.cpu_gemv_kernel = check_option(self.cpu_gemv_kernel)
        if self.quantization is not None:
            from pagefold.quantization.config import check_option

            self.quantization = check_option(self.quantization)
        if self.block_size < 1 or self.block_size % 16 and self.block_size not in (1, 2, 4, 8):
            raise ValueError(
                "block_size must be a power of two up to 8 or a multiple of 16, got "
                f"{self.block_size}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.state_checkpoint_interval < self.block_size:
            raise ValueError(
                f"state_checkpoint_interval must be at least block_size ({self.block_size}), "
                f"got {self.state_checkpoint_interval}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError("preemption_mode must be 'recompute', 'swap' or 'auto', got "
                             f"{self.preemption_mode!r}")
        self.swap_space = parse_bytes(self.swap_space)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        self.kv_offloading_disk_size = parse_bytes(self.kv_offloading_disk_size)
        if (self.kv_offloading_size or 0) < 0 or self.kv_offloading_disk_size < 0:
            raise ValueError("kv_offloading_size and kv_offloading_disk_size must be >= 0")
        if (self.kv_offloading_size or self.kv_offloading_dir) and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size / kv_offloading_dir offload the prefix cache; "
                             "they need enable_prefix_caching")
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1
                                 or (self.max_cpu_loras or self.max_loras) < self.max_loras):
            raise ValueError(f"max_loras ({self.max_loras}) and max_lora_rank "
                             f"({self.max_lora_rank}) must be >= 1 and max_cpu_loras "
                             f"({self.max_cpu_loras}) at least max_loras")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if not self.decode_burst_ms >= 0:  # NaN too
            raise ValueError(f"decode_burst_ms must be >= 0 (0: no bursts), got "
                             f"{self.decode_burst_ms}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got "
                             f"{self.pipeline_parallel_size}")
        self._check_combinations()
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.max_logprobs}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _check_combinations(self) -> None:
        """Features that cannot run together, refused before anything is built."""
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config is not supported")
        if self.pipeline_parallel_size == 1:
            return
        # A stage holds only its layers: these features need every layer's pages, the whole
        # model's logits or adapters on one rank's layers.
        refused = [
            (self.speculative_config is not None, "speculative decoding"),
            (bool(self.kv_offloading_size or self.kv_offloading_dir),
             "the prefix-cache offload tiers (kv_offloading_size / kv_offloading_dir)"),
            (self.kv_transfer_config is not None,
             "kv_transfer_config (prefill/decode disaggregation)"),
            (self.enable_lora, "enable_lora"),
        ]
        for on, what in refused:
            if on:
                raise ValueError(f"{what} needs pipeline_parallel_size 1, got "
                                 f"{self.pipeline_parallel_size}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def available_host_memory() -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pool_bytes(config: EngineConfig, device: torch.device, *, request_bytes: int) -> int:
    """Bytes of the block pool (see :class:`EngineConfig` for the rule).

    ``request_bytes``: pool bytes one request of ``max_model_len`` tokens holds (the CPU cap:
    the pool never takes more than ``max_num_seqs`` such requests can use)."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    util = config.gpu_memory_utilization
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(int((0.9 if util is None else util) * total) - used, 0)
    if util is None:
        return config.DEFAULT_KV_CACHE_MEMORY
    cap = (request_bytes + 1) * (config.max_num_seqs + 1)
    return max(min(int(util * available_host_memory()), cap), 1 << 20)
