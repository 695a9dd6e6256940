"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention layers and MLA layers, MoE.

Per layer: ``h = x + mixer(input_norm(x))``, ``y = h + ffn(post_attention_norm(h))``.

* KDA (``linear_attention``): ``q, k, v`` projections, each through its own depthwise causal
  conv + silu (one conv state over the concatenated channels), per-channel forget gate
  ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``, ``beta = sigmoid(b_proj(x))``, the delta
  rule (:mod:`pagefold.ops.kda.reference`) with L2-normalised q/k, then a per-head
  RMSNorm gated by ``sigmoid(g_b(g_a(x)))`` and ``o_proj``. State ``StateSpec(kind="kda")``:
  ``conv (3 H D, K - 1)``, ``ssm (H, D, D)`` float32.
* MLA (``full_attention``, no positional encoding): ``q`` (optionally through a LoRA pair with a
  norm), the latent ``[norm(c_kv) | k_rot] = kv_a_proj_with_mqa(x)`` goes to the page
  (:class:`~pagefold.core.kv_cache_spec.MLASpec`); keys and values are expanded from the cached
  latents by ``kv_b_proj`` at attention time (:mod:`pagefold.layers.attention.mla`).
* FFN: dense SwiGLU, or a sigmoid-routed MoE (score-correction bias, group-limited top-k,
  renormalised, scaled) plus shared experts.

Tensor parallelism: KDA heads split (q/k/v rows and their conv channels, the gate's and
beta's per-head rows, ``A_log``, ``dt_bias``, the states); the low-rank ``f_a`` / ``g_a``
projections are replicated. MLA splits query heads (``q_b_proj`` / ``kv_b_proj`` rows), while
the latent (``kv_a_proj_with_mqa``) and its page are the same on every rank, as the planner
sizes it. MoE experts (and the shared experts) split their intermediate dimension, one
all-reduce for both; under expert parallelism the routed experts are placed whole instead
(``layers/expert_parallel.py``), the shared experts' partial sum in the same collective.

Checkpoint names are the original ones (``q_conv1d`` ..., ``f_a_proj`` under ``self_attn``,
``block_sparse_moe``, ``experts.{e}.w1/w3/w2``); transformers' in-memory names are mapped too.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pagefold.core.spec_families import kimi_layer_types
from pagefold.distributed.parallel_state import all_reduce, tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention.mla import paged_mla_attention
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe import MoEExperts
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.nemotron_h import NemotronHRouter
from pagefold.models.qwen3_5 import HybridCausalLM
from pagefold.ops.conv1d import causal_conv1d
from pagefold.ops.kda import kda

__all__ = ["KimiDeltaAttention", "KimiLinearForCausalLM", "KimiMLA"]

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        full, d, hidden = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
        what = "linear_num_heads"
        if full % tp_size():
            raise ValueError(f"linear_num_heads ({full}) is not divisible by "
                             f"tensor_parallel_size {tp_size()}")
        h = full // tp_size()  # this rank's heads
        self.num_heads, self.head_dim, self.kernel = h, d, cfg.linear_conv_kernel_dim
        qkv = h * d
        self.q_proj = column_linear(hidden, full * d, bias=False, what=what)
        self.k_proj = column_linear(hidden, full * d, bias=False, what=what)
        self.v_proj = column_linear(hidden, full * d, bias=False, what=what)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = nn.Conv1d(qkv, qkv, self.kernel, groups=qkv, bias=False,
                             padding=self.kernel - 1)
            shard_rows(conv.weight, [full * d], what)
            setattr(self, name, conv)
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = column_linear(d, full * d, bias=False, what=what)
        self.dt_bias = nn.Parameter(torch.zeros(qkv, dtype=torch.float32))
        shard_rows(self.dt_bias, [full * d], what)
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1))
        shard_rows(self.A_log, [full], what, dim=2)
        self.b_proj = column_linear(hidden, full, bias=False, what=what)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = column_linear(d, full * d, bias=False, what=what)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = row_linear(full * d, hidden, bias=False, what=what)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported Kimi activation {cfg.hidden_act!r}")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        weight = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight,
                            self.v_conv1d.weight)).view(3 * h * d, self.kernel)
        _, meta = ctx.state(self.layer_name)
        states = ctx.load_states(self.layer_name)
        # A verify step keeps the states after every token (conv window and ssm): the commit
        # selects the accepted one.
        mixed, conv = causal_conv1d(mixed, weight, None, states["conv"], meta.cu_seqlens,
                                    activation="silu", decode=meta.all_decode,
                                    verify=ctx.verify)
        q, k, v = (m.reshape(t, h, d) for m in mixed.split(h * d, dim=-1))
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))  # transformers' softplus
        g = -torch.exp(self.A_log.float()).view(h, 1) * g.view(t, h, d)
        beta = torch.sigmoid(self.b_proj(x))
        o, ssm = kda(q, k, v, g, beta, states["ssm"], meta.cu_seqlens, decode=meta.all_decode,
                     verify=ctx.verify)
        if ctx.verify:
            ctx.store_token_states(self.layer_name, {"conv": conv, "ssm": ssm})
        else:
            ctx.store_states(self.layer_name, {"conv": conv, "ssm": ssm})
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        o = self.o_norm.reference(o.to(x.dtype).float()) * torch.sigmoid(gate.float())
        return self.o_proj(o.to(x.dtype).reshape(t, h * d))


class KimiMLA(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        full, hidden = cfg.num_attention_heads, cfg.hidden_size
        if full % tp_size():
            raise ValueError(f"num_attention_heads ({full}) is not divisible by "
                             f"tensor_parallel_size {tp_size()}")
        self.num_heads = full // tp_size()  # this rank's heads; the latent is shared
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        what = "num_attention_heads"
        if cfg.q_lora_rank is None:
            self.q_proj = column_linear(hidden, full * qk, bias=False, what=what)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = column_linear(cfg.q_lora_rank, full * qk, bias=False, what=what)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = column_linear(self.rank, full * (self.nope + self.v_dim), bias=False,
                                       what=what)
        self.o_proj = row_linear(full * self.v_dim, hidden, bias=bias, what=what)
        self.scale = qk**-0.5

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : self.rank]).view(n, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = latent[:, None, self.rank :].expand(n, self.num_heads, self.rope)
        return torch.cat((k_nope, k_rot), dim=-1), v

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), k_rot), dim=-1)
        cache = ctx.cache.attn[self.layer_name]
        meta = ctx.attn_meta[ctx.cache.layer_group[self.layer_name]]
        o = paged_mla_attention(q, latent, cache, meta, self.scale, self._expand)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))


class KimiMoE(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        router_cfg = SimpleNamespace(
            n_routed_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor, hidden_size=cfg.hidden_size)
        self.gate = NemotronHRouter(router_cfg)
        self.experts = MoEExperts(cfg.num_local_experts, cfg.hidden_size,
                                  cfg.moe_intermediate_size)
        self.shared_experts = GatedMLP(cfg.hidden_size,
                                       cfg.moe_intermediate_size * cfg.n_shared_experts,
                                       act=cfg.hidden_act, reduce=False,
                                       what="moe_intermediate_size * n_shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)
        if self.experts.ep is not None:  # expert parallelism: shared partial in one collective
            routed, shared = self.experts.forward_ep(x, idx, w.to(x.dtype),
                                                     self.shared_experts(x))
            return routed + shared
        return all_reduce(self.experts(x, idx, w.to(x.dtype)) + self.shared_experts(x))


class KimiLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, sparse: bool) -> None:
        super().__init__()
        self.self_attn = (KimiMLA(cfg, layer_idx) if kind == "full_attention"
                          else KimiDeltaAttention(cfg, layer_idx))
        self.block_sparse_moe = (KimiMoE(cfg) if sparse
                                 else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                               act=cfg.hidden_act))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class KimiModel(DecoderStack):
    """Embeddings -> KDA / MLA layers -> final norm (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg) -> None:
        super().__init__()
        mlp_types = list(cfg.mlp_layer_types)
        kinds = kimi_layer_types(cfg)
        self.build_stack(
            len(kinds), lambda i: KimiLayer(cfg, i, kinds[i], mlp_types[i] == "sparse"),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))

class KimiLinearForCausalLM(HybridCausalLM):
    # q/k/v stay separate (KDA convolves each; MLA has no k/v projections): only SwiGLU fuses.
    fused_names = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

    def __init__(self, cfg, max_positions: int) -> None:
        del max_positions  # no positional encoding
        super().__init__(cfg, KimiModel(cfg))

    def convert_weight(self, name: str, tensor: torch.Tensor):
        """transformers' in-memory names -> the original ones used here; per-expert
        ``w1/w3/w2`` -> ``gate_proj/up_proj/down_proj`` (stacked by the expert router)."""
        name = name.replace(".mlp.", ".block_sparse_moe.").replace(".forget_gate.", ".")
        if name.endswith("self_attn.conv1d.weight"):
            for part, t in zip(("q", "k", "v"), tensor.chunk(3), strict=True):
                yield name.replace("conv1d", f"{part}_conv1d"), t
            return
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            yield name, tensor
            return
        parts = name.split(".")
        if len(parts) > 2 and parts[-3].isdigit() and parts[-2] in _EXPERT_PROJ:
            parts[-2] = _EXPERT_PROJ[parts[-2]]
            name = ".".join(parts)
        yield name, tensor
