"""EAGLE and EAGLE-3 drafters: small Llama-style heads over the target's hidden states
(vLLM's ``speculative_config={"method": "eagle" | "eagle3", "model": PATH, ...}``).

Both are drafted by :class:`~pagefold.spec_decode.hidden_proposer.HiddenStateProposer`: the
head's row at position ``p`` takes the target's hidden state there and the embedding of the
next token ``t_{p+1}``, and its output ``g_p`` drafts ``t_{p+2}``; chained drafts feed ``g``
back as the hidden state. The heads' attention layers keep full-attention KV in the target's
pool (``eagle.layers.{i}``), so admission, preemption, prefix caching and forks cover them,
and hybrid targets work unchanged (their states are rolled back by the verify forms).

EAGLE (checkpoints as ``yuhuili/EAGLE-LLaMA3-Instruct-8B`` stores them: ``fc.weight``
(optionally ``fc.bias``), ``layers.{i}.*``, optionally ``embed_tokens.weight`` and
``lm_head.weight``): ``x = fc([embed(t_{p+1}) | h_p])`` (2H -> H) with ``h_p`` the target's
output (after its final norm); Llama decoder layers, the first without an input norm; no final
norm: ``g_p`` is the last layer's output, the logits ``lm_head(g_p)`` with the target's
``lm_head`` unless the checkpoint has one.

EAGLE-3 (``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``):
the target hidden state is the concatenation of the inputs of three target layers
(:mod:`pagefold.spec_decode.aux_hidden`), ``fc`` maps it 3H -> H; the mid layer's attention
takes ``[input_layernorm(embed) | hidden_norm(hidden)]`` (2H) and its residual is the hidden
state; ``g_p`` is the pre-norm sum and the logits are ``lm_head(norm(g_p))`` over the draft
vocabulary, placed at target ids ``i + d2t[i]`` (every other target id gets ``-inf``, so a
sampled draft's ``q`` is a distribution over the target vocabulary). A chained draft feeds
``g`` back without ``fc``.

The embeddings are the target's unless the checkpoint has its own ``embed_tokens.weight``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from pagefold.core.kv_cache_spec import FullAttentionSpec, LayerSpec, is_attention
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import GQAAttention, head_dim_of, split_heads
from pagefold.layers.linear import column_linear, load_into
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import gather_logits, lm_head_linear, vocab_embedding
from pagefold.models.llama import CausalLM, DecoderLayer
from pagefold.models.weights import iter_weights
from pagefold.spec_decode.aux_hidden import (
    check_aux_layers,
    default_aux_layer_ids,
    target_embedding,
)
from pagefold.spec_decode.hidden_proposer import HiddenStateProposer

__all__ = ["EAGLE_PREFIX", "Eagle3Head", "EagleHead", "EagleProposer", "aux_layer_ids",
           "eagle_layer_specs", "load_eagle", "load_eagle_config"]

EAGLE_PREFIX = "eagle."


def load_eagle_config(path: str | Path):
    """The head's config (a ``LlamaConfig``: EAGLE checkpoints are Llama-style)."""
    from transformers import LlamaConfig  # heavy: only when a head is opened

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"speculative_config 'model' {str(path)!r} is not a local EAGLE "
                         f"head folder (no config.json)")
    return LlamaConfig.from_pretrained(str(path))


def _num_layers(dcfg, method: str) -> int:
    return 1 if method == "eagle3" else int(dcfg.num_hidden_layers)


def eagle_layer_specs(target: dict[str, LayerSpec], dcfg, method: str, kv_dtype: torch.dtype,
                      block_size: int, tensor_parallel_size: int = 1) -> dict[str, LayerSpec]:
    """One full-attention cache entry per head layer (this rank's KV heads: the head is
    sharded like the target); ValueError when its pages cannot share the target's pool
    (pagefold keeps one attention page size per pool) or its heads do not divide."""
    kv_heads = getattr(dcfg, "num_key_value_heads", None) or dcfg.num_attention_heads
    _, kv_per_rank, _ = split_heads(int(dcfg.num_attention_heads), int(kv_heads),
                                    tensor_parallel_size)
    spec = FullAttentionSpec(kv_per_rank, head_dim_of(dcfg), kv_dtype)
    t_attn = [s for s in target.values() if is_attention(s)]
    if t_attn and t_attn[0].page_bytes(block_size) != spec.page_bytes(block_size):
        raise ValueError(
            f"the EAGLE head's attention pages ({spec.num_kv_heads} kv heads x head_dim "
            f"{spec.head_dim}) differ from the target's ({t_attn[0].page_bytes(block_size)} "
            f"bytes per block); pagefold keeps one page size per pool")
    return {f"{EAGLE_PREFIX}layers.{i}": spec for i in range(_num_layers(dcfg, method))}


def aux_layer_ids(dcfg, num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers: the head config's ``eagle_aux_hidden_state_layer_ids`` (top
    level or in ``eagle_config``), else vLLM's default (:func:`default_aux_layer_ids`)."""
    ids = getattr(dcfg, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(dcfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layer_ids(num_target_layers)
    return tuple(int(i) for i in ids)


def _attention(dcfg, layer_idx: int, max_positions: int, in_features: int) -> GQAAttention:
    """The head's attention (Llama: full RoPE, no q/k norm) reading ``in_features`` inputs."""
    bias = bool(getattr(dcfg, "attention_bias", False))
    attn = GQAAttention(dcfg, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False,
                        max_positions=max_positions)
    if in_features != dcfg.hidden_size:
        heads = dcfg.num_attention_heads
        kv = getattr(dcfg, "num_key_value_heads", None) or heads
        _, _, parts = split_heads(heads, kv)
        d = attn.head_dim
        attn.qkv_proj = column_linear(
            in_features, {"q_proj": heads * d, "k_proj": kv * d, "v_proj": kv * d},
            bias=bias, parts={"k_proj": parts, "v_proj": parts}, what="attention")
    attn.layer_name = f"{EAGLE_PREFIX}layers.{layer_idx}"
    return attn


class EagleHead(nn.Module):
    """EAGLE (see the module docstring); ``forward`` returns ``g`` (T, H)."""

    def __init__(self, dcfg, max_positions: int, *, fc_bias: bool, own_embed: bool,
                 own_head: bool) -> None:
        super().__init__()
        h = dcfg.hidden_size
        self.vocab_size = dcfg.vocab_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        bias = bool(getattr(dcfg, "attention_bias", False))
        self.layers = nn.ModuleList(
            DecoderLayer(dcfg, i, max_positions=max_positions, qkv_bias=bias, o_bias=bias,
                         qk_norm=False) for i in range(dcfg.num_hidden_layers))
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_name = f"{EAGLE_PREFIX}layers.{i}"
        # EAGLE's first layer has no input norm: fc's output enters attention as it is.
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = vocab_embedding(dcfg.vocab_size, h) if own_embed else None
        self.lm_head = lm_head_linear(h, dcfg.vocab_size) if own_head else None
        self.embed = self.embed_tokens  # or the target's lookup (load_eagle)
        self.target_logits = None  # the target's compute_logits without an own lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                *, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        e = self.embed(input_ids)
        x = self.fc(torch.cat([e, hidden.to(e.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, ctx, residual)
        return x + residual

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.target_logits(g)
        return gather_logits(self.lm_head(g), self.vocab_size).float()


class Eagle3Layer(nn.Module):
    """EAGLE-3's mid layer: attention over ``[norm(embedding) | norm(hidden)]``, the hidden
    state as residual, then a gated MLP. Returns ``(mlp output, residual)``."""

    def __init__(self, dcfg, max_positions: int) -> None:
        super().__init__()
        h, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.self_attn = _attention(dcfg, 0, max_positions, 2 * h)
        self.mlp = GatedMLP(h, dcfg.intermediate_size, bias=getattr(dcfg, "mlp_bias", False),
                            act=getattr(dcfg, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        a = self.self_attn(positions, x, ctx)
        a, residual = self.post_attention_layernorm(a, hidden)
        return self.mlp(a), residual


class Eagle3Head(nn.Module):
    """EAGLE-3 (see the module docstring); ``forward`` returns the pre-norm ``g`` (T, H)."""

    def __init__(self, dcfg, max_positions: int, *, target_hidden: int, own_embed: bool,
                 vocab_size: int) -> None:
        super().__init__()
        h = dcfg.hidden_size
        self.vocab_size = vocab_size
        draft_vocab = int(getattr(dcfg, "draft_vocab_size", None) or vocab_size)
        self.draft_vocab = draft_vocab
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = Eagle3Layer(dcfg, max_positions)
        self.norm = RMSNorm(h, dcfg.rms_norm_eps)
        self.lm_head = lm_head_linear(h, draft_vocab)
        self.embed_tokens = vocab_embedding(vocab_size, h) if own_embed else None
        self.embed = self.embed_tokens
        # Draft id -> target id (identity when the draft vocabulary is the target's).
        self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)
        self.same_vocab = draft_vocab == vocab_size  # and d2t the identity (load_eagle)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                *, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        e = self.embed(input_ids)
        h = hidden.to(e.dtype)
        if step == 0:  # the target's layer inputs; a chained draft feeds its own g back
            h = self.fc(h)
        elif h is hidden:  # the mid layer's fused add + norm writes into its residual h
            h = h.clone()
        out, residual = self.midlayer(positions, e, h, ctx)
        return out + residual

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        small = gather_logits(self.lm_head(self.norm(g)), self.draft_vocab).float()
        if self.same_vocab:
            return small
        out = small.new_full((small.shape[0], self.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = small
        return out


def _read_head(path: Path) -> dict[str, torch.Tensor]:
    """The head checkpoint's tensors, a leading ``model.`` dropped (some conversions add it)."""
    return {n.removeprefix("model."): t for n, t in iter_weights(path)}


def load_eagle(path: str | Path, method: str, target: nn.Module, target_cfg,
               dtype: torch.dtype, max_positions: int, device: torch.device
               ) -> EagleHead | Eagle3Head:
    """Build the EAGLE / EAGLE-3 head at ``path`` for ``target`` and fill it from the
    checkpoint; ValueError naming what is missing or misfit."""
    path = Path(path)
    dcfg = load_eagle_config(path)
    tensors = _read_head(path)
    th = target_cfg.hidden_size
    th3 = int(getattr(dcfg, "target_hidden_size", None) or th)
    own_embed = "embed_tokens.weight" in tensors
    if dcfg.hidden_size != th and not own_embed:
        raise ValueError(f"the EAGLE head's hidden_size {dcfg.hidden_size} differs from the "
                         f"target's {th} and the head has no embed_tokens of its own")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if method == "eagle3":
                if th3 != th:
                    raise ValueError(f"the EAGLE-3 head's target_hidden_size {th3} is not the "
                                     f"target's hidden_size {th}")
                head = Eagle3Head(dcfg, max_positions, target_hidden=th, own_embed=own_embed,
                                  vocab_size=target_cfg.vocab_size)
            else:
                if dcfg.hidden_size != th:
                    raise ValueError(f"the EAGLE head's hidden_size {dcfg.hidden_size} is not "
                                     f"the target's {th}")
                dcfg = copy.copy(dcfg)
                dcfg.vocab_size = target_cfg.vocab_size
                head = EagleHead(dcfg, max_positions, fc_bias="fc.bias" in tensors,
                                 own_embed=own_embed, own_head="lm_head.weight" in tensors)
    finally:
        torch.set_default_dtype(prev)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # the inverse mask: d2t says everything needed
    if method == "eagle":  # the first layer has no input norm (a converted head may ship one)
        tensors.pop("layers.0.input_layernorm.weight", None)
    loaded = load_into(head, sorted(tensors.items()), rename=CausalLM.fused_names)
    got = {n.split(":")[0] for n in loaded}
    missing = [n for n, _ in head.named_parameters() if n not in got]
    if missing:
        raise ValueError(f"speculative method {method!r}: the head checkpoint {path} lacks "
                         f"{len(missing)} tensor(s), e.g. {missing[0]}")
    if method == "eagle3":
        n = head.draft_vocab  # the whole draft vocabulary (lm_head rows are per rank)
        if d2t is not None:
            if d2t.shape != (n,):
                raise ValueError(f"d2t has shape {tuple(d2t.shape)}; the draft vocabulary is {n}")
            head.draft_to_target.copy_(torch.arange(n) + d2t.long())
            head.same_vocab = n == target_cfg.vocab_size and not bool(d2t.any())
        elif n != target_cfg.vocab_size:
            raise ValueError(f"the EAGLE-3 head's draft vocabulary ({n}) is not the target's "
                             f"({target_cfg.vocab_size}) and the checkpoint has no d2t")
        if int(head.draft_to_target.max()) >= target_cfg.vocab_size or int(
                head.draft_to_target.min()) < 0:
            raise ValueError("d2t maps draft ids outside the target's vocabulary")
    head.eval().requires_grad_(False)
    if head.embed_tokens is None:
        head.embed = target_embedding(target).__call__
    if isinstance(head, EagleHead) and head.lm_head is None:
        head.target_logits = target.compute_logits
    return head


class EagleProposer(HiddenStateProposer):
    """Drafts with an EAGLE / EAGLE-3 head; an EAGLE-3 head makes the runner capture the
    target's layer inputs (``aux_layers``)."""

    def __init__(self, head: EagleHead | Eagle3Head, target: nn.Module, target_cfg,
                 aux_layers: tuple[int, ...] | None) -> None:
        if aux_layers is not None:
            if len(aux_layers) != 3:
                raise ValueError(f"EAGLE-3 takes 3 target layers, got "
                                 f"eagle_aux_hidden_state_layer_ids {list(aux_layers)}")
            check_aux_layers(target, aux_layers)
        super().__init__(head, head.compute_logits, aux_layers)
