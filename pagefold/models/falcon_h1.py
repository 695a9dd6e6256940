"""Falcon-H1 (FalconH1ForCausalLM): attention and Mamba-2 side by side in every layer.

Per layer (transformers' FalconH1DecoderLayer)::

    h = input_norm(x)
    x = x + ssm_out_mult * mamba(h) + attn_out_mult * attn(attn_in_mult * h)
    y = x + mlp(pre_ff_norm(x))            mlp = down_mult * down(up(x) * silu(gate_mult * gate(x)))

Embeddings are scaled by ``embedding_multiplier``, logits by ``lm_head_multiplier``; attention
scales its keys by ``key_multiplier`` before RoPE. The Mamba-2 mixer multiplies its input by
``ssm_in_multiplier`` and its projection ``zxbcdt`` piecewise by ``ssm_multipliers`` (the "mup
vector", one factor each for z, x, B, C and dt); its intermediate width may be given
(``mamba_d_ssm``); the output is ``y * silu(z)``, or a grouped gated RMSNorm when
``mamba_rms_norm`` (gate before or after the norm per ``mamba_norm_before_gate``).

Every layer keeps two caches: its K/V pages under ``layers.{i}`` and its Mamba-2 state under
``layers.{i}.mamba`` -- two groups in the one pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import RowCut, column_linear, row_linear, shard_rows
from pagefold.layers.mamba.gated_norm import GatedRMSNorm
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import gather_logits, vocab_embedding
from pagefold.models.llama import CausalLM
from pagefold.models.mamba2_hybrid import Mamba2Config, Mamba2Mixer, dt_limit
from pagefold.ops.conv1d import causal_conv1d
from pagefold.ops.ssd import ssd_scan, ssd_verify

__all__ = ["FalconH1ForCausalLM", "falcon_h1_mamba_dims", "mup_vector"]


def falcon_h1_mamba_dims(cfg) -> tuple[int, int, int]:
    """(intermediate, heads, head_dim) of the Falcon-H1 mixer."""
    inter = cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand
                                                                    * cfg.hidden_size)
    heads = cfg.mamba_n_heads
    head_dim = cfg.mamba_d_head
    if head_dim in (None, "auto"):
        head_dim = inter // heads
    return inter, heads, int(head_dim)


def mup_vector(cfg) -> torch.Tensor:
    """Per-channel factors of the projection ``[z (I) | x (I) | B (GN) | C (GN) | dt (H)]``."""
    inter, heads, _ = falcon_h1_mamba_dims(cfg)
    gn = cfg.mamba_n_groups * cfg.mamba_d_state
    mult = list(cfg.ssm_multipliers or [1.0] * 5)
    sizes = [inter, inter, gn, gn, heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, mult, strict=True)])


class FalconH1Mixer(Mamba2Mixer):
    """The shared Mamba-2 mixer with Falcon-H1's multipliers and optional gated norm."""

    def __init__(self, cfg, layer_name: str) -> None:
        inter, heads, head_dim = falcon_h1_mamba_dims(cfg)
        mcfg = Mamba2Config(
            hidden_size=cfg.hidden_size, num_heads=heads, head_dim=head_dim,
            n_groups=cfg.mamba_n_groups, state_size=cfg.mamba_d_state,
            conv_kernel=cfg.mamba_d_conv, chunk_size=cfg.mamba_chunk_size, eps=cfg.rms_norm_eps,
            dt_limit=dt_limit(cfg), proj_bias=bool(cfg.mamba_proj_bias),
            conv_bias=bool(cfg.mamba_conv_bias), activation=cfg.hidden_act)
        super().__init__(mcfg, layer_name)
        # Tensor parallelism: as the shared mixer (this rank's heads, the one group shared),
        # the multipliers cut like in_proj's rows.
        local = self.cfg.intermediate
        self.out_proj = row_linear(inter, cfg.hidden_size, bias=bool(cfg.projectors_bias),
                                   what="Mamba-2 out_proj")
        if cfg.mamba_rms_norm:
            self.norm = GatedRMSNorm(local, eps=cfg.rms_norm_eps,
                                     group_size=local // self.cfg.n_groups,
                                     norm_before_gate=bool(cfg.mamba_norm_before_gate),
                                     spans_ranks=self.shared_group)
            shard_rows(self.norm.weight, [inter], "Mamba-2 norm")
        else:
            self.norm = None
        self.ssm_in_multiplier = float(cfg.ssm_in_multiplier)
        mup = mup_vector(cfg)
        if tp_size() > 1:
            mup = RowCut(*self.tp_blocks, "Falcon-H1 ssm_multipliers").take(mup)
        self.register_buffer("mup_vector", mup, persistent=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        inter, gn = c.intermediate, c.n_groups * c.state_size
        zxbcdt = self.in_proj(x * self.ssm_in_multiplier) * self.mup_vector.to(x.dtype)
        z, xbc, dt = zxbcdt.split([inter, c.conv_dim, c.num_heads], dim=-1)

        _, meta = ctx.state(self.layer_name)
        states = ctx.load_states(self.layer_name)
        weight = self.conv1d.weight.view(c.conv_dim, c.conv_kernel)
        # A verify step keeps the states after every token (conv window and ssm), as the
        # shared mixer does: the commit selects the accepted one.
        verify = ctx.verify
        xbc, conv_state = causal_conv1d(xbc, weight, self.conv1d.bias, states["conv"],
                                        meta.cu_seqlens, activation="silu",
                                        decode=meta.all_decode, verify=verify)
        xs, b, cmat = xbc.split([inter, gn, gn], dim=-1)
        A = -torch.exp(self.A_log.float())
        dt = self._dt(dt, meta, verify)
        xs = xs.reshape(t, c.num_heads, c.head_dim)
        if not meta.all_decode and not verify:  # a verify chunk rounds y like decode steps
            xs = xs.float()
        y, ssm_state = (ssd_verify if verify else ssd_scan)(
            xs, dt, A,
            b.reshape(t, c.n_groups, c.state_size), cmat.reshape(t, c.n_groups, c.state_size),
            self.D, states["ssm"].float(), meta.cu_seqlens,
            dt_bias=None, dt_softplus=False, chunk_size=c.chunk_size,
            **({} if verify else {"decode": meta.all_decode}),
        )
        if verify:
            ctx.store_token_states(self.layer_name, {"conv": conv_state, "ssm": ssm_state})
        else:
            ctx.store_states(self.layer_name, {"conv": conv_state, "ssm": ssm_state})
        y = y.reshape(t, inter)
        if self.norm is not None:
            y = self.norm(y, z)
        else:
            y = y * F.silu(z.to(y.dtype))
        return self.out_proj(y.to(x.dtype))


class FalconH1Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=bias, what="attention output")
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_positions)
        self.key_multiplier = float(cfg.key_multiplier)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim) * self.key_multiplier
        q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        o = ctx.attention(self.layer_name, q.contiguous(), k.contiguous(), v, self.scale)
        return self.o_proj(o.reshape(t, self.sizes[0]))


class FalconH1MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        inter, bias = cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False))
        if inter % tp_size():
            raise ValueError(f"intermediate_size ({inter}) is not divisible by "
                             f"tensor_parallel_size {tp_size()}")
        self.inter = inter // tp_size()  # this rank's share
        self.gate_up_proj = column_linear(cfg.hidden_size, {"gate_proj": inter, "up_proj": inter},
                                          bias=bias, what="intermediate_size")
        self.down_proj = row_linear(inter, cfg.hidden_size, bias=bias, what="intermediate_size")
        self.gate_mult, self.down_mult = (float(m) for m in cfg.mlp_multipliers)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported Falcon-H1 MLP activation {cfg.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(up * F.silu(gate * self.gate_mult)) * self.down_mult


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.mamba = FalconH1Mixer(cfg, f"layers.{layer_idx}.mamba")
        self.self_attn = FalconH1Attention(cfg, layer_idx, max_positions)
        self.feed_forward = FalconH1MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_in = float(cfg.attention_in_multiplier)
        self.attn_out = float(cfg.attention_out_multiplier)
        self.ssm_out = float(cfg.ssm_out_multiplier)

    def forward(self, positions, x, ctx):
        h = self.input_layernorm(x)
        m = self.mamba(h, ctx) * self.ssm_out
        a = self.self_attn(positions, h * self.attn_in, ctx) * self.attn_out
        x = x + (m + a)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1Model(DecoderStack):
    """Scaled embeddings -> parallel attention + Mamba-2 layers -> final norm
    (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.build_stack(
            cfg.num_hidden_layers, lambda i: FalconH1DecoderLayer(cfg, i, max_positions),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            norm_name="final_layernorm")

    def embed(self, input_ids):
        return self.embed_tokens(input_ids) * self.embedding_multiplier

class FalconH1ForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, FalconH1Model(cfg, max_positions))
        self.lm_head_multiplier = float(cfg.lm_head_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden), self.vocab_size)
        return (logits * self.lm_head_multiplier).float()
