"""Granite 4.0-H (GraniteMoeHybridForCausalLM) and Bamba (BambaForCausalLM).

Both are pre-norm decoders whose layers hold one token mixer (Mamba-2 or attention) followed by
a feed-forward block:

    x = x + m * mixer(input_layernorm(x))
    x = x + m * ffn(post_norm(x))

* Granite: ``m = residual_multiplier``; embeddings are scaled by ``embedding_multiplier``,
  attention uses ``attention_multiplier`` as its softmax scale, logits are divided by
  ``logits_scaling``; RoPE only when ``position_embedding_type == "rope"`` (else NoPE). The
  ffn is a sparse MoE (softmax over the top-k router logits, SwiGLU experts stored fused as
  ``input_linear`` (E, 2I, H) / ``output_linear`` (E, H, I)) plus an always-on SwiGLU
  ``shared_mlp``; with ``num_local_experts == 0`` only the shared MLP.
* Bamba: ``m = 1``; attention uses partial RoPE (``rope_parameters["partial_rotary_factor"]``,
  0.5 in every Bamba config) and the usual ``head_dim ** -0.5`` scale; SwiGLU ``feed_forward``.

Inputs are one flat token batch: ``forward(input_ids (T,), positions (T,), ctx) -> (T, hidden)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefold.core.layer_kinds import FULL, layer_kinds
from pagefold.csrc.gemm import matmul_t
from pagefold.distributed.parallel_state import all_reduce, tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.activations import get_activation
from pagefold.layers.attention_block import GQAAttention
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.expert_parallel import expert_shard, routed_ep, shard_experts
from pagefold.layers.linear import RowCut, row_linear, shard_rows
from pagefold.layers.lm_head import CausalLMHead
from pagefold.layers.lora_experts import ExpertsLayout
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe import split_expert_inter
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.mamba2_hybrid import Mamba2Config, Mamba2Mixer
from pagefold.models.weights import load_into

__all__ = ["BambaForCausalLM", "GraniteMoeHybridForCausalLM", "hybrid_layer_kinds"]

_ATTN, _MAMBA = "attention", "mamba"


def hybrid_layer_kinds(cfg) -> list[str]:
    """``"attention"`` or ``"mamba"`` per layer, read by the same parser that sizes the cache
    (``core/layer_kinds.py``): Granite's ``layer_types`` / ``layers_block_type``, Bamba's
    ``attn_layer_indices``; all-Mamba when none is given, as transformers does."""
    family = "bamba" if getattr(cfg, "model_type", None) == "bamba" else "granite"
    kinds = layer_kinds(cfg, family)
    n = cfg.num_hidden_layers
    if len(kinds) != n:
        raise ValueError(f"config lists {len(kinds)} layer types for {n} layers")
    return [_ATTN if k == FULL else _MAMBA for k in kinds]


def _activation(name: str):
    return get_activation(name, ("silu", "swish", "gelu", "gelu_pytorch_tanh"), "hidden_act")


class HybridAttention(GQAAttention):
    """GQA attention; RoPE on the first ``rotary_dim`` channels (None: no positional encoding)."""

    def __init__(self, cfg, layer_idx: int, *, scale: float, rotary_dim: int | None,
                 max_positions: int) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False,
                         max_positions=max_positions, rotary_dim=rotary_dim, scale=scale)


class _Stacked(nn.Module):
    """Holds one stacked expert tensor as ``.weight`` (the checkpoint's name)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


class GraniteMoE(nn.Module):
    """Granite's sparse MoE: top-k of the router logits, softmax over those k, SwiGLU experts.

    Weights as in Granite checkpoints: ``router.layer.weight`` (E, H), ``input_linear.weight``
    (E, 2I, H) (gate rows first, then up), ``output_linear.weight`` (E, H, I).
    ``forward(x (T, H)) -> (T, H)`` in ``x.dtype``.

    Tensor parallelism: each rank keeps every expert's ``1/N`` of the intermediate dimension
    (its gate and up rows, its down columns) and returns a partial sum; the router is
    replicated; the decoder layer all-reduces experts + shared MLP once. Expert parallelism:
    each rank keeps ``E/N`` whole experts and :meth:`forward_ep` combines them exactly, the
    shared MLP's partial sum in the same collective.

    LoRA adapters on the experts (PEFT's ``experts.gate_up_proj`` / ``experts.down_proj``,
    transformers' names of these stacks): ``lora`` (``layers/lora_experts.LoRAExperts``) adds
    each routed row's terms to its expert's two products, as in ``MoEExperts``.
    """

    lora = None
    # Quantized experts (a GGUF's, kept quantized: ``quantization.experts``): per local expert
    # a module whose ``gate_up_proj`` / ``down_proj`` run it, the children ``experts.<e>``
    # (transformers' names); the stacks are then gone.
    quantized: list | None = None
    experts_path = "experts"

    def __init__(self, cfg) -> None:
        super().__init__()
        e, h, full = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.ep = expert_shard(e, "num_local_experts")  # expert parallelism: whole experts
        i = full if self.ep is not None else split_expert_inter(full, "intermediate_size")
        self.num_experts, self.top_k, self.inter, self.full_inter = (
            e, cfg.num_experts_per_tok, i, full)
        self.router = nn.Module()
        self.router.layer = nn.Linear(h, e, bias=False)
        local = self.ep.count if self.ep is not None else e
        self.input_linear = _Stacked(local, 2 * i, h)
        self.output_linear = _Stacked(local, h, i)
        if self.ep is not None:
            shard_experts(self.input_linear.weight, self.ep)
            shard_experts(self.output_linear.weight, self.ep)
        else:
            shard_rows(self.input_linear.weight, [full, full], "intermediate_size", dim=1)
            shard_rows(self.output_linear.weight, [full], "intermediate_size", dim=2)
        self.act = _activation(cfg.hidden_act)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router.layer(x).float()
        top_logits, idx = logits.topk(self.top_k, dim=-1)
        return idx, torch.softmax(top_logits, dim=-1).to(x.dtype)

    def expert_dims(self) -> tuple[int, int, int]:
        """(local experts, hidden, this rank's intermediate size)."""
        w = self.input_linear.weight
        return w.shape[0], w.shape[2], self.inter

    def expert_stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_linear.weight, self.output_linear.weight

    def install_quantized(self, experts: list[nn.Module], first: int = 0) -> None:
        """Quantized experts replace the stacks (``MoEExperts.install_quantized``'s contract)."""
        del self.input_linear, self.output_linear
        self.experts = nn.Module()
        for e, ex in enumerate(experts):
            self.experts.add_module(str(first + e), ex)
        self.quantized = experts

    def lora_stack(self) -> tuple[str, ExpertsLayout, torch.Tensor] | None:
        """For LoRA: (transformers' stack path below this module, layout, a weight); None for
        quantized experts (no stacks)."""
        if self.quantized is not None:
            return None
        w = self.input_linear.weight
        first, count = (self.ep.first, self.ep.count) if self.ep is not None else (
            0, self.num_experts)
        return ".experts", ExpertsLayout(self.num_experts, first, count, w.shape[2],
                                         self.full_inter, self.inter), w

    def _expert(self, e: int, h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``h`` (those of tokens ``tok``), LoRA terms added."""
        slots = self.lora.rows(tok) if self.lora is not None else None
        q = self.quantized[e] if self.quantized is not None else None
        gu = matmul_t(h, self.input_linear.weight[e]) if q is None else q.gate_up_proj(h)
        if slots is not None:
            self.lora.add(e, "gate_up_proj", h, gu, slots)
        gate, up = gu.split(self.inter, dim=-1)
        act = self.act(gate) * up
        y = matmul_t(act, self.output_linear.weight[e]) if q is None else q.down_proj(act)
        if slots is not None:
            self.lora.add(e, "down_proj", act, y, slots)
        return y

    def forward_ep(self, x: torch.Tensor, extra: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: (the routed sum, complete on every rank, ``extra`` -- the
        shared MLP's partial sum -- reduced in the same collective); see
        ``layers/expert_parallel.py``."""
        idx, weights = self._route(x)
        return routed_ep(x, idx, self.ep, lambda e, tok, slot: self._expert(e, x[tok], tok)
                         * weights[tok, slot, None], extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self._route(x)
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        # Group the (token, slot) pairs by expert: one host sync for the per-expert counts.
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok, slot = sel // self.top_k, sel % self.top_k
            out.index_add_(0, tok, self._expert(e, x[tok], tok) * weights[tok, slot, None])
        return out


class GraniteSharedMLP(nn.Module):
    """SwiGLU with fused ``input_linear`` (2S, H) (gate first) and ``output_linear`` (H, S).

    Tensor parallelism: this rank's gate and up rows and down columns; the output is a partial
    sum (the decoder layer all-reduces it with the experts'). LoRA on ``input_linear`` cuts
    its B as these rows (``loader_cuts``)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        full = cfg.shared_intermediate_size
        self.inter = split_expert_inter(full, "shared_intermediate_size")
        self.input_linear = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        shard_rows(self.input_linear.weight, [full, full], "shared_intermediate_size")
        if tp_size() > 1:
            # The same gate | up cut for the loaders of raw tensors: LoRA's column layout
            # (``lora/layout.py``), a GGUF layer's rows (``quantization/gguf_tp.py``) and the
            # other quantized formats' (``quantization/tp.split_of``). Not ``tp_cuts``: this
            # plain weight is cut by ``shard_rows`` here, not by a column-parallel linear.
            self.input_linear.loader_cuts = {
                "": RowCut([full, full], tp_size(), "shared_intermediate_size")}
        self.output_linear = row_linear(full, cfg.hidden_size, bias=False,
                                        what="shared_intermediate_size", reduce=False)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).split(self.inter, dim=-1)
        return self.output_linear(self.act(gate) * up)


def _mixer(cfg, layer_idx: int, kind: str, attn_kw: dict) -> nn.Module:
    if kind == _MAMBA:
        return Mamba2Mixer(Mamba2Config.from_bamba_like(cfg), f"layers.{layer_idx}")
    return HybridAttention(cfg, layer_idx, **attn_kw)


class GraniteDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, attn_kw: dict) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == _MAMBA:
            self.mamba = _mixer(cfg, layer_idx, kind, attn_kw)
        else:
            self.self_attn = _mixer(cfg, layer_idx, kind, attn_kw)
        self.block_sparse_moe = GraniteMoE(cfg) if cfg.num_local_experts > 0 else None
        self.shared_mlp = GraniteSharedMLP(cfg)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions, x, ctx):
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx) if self.kind == _MAMBA else self.self_attn(positions, h, ctx)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ff = self.shared_mlp(h)
        moe = self.block_sparse_moe
        if moe is not None and moe.ep is not None:  # one collective: routed slots + shared
            routed, ff = moe.forward_ep(h, ff)
            ff = routed + ff
        else:
            if moe is not None:
                ff = moe(h) + ff
            if tp_size() > 1:  # one all-reduce: experts' and shared MLP's partial sums
                ff = all_reduce(ff)
        return x + ff * self.residual_multiplier


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, attn_kw: dict) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == _MAMBA:
            self.mamba = _mixer(cfg, layer_idx, kind, attn_kw)
        else:
            self.self_attn = _mixer(cfg, layer_idx, kind, attn_kw)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                     bias=bool(getattr(cfg, "mlp_bias", False)),
                                     act=getattr(cfg, "hidden_act", "silu"))

    def native_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        """The native decode step's blocks: (input norm, mixer), (pre-FF norm, MLP)."""
        mixer = self.mamba if self.kind == _MAMBA else self.self_attn
        return [(self.input_layernorm, mixer), (self.pre_ff_layernorm, self.feed_forward)]

    def forward(self, positions, x, ctx):
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx) if self.kind == _MAMBA else self.self_attn(positions, h, ctx)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class _HybridModel(DecoderStack):
    """Embeddings (scaled) -> Mamba-2 / attention layers -> final norm (``DecoderStack``).
    Bamba's layers list their blocks for the native decode step; Granite's (which scale their
    residual adds) do not, so they take the module path."""

    def __init__(self, cfg, layer_cls, attn_kw: dict, final_norm: str,
                 embedding_multiplier: float) -> None:
        super().__init__()
        kinds = hybrid_layer_kinds(cfg)
        self.final_norm_name = final_norm
        self.embedding_multiplier = embedding_multiplier
        self.build_stack(
            len(kinds), lambda i: layer_cls(cfg, i, kinds[i], attn_kw),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            norm_name=final_norm)

    def embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        return x

class _HybridCausalLM(CausalLMHead):
    fused_names = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    # transformers' in-memory names (a checkpoint it re-saved) -> the original checkpoint's.
    hf_renames: dict[str, str] = {}

    def __init__(self, cfg, model: _HybridModel, logits_divisor: float) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.init_head(cfg, self.model.embed_tokens)
        self.logits_divisor = logits_divisor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            for new, old in self.hf_renames.items():
                if name.endswith(new):
                    name = name[: -len(new)] + old
                    break
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.check_loaded(load_into(self, self._renamed(weights), rename=self.fused_names,
                                    skip_prefixes=self.head_skip_prefixes))


class GraniteMoeHybridForCausalLM(_HybridCausalLM):
    hf_renames = {
        "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
        "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
    }

    def __init__(self, cfg, max_positions: int) -> None:
        pe = getattr(cfg, "position_embedding_type", None)
        if pe not in (None, "nope", "rope"):
            raise ValueError(f"unsupported position_embedding_type {pe!r} (expected rope or none)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn_kw = dict(scale=float(cfg.attention_multiplier),
                       rotary_dim=head_dim if pe == "rope" else None,
                       max_positions=max_positions)
        model = _HybridModel(cfg, GraniteDecoderLayer, attn_kw, "norm",
                             float(cfg.embedding_multiplier))
        super().__init__(cfg, model, float(cfg.logits_scaling))


class BambaForCausalLM(_HybridCausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        # transformers' BambaRotaryEmbedding reads the factor from rope_parameters only.
        rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        attn_kw = dict(scale=head_dim**-0.5, rotary_dim=rotary_dim, max_positions=max_positions)
        model = _HybridModel(cfg, BambaDecoderLayer, attn_kw, "final_layernorm", 1.0)
        super().__init__(cfg, model, 1.0)
