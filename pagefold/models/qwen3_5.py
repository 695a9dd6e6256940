"""Qwen3.5 text model: Gated DeltaNet layers interleaved with gated full attention.

Layer ``i`` is a ``linear_attention`` (Gated DeltaNet, GDN) or ``full_attention`` layer per
``config.layer_types``; either is followed by a SwiGLU MLP (Qwen3.5) or a sparse MoE block
(Qwen3-Next, which reuses every class here). All norms except the GDN output norm are
zero-centred RMSNorms (weight stored as an offset from 1).

Inputs are one flat batch (no batch dimension): ``input_ids`` (T,), ``positions`` (T,). Both
layer kinds keep their cache under the name ``layers.{i}``:

* full attention: the paged KV cache, through ``ctx.attention``;
* GDN: per request a conv state (conv_dim, K-1) in the model dtype and a recurrent state
  (value_heads, key_head_dim, value_head_dim), loaded and stored once per step via ``ctx``.

A published Qwen3.5 checkpoint is ``Qwen3_5ForConditionalGeneration``: the same text weights
under ``model.language_model.*`` plus a vision tower (``model.visual.*``,
:mod:`pagefold.models.qwen3_5_vision`) whose image embeddings replace the placeholder tokens'
(``ctx.mm_embeds``); its config nests the text config under ``text_config``, which the
registry unwraps. Image prompts rotate the attention layers' q/k with (3, T) M-RoPE positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.moe import ExpertWeightRouter
from pagefold.layers.native_record import STATE_CODE, Step, attention_record, bf16_vector, linears
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.llama import CausalLM, GatedMLP, head_dim_of
from pagefold.models.qwen3_5_vision import Qwen3_5VisionModel
from pagefold.models.weights import load_into
from pagefold.ops import elementwise
from pagefold.ops.elementwise import sigmoid_gate
from pagefold.ops.gdn import gdn_mixer

logger = logging.getLogger(__name__)

__all__ = [
    "GatedAttention",
    "GatedDeltaNet",
    "HybridCausalLM",
    "HybridDecoderLayer",
    "HybridModel",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "RMSNormGated",
]


def rotary_dim_of(cfg, head_dim: int) -> int:
    """Rotated channels per head: ``int(head_dim * partial_rotary_factor)``, as transformers."""
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if factor is None else factor))


class RMSNormGated(nn.Module):
    """The GDN output norm: ``weight * rmsnorm(x) * silu(gate)`` (norm before gate).

    Rounds as transformers' ``Qwen3_5RMSNormGated`` does: statistics in float32, the normalised
    value cast to x's dtype before the weight, the gate applied in float32, result in x's dtype.
    x and gate: (..., dim).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # (tokens, heads, dim) on the CPU: the compiled kernel, same roundings.
        out = elementwise.rms_norm_gated(x, gate, self.weight, self.eps)
        return out if out is not None else self.reference(x, gate)

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate: ``o_proj(attn(q, k, v) * sigmoid(gate))``.

    ``q_proj`` gives per head ``[query (D) | gate (D)]`` (2 * H * D rows); q and k go through
    zero-centred per-head RMSNorms, then RoPE on the first ``rotary_dim`` channels. Qwen3.5's
    interleaved mrope reduces to this 1-D RoPE for text, whose three position rows are equal.
    q/k/v projections are fused into ``qkv_proj`` (q rows first, including the gate).
    """

    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = head_dim_of(cfg)
        self.q_size = 2 * self.num_heads * d  # this rank's heads, [query | gate] each
        self.kv_size = self.num_kv_heads * d
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": 2 * heads * d, "k_proj": kv_heads * d,
                              "v_proj": kv_heads * d},
            bias=bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=bias, what="attention output")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_positions,
                                      rotary_dim=rotary_dim_of(cfg, self.head_dim))
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
                ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qg, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk = None
        if positions.dim() == 1 and qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16:
            # One pass for q/k norm + partial RoPE (the native decode step's kernel: in bf16 the
            # same roundings as the two modules below; float32 sums differ, M-RoPE rows too).
            qk = elementwise.qk_norm_rope(
                qkv, positions, self.rotary.cos, self.rotary.sin, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, q_off=0,
                q_head_stride=2 * self.head_dim, k_off=self.q_size,
                q_weight=self.q_norm.weight, k_weight=self.k_norm.weight, eps=self.q_norm.eps,
                zero_centered=True)
        if qk is not None:
            q, k = qk
        else:
            q = self.q_norm(q)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
        o = ctx.attention(self.layer_name, q, k, v, self.scale)
        o = sigmoid_gate(o.reshape(t, -1), gate)
        return self.o_proj(o)

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record: :meth:`forward`'s kernels on decode rows (qkv,
        zero-centred q/k norm + partial RoPE, K/V write, decode attention, sigmoid gate, o)."""
        return attention_record(
            hidden, qkv=self.qkv_proj, o=self.o_proj, heads=self.num_heads,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, q_size=self.q_size,
            kv_size=self.kv_size, q_norm=self.q_norm, k_norm=self.k_norm, rotary=self.rotary,
            scale=self.scale, gated=True)

    def native_dyn(self, step: Step) -> list[int] | None:
        return step.attention_dyn(self.layer_name)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3.5's layout; Qwen3-Next's weights are converted to it).

    Per step: ``in_proj`` (the checkpoint's in_proj_qkv | in_proj_z | in_proj_b | in_proj_a,
    fused) -> causal depthwise conv over the q|k|v channels with SiLU, continuing each
    request's conv state -> split q (Hk, Dk), k (Hk, Dk), v (Hv, Dv) -> q/k heads repeated to
    the Hv value heads (each key head serves Hv/Hk consecutive value heads) ->
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32), ``beta = sigmoid(b)`` -> gated delta
    rule (L2-normalised q/k, q scaled by Dk^-0.5) from each request's recurrent state ->
    ``RMSNormGated(o, z)`` per value head -> ``out_proj``.

    Prefix-cache checkpoints requested in ``ctx`` are taken inside the kernels
    (``captures_checkpoints``).
    """

    captures_checkpoints = True

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if nv % nk:
            raise ValueError(f"linear_num_value_heads {nv} is not a multiple of "
                             f"linear_num_key_heads {nk}")
        tp = tp_size()
        for field, n in (("linear_num_key_heads", nk), ("linear_num_value_heads", nv)):
            if n % tp:
                raise ValueError(f"{field} ({n}) is not divisible by tensor_parallel_size {tp}")
        # This rank's heads (key heads and the value heads they serve stay together).
        self.num_k_heads, self.num_v_heads = nk // tp, nv // tp
        self.head_k_dim, self.head_v_dim = dk, dv
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported Gated DeltaNet conv activation {act!r} (only silu)")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.splits = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        qkv_blocks = [nk * dk, nk * dk, nv * dv]  # the checkpoint's q | k | v channel blocks
        self.in_proj = column_linear(
            cfg.hidden_size, {"in_proj_qkv": qkv_blocks, "in_proj_z": nv * dv, "in_proj_b": nv,
                              "in_proj_a": nv}, bias=False, what="Gated DeltaNet")
        # Kept as nn.Conv1d so the checkpoint's (C, 1, K) weight loads by name; never called.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        shard_rows(self.conv1d.weight, qkv_blocks, "Gated DeltaNet conv channels")
        shard_rows(self.dt_bias, [nv], "linear_num_value_heads")
        shard_rows(self.A_log, [nv], "linear_num_value_heads")
        self.norm = RMSNormGated(self.head_v_dim, eps=cfg.rms_norm_eps)
        self.out_proj = row_linear(nv * dv, cfg.hidden_size, bias=False,
                                   what="Gated DeltaNet output")

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record: :meth:`forward`'s kernels on CPU decode rows
        (in_proj, ``pf_gdn`` on the states in their pages, the gated norm, out_proj); None
        unless they take the weights as ``ops.gdn.cpu.gdn_layer`` and ``rms_norm_gated``
        check them."""
        lib = cpu_ops.kernels()
        w, n = self.conv1d.weight, self.norm
        lin = linears(self.in_proj, self.out_proj, hidden, self.value_dim)
        if (lib is None or lin is None
                or lin["n0"] != self.conv_dim + self.value_dim + 2 * self.num_v_heads
                or not bf16_vector(w) or self.conv1d.bias is not None
                or not bf16_vector(self.dt_bias) or self.head_k_dim > lib.pf_max_head_dim()
                or self.kernel < 2 or not bf16_vector(n.weight)
                or n.weight.numel() != self.head_v_dim):
            return None
        conv_w = w.view(self.conv_dim, self.kernel)
        return "gdn", {
            **lin, "conv_dim": self.conv_dim, "conv_k": self.kernel,
            "ssm_heads": self.num_v_heads, "ssm_head_dim": self.head_v_dim,
            "k_heads": self.num_k_heads, "k_head_dim": self.head_k_dim,
            "conv_w": conv_w.data_ptr(), "dt_bias": self.dt_bias.data_ptr(),
            "gnorm_w": n.weight.data_ptr(),
        }, {"eps2": float(n.eps), "scale": float(self.head_k_dim**-0.5)}

    def native_dyn(self, step: Step) -> list[int] | None:
        return step.state_dyn(
            self.layer_name, self.A_log, (self.conv_dim, self.kernel - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim), tuple(STATE_CODE))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); reads and writes this layer's states in ``ctx``."""
        t = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        o = gdn_mixer(ctx, self.layer_name, mixed, a, b,
                      conv_weight=self.conv1d.weight.view(self.conv_dim, self.kernel),
                      A_log=self.A_log, dt_bias=self.dt_bias, num_k_heads=self.num_k_heads,
                      num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
                      head_v_dim=self.head_v_dim)
        o = self.norm(o, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))


MlpFactory = Callable[[object, int], nn.Module]


def dense_mlp(cfg, layer_idx: int) -> nn.Module:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=getattr(cfg, "hidden_act", "silu"))


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (``linear_attn`` or ``self_attn``), then ``mlp``."""

    def __init__(self, cfg, layer_idx: int, max_positions: int, mlp: nn.Module) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, layer_idx, max_positions)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r}; "
                             "expected linear_attention or full_attention")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                zero_centered=True)

    def native_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        """The native decode step's blocks: (input norm, mixer), (post norm, MLP)."""
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        return [(self.input_layernorm, mixer), (self.post_attention_layernorm, self.mlp)]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, ctx)
        else:
            h = self.self_attn(positions, h, ctx)
        # The residual add and the norm in one pass; the sum (x + h rounded, as the add alone)
        # goes into the mixer output's own storage, never into x (a caller may hold x).
        h, x = self.post_attention_layernorm(x, h)
        return x + self.mlp(h)


class HybridModel(DecoderStack):
    """Embeddings -> hybrid decoder layers -> final zero-centred norm; (T,) ids -> (T, hidden)
    (``DecoderStack``)."""

    def __init__(self, cfg, max_positions: int, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        if len(cfg.layer_types) < cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for "
                             f"{cfg.num_hidden_layers} layers")
        self.build_stack(
            cfg.num_hidden_layers,
            lambda i: HybridDecoderLayer(cfg, i, max_positions, make_mlp(cfg, i)),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))

    def embed_inputs(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        if ctx.mm_embeds is not None:  # image placeholder rows take the encoder's output
            rows, embeds = ctx.mm_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        return x

    # Without image rows (``ctx.mm_embeds`` None, as in every native decode step) this is the
    # plain lookup: DecoderStack.greedy_run may copy the rows itself.
    embed_inputs.pf_images_only = True  # type: ignore[attr-defined]


class HybridCausalLM(CausalLM):
    """Checkpoint loading shared by the Gated DeltaNet hybrids.

    Accepts the text-only layout (``model.*``, ``lm_head.*``) and the multimodal one
    (``model.language_model.*``); skips the vision tower (``model.visual.*``) and the
    multi-token-prediction head (``mtp.*``). Subclasses convert other layouts in
    :meth:`convert_weight`. An untied config whose checkpoint has no ``lm_head.weight`` is tied
    (multimodal configs may state tying only at the top level, which the text config lacks).
    """

    fused_names = {
        **CausalLM.fused_names,
        "in_proj_qkv": "in_proj", "in_proj_z": "in_proj",
        "in_proj_b": "in_proj", "in_proj_a": "in_proj",
    }
    skipped_prefixes = ("mtp.", "model.visual.", "visual.", "model.mtp.")

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensor -> tensors in Qwen3.5's text layout (identity here)."""
        yield name, tensor

    def _canonical(self, weights: Iterable[tuple[str, torch.Tensor]], seen: set[str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        visual = getattr(self, "visual", None) is not None
        for name, tensor in weights:
            if visual and name.startswith("model.visual."):
                yield "visual." + name.removeprefix("model.visual."), tensor
                continue
            if name.startswith(self.skipped_prefixes):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            seen.add(name)
            if name == "lm_head.weight" and self.tied:
                continue
            yield from self.convert_weight(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = ExpertWeightRouter(self)
        seen: set[str] = set()
        loaded = load_into(self, experts.route(self._canonical(weights, seen)),
                           rename=self.fused_names)
        # a kept-quantized GGUF head is stored as lm_head.gguf_<type>
        if not self.tied and not any(n.startswith(("lm_head.weight", "lm_head.gguf_"))
                                     for n in seen):
            logger.info("checkpoint has no lm_head.weight: tying it to the input embeddings")
            self.tie_head(self.model.embed_tokens)
        self.check_loaded(loaded, experts.complete())


class Qwen3_5ForCausalLM(HybridCausalLM):
    """Qwen3.5 dense text model (GDN + gated attention, SwiGLU MLPs)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, HybridModel(cfg, max_positions, dense_mlp))


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The published Qwen3.5 checkpoints: text weights under ``model.language_model.*``, the
    vision tower under ``model.visual.*``.

    Built from the (registry-unwrapped) ``text_config`` and, when the checkpoint's config has
    one, its ``vision_config`` (the tower is ``self.visual``; without it only text is served).
    """

    takes_vision_config = True

    def __init__(self, cfg, max_positions: int, vision_config=None) -> None:
        super().__init__(cfg, max_positions)
        self.visual = (Qwen3_5VisionModel(vision_config) if vision_config is not None
                       else None)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> torch.Tensor:
        """The vision tower on images' patches -> their placeholder tokens' embeddings (the
        tower is replicated on every tensor-parallel rank)."""
        return self.visual(pixels, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The text weights as :class:`HybridCausalLM` loads them, and the vision tower's; a
        checkpoint whose tower is incomplete (a text-only export keeping a stub of it) is
        served as text only, the tower dropped with a warning."""
        if self.visual is None:
            return super().load_weights(weights)
        got: set[str] = set()

        def note(ws):
            for name, tensor in ws:
                if name.startswith("model.visual."):
                    got.add(name.removeprefix("model.visual."))
                yield name, tensor

        for p in self.visual.parameters():
            p.optional = True  # checked here, not by check_loaded
        super().load_weights(note(weights))
        missing = [n for n, _ in self.visual.named_parameters() if n not in got]
        if missing:
            logger.warning("the checkpoint's vision tower lacks %s: serving text only",
                           missing[:4])
            self.visual = None
