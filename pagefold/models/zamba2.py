"""Zamba2 (Zamba2ForCausalLM): a Mamba-2 backbone with shared attention blocks.

Every layer ``i`` is a Mamba-2 block ``x + mamba(norm(x + t))``. In a "hybrid" layer ``t`` is
the output of a *shared* transformer block followed by the layer's own ``linear``; otherwise
``t = 0``. There are ``num_mem_blocks`` shared blocks, used in turn by the hybrid layers
(hybrid layer ``j`` uses block ``j % num_mem_blocks``). A shared block sees
``[x | embeddings]`` (width 2 * hidden)::

    h = input_norm([x | e]);  q/k/v = proj(h) + lora_j(h)       (adapter of hybrid use j)
    a = o_proj(attention(q, k, v))        head_dim = 2 * hidden / heads, scale (head_dim/2)^-1/2
    t = mlp_j(pre_ff_norm(a))             gate_up(a) + lora_j(a), act(gate) * up, down

The KV cache is per *use*, not per weight: each hybrid layer's attention has its own pages
(cache layer ``layers.{i}.attn``), while the Mamba-2 state of every layer is ``layers.{i}``.
Checkpoints name a block's weights under the first hybrid layer that uses it
(``layers.{i}.shared_transformer.``); later users repeat or omit them.

Tensor parallelism: the shared blocks split like any attention + MLP (query/KV heads, the
MLP's gate and up columns); a LoRA adapter's down-projection (``d_in -> rank``) is replicated
and its up-projection cut exactly as the projection it adds to, so ``proj(h) + lora(h)``
stays this rank's slice. The Mamba-2 layers split as in ``mamba2_hybrid.py``.

Pipeline parallelism: the model is a ``DecoderStack`` whose second stream is the embeddings;
each stage holds the shared blocks its own hybrid layers use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.core.spec_families import zamba2_hybrid_layers
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import split_heads
from pagefold.layers.decoder_stack import AbsentPart, DecoderStack, stage_builds
from pagefold.layers.linear import column_linear, row_linear
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.llama import CausalLM
from pagefold.models.mamba2_hybrid import Mamba2Config, Mamba2Mixer
from pagefold.models.weights import load_into

__all__ = ["Zamba2ForCausalLM"]


def _lora(d_in: int, rank: int, d_out, parts: int | None, what: str) -> nn.Sequential:
    """``d_out``: the full output rows (an int, or a list of row blocks) cut like the layer
    the adapter adds to (``parts``: the parts its rows are cut in; None: the rank count)."""
    up = column_linear(rank, d_out, bias=False, what=what,
                       parts=None if parts is None else {"": parts})
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), up)


def _adapters(cfg, block_id: int, uses: int, d_in: int, d_out, what: str,
              parts: int | None = None) -> nn.ModuleList:
    """One slot per hybrid use; the slots this block serves hold a LoRA pair (as transformers
    lays them out, so checkpoint names match), the others an Identity placeholder."""
    return nn.ModuleList(_lora(d_in, cfg.adapter_rank, d_out, parts, what)
                         if j % cfg.num_mem_blocks == block_id else nn.Identity()
                         for j in range(uses))


class Zamba2Attention(nn.Module):
    def __init__(self, cfg, block_id: int, uses: int, max_positions: int) -> None:
        super().__init__()
        width = 2 * cfg.hidden_size
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = width // heads
        q, kv = heads * d, kv_heads * d
        self.q_proj = column_linear(width, q, bias=False, what="attention")
        self.k_proj = column_linear(width, kv, bias=False, what="attention",
                                    parts={"": kv_parts})
        self.v_proj = column_linear(width, kv, bias=False, what="attention",
                                    parts={"": kv_parts})
        self.o_proj = row_linear(q, cfg.hidden_size, bias=False, what="attention output")
        self.adapt = bool(cfg.use_shared_attention_adapter)
        if self.adapt:  # transformers' adapters are width -> width (q, k and v alike)
            self.linear_q_adapter_list = _adapters(cfg, block_id, uses, width, q, "attention")
            self.linear_k_adapter_list = _adapters(cfg, block_id, uses, width, kv, "attention",
                                                   kv_parts)
            self.linear_v_adapter_list = _adapters(cfg, block_id, uses, width, kv, "attention",
                                                   kv_parts)
        self.rotary = (RotaryEmbedding(cfg, self.head_dim, max_positions)
                       if cfg.use_mem_rope else None)
        self.scale = (self.head_dim / 2) ** -0.5

    def forward(self, positions, h, use: int, cache_name: str, ctx: ForwardContext):
        t = h.shape[0]
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if self.adapt:
            q = q + self.linear_q_adapter_list[use](h)
            k = k + self.linear_k_adapter_list[use](h)
            v = v + self.linear_v_adapter_list[use](h)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = ctx.attention(cache_name, q.contiguous(), k.contiguous(), v.contiguous(), self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Zamba2MLP(nn.Module):
    def __init__(self, cfg, block_id: int, uses: int) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        bias = bool(cfg.add_bias_linear)
        # gate | up row blocks, each cut over the ranks (so chunk(2) splits this rank's rows).
        self.gate_up_proj = column_linear(h, [inter, inter], bias=bias, what="intermediate_size")
        self.down_proj = row_linear(inter, h, bias=bias, what="intermediate_size")
        self.gate_up_proj_adapter_list = _adapters(cfg, block_id, uses, h, [inter, inter],
                                                   "intermediate_size")
        act = cfg.hidden_act
        if act not in ("gelu", "gelu_pytorch_tanh", "silu"):
            raise ValueError(f"unsupported Zamba2 MLP activation {act!r}")
        self.act = F.silu if act == "silu" else (
            lambda x: F.gelu(x, approximate="tanh" if "tanh" in act else "none"))

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)).chunk(2, -1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    def __init__(self, cfg, block_id: int, uses: int, max_positions: int) -> None:
        super().__init__()
        self.self_attn = Zamba2Attention(cfg, block_id, uses, max_positions)
        self.feed_forward = Zamba2MLP(cfg, block_id, uses)
        self.input_layernorm = RMSNorm(2 * cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, emb, use: int, cache_name: str, ctx):
        h = self.input_layernorm(torch.cat((x, emb), dim=-1))
        a = self.self_attn(positions, h, use, cache_name, ctx)
        return self.feed_forward(self.pre_ff_layernorm(a), use)


class Zamba2MambaLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        inter = int(cfg.mamba_expand * cfg.hidden_size)
        mcfg = Mamba2Config(
            hidden_size=cfg.hidden_size, num_heads=cfg.n_mamba_heads,
            head_dim=inter // cfg.n_mamba_heads, n_groups=cfg.mamba_ngroups,
            state_size=cfg.mamba_d_state, conv_kernel=cfg.mamba_d_conv,
            chunk_size=cfg.chunk_size, eps=1e-5,  # transformers hard-codes the gated norm's eps
            dt_limit=(float(cfg.time_step_min), float("inf")),
            proj_bias=bool(cfg.add_bias_linear), conv_bias=True)
        self.mamba = Mamba2Mixer(mcfg, f"layers.{layer_idx}")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_idx = layer_idx

    def forward(self, x, ctx, t=None):
        h = self.input_layernorm(x if t is None else x + t)
        return x + self.mamba(h, ctx)


class Zamba2HybridLayer(nn.Module):
    """The Mamba-2 layer plus this use's linear; the shared block lives in the model."""

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.mamba_decoder = Zamba2MambaLayer(cfg, layer_idx)
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer_idx = layer_idx


class Zamba2Model(DecoderStack):
    """Embeddings -> layers -> final norm (``DecoderStack``, on the module path). The stack's
    second stream is the embeddings (every shared block reads them): a pipeline stage receives
    ``(x, embeddings)`` and hands both on, and builds the shared blocks its hybrid layers use
    (a block used on two stages is held by both)."""

    residual_stream = True
    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        hybrid = zamba2_hybrid_layers(cfg)
        self.use_of = {layer: j for j, layer in enumerate(hybrid)}
        self.block_of = {layer: j % cfg.num_mem_blocks for j, layer in enumerate(hybrid)}
        self.build_stack(
            cfg.num_hidden_layers,
            lambda i: Zamba2HybridLayer(cfg, i) if i in self.use_of else Zamba2MambaLayer(cfg, i),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            norm_name="final_layernorm")
        used = {self.block_of[i] for i in hybrid if stage_builds(i)}
        self.shared_blocks = nn.ModuleList(
            Zamba2SharedBlock(cfg, b, len(hybrid), max_positions) if b in used else AbsentPart()
            for b in range(min(cfg.num_mem_blocks, len(hybrid))))

    def capture_input(self, ctx, index, x, emb) -> None:
        ctx.capture_layer_input(index, x, None)  # the second stream is the embeddings

    def run_layer(self, layer, positions, x, emb, ctx):
        if emb is None:
            emb = x  # the first layer's input is the embeddings
        i = layer.layer_idx
        if i not in self.use_of:
            return layer(x, ctx), emb
        block = self.shared_blocks[self.block_of[i]]
        t = block(positions, x, emb, self.use_of[i], f"layers.{i}.attn", ctx)
        return layer.mamba_decoder(x, ctx, layer.linear(t)), emb

    def final_norm(self, x, emb):
        return self.final_layernorm(x)


class Zamba2ForCausalLM(CausalLM):
    fused_names: dict[str, str] = {}

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, Zamba2Model(cfg, max_positions))

    def load_weights(self, weights) -> None:
        """``layers.{i}.shared_transformer.X`` -> ``shared_blocks.{block of i}.X``: a block's
        weights are stored once per checkpoint (or repeated, identical, per use)."""
        block_of = self.model.block_of

        def renamed():
            for name, tensor in weights:
                if ".shared_transformer." in name:
                    head, rest = name.split(".shared_transformer.", 1)
                    layer = int(head.rsplit(".", 1)[1])
                    name = f"model.shared_blocks.{block_of[layer]}.{rest}"
                yield name, tensor

        skip = ("lm_head.",) if self.tied else ()
        loaded = load_into(self, renamed(), skip_prefixes=skip)
        expected = {n for n, _ in self.named_parameters()}
        if self.tied:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")
