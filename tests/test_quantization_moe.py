"""Quantized MoE experts (Qwen3-Next: GDN + sparse MoE with a shared expert) against
transformers running the same weights dequantized: a checkpoint storing every expert's
``gate_proj`` / ``up_proj`` / ``down_proj`` quantized (compressed-tensors W4A16 groups of 32,
GPTQ int4 act-order, FP8 with block scales), and ``quantization=int8|int4|fp8`` on load,
which quantizes the experts as it does every linear. The checkpoints and the on-load rule
are ``tests/test_quantization.py``'s (written from the formats' documentation), applied here
to every expert's matrices."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from pagefold import LLM
from tests.test_quantization import (
    _on_load_reference,
    _oracle,
    _pagefold,
    _quantizable,
    write_quantized,
)


def _experts_quantized(model_dir) -> int:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    return sum(len(m.quantized) for m in llm.engine.model.modules()
               if getattr(m, "quantized", None))


@pytest.mark.parametrize("fmt", ["ct-w4a16-g32", "gptq-int4-g32-actorder", "fp8-block"])
def test_quantized_expert_checkpoint_matches_dequantized_transformers(tiny_model_factory,
                                                                      tmp_path, fmt):
    src = tiny_model_factory("qwen3_next")
    # Qwen3-Next's GDN projections are stored in an interleaved row order the loader
    # reshuffles (plain only); its attention, MLP and expert linears quantize.
    write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt, plain=("linear_attn",))
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert any(f"model.layers.0.mlp.experts.3.down_proj.{t}" in stored
               for t in ("scales", "weight_scale", "weight_scale_inv"))
    assert _pagefold(tmp_path / "q") == _oracle(tmp_path / "ref")
    assert _experts_quantized(tmp_path / "q") == 4 * 4  # 4 experts in each of 4 layers


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quantization_on_load_quantizes_experts(tiny_model_factory, tmp_path, kind):
    src = tiny_model_factory("qwen3_next")
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    out = {k: (_on_load_reference(t.float(), kind).to(t.dtype)
               if _quantizable(k, t, 1, 8) else t) for k, t in tensors.items()}
    assert any(".experts.2.up_proj" in k and not out[k].equal(tensors[k]) for k in out)
    save_file(out, str(ref / "model.safetensors"))
    assert _pagefold(src, quantization=kind) == _oracle(ref)


def test_quantized_qwen3_next_gdn_projections_are_refused(tiny_model_factory, tmp_path):
    """Their rows are reshuffled on load (plain only): a quantized one is an error naming it."""
    write_quantized(tiny_model_factory("qwen3_next"), tmp_path / "q", tmp_path / "r",
                    "ct-w8a16-channel")
    with pytest.raises(ValueError, match=r"linear_attn\.in_proj_(qkvz|ba)\.weight_\w+: "
                                         r"Qwen3-Next's Gated DeltaNet input projections"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
