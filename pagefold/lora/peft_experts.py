"""Reading PEFT LoRA on routed experts' stacked parameters (``target_parameters``).

Facts of PEFT's format (``lora.ParamWrapper``, peft 0.21): a targeted 3D parameter of
``E`` experts gets ``lora_A`` (r * E, in) and ``lora_B`` (out, r * E), with ``in`` / ``out``
the expert product's own input and output widths whatever the parameter's storage order;
expert ``e``'s pair is ``A[e*r:(e+1)*r]`` and ``B[:, e::E]`` (``B`` read as (out, r, E)), and
its weight delta ``scaling * B_e @ A_e``. ``r`` and ``lora_alpha`` come from the config
(``rank_pattern`` / ``alpha_pattern`` keyed by the parameter's full name). The saved tensors
are named by module, not by parameter: several parameters of one module nest their wrappers,
the first of the module's parameters (in registration order: ``gate_up_proj`` then
``down_proj``) innermost, so ``<experts>.lora_A.weight`` belongs to the last targeted
parameter and each ``.base_layer`` step goes one parameter back.

The module paths are transformers' (``model.layers.N.mlp.experts``), which pagefold's expert
stacks share (a multimodal checkpoint's ``model.language_model.`` is dropped as for linears).
Every refusal is a :class:`~pagefold.lora.peft.LoRAError` naming the adapter and the thing.
"""

from __future__ import annotations

import math
import re

import torch

from pagefold.layers.lora_experts import PARAMS, ExpertsLayout
from pagefold.lora.errors import LoRAError

_PER_EXPERT = re.compile(r"\.experts\.\d+\.\w+$")  # ``experts.3.gate_proj``: v4 layout


def peft_pattern(patterns: dict, key: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: a pattern matches a name's tail."""
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default


def _targeted(cfg: dict, owner: str) -> list[str]:
    """The parameters of module ``owner`` that the config's ``target_parameters`` name (PEFT's
    match: the full name, or a tail of it after a dot), in registration order."""
    targets = [t for t in cfg.get("target_parameters") or [] if not t.endswith(".weight")]
    return [p for p in PARAMS
            if any(f"{owner}.{p}" == t or f"{owner}.{p}".endswith(f".{t}") for t in targets)]


def _owner(module: str) -> tuple[str, int]:
    """(the wrapped module's path, nesting depth) of a saved LoRA module name."""
    depth = 0
    while module.endswith(".base_layer"):
        module = module.removesuffix(".base_layer")
        depth += 1
    if module.startswith("model.language_model."):
        module = "model." + module.removeprefix("model.language_model.")
    return module, depth


def expert_pairs(name: str, cfg: dict, pairs: dict[str, dict[str, torch.Tensor]],
                 experts: dict[str, ExpertsLayout]) -> dict[tuple[str, str], dict]:
    """Take the expert-parameter pairs out of ``pairs`` (saved module name -> {"A", "B"}):
    ``{(stack path, param): ab}``. Refused: target parameters other than the routed experts'
    ``gate_up_proj`` / ``down_proj``, and targets with no expert stack in this model."""
    # A 2D ``<module>.weight`` target (PEFT maps a router ``gate`` to ``gate.weight``) is saved
    # as a linear's LoRA is: the linears' path reads it.
    per_expert = sorted(m for m in pairs if _PER_EXPERT.search(_owner(m)[0]))
    if per_expert:
        raise LoRAError(f"LoRA adapter {name!r}: per-expert LoRA tensors ({per_expert[0]}, "
                        f"transformers 4's expert linears) are not served; routed experts take "
                        f"PEFT target_parameters adapters on experts.gate_up_proj / "
                        f"experts.down_proj")
    targets = [t for t in cfg.get("target_parameters") or [] if not t.endswith(".weight")]
    if not targets:
        return {}
    bad = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in PARAMS)
    if bad:
        raise LoRAError(f"LoRA adapter {name!r}: target parameters {bad} are not supported "
                        f"(only routed experts' {list(PARAMS)})")
    found: dict[tuple[str, str], dict] = {}
    for module in sorted(pairs):
        owner, depth = _owner(module)
        # transformers names every routed expert stack ``experts``; other modules' pairs
        # (a bare target name matches any module's tail) are the linears'.
        params = _targeted(cfg, owner)
        if not params or (owner not in experts and not owner.endswith(".experts")):
            continue
        if owner not in experts:
            raise LoRAError(f"LoRA adapter {name!r}: target parameters {targets} at {owner!r}: "
                            f"this model has no routed expert stack there to adapt (experts "
                            f"quantized per expert take no adapters; expert stacks: "
                            f"{sorted(experts)[:3] or 'none'}{' ...' if len(experts) > 3 else ''}"
                            f")")
        if depth >= len(params):
            raise LoRAError(f"LoRA adapter {name!r}: {module} nests {depth} wrappers deep but "
                            f"the config targets {params} there")
        found[(owner, params[len(params) - 1 - depth])] = pairs.pop(module)
    return found


def read_expert_part(name: str, cfg: dict, where: tuple[str, str], ab: dict,
                     lay: ExpertsLayout, max_rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A (E, r, in) float32, B (E, out, r) float32 scaled, r) of one targeted parameter,
    checked against the stack: rank, expert count, widths."""
    owner, param = where
    key = f"{owner}.{param}"
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"LoRA adapter {name!r}: {key} has lora_{''.join(ab)} only")
    a, b = ab["A"], ab["B"]
    r = int(peft_pattern(cfg.get("rank_pattern"), key, cfg.get("r", 8)))
    if r > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: {key} has rank {r}, above max_lora_rank "
                        f"{max_rank}")
    e = lay.total
    d_in, d_out = lay.widths(param)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r * e or b.shape[1] != r * e:
        held = f"{a.shape[0] / r:g}" if a.dim() == 2 else "?"
        raise LoRAError(f"LoRA adapter {name!r} does not fit the base model at {key}: lora_A "
                        f"{tuple(a.shape)} and lora_B {tuple(b.shape)} hold {held} experts of "
                        f"rank {r}, the model has {e} experts")
    if a.shape[1] != d_in or b.shape[0] != d_out:
        raise LoRAError(f"LoRA adapter {name!r} does not fit the base model at {key}: lora_A "
                        f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, but each expert's "
                        f"{param} takes {d_in} inputs and has {d_out} outputs (an adapter of "
                        f"another base model?)")
    alpha = peft_pattern(cfg.get("alpha_pattern"), key, cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    a_e = a.float().reshape(e, r, d_in).contiguous()
    b_e = (b.float().reshape(d_out, r, e).permute(2, 0, 1) * scaling).contiguous()
    return a_e, b_e, r
