"""Which quantization a model loads with: the checkpoint's ``quantization_config`` or the
``quantization`` option (vLLM's ``--quantization``).

``resolve`` returns a :class:`QuantPlan` or None (plain weights). A checkpoint that declares a
format loads its stored tensors as they are (``checkpoint``: the :class:`QuantMethod`); the
option on a plain checkpoint quantizes its linears once loaded (``on_load``: ``fp8``
per-channel, ``int8`` / ``int4`` symmetric with groups of 128 inputs). Every refusal names the
format and what to do: an unknown name, a format pagefold does not load yet, a layout variant
it cannot decode, an option that contradicts the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefold.quantization.formats import AWQ, FP8, GPTQ, PackedInt, QuantizationError, QuantMethod

__all__ = ["QUANTIZATIONS", "ON_LOAD", "QuantPlan", "check_option", "resolve"]

ON_LOAD = ("fp8", "int8", "int4")
CHECKPOINT_FORMATS = ("fp8", "gptq", "awq", "compressed-tensors", "mxfp4", "gguf")
# ``none``: weights as the checkpoint stores them; for a .gguf file, its dequantized bf16
# conversion instead of its blocks (``models/gguf_checkpoint.resolve_model``).
QUANTIZATIONS = tuple(dict.fromkeys(ON_LOAD + CHECKPOINT_FORMATS + ("none",)))
# Named by vLLM users, not loaded by pagefold yet: refused with that said, not as unknown.
NOT_YET = ("bitsandbytes", "marlin", "gptq_marlin", "awq_marlin", "fbgemm_fp8",
           "modelopt", "experts_int8", "hqq")
ON_LOAD_GROUP = 128


@dataclass(frozen=True)
class QuantPlan:
    """``checkpoint``: the stored format's decoder (tensors converted as they load); ``on_load``:
    quantize the plain linears after loading; ``gguf``: a kept-quantized GGUF conversion
    (``quantization.gguf`` loads it); ``label``: for logs and errors."""

    label: str
    checkpoint: QuantMethod | None = None
    on_load: str | None = None
    gguf: bool = False


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _checkpoint_config(hf_config: Any) -> dict | None:
    q = _get(hf_config, "quantization_config")
    if q is None:
        text = _get(hf_config, "text_config")
        q = _get(text, "quantization_config") if text is not None else None
    if q is None:
        return None
    return q if isinstance(q, dict) else dict(q.to_dict() if hasattr(q, "to_dict") else vars(q))


def _compressed_tensors(q: dict) -> QuantPlan:
    groups = [g for g in (q.get("config_groups") or {}).values()
              if any("Linear" in str(t) for t in g.get("targets", []))]
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors: expected one config group targeting Linear "
                                f"layers, found {len(groups)}")
    g = groups[0]
    w = g.get("weights") or {}
    fmt = q.get("format", "")
    if g.get("input_activations"):
        raise QuantizationError(f"compressed-tensors: activation quantization ({fmt}) is not "
                                "supported; weight-only schemes (W4A16, W8A16, FP8 weights) are")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if kind == "float" and bits == 8:
        block = w.get("block_structure")
        return QuantPlan("compressed-tensors fp8", FP8(
            scale=strategy, block=tuple(block) if block else None))
    if kind != "int" or fmt != "pack-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r} with {kind} {bits}-bit "
                                "weights is not supported (pack-quantized int4/int8 and "
                                "float-quantized fp8 are)")
    if not w.get("symmetric", True):
        raise QuantizationError("compressed-tensors: asymmetric integer weights (zero points) "
                                "are not supported")
    group = w.get("group_size") if strategy == "group" else -1
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors: int weight strategy {strategy!r} is not "
                                "supported (group, channel are)")
    act = w.get("actorder") in ("group", "weight", True)
    return QuantPlan(f"compressed-tensors w{bits}a16", PackedInt(bits, group or -1, act))


def _from_checkpoint(q: dict) -> QuantPlan:
    method = str(q.get("quant_method", "")).lower()
    if method == "gptq":
        if q.get("checkpoint_format", "gptq") not in ("gptq", None):
            raise QuantizationError(f"gptq checkpoint_format {q['checkpoint_format']!r} is not "
                                    "supported (the v1 'gptq' layout is)")
        bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))
        return QuantPlan(f"gptq int{bits} g{group}", GPTQ(bits, group, bool(q.get("sym", True))))
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"awq version {version!r} is not supported (gemm is)")
        if not q.get("zero_point", True):
            raise QuantizationError("awq without zero points is not supported")
        bits, group = int(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size",
                                                                        q.get("q_group_size",
                                                                              128)))
        return QuantPlan(f"awq int{bits} g{group}", AWQ(bits, group))
    if method == "fp8":
        block = q.get("weight_block_size")
        if block:
            return QuantPlan("fp8 block", FP8("block", tuple(block)))
        return QuantPlan("fp8", FP8("tensor"))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "mxfp4":  # gpt-oss experts: the model loads its blocks / scales itself
        return QuantPlan("mxfp4 experts")
    if method == "gguf":
        return QuantPlan("gguf", gguf=True)
    if method in NOT_YET:
        raise QuantizationError(f"the checkpoint is {method}-quantized, which pagefold does not "
                                "load yet")
    raise QuantizationError(f"unknown quantization method {method!r} in the checkpoint's "
                            "quantization_config")


def check_option(option: str) -> str:
    """The ``quantization`` option, lower-cased; a name pagefold does not load is refused."""
    opt = option.strip().lower()
    if opt not in QUANTIZATIONS:
        if opt in NOT_YET:
            raise QuantizationError(f"quantization {option!r} is not supported yet; supported: "
                                    f"{', '.join(QUANTIZATIONS)}")
        raise QuantizationError(f"unknown quantization {option!r}; supported: "
                                f"{', '.join(QUANTIZATIONS)}")
    return opt


def resolve(hf_config: Any, option: str | None) -> QuantPlan | None:
    """The quantization for a model: its checkpoint's, or ``option`` on a plain checkpoint."""
    opt = check_option(option) if option else None
    if opt == "none":
        opt = None
    q = _checkpoint_config(hf_config)
    if q is not None:
        plan = _from_checkpoint(q)
        declared = str(q.get("quant_method", "")).lower()
        if opt is not None and opt != declared:
            raise QuantizationError(f"the checkpoint is {declared}-quantized; quantization "
                                    f"{option!r} does not apply to it (leave it unset)")
        return plan
    if opt is None:
        return None
    if opt not in ON_LOAD:
        raise QuantizationError(f"quantization {option!r} needs a checkpoint stored in that "
                                f"format; on a plain checkpoint use one of {', '.join(ON_LOAD)}")
    return QuantPlan(f"{opt} (quantized on load)", on_load=opt)
