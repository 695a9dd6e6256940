"""The one table of supported architectures: model class, cache-spec family, tensor parallelism.

Every reader takes what it needs from :data:`ARCHITECTURES`: the model loader the class (by
dotted path, imported only when a model is built, so this module and ``core/`` import no
model code), the cache-spec readers (``core/spec_from_config``, ``core/spec_families``) the
family, the engine whether the layers have tensor-parallel shards. A ``config.json`` names
its family either by ``model_type`` (:data:`MODEL_TYPES`) or by an architecture.

Invariants: every entry's ``family`` has a spec reader; an entry without ``model`` is known to
the capacity planner only (its specs can be computed, it cannot be served).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "Architecture", "resolve_architecture",
           "served_architectures", "tensor_parallel_architectures"]


@dataclass(frozen=True)
class Architecture:
    """``family``: how the cache specs are read; ``model``: ``"module:Class"`` of the pagefold
    model (None: specs only); ``tensor_parallel``: True when every layer has shards, else the
    part that does not split (named in the refusal); ``expert_parallel``: True when its MoE
    layers place whole experts on ranks under ``enable_expert_parallel``, False when it has no
    experts (the option changes nothing), else why it is refused."""

    family: str
    model: str | None = None
    tensor_parallel: bool | str = True
    expert_parallel: bool | str = False


def _m(module: str, cls: str) -> str:
    return f"pagefold.models.{module}:{cls}"


# MoE layers that still split every expert's intermediate dimension only.
_EP_NOT_YET = "its experts split by tensor parallelism only (no whole-expert placement yet)"

# The families read by ``core/spec_from_config`` come first, then those read by
# ``core/spec_families`` (the order of the "supported architectures" message).
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("attention", _m("llama", "LlamaForCausalLM")),
    "Qwen2ForCausalLM": Architecture("attention", _m("llama", "Qwen2ForCausalLM")),
    "Qwen3ForCausalLM": Architecture("attention", _m("llama", "Qwen3ForCausalLM")),
    "Qwen3MoeForCausalLM": Architecture("attention"),
    "Qwen3_5ForConditionalGeneration": Architecture(
        "gdn", _m("qwen3_5", "Qwen3_5ForConditionalGeneration")),
    "Qwen3_5ForCausalLM": Architecture("gdn", _m("qwen3_5", "Qwen3_5ForCausalLM")),
    "Qwen3_5MoeForConditionalGeneration": Architecture(
        "gdn", _m("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"), expert_parallel=True),
    "Qwen3_5MoeForCausalLM": Architecture("gdn", _m("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
                                          expert_parallel=True),
    "Qwen3NextForCausalLM": Architecture("gdn", _m("qwen3_next", "Qwen3NextForCausalLM"),
                                         expert_parallel=True),
    "NemotronHForCausalLM": Architecture("nemotron_h",
                                         _m("nemotron_h", "NemotronHForCausalLM"),
                                         expert_parallel=_EP_NOT_YET),
    "GraniteMoeHybridForCausalLM": Architecture(
        "granite", _m("granite_hybrid", "GraniteMoeHybridForCausalLM"), expert_parallel=True),
    "BambaForCausalLM": Architecture("bamba", _m("granite_hybrid", "BambaForCausalLM")),
    "KimiLinearForCausalLM": Architecture("kimi_linear",
                                          _m("kimi_linear", "KimiLinearForCausalLM"),
                                          expert_parallel=True),
    "MiniMaxForCausalLM": Architecture("minimax", _m("minimax", "MiniMaxForCausalLM"),
                                       expert_parallel=True),
    "JambaForCausalLM": Architecture("jamba", _m("jamba", "JambaForCausalLM"),
                                     expert_parallel=True),
    "Zamba2ForCausalLM": Architecture("zamba2", _m("zamba2", "Zamba2ForCausalLM")),
    "FalconH1ForCausalLM": Architecture("falcon_h1", _m("falcon_h1", "FalconH1ForCausalLM")),
    "Lfm2ForCausalLM": Architecture("lfm2", _m("lfm2", "Lfm2ForCausalLM")),
    "Mamba2ForCausalLM": Architecture("mamba2", _m("mamba2", "Mamba2ForCausalLM")),
    "MambaForCausalLM": Architecture("mamba1", _m("mamba1", "MambaForCausalLM")),
    "FalconMambaForCausalLM": Architecture("mamba1", _m("mamba1", "FalconMambaForCausalLM")),
    "Llama4ForCausalLM": Architecture("llama4", _m("llama4", "Llama4ForCausalLM"),
                                      expert_parallel=_EP_NOT_YET),
    "Llama4ForConditionalGeneration": Architecture(
        "llama4", _m("llama4", "Llama4ForConditionalGeneration"), expert_parallel=_EP_NOT_YET),
    "Gemma3ForCausalLM": Architecture("gemma3", _m("gemma3", "Gemma3ForCausalLM")),
    "Gemma3ForConditionalGeneration": Architecture(
        "gemma3", _m("gemma3", "Gemma3ForConditionalGeneration")),
    "GptOssForCausalLM": Architecture("gpt_oss", _m("gpt_oss", "GptOssForCausalLM"),
                                      expert_parallel=True),
}

# config.json ``model_type`` -> family (same order as above).
MODEL_TYPES: dict[str, str] = {
    "llama": "attention",
    "qwen2": "attention",
    "qwen3": "attention",
    "qwen3_moe": "attention",
    "qwen3_5": "gdn",
    "qwen3_5_text": "gdn",
    "qwen3_5_moe": "gdn",
    "qwen3_5_moe_text": "gdn",
    "qwen3_next": "gdn",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granite",
    "bamba": "bamba",
    "kimi_linear": "kimi_linear",
    "minimax": "minimax",
    "jamba": "jamba",
    "zamba2": "zamba2",
    "falcon_h1": "falcon_h1",
    "lfm2": "lfm2",
    "mamba2": "mamba2",
    "mamba": "mamba1",
    "falcon_mamba": "mamba1",
    "llama4_text": "llama4",
    "llama4": "llama4",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt_oss": "gpt_oss",
}


def served_architectures() -> list[str]:
    """Architectures with a pagefold model, sorted."""
    return sorted(a for a, e in ARCHITECTURES.items() if e.model is not None)


def tensor_parallel_architectures() -> list[str]:
    """Served architectures whose every layer has tensor-parallel shards, sorted."""
    return [a for a in served_architectures() if ARCHITECTURES[a].tensor_parallel is True]


def resolve_architecture(config: dict) -> str:
    """The first of a ``config.json``'s ``architectures`` that pagefold serves; raises
    ``ValueError`` listing the served ones."""
    archs = config.get("architectures") or []
    for a in archs:
        entry = ARCHITECTURES.get(a)
        if entry is not None and entry.model is not None:
            return a
    raise ValueError(
        f"unsupported architecture {archs or config.get('model_type')!r}; pagefold supports: "
        f"{', '.join(served_architectures())}"
    )
