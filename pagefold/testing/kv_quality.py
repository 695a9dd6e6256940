"""KV cache quality on real text: next-token distributions of a teacher-forced prompt.

:func:`prompt_logprobs` runs one prompt through an :class:`~pagefold.LLM` (the engine's own
scheduler, chunked prefill and cache, so an FP8 cache is read back for every chunk after the
first) and returns the log-softmax of the logits at every prompt position, captured from the
model's hidden states. :func:`mean_kl` compares two such runs: the figure BENCHMARKS.md and
``tests/test_smollm2.py`` report for FP8 against the bf16 cache.
"""

from __future__ import annotations

import torch

from pagefold.sampling_params import SamplingParams

# Real prose (written for pagefold, not from any model's data) for KV quality measurements.
SAMPLE_TEXT = (
    "The river town woke slowly. Fishermen carried their nets down to the water while the "
    "baker opened his shutters and the smell of fresh bread drifted over the square. Children "
    "ran past the fountain on their way to school, and an old man fed the pigeons from a paper "
    "bag, as he had done every morning for thirty years. By noon the market was full: farmers "
    "sold apples, cheese and honey, a woman played the violin near the church, and tourists "
    "photographed the stone bridge that had stood since the fourteenth century. In the "
    "afternoon clouds gathered over the hills, and by evening a gentle rain fell on the red "
    "roofs, washing the dust from the streets.")


def prompt_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) float32 log-probabilities of the next token at each position.

    The prompt must run alone and miss the prefix cache (every position is computed)."""
    model = llm.engine.runner.model
    rows: list[torch.Tensor] = []
    original = model.forward

    def capture(input_ids, positions, ctx):
        hidden = original(input_ids, positions, ctx)
        rows.append(hidden.detach().clone())
        return hidden

    model.forward = capture
    try:
        llm.generate({"prompt_token_ids": list(token_ids)},
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        del model.forward  # back to the class's method
    hidden = torch.cat(rows)
    if hidden.shape[0] != len(token_ids):
        raise ValueError(f"captured {hidden.shape[0]} rows for {len(token_ids)} tokens: run a "
                         "prompt the prefix cache does not hold, alone")
    with torch.inference_mode():
        return model.compute_logits(hidden).float().log_softmax(-1)


def mean_kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position, from log-probabilities (T, vocab) -> (T,)."""
    return (ref.exp() * (ref - other)).sum(-1)
