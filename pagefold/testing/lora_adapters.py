"""Random PEFT LoRA adapters for tests, made and run by ``peft`` itself (the oracle).

:func:`make_adapter` wraps the tiny base model with ``peft.get_peft_model`` (random, non-zero
A and B: ``init_lora_weights=False``), saves the adapter directory with ``save_pretrained``
and keeps the wrapped model; :func:`peft_greedy` decodes greedily with it in float32, one
prompt at a time, recomputing the whole sequence every token (no cache, no batching)."""

from __future__ import annotations

from pathlib import Path

import torch

_models: dict[str, object] = {}


def make_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int,
                 target_modules: list[str], seed: int, alpha: float | None = None,
                 target_parameters: list[str] | None = None) -> Path:
    """``target_parameters``: PEFT's LoRA on parameters (routed experts' stacked
    ``experts.gate_up_proj`` / ``experts.down_proj``), besides ``target_modules``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                     target_modules=target_modules, init_lora_weights=False, lora_dropout=0.0,
                     target_parameters=target_parameters)
    model = get_peft_model(base, cfg).eval()
    out = Path(out_dir)
    model.save_pretrained(str(out))
    _models[str(out.resolve())] = model
    return out


def peft_greedy(adapter_dir: str | Path | None, base_dir: str | Path,
                prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the base model with the adapter (None: the base model alone)."""
    if adapter_dir is None:
        from transformers import AutoModelForCausalLM

        key = str(Path(base_dir).resolve())
        if key not in _models:
            _models[key] = AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32).eval()
        model = _models[key]
    else:
        model = _models[str(Path(adapter_dir).resolve())]
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs
