"""The weight bytes one rank of a model holds once loaded, without loading it.

``weight_bytes`` builds the model on the meta device (this rank's shard, no memory) and counts
every parameter once in the model dtype, except the linears that load quantized: those count
what their kernel layout holds (``quantization.int_kernel.IntWeight``: per output row the codes,
4-bit two to a byte, FP8 and 8-bit one byte, and a float32 scale and zero per group), or the
checkpoint's tensors for a layout the kernel does not take (FP8 blocks not dividing the
inputs). Which linears: with ``--quantization fp8|int8|int4`` every one ``quantize_loaded``
converts; for a quantized checkpoint those whose tensors the checkpoint stores in its format
(read from the safetensors headers, nothing else). A GPTQ act-order layer split over rows of
ranks may pad its groups (``quantization.tp``): not counted (a few percent of that layer).

A kept-quantized GGUF conversion (``models/gguf_checkpoint.py``) counts each linear or
embedding whose weight it stores as GGUF blocks (``<module>.gguf_<type>`` in its safetensors
headers, fused shards by the model's ``fused_names``) as ``GGUFWeight`` holds it
(``quantization.gguf_kernel.layout_bytes``: codes, scales and mins in the kernel layout of its
parts' types), a tied head once with its embedding table. MoE experts that pagefold's reader
stores per expert (``<experts>.<e>.<proj>.gguf_<type>``: kept quantized,
``quantization/experts.py``; Granite-4.0-H's below its MoE block's ``experts``) count per
expert a ``gate_up_proj`` and a ``down_proj`` GGUF layer of that expert's types; experts
stored stacked (``gguf_dequant_``: decoded on load, as transformers' reader's are) and the
other tensors (norms, routers) count in the model dtype; under tensor parallelism a rank's
part of each expert, under expert parallelism its whole experts. A row-parallel split inside
a GGUF block (the engine refuses it) is a ``ValueError``, not a figure.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagefold.architectures import ARCHITECTURES
from pagefold.distributed.parallel_state import (
    expert_parallel_enabled,
    pp_layers,
    pp_size,
    pp_stage,
    set_expert_parallel,
    set_pipeline_stage,
    set_tensor_parallel,
    tp_rank,
    tp_size,
)
from pagefold.layers.linear import RowParallelLinear
from pagefold.layers.moe import MoEExperts
from pagefold.models.registry import build_model, model_class
from pagefold.models.weights import safetensors_files
from pagefold.quantization.config import ON_LOAD_GROUP, QuantPlan, resolve
from pagefold.quantization.formats import FP8, IntFormat, PackedInt, QuantMethod
from pagefold.quantization.gguf import DEQUANT_PREFIX, EMBEDDINGS, KEEP_PREFIX, LINEARS
from pagefold.quantization.gguf_blocks import BLOCK
from pagefold.quantization.gguf_kernel import layout_bytes

__all__ = ["linear_bytes", "weight_bytes"]


def linear_bytes(method: QuantMethod, n: int, k: int) -> int:
    """Bytes a quantized linear of ``n`` outputs and ``k`` inputs holds once loaded."""
    layout_ok = getattr(method, "kernel_layout", None)
    if isinstance(method, IntFormat) and (layout_ok is None or layout_ok(k)):
        if isinstance(method, FP8):
            groups = k // method.block[1] if method.scale == "block" else 1
        else:
            size = getattr(method, "group_size", -1)
            groups = 1 if size in (-1, 0, None) else k // size
        codes = n * ((k + 1) // 2) if method.bits == 4 else n * k
        return codes + 8 * n * groups
    return sum(math.prod(s.shape) * s.dtype.itemsize
               for s in method.params(n, k, "?").values())


def _tail(name: str) -> str:
    """A layer's name from ``layers.`` on (prefixes differ between checkpoint and model)."""
    i = name.find("layers.")
    return name[i:] if i >= 0 else name


def _checkpoint_layers(model_dir: Path, method: QuantMethod | None) -> set[str]:
    """Tails of the checkpoint's layers stored in ``method``'s format (and of its MXFP4
    tensors, whole names)."""
    names = method.tensor_names() - {"bias"} if method is not None else set()
    out = set()
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith("_blocks"):
                    out.add(_tail(key))
                prefix, _, leaf = key.rpartition(".")
                if leaf not in names:
                    continue
                if leaf == "weight" and fh.get_slice(key).get_dtype() != "F8_E4M3":
                    continue
                out.add(_tail(prefix))
    return out


def _gguf_layers(model_dir: Path, rename: dict[str, str]) -> dict[str, list[str]]:
    """A kept-quantized GGUF conversion's layers held as GGUF blocks: module path (as the
    model names it once ``rename`` fuses shards) -> the GGUF types of its tensors."""
    out: dict[str, list[str]] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                prefix, _, leaf = key.rpartition(".")
                if not leaf.startswith(KEEP_PREFIX) or leaf.startswith(DEQUANT_PREFIX):
                    continue
                parts = prefix.split(".")
                for i, part in enumerate(parts):
                    if part in rename:  # as ``load_into`` routes a fused layer's shards
                        parts[i] = rename[part]
                        break
                out.setdefault(".".join(parts), []).append(leaf[len(KEEP_PREFIX):].upper())
    for key, kinds in list(out.items()):  # a model prefix other than the checkpoint's
        if "layers." in key:
            out.setdefault(_tail(key), kinds)
        elif "." in key:  # a top-level module (Nemotron-H: model.embeddings -> backbone.)
            out.setdefault("*." + key.split(".", 1)[1], kinds)
    return out


def _gguf_kinds(path: str, layers: dict[str, list[str]]) -> list[str] | None:
    kinds = layers.get(path)
    if kinds is None and "layers." in path:
        return layers.get(_tail(path))
    if kinds is None and "." in path:
        return layers.get("*." + path.split(".", 1)[1])
    return kinds


def _gguf_bytes(path: str, mod: nn.Module, layers: dict[str, list[str]]) -> int | None:
    """Bytes the GGUF layer replacing ``mod`` holds (None: ``mod`` loads plain)."""
    if type(mod) in LINEARS:
        n, k = mod.out_features, mod.in_features
    elif type(mod) in EMBEDDINGS:
        n, k = mod.num_embeddings, mod.embedding_dim
    else:
        return None
    kinds = _gguf_kinds(path, layers)
    if not kinds:
        return None
    cut = [c for c in kinds if k % BLOCK[c]] if isinstance(mod, RowParallelLinear) else []
    if cut:  # the engine refuses this split (``quantization.gguf_tp``): no figure for it
        raise ValueError(f"{path}: tensor parallelism gives each of {tp_size()} ranks {k} of "
                         f"its inputs, which cuts a GGUF {cut[0]} block of {BLOCK[cut[0]]} "
                         "inputs (the file loads with tensor_parallel_size 1)")
    return layout_bytes(kinds, n, k)


def _gguf_experts_bytes(path: str, mod: nn.Module, layers: dict[str, list[str]]
                        ) -> int | None:
    """Bytes of ``mod``'s experts (an ``MoEExperts``, or a model's experts block: its
    ``experts_path``) kept quantized as GGUF layers (None: stacked, decoded)."""
    if mod.experts_path:
        path = f"{path}.{mod.experts_path}"
    count, hidden, inter = mod.expert_dims()
    first = mod.ep.first if mod.ep is not None else 0  # the file names experts globally
    if _gguf_kinds(f"{path}.{first}.down_proj", layers) is None:
        return None
    total = 0
    for e in range(first, first + count):  # each expert by its own types
        gu = _gguf_kinds(f"{path}.{e}.gate_up_proj", layers)
        dn = _gguf_kinds(f"{path}.{e}.down_proj", layers)
        if not gu or not dn:
            raise ValueError(f"{path}: expert {e} is not stored as GGUF blocks like expert 0")
        cut = [c for c in dn if inter % BLOCK[c]]
        if cut:  # as ``quantization.gguf_tp`` refuses it
            raise ValueError(f"{path}: tensor parallelism gives each of {tp_size()} ranks "
                             f"{inter} of its experts' inputs, which cuts a GGUF {cut[0]} "
                             f"block of {BLOCK[cut[0]]} inputs (the file loads with "
                             "tensor_parallel_size 1)")
        total += layout_bytes(gu, 2 * inter, hidden) + layout_bytes(dn, hidden, inter)
    return total


def _on_load(kind: str, full_k: int) -> QuantMethod | None:
    if kind == "fp8":
        return FP8("channel")
    bits = 8 if kind == "int8" else 4
    if full_k % (32 // bits):
        return None
    return PackedInt(bits, ON_LOAD_GROUP if full_k % ON_LOAD_GROUP == 0 else -1)


def _experts_bytes(path: str, mod: MoEExperts, plan: QuantPlan, stored: set[str]) -> int | None:
    """Bytes of quantized experts (per expert a gate_up and a down layer), None: plain."""
    hidden, inter = mod.gate_up_proj.shape[2], mod.inter
    if plan.on_load is not None:
        gu, dn = _on_load(plan.on_load, hidden), _on_load(plan.on_load, mod.full_inter)
    elif _tail(f"{path}.0.down_proj") in stored:
        gu = dn = plan.checkpoint
    else:
        return None
    return mod.num_experts * (linear_bytes(gu, 2 * inter, hidden)
                              + linear_bytes(dn, hidden, inter))


def _quantized(path: str, mod: nn.Module, plan: QuantPlan, stored: set[str]):
    """The format ``mod`` loads in (None: as its plain weight), and its full inputs."""
    if type(mod) not in (nn.Linear, RowParallelLinear):
        return None, 0
    full_k = mod.in_features * (tp_size() if isinstance(mod, RowParallelLinear) else 1)
    if plan.on_load is not None:
        if getattr(mod, "pf_logits", False) or path.endswith("lm_head"):
            return None, 0
        return _on_load(plan.on_load, full_k), full_k
    fused = getattr(mod.weight, "fused", None)
    parent = path.rpartition(".")[0]
    names = [path] + ([f"{parent}.{s}" if parent else s for s in fused.shards]
                      if fused is not None else [])
    return (plan.checkpoint, full_k) if any(_tail(c) in stored for c in names) else (None, 0)


def weight_bytes(model_dir: str | Path, hf_config, arch: str, dtype: torch.dtype,
                 quantization: str | None = None, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False,
                 pipeline_stage: tuple[int, int, tuple[int, int]] | None = None
                 ) -> tuple[int, str | None]:
    """(bytes one rank holds, the quantization's label or None) for the model in
    ``model_dir`` loaded in ``dtype`` with the ``quantization`` option. With
    ``expert_parallel`` rank 0's MoE layers hold their ``E / N`` whole experts (every rank
    holds as many bytes). ``pipeline_stage``: ``(stage, stages, (start, end))``, the bytes of
    a rank of that stage (its layers; the embeddings on the first stage and, tied, the last;
    the final norm and head on the last)."""
    why = ARCHITECTURES[arch].expert_parallel if arch in ARCHITECTURES else None
    if expert_parallel and isinstance(why, str):
        raise ValueError(f"enable_expert_parallel is not supported for {arch}: {why}")
    plan = resolve(hf_config, quantization)
    stored = (_checkpoint_layers(Path(model_dir), plan.checkpoint)
              if plan is not None and plan.on_load is None else set())
    gguf = (_gguf_layers(Path(model_dir), getattr(model_class(arch), "fused_names", None) or {})
            if plan is not None and plan.gguf else {})
    prev, prev_ep = (tp_rank(), tp_size()), expert_parallel_enabled()
    prev_pp = (pp_stage(), pp_size(), pp_layers())
    set_tensor_parallel(0, tensor_parallel_size)
    set_expert_parallel(expert_parallel)
    if pipeline_stage is not None:
        set_pipeline_stage(*pipeline_stage)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(model_class(arch), hf_config, max_positions=2)
        total, seen = 0, set()
        for path, mod in model.named_modules():
            nbytes = _gguf_bytes(path, mod, gguf) if gguf else None
            if nbytes is not None:
                seen.add(id(mod.weight))  # a tied head's weight: counted here, once
                total += nbytes
                continue
            if getattr(mod, "mxfp4", None) is not None and _tail(
                    f"{path}.gate_up_proj_blocks") in stored:
                # gpt-oss MXFP4 experts: per 32 inputs 16 code bytes and one scale byte.
                seen.update((id(mod.gate_up_proj), id(mod.down_proj)))
                total += mod.num_experts * (2 * mod.inter * mod.hidden
                                            + mod.hidden * mod.inter) * 17 // 32
                continue
            if callable(getattr(mod, "install_quantized", None)) and gguf:
                nbytes = _gguf_experts_bytes(path, mod, gguf)
                if nbytes is not None:
                    seen.update(id(w) for w in mod.expert_stacks())
                    total += nbytes
                    continue
            if isinstance(mod, MoEExperts) and plan is not None:
                nbytes = _experts_bytes(path, mod, plan, stored)
                if nbytes is not None:
                    seen.update((id(mod.gate_up_proj), id(mod.down_proj)))
                    total += nbytes
                continue
            method, _ = _quantized(path, mod, plan, stored) if plan else (None, 0)
            if method is None:
                continue
            seen.add(id(mod.weight))
            total += linear_bytes(method, mod.out_features, mod.in_features)
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    finally:
        torch.set_default_dtype(old)
        set_tensor_parallel(*prev)
        set_expert_parallel(prev_ep)
        set_pipeline_stage(*prev_pp)
    return total, (plan.label if plan is not None else None)
