"""Qwen3.5's decoder layer on the CPU, bit for bit against its parts run separately: the
gated attention's fused q/k norm + partial RoPE (against the zero-centred per-head RMSNorm,
then RoPE on the first channels) and the residual add fused into the post-mixer norm."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagefold.models.qwen3_5 import GatedAttention, HybridDecoderLayer, dense_mlp


class _Capture:
    """A forward context whose attention keeps q, k, v and returns q."""

    def attention(self, layer, q, k, v, scale):
        self.q, self.k, self.v = q, k, v
        return q.clone()


def _modules_qk(attn: GatedAttention, x: torch.Tensor, positions: torch.Tensor):
    t, d = x.shape[0], attn.head_dim
    qkv = torch.nn.functional.linear(x, attn.qkv_proj.weight)
    qg, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = qg.view(t, attn.num_heads, 2 * d)[..., :d]
    q = attn.q_norm.reference(q)
    k = attn.k_norm.reference(k.reshape(t, attn.num_kv_heads, d))
    cos = attn.rotary.cos[positions].to(x.dtype)[:, None]
    sin = attn.rotary.sin[positions].to(x.dtype)[:, None]
    r = cos.shape[-1]

    def rope(y):
        a, rest = y[..., :r], y[..., r:]
        rh = torch.cat((-a[..., r // 2:], a[..., : r // 2]), dim=-1)
        return torch.cat((a * cos + rh * sin, rest), dim=-1)

    return rope(q), rope(k)


def _config():
    return SimpleNamespace(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=40,
        intermediate_size=72, hidden_act="silu", layer_types=["full_attention"],
        rms_norm_eps=1e-6, max_position_embeddings=64, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.4, "mrope_section": [2, 2, 0]})


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    """bf16 weights, the float32 RoPE tables kept (as a loaded model has them)."""
    for p in module.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3).to(torch.bfloat16)


def test_fused_qk_norm_rope_equals_modules():
    g = torch.Generator().manual_seed(3)
    attn = GatedAttention(_config(), 0, 64)
    _randomize(attn, g)
    assert attn.rotary.cos.dtype == torch.float32
    x = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    positions = torch.tensor([5, 0, 63, 17, 17, 2, 40])
    ctx = _Capture()
    with torch.no_grad():
        attn(positions, x, ctx)
        q_ref, k_ref = _modules_qk(attn, x, positions)
        assert torch.equal(ctx.q, q_ref)
        assert torch.equal(ctx.k, k_ref)
        attn(positions.expand(3, -1), x, ctx)  # M-RoPE rows (equal): the modules' path
        assert torch.equal(ctx.q, q_ref)
        assert torch.equal(ctx.k, k_ref)


def test_layer_fused_residual_norm_equals_separate_add():
    g = torch.Generator().manual_seed(4)
    cfg = _config()
    layer = HybridDecoderLayer(cfg, 0, 64, dense_mlp(cfg, 0))
    _randomize(layer, g)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    x_before = x.clone()
    positions = torch.tensor([3, 9, 1, 0, 30])
    with torch.no_grad():
        out = layer(positions, x, _Capture())
        assert torch.equal(x, x_before)  # the sum never lands in the caller's x
        h = layer.self_attn(positions, layer.input_layernorm.reference(x), _Capture())
        x1 = x + h
        ref = x1 + layer.mlp(layer.post_attention_layernorm.reference(x1))
    assert torch.equal(out, ref)
