"""GGUF architectures pagefold reads itself: llama.cpp's names and transforms, inverted.

transformers 5 reads no GGUF of the GDN hybrids (``qwen3next``, ``qwen35``, ``qwen35moe``)
nor of the Mamba-2 family (``mamba2``, ``nemotron_h``, ``nemotron_h_moe``,
``granitehybrid``), so for those :mod:`.gguf_native` reads the file with the tables here.
Each :class:`ArchSpec` gives

* ``config``: the Hugging Face config keyword arguments from the file's metadata (keys as
  llama.cpp's ``convert_hf_to_gguf.py`` writes them, ``gguf.Keys``), and
* ``plan``: for one GGUF tensor (``blk.N.<short>.<suffix>``, names ``gguf.TENSOR_NAMES``),
  the :class:`Out` pieces it becomes: a Hugging Face parameter name, the rows it takes (a
  row permutation or split: applied to a quantized tensor's raw block rows, nothing
  decoded), and a float transform (which decodes the tensor).

The transforms llama.cpp applies and their inverses here: ``A_log`` stored as ``-exp(A_log)``
(read back as ``log(-A)``); conv1d weights squeezed to (channels, kernel) (unsqueezed);
Qwen3-Next's norm weights stored ``+ 1`` except the GDN output norm (``- 1``); Qwen3-Next's
``in_proj_qkvz`` split into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z), which
is already the split pagefold's model makes (loaded as ``in_proj_qkv`` / ``in_proj_z``);
``in_proj_ba`` kept per key head ``[b (r) | a (r)]`` (split into ``in_proj_b`` / ``in_proj_a``
by rows); Qwen3.5's value heads reordered from grouped-by-key-head to tiled (rows of ``v``,
``z``, ``b``, ``a``, ``A_log``, ``dt_bias``, conv channels; columns of ``out_proj``); the
Mamba-2 family's ``A`` / ``D`` as (heads, 1) and the gated norm as (groups, channels / groups);
Nemotron-H's and Granite's attention Q/K rows permuted as Llama's (``LlamaModel.permute``);
MoE experts stacked into ``ffn_{gate,up,down}_exps`` (gate and up joined back into
``gate_up_proj``; Nemotron-H's ungated ``ffn_{up,down}_exps``, its router's score bias as
``exp_probs_b``, its latent projections as ``ffn_latent_{down,up}``), each expert's rows kept
quantized as that expert's own weight; Granite's shared MLP ``input_linear`` split into
``ffn_{gate,up}_shexp`` (joined back) and its multipliers written as ``*_scale`` keys.

Invariant: every row index is a permutation or a contiguous part of the stored rows, so a
quantized tensor keeps its blocks bit for bit; a column permutation (Qwen3.5's ``out_proj``
with fewer key than value heads) moves whole blocks when the value head width is a multiple
of the block, else that one tensor is decoded (``Out.cols``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["ARCHS", "ArchSpec", "GGUFConversionError", "Meta", "Out"]


class GGUFConversionError(RuntimeError):
    """A GGUF file could not be turned into a checkpoint (message says why and what to do)."""


@dataclass
class Out:
    """One Hugging Face tensor (or part of one) made from a GGUF tensor.

    ``rows``: indices into the stored rows (None: all, in order); ``value``: a float
    transform (the tensor is decoded first); ``shape``: the result's shape (float only);
    ``part``: position when several GGUF tensors are joined along the rows (``gate_up_proj``);
    ``cols``: a column permutation (moved as whole blocks, or decoded); ``decode``: always
    stored as float (routers: not a linear layer of the model); ``expert``: a stacked MoE
    tensor (experts, rows, cols) whose expert ``e`` kept quantized is the Hugging Face
    per-expert weight ``<experts>.<e>.<expert>.weight``."""

    hf: str
    rows: np.ndarray | None = None
    value: Callable[[torch.Tensor], torch.Tensor] | None = None
    shape: tuple[int, ...] | None = None
    part: int | None = None
    cols: np.ndarray | None = None
    decode: bool = False
    expert: str | None = None


@dataclass
class Meta:
    """The file's metadata (``general.architecture``'s keys) and its tensor names/shapes."""

    arch: str
    fields: dict
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> HF-order shape

    def get(self, key: str, default=None):
        """``{arch}.<key>`` (or ``key`` itself when it names another namespace)."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        return self.fields.get(full, default)

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise GGUFConversionError(f"the {self.arch} GGUF lacks the metadata key "
                                      f"{self.arch}.{key} (file truncated or not written by "
                                      "llama.cpp's converter)")
        return v

    def has(self, name: str) -> bool:
        return name in self.tensors

    def blocks(self) -> int:
        return int(self.need("block_count")) - int(self.get("nextn_predict_layers", 0) or 0)


@dataclass
class ArchSpec:
    model_type: str
    config: Callable[[Meta], dict]
    plan: Callable[[str, str, int | None, dict], list[Out] | None]


def _neg_exp_inv(a: torch.Tensor) -> torch.Tensor:
    return torch.log(-a)


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w - 1.0


def _max(v) -> int:
    return int(max(v)) if isinstance(v, (list, tuple)) else int(v)


def _common(m: Meta) -> dict:
    eos = m.get("tokenizer.ggml.eos_token_id")
    return dict(
        vocab_size=m.tensors["token_embd.weight"][0],
        hidden_size=int(m.need("embedding_length")),
        num_hidden_layers=m.blocks(),
        max_position_embeddings=int(m.get("context_length", 4096)),
        tie_word_embeddings=not m.has("output.weight"),
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=m.get("tokenizer.ggml.padding_token_id"),
    )


# --------------------------------------------------------------------------- GDN hybrids

def _gdn_dims(cfg: dict) -> tuple[int, int, int, int]:
    return (cfg["linear_num_key_heads"], cfg["linear_key_head_dim"],
            cfg["linear_num_value_heads"], cfg["linear_value_head_dim"])


def _qwen_gdn_config(m: Meta) -> dict:
    n = m.blocks()
    head_dim = int(m.need("attention.key_length"))
    rec = m.get("attention.recurrent_layers")
    if rec is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in list(rec)[:n]]
    else:
        every = int(m.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % every else "full_attention"
                       for i in range(n)]
    nv = int(m.need("ssm.time_step_rank"))
    rope = dict(rope_type="default", rope_theta=float(m.get("rope.freq_base", 10000.0)),
                partial_rotary_factor=int(m.need("rope.dimension_count")) / head_dim)
    sections = m.get("rope.dimension_sections")
    if sections is not None and m.arch != "qwen3next":
        rope.update(mrope_section=[int(s) for s in list(sections)[:3]], mrope_interleaved=True)
    cfg = dict(
        _common(m),
        num_attention_heads=_max(m.need("attention.head_count")),
        num_key_value_heads=_max(m.need("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(m.need("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        layer_types=layer_types,
        linear_conv_kernel_dim=int(m.need("ssm.conv_kernel")),
        linear_key_head_dim=int(m.need("ssm.state_size")),
        linear_num_key_heads=int(m.need("ssm.group_count")),
        linear_num_value_heads=nv,
        linear_value_head_dim=int(m.need("ssm.inner_size")) // nv,
    )
    if m.get("feed_forward_length") is not None:
        cfg["intermediate_size"] = _max(m.get("feed_forward_length"))
    if m.get("expert_count"):
        cfg.update(num_experts=int(m.need("expert_count")),
                   num_experts_per_tok=int(m.need("expert_used_count")),
                   moe_intermediate_size=int(m.need("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(
                       m.get("expert_shared_feed_forward_length", 0) or 0),
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return cfg


def _tiled(nk: int, r: int, width: int) -> np.ndarray:
    """Row ``i`` of the stored (tiled: value head ``j * nk + k``) layout for each grouped row
    (value head ``k * r + j``) of ``width`` rows per head: the inverse of llama.cpp's
    ``_reorder_v_heads``."""
    idx = np.arange(nk * r * width).reshape(r, nk, width)  # stored order: [j][k]
    return idx.transpose(1, 0, 2).reshape(-1)  # grouped order: [k][j]


# Per-layer names shared by the Qwen GDN hybrids: GGUF short name -> HF suffix.
_QWEN_PLAIN = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_QWEN_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _qwen_gdn_plan(short: str, suffix: str, bid: int | None, cfg: dict) -> list[Out] | None:
    top = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight"}
    if bid is None:
        if short == "output_norm":
            return [Out("model.norm.weight", value=_minus_one)]
        return [Out(top[short])] if short in top and suffix == "weight" else None
    p = f"model.layers.{bid}."
    nk, dk, nv, dv = _gdn_dims(cfg)
    r = nv // nk
    tiled = cfg.get("_gguf_arch") != "qwen3next" and nk != nv  # Qwen3.5's head order
    if short in _QWEN_PLAIN:
        return [Out(f"{p}{_QWEN_PLAIN[short]}.{suffix}")]
    if short in _QWEN_NORMS:
        return [Out(f"{p}{_QWEN_NORMS[short]}.weight", value=_minus_one)]
    la = f"{p}linear_attn."
    heads = _tiled(nk, r, 1) if tiled else None
    if short == "attn_qkv":
        rows = None
        if tiled:
            rows = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + _tiled(nk, r, dv)])
        return [Out(f"{la}in_proj_qkv.weight", rows=rows)]
    if short == "attn_gate":
        if "linear_attention" not in cfg["layer_types"][bid]:
            return None  # only the GDN layers have a z gate in the GGUF layout
        return [Out(f"{la}in_proj_z.weight", rows=_tiled(nk, r, dv) if tiled else None)]
    if short == "ssm_ba":  # Qwen3-Next: per key head [b (r) | a (r)]
        per = np.arange(nk * 2 * r).reshape(nk, 2, r)
        return [Out(f"{la}in_proj_b.weight", rows=per[:, 0].reshape(-1)),
                Out(f"{la}in_proj_a.weight", rows=per[:, 1].reshape(-1))]
    if short in ("ssm_beta", "ssm_alpha"):
        return [Out(f"{la}in_proj_{'b' if short == 'ssm_beta' else 'a'}.weight", rows=heads)]
    if short == "ssm_conv1d":
        rows = None
        if tiled:
            rows = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + _tiled(nk, r, dv)])
        return [Out(f"{la}conv1d.weight", rows=rows, value=lambda w: w,
                    shape=(2 * nk * dk + nv * dv, 1, cfg["linear_conv_kernel_dim"]))]
    if short == "ssm_dt" and suffix == "bias":
        return [Out(f"{la}dt_bias", rows=heads, value=lambda w: w)]
    if short == "ssm_a":
        return [Out(f"{la}A_log", rows=heads, value=_neg_exp_inv)]
    if short == "ssm_norm":
        return [Out(f"{la}norm.weight", value=lambda w: w)]
    if short == "ssm_out":
        cols = _tiled(nk, r, dv) if tiled else None
        return [Out(f"{la}out_proj.weight", cols=cols)]
    if short == "ffn_gate_inp":
        return [Out(f"{p}mlp.gate.weight", decode=True)]
    if short == "ffn_gate_inp_shexp":
        return [Out(f"{p}mlp.shared_expert_gate.weight", decode=True, value=lambda w: w,
                    shape=(1, cfg["hidden_size"]))]
    if short in ("ffn_gate_exps", "ffn_up_exps"):
        gate = short == "ffn_gate_exps"
        return [Out(f"{p}mlp.experts.gate_up_proj", part=0 if gate else 1,
                    expert="gate_proj" if gate else "up_proj")]
    if short == "ffn_down_exps":
        return [Out(f"{p}mlp.experts.down_proj", expert="down_proj")]
    return None


# --------------------------------------------------------------------------- Mamba-2 family

def _mamba2_common(m: Meta) -> dict:
    heads = int(m.need("ssm.time_step_rank"))
    eps = m.get("attention.layer_norm_rms_epsilon") or m.get("attention.layer_norm_epsilon")
    return dict(ssm_state_size=int(m.need("ssm.state_size")),
                conv_kernel=int(m.need("ssm.conv_kernel")), n_groups=int(m.need("ssm.group_count")),
                head_dim=int(m.need("ssm.inner_size")) // heads, num_heads=heads,
                layer_norm_epsilon=float(eps if eps is not None else 1e-5))


def _mamba2_config(m: Meta) -> dict:
    c = _mamba2_common(m)
    c["state_size"] = c.pop("ssm_state_size")
    hidden = int(m.need("embedding_length"))
    return dict(_common(m), **c, expand=c["head_dim"] * c["num_heads"] // hidden,
                use_conv_bias=m.has("blk.0.ssm_conv1d.bias"), use_bias=m.has("blk.0.ssm_in.bias"),
                rms_norm=True, norm_before_gate=False)


def _nemotron_h_config(m: Meta) -> dict:
    c = _mamba2_common(m)
    types = []
    for i in range(m.blocks()):
        if m.has(f"blk.{i}.ssm_in.weight"):
            types.append("mamba")
        elif m.has(f"blk.{i}.attn_q.weight"):
            types.append("attention")
        elif m.has(f"blk.{i}.ffn_up.weight"):
            types.append("mlp")
        elif m.has(f"blk.{i}.ffn_up_exps.weight"):
            types.append("moe")
        else:
            raise GGUFConversionError(f"{m.arch} GGUF: block {i} has no ssm_in, attn_q, "
                                      "ffn_up or ffn_up_exps tensor")
    hidden = int(m.need("embedding_length"))
    # nemotron_h_moe (what the converter writes whenever the config names
    # num_experts_per_tok, as transformers 5's always does) gives its feed_forward_length to
    # the MoE blocks (0 for dense MLP ones): a dense width from the tensors
    mlp = [i for i, t in enumerate(types) if t == "mlp"]
    inter = (m.tensors[f"blk.{mlp[0]}.ffn_up.weight"][0] if mlp
             else _max(m.get("feed_forward_length", 0) or 0))
    return dict(
        _common(m), **(_nemotron_h_moe_config(m) if "moe" in types else {}),
        layers_block_type=types,
        num_attention_heads=_max(m.need("attention.head_count")),
        num_key_value_heads=_max(m.need("attention.head_count_kv")),
        head_dim=int(m.get("attention.key_length", hidden // _max(m.need(
            "attention.head_count")))),
        intermediate_size=inter or 1,
        mamba_num_heads=c["num_heads"], mamba_head_dim=c["head_dim"], n_groups=c["n_groups"],
        ssm_state_size=c["ssm_state_size"], conv_kernel=c["conv_kernel"],
        expand=c["head_dim"] * c["num_heads"] // hidden,
        use_conv_bias=m.has(f"blk.{types.index('mamba')}.ssm_conv1d.bias")
        if "mamba" in types else True,
        mamba_proj_bias=False, layer_norm_epsilon=c["layer_norm_epsilon"],
    )


def _nemotron_h_moe_config(m: Meta) -> dict:
    """Nemotron-H's MoE keys (written by the converter for ``nemotron_h_moe``)."""
    groups = int(m.get("expert_group_count", 1) or 1)
    used_groups = m.get("expert_group_used_count")
    if groups > 1 and used_groups is None:  # the converter does not write topk_group
        raise GGUFConversionError(f"the {m.arch} GGUF routes over {groups} expert groups but "
                                  f"lacks {m.arch}.expert_group_used_count (topk_group)")
    latent = m.get("moe_latent_size")
    return dict(
        n_routed_experts=int(m.need("expert_count")),
        num_experts_per_tok=int(m.need("expert_used_count")),
        moe_intermediate_size=_max(m.need("expert_feed_forward_length")),
        moe_shared_expert_intermediate_size=_max(m.need("expert_shared_feed_forward_length")),
        n_shared_experts=int(m.get("expert_shared_count", 1) or 1),
        norm_topk_prob=bool(m.get("expert_weights_norm", True)),
        routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)),
        n_group=groups, topk_group=int(used_groups or 1),
        moe_latent_size=int(latent) if latent else None,
    )


def _unpermute(n_head: int, rows: int) -> np.ndarray:
    """The stored row of each model row of a Q/K weight that llama.cpp permuted per head
    (``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``): model row ``(h, j, i)`` is stored at
    ``(h, i, j)``."""
    half = rows // n_head // 2
    stored = np.arange(rows).reshape(n_head, half, 2)  # stored position of model (h, j, i)
    return stored.transpose(0, 2, 1).reshape(-1)


def _mamba2_mixer(short: str, suffix: str, mx: str, cfg: dict) -> list[Out] | None:
    heads = cfg.get("mamba_num_heads", cfg.get("num_heads"))
    if short == "ssm_in":
        return [Out(f"{mx}in_proj.{suffix}")]
    if short == "ssm_out":
        return [Out(f"{mx}out_proj.{suffix}")]
    if short == "ssm_conv1d":
        if suffix == "bias":
            return [Out(f"{mx}conv1d.bias", value=lambda w: w)]
        return [Out(f"{mx}conv1d.weight", value=lambda w: w.unsqueeze(1))]
    if short == "ssm_dt" and suffix == "bias":
        return [Out(f"{mx}dt_bias", value=lambda w: w)]
    if short == "ssm_a":
        return [Out(f"{mx}A_log", value=_neg_exp_inv, shape=(heads,))]
    if short == "ssm_d":
        return [Out(f"{mx}D", value=lambda w: w, shape=(heads,))]
    if short == "ssm_norm":
        return [Out(f"{mx}norm.weight", value=lambda w: w.reshape(-1))]
    return None


def _mamba2_plan(short: str, suffix: str, bid: int | None, cfg: dict) -> list[Out] | None:
    top = {"token_embd": "backbone.embeddings.weight", "output": "lm_head.weight",
           "output_norm": "backbone.norm_f.weight"}
    if bid is None:
        return [Out(top[short])] if short in top else None
    if short == "attn_norm":
        return [Out(f"backbone.layers.{bid}.norm.weight")]
    return _mamba2_mixer(short, suffix, f"backbone.layers.{bid}.mixer.", cfg)


def _nemotron_h_plan(short: str, suffix: str, bid: int | None, cfg: dict) -> list[Out] | None:
    top = {"token_embd": "model.embeddings.weight", "output": "lm_head.weight",
           "output_norm": "model.norm_f.weight"}
    if bid is None:
        return [Out(top[short])] if short in top else None
    mx = f"model.layers.{bid}.mixer."
    if short == "attn_norm":
        return [Out(f"model.layers.{bid}.norm.weight")]
    plain = {"attn_v": "v_proj", "attn_output": "o_proj", "ffn_up": "up_proj",
             "ffn_down": "down_proj", "ffn_up_shexp": "shared_experts.up_proj",
             "ffn_down_shexp": "shared_experts.down_proj", "ffn_latent_down": "fc1_latent_proj",
             "ffn_latent_up": "fc2_latent_proj"}
    if short in plain:
        return [Out(f"{mx}{plain[short]}.{suffix}")]
    if short in ("ffn_up_exps", "ffn_down_exps"):  # stacked, kept quantized per expert
        proj = "up_proj" if short == "ffn_up_exps" else "down_proj"
        return [Out(f"{mx}experts.{proj}", expert=proj)]
    if short == "ffn_gate_inp":  # the router, float32 as transformers keeps it
        return [Out(f"{mx}gate.weight", decode=True)]
    if short == "exp_probs_b":
        return [Out(f"{mx}gate.e_score_correction_bias", value=lambda w: w)]
    if short in ("attn_q", "attn_k"):
        n = cfg["num_attention_heads"] if short == "attn_q" else cfg["num_key_value_heads"]
        rows = n * cfg["head_dim"]
        return [Out(f"{mx}{short[-1]}_proj.{suffix}", rows=_unpermute(n, rows))]
    return _mamba2_mixer(short, suffix, mx, cfg)


def _granite_hybrid_config(m: Meta) -> dict:
    c = _mamba2_common(m)
    n = m.blocks()
    kv = m.need("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    hidden = int(m.need("embedding_length"))
    experts = int(m.get("expert_count", 0) or 0)
    # widths from the tensors: llama.cpp writes the expert width as feed_forward_length and
    # the shared MLP's only for the shared-expert variant
    up = "ffn_up_shexp" if experts else "ffn_up"
    shared = next((m.tensors[k][0] for k in m.tensors if k.endswith(f".{up}.weight")), 0)
    # layer kinds from the tensors: the converter's per-layer head_count_kv is all 0 for a
    # config whose layer_types say "full_attention" (transformers 5) rather than "attention"
    attn = [i for i in range(n) if m.has(f"blk.{i}.attn_q.weight")]
    heads = _max(m.need("attention.head_count"))
    kv_heads = max(int(k) for k in kv)
    if not kv_heads and attn:
        kv_heads = m.tensors[f"blk.{attn[0]}.attn_k.weight"][0] // (hidden // heads)
    cfg = dict(
        _common(m),
        layer_types=["full_attention" if i in attn else "linear_attention" for i in range(n)],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or 1,
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=dict(rope_type="default",
                             rope_theta=float(m.get("rope.freq_base", 10000.0))),
        position_embedding_type="rope" if m.get("rope.scaling.finetuned") else None,
        embedding_multiplier=float(m.get("embedding_scale", 1.0)),
        residual_multiplier=float(m.get("residual_scale", 1.0)),
        logits_scaling=float(m.get("logit_scale", 1.0)),
        attention_multiplier=float(m.get("attention.scale", 1.0)),
        num_local_experts=experts, shared_intermediate_size=shared,
        mamba_n_heads=c["num_heads"], mamba_d_head=c["head_dim"], mamba_n_groups=c["n_groups"],
        mamba_d_state=c["ssm_state_size"], mamba_d_conv=c["conv_kernel"],
        mamba_expand=c["head_dim"] * c["num_heads"] // hidden,
        mamba_conv_bias=any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
        mamba_proj_bias=any(k.endswith("ssm_in.bias") for k in m.tensors),
    )
    if experts:
        cfg.update(num_experts_per_tok=int(m.need("expert_used_count")),
                   intermediate_size=next(m.tensors[k][-2] for k in m.tensors
                                          if k.endswith(".ffn_gate_exps.weight")))
    return cfg


def _granite_hybrid_plan(short: str, suffix: str, bid: int | None, cfg: dict
                         ) -> list[Out] | None:
    top = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight",
           "output_norm": "model.norm.weight"}
    if bid is None:
        return [Out(top[short])] if short in top else None
    p = f"model.layers.{bid}."
    plain = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_down_shexp": "shared_mlp.output_linear", "ffn_down": "shared_mlp.output_linear"}
    if short in plain:
        return [Out(f"{p}{plain[short]}.{suffix}")]
    if short in ("attn_q", "attn_k"):  # llama.cpp permutes them as Llama's (undo_permute)
        n = cfg["num_attention_heads"] if short == "attn_q" else cfg["num_key_value_heads"]
        rows = n * (cfg["hidden_size"] // cfg["num_attention_heads"])
        return [Out(f"{p}self_attn.{short[-1]}_proj.{suffix}", rows=_unpermute(n, rows))]
    if short in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_gate", "ffn_up"):
        return [Out(f"{p}shared_mlp.input_linear.weight", part=0 if "gate" in short else 1)]
    if short == "ffn_gate_inp":
        return [Out(f"{p}block_sparse_moe.router.weight", decode=True)]
    # kept quantized per expert (``<moe>.experts.<e>.<proj>``), as Qwen3-Next's
    if short in ("ffn_gate_exps", "ffn_up_exps"):
        gate = short == "ffn_gate_exps"
        return [Out(f"{p}block_sparse_moe.experts.gate_up_proj", part=0 if gate else 1,
                    expert="gate_proj" if gate else "up_proj")]
    if short == "ffn_down_exps":
        return [Out(f"{p}block_sparse_moe.experts.down_proj", expert="down_proj")]
    return _mamba2_mixer(short, suffix, f"{p}mamba.", dict(cfg, num_heads=cfg["mamba_n_heads"]))


ARCHS: dict[str, ArchSpec] = {
    "qwen3next": ArchSpec("qwen3_next", _qwen_gdn_config, _qwen_gdn_plan),
    "qwen35": ArchSpec("qwen3_5_text", _qwen_gdn_config, _qwen_gdn_plan),
    "qwen35moe": ArchSpec("qwen3_5_moe_text", _qwen_gdn_config, _qwen_gdn_plan),
    "mamba2": ArchSpec("mamba2", _mamba2_config, _mamba2_plan),
    "nemotron_h": ArchSpec("nemotron_h", _nemotron_h_config, _nemotron_h_plan),
    "nemotron_h_moe": ArchSpec("nemotron_h", _nemotron_h_config, _nemotron_h_plan),
    "granitehybrid": ArchSpec("granitemoehybrid", _granite_hybrid_config,
                              _granite_hybrid_plan),
}
