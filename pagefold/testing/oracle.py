"""Reference outputs from Hugging Face transformers, used as the oracle in pagefold's tests.

Everything runs in float32 on CPU, one sequence at a time (batch size 1, no padding), so the
oracle is free of padding and batching effects. Loaded models are kept in a small LRU cache keyed
by the resolved model path, so a directory must not be rebuilt in place with different weights
during one process (call :func:`clear_cache` if it is).
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["clear_cache", "hf_greedy", "hf_logprobs", "load_hf_model"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.lru_cache(maxsize=4)
def _load(resolved_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolved_dir, dtype=torch.float32)
    model.eval()
    return model


def load_hf_model(model_dir: str | Path) -> Any:
    """The transformers model in ``model_dir`` (float32, eval mode), loaded once per process."""
    return _load(str(Path(model_dir).resolve()))


# Results are remembered per (model, input): scenarios that agree with HF ask the same questions.
_greedy_memo: dict[tuple, list[int]] = {}
_logprob_memo: dict[tuple, list[dict[int, float]]] = {}


def clear_cache() -> None:
    """Forget every cached model and result (e.g. after rewriting a model directory in place)."""
    _load.cache_clear()
    _greedy_memo.clear()
    _logprob_memo.clear()


def _vocab_width(model: Any) -> int:
    """Number of logits the model produces per position (may exceed ``len(tokenizer)``)."""
    return int(model.get_output_embeddings().weight.shape[0])


def hf_greedy(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = True,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` from transformers' ``generate`` (``do_sample=False``).

    Returns only the generated ids, one list per prompt. With ``ignore_eos`` every list has
    exactly ``max_new_tokens`` ids and eos ids may appear inside it (generation does not stop and
    eos is not suppressed, matching an engine's ``ignore_eos``). Without it, generation stops
    after the first id in ``generation_config.eos_token_id``, which is included in the output.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model = load_hf_model(model_dir)
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    gen_config.num_beams = 1
    gen_config.max_new_tokens = max_new_tokens
    gen_config.min_new_tokens = None
    gen_config.max_length = None
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        setattr(gen_config, name, None)
    if ignore_eos:
        # `generate` fills an eos of None back in from the model's generation_config, and
        # `min_new_tokens` would mask eos out of the argmax. An id one past the last logit can
        # never be produced, so no stopping criterion ever fires and the argmax is untouched.
        gen_config.eos_token_id = [_vocab_width(model)]
        if gen_config.pad_token_id is None:
            gen_config.pad_token_id = 0
    outputs: list[list[int]] = []
    with torch.inference_mode():
        for prompt in prompts:
            if not prompt:
                raise ValueError("prompts must be non-empty")
            key = (str(Path(model_dir).resolve()), tuple(prompt), max_new_tokens, ignore_eos)
            if key in _greedy_memo:
                outputs.append(list(_greedy_memo[key]))
                continue
            input_ids = torch.tensor([prompt], dtype=torch.long)
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen_config,
            )
            _greedy_memo[key] = generated[0, len(prompt) :].tolist()
            outputs.append(list(_greedy_memo[key]))
    return outputs


def hf_logprobs(model_dir: str | Path, token_ids: list[int], top_k: int) -> list[dict[int, float]]:
    """Top-``top_k`` log-probabilities at every position of one teacher-forced forward pass.

    Entry ``i`` maps token id -> log p(token | token_ids[: i + 1]) for the ``top_k`` most likely
    next tokens after position ``i`` (``len(result) == len(token_ids)``). Computed as a float32
    ``log_softmax`` over the full logit row.
    """
    if not token_ids:
        raise ValueError("token_ids must be non-empty")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    key = (str(Path(model_dir).resolve()), tuple(token_ids), top_k)
    if key in _logprob_memo:
        return [dict(d) for d in _logprob_memo[key]]
    model = load_hf_model(model_dir)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.inference_mode():
        # logits_to_keep=0 keeps every position (the default keeps all too, but be explicit).
        logits = model(input_ids, attention_mask=torch.ones_like(input_ids), logits_to_keep=0)
        logprobs = torch.log_softmax(logits.logits[0].float(), dim=-1)
        values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    _logprob_memo[key] = [
        dict(zip(idx.tolist(), val.tolist(), strict=True))
        for idx, val in zip(indices, values, strict=True)
    ]
    return [dict(d) for d in _logprob_memo[key]]
