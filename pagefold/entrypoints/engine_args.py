"""Command-line flags generated from :class:`~pagefold.config.EngineConfig`.

One source of truth: every dataclass field of ``EngineConfig`` becomes a ``--kebab-case``
flag whose type, default and help come from the field itself, so a field added to the config
is a flag at once (no second list to keep in sync). Help text is, in order: an entry of
:data:`HELP`, else the ``#`` comment lines written just above the field in ``config.py``,
else the field's name. Defaults are always shown (``ArgumentDefaultsHelpFormatter``).

Types map as: ``bool`` -> ``--flag`` / ``--no-flag``; ``int`` / ``float`` / ``str`` (also
``X | None``) -> that type, where ``none`` means None for optional fields; ``int | str``
(memory sizes) -> the string, parsed by the config; ``dict`` / ``list`` -> JSON text.

vLLM's spellings are accepted too: :data:`ALIASES` adds extra names for some fields, and
:data:`IGNORED_FLAGS` lists vLLM flags that mean nothing here; they are accepted and logged
(never fatal), so a vLLM launch line starts pagefold unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import re
import types
import typing
from typing import Any

from pagefold.config import EngineConfig

logger = logging.getLogger("pagefold")

# Fields that are not command-line flags (``model`` is the subcommand's positional/--model).
SKIP = {"model"}

# Help for fields whose config comment is missing or too terse for --help.
HELP: dict[str, str] = {
    "tokenizer": "tokenizer directory; none: the model directory",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, bfloat16, "
             "float16",
    "kv_cache_dtype": "KV cache dtype: auto (the model dtype), float32, bfloat16, float16, fp8",
    "kv_cache_memory": "bytes of the KV/state block pool, e.g. 2GiB or 512MiB; when not given "
                       "the pool size follows --gpu-memory-utilization",
    "gpu_memory_utilization": (
        "share of memory for the block pool when --kv-cache-memory is not given. GPU: the "
        "pool gets this fraction of the GPU's total memory minus what is in use after loading "
        "the weights (default 0.9). CPU: the pool gets this fraction of the host's available "
        "memory (MemAvailable after loading the weights), capped at what max_num_seqs "
        "requests of max_model_len tokens can use; when not given on the CPU the pool is "
        "1 GiB"),
    "max_model_len": "longest prompt + output in tokens; none: the model's "
                     "max_position_embeddings",
    "max_num_batched_tokens": "most tokens computed in one step; none: 4096",
    "max_num_seqs": "most requests running at once",
    "block_size": "tokens per attention page",
    "enable_prefix_caching": "reuse cached blocks (and hybrid state checkpoints) of earlier "
                             "prompts with the same prefix",
    "preemption_mode": "how a preempted request gives its blocks back: recompute, swap to "
                       "host memory (needs --swap-space), or auto (cheaper per request)",
    "kv_offloading_size": "GiB of host memory for blocks and state checkpoints evicted from "
                          "the pool (prefix-cache offload tier; vLLM's flag)",
    "kv_offloading_dir": "directory of the disk offload tier (page files with a checksum per "
                         "page, see docs/OFFLOAD_FORMAT.md); a restarted engine serves its "
                         "prefixes from it",
    "kv_offloading_disk_size": "cap of the disk offload tier, e.g. 20GiB (least recently used "
                               "pages deleted first)",
    "swap_space": "host memory for swapped-out blocks, e.g. 4GiB (0: no swap)",
    "state_checkpoint_interval": "tokens between cached recurrent-state checkpoints of hybrid "
                                 "models (a multiple of --block-size)",
    "scheduling_policy": "fcfs, or priority (lower 'priority' values first)",
    "seed": "engine seed (unseeded sampling draws from it)",
    "device": "auto (cuda when available, else cpu), cpu, cuda, cuda:N",
    "mamba_ssm_cache_dtype": "dtype of Mamba-2 SSM states; none: the KV cache dtype",
    "warm_up": "run one forward of max_num_batched_tokens dummy tokens before serving",
    "generation_config": "sampling defaults: 'auto' takes temperature, top_p, top_k, min_p "
                         "and repetition_penalty from the checkpoint's generation_config.json; "
                         "'vllm' uses the engine's neutral defaults; or a folder holding a "
                         "generation_config.json",
    "max_logprobs": "most logprobs (per token, and prompt logprobs) a request may ask for",
}

# Extra spellings of a field's flag (vLLM's names and short forms).
ALIASES: dict[str, list[str]] = {
    "tensor_parallel_size": ["-tp"],
    "pipeline_parallel_size": ["-pp"],
    "data_parallel_size": ["-dp"],
}

# vLLM flags with no effect in pagefold: accepted, logged, never fatal. Value: (takes a value,
# why it is ignored).
IGNORED_FLAGS: dict[str, tuple[bool, str]] = {
    "--enforce-eager": (False, "pagefold has no CUDA graphs to disable; always eager"),
    "--no-enforce-eager": (False, "pagefold is always eager"),
    "--trust-remote-code": (False, "only built-in architectures are loaded; no remote code "
                                   "runs"),
    "--no-trust-remote-code": (False, "no remote code ever runs"),
    "--disable-custom-all-reduce": (False, "no custom all-reduce here"),
    "--disable-frontend-multiprocessing": (False, "the API process is always separate"),
    "--disable-fastapi-docs": (False, "no docs routes are served"),
    "--load-format": (True, "checkpoints are read from safetensors/GGUF as found"),
    "--download-dir": (True, "no model hub access; give a local directory"),
    "--revision": (True, "no model hub access; give a local directory"),
    "--tokenizer-mode": (True, "the Hugging Face fast tokenizer is always used"),
    "--distributed-executor-backend": (True, "one executor backend here"),
    "--max-seq-len-to-capture": (True, "no CUDA graphs"),
    "--compilation-config": (True, "no torch.compile here"),
    "-O": (True, "no torch.compile here"),
    "--enable-chunked-prefill": (False, "prefills are always chunked to fit "
                                        "--max-num-batched-tokens"),
    "--no-enable-chunked-prefill": (False, "prefills are always chunked"),
    "--enable-prompt-tokens-details": (False, "usage.prompt_tokens_details (cached tokens) is "
                                              "always reported"),
    "--enable-server-load-tracking": (False, "GET /load always reports the generation "
                                             "requests in flight"),
    "--skip-tokenizer-init": (False, "the tokenizer is always loaded (token-id prompts and "
                                     "return_token_ids work with it too)"),
    "--show-hidden-metrics-for-version": (True, "no metric is hidden: vLLM's older names are "
                                                "always exported too"),
}


def _field_comments() -> dict[str, str]:
    """The ``#`` comment block just above each field in EngineConfig's source."""
    try:
        lines = inspect.getsource(EngineConfig).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("#").strip())
            continue
        m = re.match(r"([a-z_][a-z0-9_]*)\s*:", s)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _base_type(tp: Any) -> tuple[set[type], bool]:
    """The non-None member types of an annotation and whether None is allowed."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
    else:
        args = (tp,)
    kinds: set[type] = set()
    for a in args:
        if a is type(None):
            continue
        kinds.add(typing.get_origin(a) or a)
    return kinds, type(None) in (typing.get_args(tp) if origin else ())


def _converter(name: str, kinds: set[type], optional: bool):
    """A string -> value function for one field's flag."""
    if kinds & {dict, list}:
        def parse_json(s: str):
            if optional and s.lower() == "none":
                return None
            try:
                return json.loads(s)
            except json.JSONDecodeError as e:
                raise argparse.ArgumentTypeError(f"--{name}: not JSON: {e}") from None
        return parse_json
    if kinds == {int}:
        base = int
    elif kinds == {float} or kinds == {int, float}:
        base = float
    else:  # str, int | str (memory sizes, parsed by the config), anything else
        base = str

    def convert(s: str):
        if optional and s.lower() == "none":
            return None
        try:
            return base(s)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{name.replace('_', '-')}: expected {base.__name__}, got {s!r}") from None
    convert.__name__ = base.__name__
    return convert


def config_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in SKIP and f.init]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (see the module docstring), plus vLLM's no-op flags."""
    hints = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    group = p.add_argument_group("engine (EngineConfig)")
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        kinds, optional = _base_type(hints.get(f.name, str))
        default = _default(f)
        text = HELP.get(f.name) or comments.get(f.name) or f.name.replace("_", " ")
        names = [n for n in (flag, *ALIASES.get(f.name, []))
                 if n not in p._option_string_actions]
        if not names:  # the subcommand defines this flag itself
            continue
        if kinds == {bool}:
            group.add_argument(*names, dest=f.name, default=default, help=text,
                               action=argparse.BooleanOptionalAction)
            continue
        group.add_argument(*names, dest=f.name, default=default, help=text,
                           type=_converter(f.name, kinds, optional),
                           metavar=f.name.upper())
    ignored = p.add_argument_group("accepted for vLLM compatibility (no effect here)")
    for flag, (takes_value, why) in IGNORED_FLAGS.items():
        dest = "ignored_" + flag.lstrip("-").replace("-", "_")
        if flag in p._option_string_actions:
            continue
        if takes_value:
            ignored.add_argument(flag, dest=dest, default=None, help=why, metavar="VALUE")
        else:
            ignored.add_argument(flag, dest=dest, action="store_true", default=None, help=why)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from parsed flags (every field that has a flag)."""
    return {f.name: getattr(args, f.name) for f in config_fields() if hasattr(args, f.name)}


def log_ignored(args: argparse.Namespace) -> list[str]:
    """Log (and return) the vLLM flags given that have no effect here."""
    given = []
    for flag, (_, why) in IGNORED_FLAGS.items():
        dest = "ignored_" + flag.lstrip("-").replace("-", "_")
        if getattr(args, dest, None) is not None:
            given.append(flag)
            logger.info("%s accepted and ignored: %s", flag, why)
    return given
