"""gpt-oss (GptOssForCausalLM): sliding and full attention with per-head sinks, sparse MoE.

Per layer: ``h = x + attn(norm(x))``, ``y = h + moe(norm(h))`` (transformers' GptOssDecoderLayer).

* Attention: q/k/v/o with biases, RoPE (YaRN in published configs), scale ``head_dim ** -0.5``,
  and a learned logit per head (``sinks``) that joins every softmax and is dropped after it
  (:func:`pagefold.layers.attention.extras.paged_attention_extras`). ``layer_types`` alternates
  sliding-window (``sliding_window`` keys) and full layers; the cache gives each its own group.
* MoE: router ``logits = x W^T + b``, top-k logits softmaxed; experts hold stacked
  ``gate_up_proj (E, hidden, 2I)`` with gate and up interleaved column by column,
  ``down_proj (E, I, hidden)`` and biases; the activation is the clamped SwiGLU
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``.

Expert weights load as transformers saves them, or as the published checkpoints store them:
MXFP4 ``*_blocks`` / ``*_scales`` (``quantization/mxfp4.py``), kept as stored (blocks of 32
inputs: the gate/up matrix's rows are its interleaved output columns) and decoded a tile at a
time for each routed expert's product.

Tensor parallelism: query heads (with their sinks) and KV heads split as in every GQA block;
experts keep this rank's ``1/N`` of the intermediate dimension -- a contiguous run of the
interleaved gate/up columns, the matching down rows -- the router is replicated, the down
bias is added on rank 0 only and the layer's partial sums meet in one all-reduce. Expert
parallelism: each rank holds ``E/N`` whole experts (MXFP4 blocks included, cut along the
expert axis) with their biases, combined exactly by ``layers/expert_parallel.py``.

LoRA on the experts (PEFT ``target_parameters`` ``experts.gate_up_proj`` / ``down_proj``;
transformers' stacks are (E, in, out), which PEFT reads unswapped: the pairs are per expert
``A`` (r, in), ``B`` (out, r) as for every stack): ``lora`` (``layers/lora_experts``) adds each
routed row's terms to its expert's two products before their biases, the gate/up term in the
interleaved column order. MXFP4 experts take them the same way: the product stays the MXFP4
one (the rows of its blocks are the interleaved gate/up columns, so the term's order is the
same) and the adapters' float terms are added to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.core.spec_families import gpt_oss_layer_types
from pagefold.distributed.parallel_state import all_reduce, tp_rank
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention.extras import paged_attention_extras
from pagefold.layers.attention_block import split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.expert_parallel import expert_shard, routed_ep, shard_experts
from pagefold.layers.linear import column_linear, load_into, row_linear, shard_rows
from pagefold.layers.lora_experts import ExpertsLayout
from pagefold.layers.moe import split_expert_inter
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.llama import CausalLM
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.mxfp4 import MXFP4_BLOCK, check_mxfp4, mxfp4_linear

__all__ = ["GptOssExperts", "GptOssForCausalLM"]


class GptOssAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = cfg.head_dim
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        bias = bool(getattr(cfg, "attention_bias", True))
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=bias, what="attention output")
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        shard_rows(self.sinks, [heads], "num_attention_heads")
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_positions)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k = self.rotary(positions, q.reshape(t, self.num_heads, self.head_dim),
                           k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        cache = ctx.cache.attn[self.layer_name]
        meta = ctx.attn_meta[ctx.cache.layer_group[self.layer_name]]
        o = paged_attention_extras(q, k, v, cache, meta, self.scale, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.sizes[0]))


class GptOssExperts(nn.Module):
    """Stacked experts, parameters named and shaped as transformers' GptOssExperts."""

    # Resident LoRA adapters (``layers/lora_experts.LoRAExperts``), set by the LoRA manager.
    lora = None

    def __init__(self, cfg) -> None:
        super().__init__()
        e, h, full = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        # Expert parallelism: this rank's E/N whole experts (``num_experts`` counts them).
        self.ep = expert_shard(e, "num_local_experts")
        i = full if self.ep is not None else split_expert_inter(full, "intermediate_size")
        e = self.ep.count if self.ep is not None else e
        self.num_experts, self.hidden, self.inter, self.full_inter = e, h, i, full
        self.mxfp4: set[str] = set()  # projections loaded as MXFP4 blocks / scales
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        if self.ep is not None:
            for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                      self.down_proj_bias):
                shard_experts(p, self.ep)
        else:
            # Interleaved gate/up columns: a run of intermediate channels is a run of columns.
            shard_rows(self.gate_up_proj, [2 * full], "intermediate_size", dim=2)
            shard_rows(self.gate_up_proj_bias, [2 * full], "intermediate_size", dim=1)
            shard_rows(self.down_proj, [full], "intermediate_size", dim=1)
        # The ranks' partial sums carry the down bias once; whole experts always add it.
        self.add_down_bias = tp_rank() == 0 or self.ep is not None
        self.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        self.limit = float(getattr(cfg, "swiglu_limit", 7.0))

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def load_mxfp4(self, proj: str, part: str, tensor: torch.Tensor, name: str) -> None:
        """Take one MXFP4 checkpoint tensor (``proj`` ``gate_up_proj`` / ``down_proj``,
        ``part`` ``blocks`` / ``scales``), this rank's part of it: the gate/up rows of its
        intermediate channels, the down blocks of its inputs (whole blocks of 32)."""
        if proj not in ("gate_up_proj", "down_proj") or part not in ("blocks", "scales"):
            raise QuantizationError(f"{name}: not a gpt-oss mxfp4 expert tensor")
        rows, k = ((2 * self.full_inter, self.hidden) if proj == "gate_up_proj"
                   else (self.hidden, self.full_inter))
        total = self.ep.total if self.ep is not None else self.num_experts
        want = (total, rows, k // MXFP4_BLOCK) + ((16,) if part == "blocks" else ())
        if k % MXFP4_BLOCK or tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
            raise QuantizationError(f"{name}: mxfp4 tensor {tuple(tensor.shape)} {tensor.dtype}"
                                    f", expected {want} uint8 (inputs {k} in blocks of "
                                    f"{MXFP4_BLOCK}; truncated or corrupt checkpoint)")
        if self.ep is not None:  # expert parallelism: this rank's experts, whole
            tensor = tensor.narrow(0, self.ep.first, self.ep.count)
        elif self.inter != self.full_inter:  # tensor parallelism: this rank's share
            r = tp_rank()
            if proj == "gate_up_proj":
                tensor = tensor.narrow(1, r * 2 * self.inter, 2 * self.inter)
            elif self.inter % MXFP4_BLOCK:
                raise QuantizationError(f"{name}: tensor parallelism gives each rank "
                                        f"{self.inter} of the {self.full_inter} intermediate "
                                        f"channels, which cuts mxfp4 blocks of {MXFP4_BLOCK}")
            else:
                g = self.inter // MXFP4_BLOCK
                tensor = tensor.narrow(2, r * g, g)
        if proj not in self.mxfp4:
            self.mxfp4.add(proj)
            delattr(self, proj)  # the plain stacked weight is not kept
            setattr(self, proj, None)
        self.register_parameter(f"{proj}_{part}",
                                nn.Parameter(tensor.contiguous(), requires_grad=False))
        other = getattr(self, f"{proj}_{'scales' if part == 'blocks' else 'blocks'}", None)
        if other is not None:
            b, sc = ((tensor, other) if part == "blocks" else (other, tensor))
            check_mxfp4(b, sc, name)

    def lora_stack(self) -> tuple[str, ExpertsLayout, torch.Tensor]:
        """For LoRA: (the adapters' path below this module, the layout, a tensor of the model
        dtype and device: the down bias, which MXFP4 experts keep plain too)."""
        total, first = ((self.ep.total, self.ep.first) if self.ep is not None
                        else (self.num_experts, 0))
        return "", ExpertsLayout(total, first, self.num_experts, self.hidden, self.full_inter,
                                 self.inter, interleaved=True), self.down_proj_bias

    def _product(self, x: torch.Tensor, proj: str, e: int) -> torch.Tensor:
        if proj in self.mxfp4:
            return mxfp4_linear(x, getattr(self, f"{proj}_blocks")[e],
                                getattr(self, f"{proj}_scales")[e])
        return x @ getattr(self, proj)[e]

    def _expert(self, e: int, h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``h`` (those of tokens ``tok``), each product with its
        rows' LoRA terms (added before the bias, as PEFT's merged weight does)."""
        slots = self.lora.rows(tok) if self.lora is not None else None
        gu = self._product(h, "gate_up_proj", e)
        if slots is not None:
            self.lora.add(e, "gate_up_proj", h, gu, slots)
        act = self._glu(gu + self.gate_up_proj_bias[e])
        y = self._product(act, "down_proj", e)
        if slots is not None:
            self.lora.add(e, "down_proj", act, y, slots)
        return y + self.down_proj_bias[e] if self.add_down_bias else y

    def forward_ep(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the routed sum over every rank's experts, complete and the
        same bits on every rank (``layers/expert_parallel.py``)."""
        return routed_ep(x, idx, self.ep, lambda e, tok, slot: (
            self._expert(e, x[tok], tok) * w[tok, slot, None]).to(x.dtype))[0]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), idx/w (T, k) -> (T, hidden): each token's chosen experts, weighted."""
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok, slot = sel // idx.shape[1], sel % idx.shape[1]
            y = self._expert(e, x[tok], tok)
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(x.dtype))
        return out


class GptOssRouter(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_local_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_local_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return idx, torch.softmax(top, dim=-1, dtype=top.dtype)


class GptOssMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.router = GptOssRouter(cfg)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.router(x)
        if self.experts.ep is not None:
            return self.experts.forward_ep(x, idx, w)
        return all_reduce(self.experts(x, idx, w))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_idx, max_positions)
        self.mlp = GptOssMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssModel(DecoderStack):
    """Embeddings -> decoder layers -> final norm (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        gpt_oss_layer_types(cfg)  # validates the pattern the cache is built from
        self.build_stack(
            cfg.num_hidden_layers, lambda i: GptOssDecoderLayer(cfg, i, max_positions),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))

class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, GptOssModel(cfg, max_positions))

    def load_weights(self, weights) -> None:
        mxfp4: set[str] = set()

        def routed():
            for name, tensor in weights:
                if not name.endswith(("_blocks", "_scales")):
                    yield name, tensor
                    continue
                path, _, leaf = name.rpartition(".")
                proj, _, part = leaf.rpartition("_")
                try:
                    experts = self.get_submodule(path)
                except AttributeError:
                    experts = None
                if not isinstance(experts, GptOssExperts):
                    raise QuantizationError(f"{name}: mxfp4 tensors of something other than "
                                            "gpt-oss experts are not supported")
                experts.load_mxfp4(proj, part, tensor, name)
                mxfp4.add(f"{path}.{leaf}")

        self.check_loaded(load_into(self, routed(), rename=self.fused_names,
                                    skip_prefixes=self.head_skip_prefixes), mxfp4)
