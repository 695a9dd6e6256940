"""``pagefold capacity PATH ...``: what a KV-cache budget buys for a model, from its config alone.

PATH is a ``config.json`` or a model directory holding one; no weights, no network, and the
config is read as a plain dict, so transformers need not know the model type. A ``.gguf``
file is converted first, as ``LLM`` and ``serve`` load it (``models/gguf_checkpoint.py``: kept
quantized unless ``--quantization`` says otherwise; once, into the pagefold cache), and the
report is that checkpoint's. Prints the
rendered report, or one JSON object with ``--json``. Sizes are per GPU (tensor-parallel rank),
so ``--kv-cache-memory`` is one GPU's budget, as vLLM logs it. For a model pagefold serves,
the report also states the weight bytes a rank holds once loaded (``models/footprint.py``:
quantized layers as their kernel layout holds them, a quantized checkpoint's from its
safetensors headers, ``--quantization fp8|int8|int4`` as quantized on load).

Example (vLLM's numbers for Qwen3.5-27B at TP 2 with an FP8 KV cache)::

    pagefold capacity Qwen3.5-27B/ --tensor-parallel-size 2 --kv-cache-dtype fp8 \
        --kv-cache-memory 52.89GiB --max-model-len 132096 --enable-prefix-caching --layout vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from pagefold.config import parse_bytes, resolve_dtype
from pagefold.core.capacity import LAYOUTS, capacity_report, format_bytes, render_report
from pagefold.core.config_fields import config_model_dtype, unwrap_text_config
from pagefold.core.kv_cache_planner import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.core.vllm_layout import VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS

HELP = "report the KV-cache capacity of a model for a memory budget (needs only config.json)"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a config.json, a model directory that holds one, or a .gguf "
                                "file (converted once, as serve loads it)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE experts placed whole on the ranks (the weight bytes per rank)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="stages of contiguous layers (pagefold layout): each stage's pool, "
                        "with --kv-cache-memory per rank, as the engine builds it")
    p.add_argument(
        "--kv-cache-dtype", choices=("auto", "bfloat16", "float16", "fp8"), default="auto"
    )
    p.add_argument(
        "--kv-cache-memory",
        required=True,
        help="KV-cache budget per GPU: 52.89GiB, 512MiB, 4GB or 1e9 (bytes)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest request (default: the config's max_position_embeddings)",
    )
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False
    )
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's tokens per step: the longest prefill chunk, which sizes what a "
        f"sliding-window or chunked-local layer holds (default: the engine's own, pagefold "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, vLLM {VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="pagefold")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the recurrent (SSM) state (default: the config's, else the model dtype)",
    )
    p.add_argument("--block-size", type=int, default=16, help="attention tokens per page")
    p.add_argument("--quantization", "-q", default=None,
                   help="weights quantized on load (fp8, int8, int4) for the weight bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``capacity`` on an ``argparse`` subparsers object; ``func`` is :func:`run`."""
    p = subparsers.add_parser("capacity", help=HELP, description=HELP)
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def load_config(path: str | Path) -> dict[str, Any]:
    """config.json as a dict, from the file itself or from a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        with p.open(encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} does not hold a JSON object")
    return cfg


def _checkpoint_dir(path: str, quantization: str | None) -> str:
    """``path``, or for a ``.gguf`` file the checkpoint directory ``LLM`` would load (its
    conversion's progress lines go to stderr: ``--json`` prints one object on stdout)."""
    from pagefold.models.gguf_checkpoint import GGUFConversionError, is_gguf, resolve_model
    from pagefold.quantization.config import check_option

    if not is_gguf(path):
        return path
    if quantization:
        check_option(quantization)  # a bad option is refused before any conversion
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return resolve_model(path, quantization=quantization)
    except GGUFConversionError as e:
        raise ValueError(str(e)) from e


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """The capacity report for parsed ``args`` (raises ``ValueError`` with a readable message)."""
    shown = args.path
    args = argparse.Namespace(**{**vars(args), "path": _checkpoint_dir(args.path,
                                                                       args.quantization)})
    cfg = load_config(args.path)
    model_dtype = resolve_dtype(args.dtype, config_model_dtype(cfg))
    max_len = args.max_model_len
    if max_len is None:
        max_len = unwrap_text_config(cfg).get("max_position_embeddings")
        if max_len is None:
            raise ValueError("the config names no max_position_embeddings; pass --max-model-len")
    specs = layer_specs_from_config(
        cfg,
        model_dtype=model_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        # vLLM keeps the speculative tokens' conv rows in each state; pagefold's engine sizes
        # its pool from specs without them (verify states live outside the pool).
        num_speculative_tokens=args.num_speculative_tokens if args.layout == "vllm" else 0,
    )
    memory = parse_bytes(args.kv_cache_memory)
    pipeline = None
    if args.pipeline_parallel_size > 1:
        pipeline, memory = _pipeline(args, specs, memory)
    report = capacity_report(
        specs,
        layout=args.layout,
        memory_bytes=memory,
        max_model_len=int(max_len),
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    report["model"] = {
        "path": str(shown),
        "architectures": cfg.get("architectures"),
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": bool(getattr(args, "enable_expert_parallel", False)),
        "pipeline_parallel_size": args.pipeline_parallel_size,
    }
    if pipeline is not None:
        report["pipeline"] = pipeline
    report["weights"] = _weights(args, model_dtype)
    return report


def _pipeline(args: argparse.Namespace, specs: dict, memory: int) -> tuple[dict, int]:
    """``({"stages": [...]}, the memory whose whole-model plan has the stages' block count)``:
    each stage's layers and pool as the engine builds them (``distributed.pipeline``); the
    model must be one pagefold serves through its shared decoder stack."""
    if args.layout != "pagefold":
        raise ValueError("--pipeline-parallel-size reports pagefold's layout only")
    from pagefold.checkpoint import load_hf_config, text_config
    from pagefold.distributed.pipeline import plan_pipeline

    model_dir = Path(args.path)
    model_dir = model_dir if model_dir.is_dir() else model_dir.parent
    arch, hf_config = load_hf_config(str(model_dir))
    spans, sched, stages = plan_pipeline(arch, text_config(hf_config), specs, args.block_size,
                                         memory, args.pipeline_parallel_size,
                                         args.tensor_parallel_size)
    info = {"stages": [{"layers": [a, b - 1], "num_blocks": c.num_blocks,
                        "layers_per_group": c.layers_per_group,
                        "pool_bytes": c.total_bytes} for (a, b), c in zip(spans, stages)]}
    return info, sched.num_blocks * sched.layers_per_group * sched.page_bytes


def _weights(args: argparse.Namespace, model_dtype) -> dict[str, Any]:
    """``{"bytes": per rank, "quantization": label}``, or ``{"error": why}`` when the model
    cannot be built here (an architecture pagefold does not serve, a config transformers does
    not read). A quantization option pagefold refuses is an error of the whole report."""
    from pagefold.quantization.formats import QuantizationError

    model_dir = Path(args.path)
    model_dir = model_dir if model_dir.is_dir() else model_dir.parent
    try:
        from pagefold.checkpoint import load_hf_config
        from pagefold.models.footprint import weight_bytes

        arch, hf_config = load_hf_config(str(model_dir))
        ep = getattr(args, "enable_expert_parallel", False)
        stages = getattr(args, "pipeline_parallel_size", 1)
        if stages > 1:
            from pagefold.checkpoint import text_config
            from pagefold.distributed.pipeline import split_for

            spans = split_for(arch, text_config(hf_config), stages, args.tensor_parallel_size)
            per_stage = [weight_bytes(model_dir, hf_config, arch, model_dtype, args.quantization,
                                      args.tensor_parallel_size, expert_parallel=ep,
                                      pipeline_stage=(i, stages, span))
                         for i, span in enumerate(spans)]
            label = per_stage[0][1]
            return {"bytes": max(b for b, _ in per_stage), "quantization": label,
                    "per_stage": [b for b, _ in per_stage]}
        nbytes, label = weight_bytes(model_dir, hf_config, arch, model_dtype,
                                     args.quantization, args.tensor_parallel_size,
                                     expert_parallel=ep)
    except QuantizationError:
        raise
    except Exception as e:  # noqa: BLE001 - the KV report stands without the weights
        if args.quantization:
            raise ValueError(f"weight bytes with --quantization {args.quantization}: {e}") from e
        return {"error": str(e)}
    return {"bytes": nbytes, "quantization": label}


def run(args: argparse.Namespace) -> int:
    """Print the report; 0 on success, 1 with a message on stderr when the inputs do not work."""
    try:
        report = build_report(args)
    except ValueError as e:
        print(f"pagefold capacity: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
    else:
        m = report["model"]
        print(
            f"{m['path']}: {', '.join(m['architectures'] or ['?'])}, {m['model_dtype']} weights, "
            f"{m['kv_cache_dtype']} KV cache, tensor parallel {m['tensor_parallel_size']}"
        )
        w = report["weights"]
        if "bytes" in w:
            stages = w.get("per_stage")
            print(f"weights: {format_bytes(w['bytes'])} per rank "
                  f"({w['quantization'] or m['model_dtype']})"
                  + (" on the largest stage; per stage "
                     + ", ".join(format_bytes(b) for b in stages) if stages else ""))
        print(render_report(report))
        for i, st in enumerate(report.get("pipeline", {}).get("stages", [])):
            print(f"pipeline stage {i}: layers {st['layers'][0]}-{st['layers'][1]}, "
                  f"{st['num_blocks']:,} blocks x {st['layers_per_group']} tensors, "
                  f"pool {format_bytes(st['pool_bytes'])} per rank")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``main(["PATH", "--kv-cache-memory", "4GiB", ...])`` (a leading
    ``"capacity"`` is accepted too)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["capacity"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="pagefold capacity", description=HELP)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
