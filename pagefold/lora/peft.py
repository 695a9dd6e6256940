"""Reading a PEFT LoRA adapter directory and checking it against the base model.

``adapter_config.json`` gives ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``,
``rank_pattern`` / ``alpha_pattern``; ``adapter_model.safetensors`` holds
``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r).
A module name maps to the model's linear as the checkpoint loader maps weights (the model's
``fused_names``: ``q_proj`` -> part ``q_proj`` of ``qkv_proj``). Each part's scaling
(``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into its B. LoRA on routed
experts' stacked parameters (``target_parameters``) is read by :mod:`.peft_experts`.

Every refusal is a :class:`LoRAError` (a ValueError; the server's 400) naming the adapter and
the offending thing: a rank above ``max_lora_rank``, target modules the model has no
LoRA-able linear for, a tensor whose shape does not fit the model (another base model),
features pagefold does not serve (DoRA, biases, ``modules_to_save``, embeddings).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagefold.layers.lora_experts import ExpertsLayout
from pagefold.layers.lora_linear import LinearLayout
from pagefold.lora.errors import LoRAError
from pagefold.lora.peft_experts import expert_pairs, peft_pattern, read_expert_part

PREFIX = "base_model.model."
# The decoder roots one checkpoint may carry under either name.
ROOT_ALIASES = ("model", "backbone")


def _roots(layout: dict) -> set[str]:
    return {path.split(".", 1)[0] + "." for path in layout}


@dataclass
class LoRAAdapter:
    """A checked adapter on the host: ``parts[(module path, part)] = (A (r, in) float32,
    B (rows, r) float32 with the scaling folded in)``, full (unsharded) shapes."""

    lora_id: int
    name: str
    path: str
    rank: int
    parts: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _resolve(module: str, layout: dict[str, LinearLayout],
             fused_names: dict[str, str]) -> tuple[str, str] | None:
    """(layout path, part) for a checkpoint module name, or None."""
    if module.startswith("model.language_model."):  # multimodal checkpoints' text tower
        module = "model." + module.removeprefix("model.language_model.")
    root, _, rest = module.partition(".")
    if root in ROOT_ALIASES and f"{root}." not in _roots(layout):
        # transformers renames a checkpoint's root (Nemotron-H's ``backbone.`` is ``model.``
        # in transformers 5, so PEFT saves ``model.layers.*``); the model keeps the
        # checkpoint's name.
        module = next((f"{r}{rest}" for r in _roots(layout) if r[:-1] in ROOT_ALIASES), module)
    head, _, last = module.rpartition(".")
    target = f"{head}.{fused_names[last]}" if last in fused_names else module
    lay = layout.get(target)
    if lay is None or last not in lay.parts:
        return None
    return target, last


def _read_config(name: str, root: Path) -> dict:
    cfg_file = root / "adapter_config.json"
    if not root.is_dir() or not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {root} is not a PEFT adapter directory (no "
                        f"adapter_config.json)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise LoRAError(f"LoRA adapter {name!r}: {key}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only "
                        f"'none')")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is "
                        f"not supported")
    return cfg


def load_adapter(lora_id: int, name: str, path: str, layout: dict[str, LinearLayout],
                 fused_names: dict[str, str], max_rank: int,
                 convert: Callable[[str, torch.Tensor], Iterable] | None = None,
                 experts: dict[str, ExpertsLayout] | None = None) -> LoRAAdapter:
    """Read and check the adapter at ``path`` against ``layout`` (module path -> layout) and
    the routed expert stacks ``experts`` (path -> layout; :mod:`.peft_experts`: their parts
    are ``(stack path, "gate_up_proj" | "down_proj")`` with A (E, r, in), B (E, out, r)).

    ``convert`` is the model's checkpoint conversion (``convert_weight(name, tensor)``
    yielding ``(name, tensor)`` pairs): a B goes through it as its layer's weight would, so a
    checkpoint layer the model splits by rows (Qwen3-Next's ``in_proj_qkvz`` into
    ``in_proj_qkv`` and ``in_proj_z``) gives each part its rows of B, with the same A."""
    root = Path(path)
    cfg = _read_config(name, root)
    supported = {part for lay in layout.values() for part in lay.parts}
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {root}")
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(.*)\.lora_([AB])(?:\.[\w-]+)?\.weight", key.removeprefix(PREFIX))
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B "
                            f"weight (embeddings, DoRA and biases are not supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    adapter = LoRAAdapter(lora_id, name, str(path), 0)
    for where, ab in expert_pairs(name, cfg, pairs, experts or {}).items():
        a, b, r = read_expert_part(name, cfg, where, ab, experts[where[0]], max_rank)
        adapter.parts[where] = (a, b)
        adapter.rank = max(adapter.rank, r)
    served: set[str] = set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has rank {r}, above "
                            f"max_lora_rank {max_rank}")
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)}, not (r, in) and (out, r)")
        alpha = peft_pattern(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        pieces = [(f"{module}.weight", b)]
        if convert is not None:
            try:
                pieces = list(convert(f"{module}.weight", b))
            except (RuntimeError, ValueError) as e:  # rows that do not reshape: wrong model
                raise LoRAError(f"LoRA adapter {name!r} does not fit the base model at "
                                f"{module}: lora_B {tuple(b.shape)} ({e})") from None
        for piece_name, b_part in pieces:
            sub_module = piece_name.removesuffix(".weight")
            where = _resolve(sub_module, layout, fused_names)
            if where is None:
                raise LoRAError(f"LoRA adapter {name!r}: target module {module!r} has no "
                                f"LoRA-able linear in this model (supported: "
                                f"{sorted(supported)})")
            lay = layout[where[0]]
            part = lay.parts[where[1]]
            if a.shape[1] != lay.in_full or b_part.shape[0] != part.full_rows:
                raise LoRAError(
                    f"LoRA adapter {name!r} does not fit the base model at {module}: lora_A "
                    f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, but the layer takes "
                    f"{lay.in_full} inputs and has {part.full_rows} outputs (an adapter of "
                    f"another base model?)")
            adapter.parts[where] = (a.float().contiguous(),
                                    (b_part.float() * scaling).contiguous())
        served.add(module.rsplit(".", 1)[-1])
        adapter.rank = max(adapter.rank, r)
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - supported - served)
        if unknown:
            raise LoRAError(f"LoRA adapter {name!r}: unknown target modules {unknown}; this "
                            f"model's LoRA-able modules are {sorted(supported)}")
    if not adapter.parts:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return adapter
