"""Tiny GGUFs of the hybrids, written from a transformers model as llama.cpp's converter
writes them (``convert_hf_to_gguf.py``: facts only), with the ``gguf`` package; nothing of
pagefold's reader is used.

:func:`write_hybrid_gguf` returns the reference state dict: the model's weights as the file
holds them, in Hugging Face layout. A quantized tensor's reference is
``gguf.quants.dequantize(gguf.quants.quantize(w))`` of the Hugging Face weight: llama.cpp's
transforms of quantized tensors only move or split rows (Q/K permutation, ``in_proj_qkvz``
split, experts stacked), and quantization is per row, so that is exactly what the file's
blocks decode to. Float transforms are undone here as a reader must: ``A_log`` stored as
``-exp(A_log)`` comes back as ``log(-A)``, Qwen3-Next's ``norm + 1`` as ``stored - 1``.

Layouts (llama.cpp 0.3.36):

* ``qwen3next``: ``in_proj_qkvz`` (per key head ``[q | k | v (r) | z (r)]``) split into
  ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z); ``in_proj_ba`` stored as is
  (``ssm_ba``); conv1d squeezed; ``dt_bias`` as ``ssm_dt.bias``; norms ``+ 1`` except the
  GDN norm; experts stacked ``ffn_{gate,up,down}_exps``; routers F32.
* ``qwen35``: as Qwen3-Next's GDN (its checkpoint has ``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a`` already: ``attn_qkv`` / ``attn_gate`` / ``ssm_beta`` /
  ``ssm_alpha``), value heads reordered from grouped-by-key-head to tiled when there are
  fewer key heads (rows of v, z, b, a, conv channels, A, dt; columns of ``ssm_out``); dense
  MLP; mrope sections.
* ``nemotron_h``: attention Q/K rows permuted per head (``LlamaModel.permute``), A / D as
  (heads, 1), the gated norm as (groups, channels / groups), conv squeezed;
  ``nemotron_h_moe``: MoE blocks as ``ffn_gate_inp`` (router), ``exp_probs_b.bias`` (its
  score-correction bias), stacked ``ffn_{up,down}_exps``, ``ffn_{up,down}_shexp`` and the
  latent projections ``ffn_latent_{down,up}``, all as stored (no row moves).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class _Writer:
    def __init__(self, path, arch: str, kind: str, tok: dict) -> None:
        self.w = gguf.GGUFWriter(str(path), arch)
        self.arch, self.kind = arch, Q[kind]
        self.ref: dict[str, torch.Tensor] = {}
        w = self.w
        w.add_name("tiny-hybrid")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(tok["bos"])
        w.add_eos_token_id(tok["eos"])

    def key(self, name: str, value) -> None:
        full = f"{self.arch}.{name}"
        if isinstance(value, list):
            self.w.add_array(full, value)
        elif isinstance(value, float):
            self.w.add_float32(full, value)
        else:
            self.w.add_uint32(full, int(value))

    def quant(self, gguf_name: str, hf_name: str, w: torch.Tensor, moved=None,
              back=None) -> None:
        """``w`` (Hugging Face layout) quantized when its rows are whole blocks (else F32,
        as llama.cpp falls back); ``moved``: llama.cpp's row transform of the stored tensor;
        ``back``: the inverse of a column transform (which does not commute with per-block
        quantization: the reference is then the stored tensor decoded and moved back)."""
        a = w.detach().float().numpy()
        if a.shape[-1] % 32:
            self.f32(gguf_name, hf_name, w, moved)
            return
        q = gguf.quants.quantize(a, self.kind)
        stored = gguf.quants.quantize(moved(a) if moved else a, self.kind)
        if back is not None:
            deq = back(gguf.quants.dequantize(stored, self.kind))
            self.ref[hf_name] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            self.ref[hf_name] = torch.from_numpy(gguf.quants.dequantize(q, self.kind).copy())
        self.w.add_tensor(gguf_name, stored, raw_dtype=self.kind)

    def f32(self, gguf_name: str, hf_name: str | None, w: torch.Tensor, moved=None,
            ref: torch.Tensor | None = None) -> None:
        a = w.detach().float().numpy()
        self.w.add_tensor(gguf_name, np.ascontiguousarray(moved(a) if moved else a))
        if hf_name is not None:
            self.ref[hf_name] = (ref if ref is not None else w.detach().float()).clone()

    def close(self) -> dict[str, torch.Tensor]:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.ref


def _a_stored(a_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what llama.cpp stores: -exp(A_log), what a reader gets back: log(-stored))."""
    stored = -torch.exp(a_log.detach().float())
    return stored, torch.log(-stored)


def _tiled(a: np.ndarray, nk: int, r: int, width: int, axis: int = 0) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    t = a.reshape(nk, r, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def _qwen_keys(w: _Writer, cfg) -> None:
    head_dim = cfg.head_dim
    w.key("block_count", cfg.num_hidden_layers)
    w.key("context_length", cfg.max_position_embeddings)
    w.key("embedding_length", cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):
        w.key("feed_forward_length", cfg.intermediate_size)
    w.key("attention.head_count", cfg.num_attention_heads)
    w.key("attention.head_count_kv", cfg.num_key_value_heads)
    w.key("attention.key_length", head_dim)
    w.key("attention.value_length", head_dim)
    w.key("attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    w.key("rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.key("rope.dimension_count",
          int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if "mrope_section" in cfg.rope_parameters:
        w.key("rope.dimension_sections", [*cfg.rope_parameters["mrope_section"], 0][:4])
    if getattr(cfg, "num_experts", 0):
        w.key("expert_count", cfg.num_experts)
        w.key("expert_used_count", cfg.num_experts_per_tok)
        w.key("expert_feed_forward_length", cfg.moe_intermediate_size)
        w.key("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    w.key("ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    w.key("ssm.state_size", cfg.linear_key_head_dim)
    w.key("ssm.group_count", cfg.linear_num_key_heads)
    w.key("ssm.time_step_rank", cfg.linear_num_value_heads)
    w.key("ssm.inner_size", cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    w.key("full_attention_interval", 4)
    w.w.add_array(f"{w.arch}.attention.recurrent_layers",
                  [t == "linear_attention" for t in cfg.layer_types])


def _norm(w: _Writer, sd: dict, gname: str, hname: str) -> None:
    """Qwen's zero-centred norms: stored + 1, read back - 1."""
    stored = sd[hname].float() + 1
    w.f32(gname, hname, stored, ref=stored - 1)


def _qwen_attention(w: _Writer, sd: dict, b: str, p: str) -> None:
    sa = p + "self_attn."
    for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                 ("attn_output", "o_proj")):
        w.quant(f"{b}.{g}.weight", f"{sa}{h}.weight", sd[f"{sa}{h}.weight"])
    _norm(w, sd, f"{b}.attn_q_norm.weight", sa + "q_norm.weight")
    _norm(w, sd, f"{b}.attn_k_norm.weight", sa + "k_norm.weight")


def _qwen_moe(w: _Writer, sd: dict, b: str, mp: str, cfg) -> None:
    """Router and shared-expert gate F32, experts stacked (gate and up split)."""
    w.f32(f"{b}.ffn_gate_inp.weight", mp + "gate.weight", sd[mp + "gate.weight"])
    gu, dn = sd[mp + "experts.gate_up_proj"].float(), sd[mp + "experts.down_proj"].float()
    inter = cfg.moe_intermediate_size
    w.quant(f"{b}.ffn_gate_exps.weight", mp + "experts.gate_up_proj", gu,
            moved=lambda a, n=inter: np.ascontiguousarray(a[:, :n]))
    w.w.add_tensor(f"{b}.ffn_up_exps.weight",
                   gguf.quants.quantize(np.ascontiguousarray(gu.numpy()[:, inter:]),
                                        w.kind), raw_dtype=w.kind)
    w.quant(f"{b}.ffn_down_exps.weight", mp + "experts.down_proj", dn)
    for g, h in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                 ("ffn_down_shexp", "down_proj")):
        w.quant(f"{b}.{g}.weight", f"{mp}shared_expert.{h}.weight",
                sd[f"{mp}shared_expert.{h}.weight"])
    w.f32(f"{b}.ffn_gate_inp_shexp.weight", mp + "shared_expert_gate.weight",
          sd[mp + "shared_expert_gate.weight"])


def _qwen35(w: _Writer, model, cfg) -> None:
    """Qwen3.5 (dense MLP, or MoE as Qwen3-Next's for ``qwen35moe``): value heads tiled
    when there are fewer key heads."""
    sd = model.state_dict()
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r, qk = nv // nk, 2 * nk * dk
    _qwen_keys(w, cfg)
    w.quant("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    _norm(w, sd, "output_norm.weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        w.quant("output.weight", "lm_head.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        b, p = f"blk.{i}", f"model.layers.{i}."
        _norm(w, sd, f"{b}.attn_norm.weight", p + "input_layernorm.weight")
        _norm(w, sd, f"{b}.post_attention_norm.weight", p + "post_attention_layernorm.weight")
        if cfg.layer_types[i] == "linear_attention":
            la = p + "linear_attn."

            def qkv_rows(a):
                return np.concatenate([a[:qk], _tiled(a[qk:], nk, r, dv)])

            w.quant(f"{b}.attn_qkv.weight", la + "in_proj_qkv.weight",
                    sd[la + "in_proj_qkv.weight"], moved=qkv_rows)
            w.quant(f"{b}.attn_gate.weight", la + "in_proj_z.weight",
                    sd[la + "in_proj_z.weight"], moved=lambda a: _tiled(a, nk, r, dv))
            for g, h in (("ssm_beta", "in_proj_b"), ("ssm_alpha", "in_proj_a")):
                w.quant(f"{b}.{g}.weight", f"{la}{h}.weight", sd[f"{la}{h}.weight"],
                        moved=lambda a: _tiled(a, nk, r, 1))
            w.f32(f"{b}.ssm_conv1d.weight", la + "conv1d.weight", sd[la + "conv1d.weight"],
                  moved=lambda a: qkv_rows(a.squeeze(1)))
            w.f32(f"{b}.ssm_dt.bias", la + "dt_bias", sd[la + "dt_bias"],
                  moved=lambda a: _tiled(a, nk, r, 1))
            stored, back = _a_stored(sd[la + "A_log"])
            w.f32(f"{b}.ssm_a", la + "A_log", stored, ref=back,
                  moved=lambda a: _tiled(a, nk, r, 1))
            w.f32(f"{b}.ssm_norm.weight", la + "norm.weight", sd[la + "norm.weight"])
            w.quant(f"{b}.ssm_out.weight", la + "out_proj.weight", sd[la + "out_proj.weight"],
                    moved=lambda a: _tiled(a, nk, r, dv, axis=1),
                    back=lambda a: _tiled(a, r, nk, dv, axis=1))
        else:
            _qwen_attention(w, sd, b, p)
        if getattr(cfg, "num_experts", 0):
            _qwen_moe(w, sd, b, p + "mlp.", cfg)
            continue
        for g, h in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            w.quant(f"{b}.{g}.weight", f"{p}mlp.{h}.weight", sd[f"{p}mlp.{h}.weight"])


def _qwen3next(w: _Writer, model, cfg) -> None:
    sd = model.state_dict()
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r = nv // nk
    _qwen_keys(w, cfg)

    def norm(gname: str, hname: str) -> None:
        _norm(w, sd, gname, hname)

    w.quant("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    norm("output_norm.weight", "model.norm.weight")
    w.quant("output.weight", "lm_head.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        b, p = f"blk.{i}", f"model.layers.{i}."
        norm(f"{b}.attn_norm.weight", p + "input_layernorm.weight")
        norm(f"{b}.post_attention_norm.weight", p + "post_attention_layernorm.weight")
        if cfg.layer_types[i] == "linear_attention":
            la = p + "linear_attn."
            qkvz = sd[la + "in_proj_qkvz.weight"].float()
            per = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = per.split([dk, dk, r * dv, r * dv], dim=1)
            qkv = torch.cat([t.reshape(-1, cfg.hidden_size) for t in (q, k, v)])
            z = z.reshape(-1, cfg.hidden_size)
            # llama.cpp's split is a row permutation of in_proj_qkvz: its quantized rows are
            # those of the Hugging Face tensor (reference: the whole tensor round-tripped)
            w.quant(f"{b}.attn_qkv.weight", la + "in_proj_qkvz.weight", qkvz,
                    moved=lambda a, qkv=qkv: qkv.numpy())
            w.w.add_tensor(f"{b}.attn_gate.weight", gguf.quants.quantize(z.numpy(), w.kind),
                           raw_dtype=w.kind)
            w.quant(f"{b}.ssm_ba.weight", la + "in_proj_ba.weight",
                    sd[la + "in_proj_ba.weight"])
            w.f32(f"{b}.ssm_conv1d.weight", la + "conv1d.weight", sd[la + "conv1d.weight"],
                  moved=lambda a: a.squeeze(1))
            w.f32(f"{b}.ssm_dt.bias", la + "dt_bias", sd[la + "dt_bias"])
            stored, back = _a_stored(sd[la + "A_log"])
            w.f32(f"{b}.ssm_a", la + "A_log", stored, ref=back)
            w.f32(f"{b}.ssm_norm.weight", la + "norm.weight", sd[la + "norm.weight"])
            w.quant(f"{b}.ssm_out.weight", la + "out_proj.weight", sd[la + "out_proj.weight"])
        else:
            _qwen_attention(w, sd, b, p)
        _qwen_moe(w, sd, b, p + "mlp.", cfg)


def _nemotron_h(w: _Writer, model, cfg) -> None:
    sd = model.state_dict()
    types = cfg.layers_block_type
    n = len(types)
    heads, hd, groups = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups
    w.key("block_count", n)
    w.key("context_length", cfg.max_position_embeddings)
    w.key("embedding_length", cfg.hidden_size)
    moe = "moe" in types  # nemotron_h_moe: feed_forward_length is the experts' width
    w.key("feed_forward_length", [cfg.moe_intermediate_size if t == "moe" else 0 for t in types]
          if moe else [cfg.intermediate_size if t == "mlp" else 0 for t in types])
    if moe:
        for k, v in (("expert_count", cfg.n_routed_experts),
                     ("expert_used_count", cfg.num_experts_per_tok),
                     ("expert_feed_forward_length", cfg.moe_intermediate_size),
                     ("expert_shared_feed_forward_length",
                      cfg.moe_shared_expert_intermediate_size),
                     ("expert_shared_count", cfg.n_shared_experts),
                     ("expert_weights_scale", float(cfg.routed_scaling_factor)),
                     ("expert_group_count", cfg.n_group)):
            w.key(k, v)
        w.w.add_bool(f"{w.arch}.expert_weights_norm", bool(cfg.norm_topk_prob))
        if cfg.moe_latent_size:
            w.key("moe_latent_size", cfg.moe_latent_size)
    w.key("attention.head_count", cfg.num_attention_heads)
    w.key("attention.head_count_kv",
          [cfg.num_key_value_heads if "attention" in t else 0 for t in types])
    w.key("attention.key_length", cfg.head_dim)
    w.key("attention.value_length", cfg.head_dim)
    w.key("attention.layer_norm_epsilon", float(cfg.layer_norm_epsilon))
    w.key("ssm.conv_kernel", cfg.conv_kernel)
    w.key("ssm.state_size", cfg.ssm_state_size)
    w.key("ssm.group_count", groups)
    w.key("ssm.inner_size", heads * hd)
    w.key("ssm.time_step_rank", heads)
    w.quant("token_embd.weight", "model.embeddings.weight", sd["model.embeddings.weight"])
    w.f32("output_norm.weight", "model.norm_f.weight", sd["model.norm_f.weight"])
    w.quant("output.weight", "lm_head.weight", sd["lm_head.weight"])
    for i, t in enumerate(types):
        b, mx = f"blk.{i}", f"model.layers.{i}.mixer."
        w.f32(f"{b}.attn_norm.weight", f"model.layers.{i}.norm.weight",
              sd[f"model.layers.{i}.norm.weight"])
        if t in ("mamba", "linear_attention"):
            w.quant(f"{b}.ssm_in.weight", mx + "in_proj.weight", sd[mx + "in_proj.weight"])
            w.f32(f"{b}.ssm_conv1d.weight", mx + "conv1d.weight", sd[mx + "conv1d.weight"],
                  moved=lambda a: a.squeeze(1))
            w.f32(f"{b}.ssm_conv1d.bias", mx + "conv1d.bias", sd[mx + "conv1d.bias"])
            w.f32(f"{b}.ssm_dt.bias", mx + "dt_bias", sd[mx + "dt_bias"])
            stored, back = _a_stored(sd[mx + "A_log"])
            w.f32(f"{b}.ssm_a", mx + "A_log", stored.reshape(-1, 1), ref=back)
            w.f32(f"{b}.ssm_d", mx + "D", sd[mx + "D"], moved=lambda a: a.reshape(-1, 1))
            w.f32(f"{b}.ssm_norm.weight", mx + "norm.weight", sd[mx + "norm.weight"],
                  moved=lambda a: a.reshape(groups, -1))
            w.quant(f"{b}.ssm_out.weight", mx + "out_proj.weight", sd[mx + "out_proj.weight"])
        elif "attention" in t:
            w.quant(f"{b}.attn_q.weight", mx + "q_proj.weight", sd[mx + "q_proj.weight"],
                    moved=lambda a: _permute(a, cfg.num_attention_heads))
            w.quant(f"{b}.attn_k.weight", mx + "k_proj.weight", sd[mx + "k_proj.weight"],
                    moved=lambda a: _permute(a, cfg.num_key_value_heads))
            w.quant(f"{b}.attn_v.weight", mx + "v_proj.weight", sd[mx + "v_proj.weight"])
            w.quant(f"{b}.attn_output.weight", mx + "o_proj.weight", sd[mx + "o_proj.weight"])
        elif t == "moe":  # router and score bias F32, experts stacked (E, out, in)
            w.f32(f"{b}.ffn_gate_inp.weight", mx + "gate.weight", sd[mx + "gate.weight"])
            w.f32(f"{b}.exp_probs_b.bias", mx + "gate.e_score_correction_bias",
                  sd[mx + "gate.e_score_correction_bias"])
            named = [("ffn_up_exps", "experts.up_proj"), ("ffn_down_exps", "experts.down_proj"),
                     ("ffn_up_shexp", "shared_experts.up_proj.weight"),
                     ("ffn_down_shexp", "shared_experts.down_proj.weight")]
            if cfg.moe_latent_size:
                named += [("ffn_latent_down", "fc1_latent_proj.weight"),
                          ("ffn_latent_up", "fc2_latent_proj.weight")]
            for g, h in named:
                w.quant(f"{b}.{g}.weight", mx + h, sd[mx + h])
        else:
            w.quant(f"{b}.ffn_up.weight", mx + "up_proj.weight", sd[mx + "up_proj.weight"])
            w.quant(f"{b}.ffn_down.weight", mx + "down_proj.weight", sd[mx + "down_proj.weight"])


def _granitehybrid(w: _Writer, model, cfg) -> None:
    """Granite-4.0-H: Mamba-2 as Mamba2Model writes it, attention as Llama's (Q/K
    permuted), MoE experts split from ``input_linear`` (gate rows, then up), the shared MLP's
    ``input_linear`` split into ``ffn_gate_shexp`` / ``ffn_up_shexp``; multipliers as
    ``*_scale`` keys."""
    sd = model.state_dict()
    n, heads = cfg.num_hidden_layers, cfg.mamba_n_heads
    attn = [t == "full_attention" for t in cfg.layer_types]
    w.key("block_count", n)
    w.key("context_length", cfg.max_position_embeddings)
    w.key("embedding_length", cfg.hidden_size)
    w.key("feed_forward_length", cfg.intermediate_size)
    w.key("attention.head_count", cfg.num_attention_heads)
    w.key("attention.head_count_kv", [cfg.num_key_value_heads if a else 0 for a in attn])
    w.key("attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    w.key("rope.freq_base", 10000.0)
    w.w.add_bool("granitehybrid.rope.scaling.finetuned", False)
    for k, v in (("attention.scale", cfg.attention_multiplier),
                 ("embedding_scale", cfg.embedding_multiplier),
                 ("residual_scale", cfg.residual_multiplier),
                 ("logit_scale", cfg.logits_scaling)):
        w.key(k, float(v))
    w.key("expert_count", cfg.num_local_experts)
    w.key("expert_used_count", cfg.num_experts_per_tok)
    w.key("expert_shared_feed_forward_length", cfg.shared_intermediate_size)
    w.key("ssm.conv_kernel", cfg.mamba_d_conv)
    w.key("ssm.state_size", cfg.mamba_d_state)
    w.key("ssm.group_count", cfg.mamba_n_groups)
    w.key("ssm.inner_size", heads * cfg.mamba_d_head)
    w.key("ssm.time_step_rank", heads)
    w.quant("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    w.f32("output_norm.weight", "model.norm.weight", sd["model.norm.weight"])
    inter, shared = cfg.intermediate_size, cfg.shared_intermediate_size
    for i in range(n):
        b, p = f"blk.{i}", f"model.layers.{i}."
        w.f32(f"{b}.attn_norm.weight", p + "input_layernorm.weight",
              sd[p + "input_layernorm.weight"])
        w.f32(f"{b}.ffn_norm.weight", p + "post_attention_layernorm.weight",
              sd[p + "post_attention_layernorm.weight"])
        if attn[i]:
            sa = p + "self_attn."
            w.quant(f"{b}.attn_q.weight", sa + "q_proj.weight", sd[sa + "q_proj.weight"],
                    moved=lambda a: _permute(a, cfg.num_attention_heads))
            w.quant(f"{b}.attn_k.weight", sa + "k_proj.weight", sd[sa + "k_proj.weight"],
                    moved=lambda a: _permute(a, cfg.num_key_value_heads))
            w.quant(f"{b}.attn_v.weight", sa + "v_proj.weight", sd[sa + "v_proj.weight"])
            w.quant(f"{b}.attn_output.weight", sa + "o_proj.weight", sd[sa + "o_proj.weight"])
        else:
            mx = p + "mamba."
            w.quant(f"{b}.ssm_in.weight", mx + "in_proj.weight", sd[mx + "in_proj.weight"])
            w.f32(f"{b}.ssm_conv1d.weight", mx + "conv1d.weight", sd[mx + "conv1d.weight"],
                  moved=lambda a: a.squeeze(1))
            w.f32(f"{b}.ssm_conv1d.bias", mx + "conv1d.bias", sd[mx + "conv1d.bias"])
            w.f32(f"{b}.ssm_dt.bias", mx + "dt_bias", sd[mx + "dt_bias"])
            stored, back = _a_stored(sd[mx + "A_log"])
            w.f32(f"{b}.ssm_a", mx + "A_log", stored.reshape(-1, 1), ref=back)
            w.f32(f"{b}.ssm_d", mx + "D", sd[mx + "D"], moved=lambda a: a.reshape(-1, 1))
            w.f32(f"{b}.ssm_norm.weight", mx + "norm.weight", sd[mx + "norm.weight"],
                  moved=lambda a: a.reshape(cfg.mamba_n_groups, -1))
            w.quant(f"{b}.ssm_out.weight", mx + "out_proj.weight", sd[mx + "out_proj.weight"])
        moe = p + "block_sparse_moe."
        w.f32(f"{b}.ffn_gate_inp.weight", moe + "router.weight", sd[moe + "router.weight"])
        gu = sd[moe + "experts.gate_up_proj"].float()
        w.quant(f"{b}.ffn_gate_exps.weight", moe + "experts.gate_up_proj", gu,
                moved=lambda a: np.ascontiguousarray(a[:, :inter]))
        w.w.add_tensor(f"{b}.ffn_up_exps.weight", gguf.quants.quantize(
            np.ascontiguousarray(gu.numpy()[:, inter:]), w.kind), raw_dtype=w.kind)
        w.quant(f"{b}.ffn_down_exps.weight", moe + "experts.down_proj",
                sd[moe + "experts.down_proj"])
        mlp = p + "shared_mlp."
        gu = sd[mlp + "input_linear.weight"].float()
        w.quant(f"{b}.ffn_gate_shexp.weight", mlp + "input_linear.weight", gu,
                moved=lambda a: np.ascontiguousarray(a[:shared]))
        w.w.add_tensor(f"{b}.ffn_up_shexp.weight", gguf.quants.quantize(
            np.ascontiguousarray(gu.numpy()[shared:]), w.kind), raw_dtype=w.kind)
        w.quant(f"{b}.ffn_down_shexp.weight", mlp + "output_linear.weight",
                sd[mlp + "output_linear.weight"])


WRITERS = {"qwen3next": _qwen3next, "qwen35": _qwen35, "qwen35moe": _qwen35,
           "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h,
           "granitehybrid": _granitehybrid}


def write_hybrid_gguf(path, model, arch: str, kind: str, tok: dict) -> dict[str, torch.Tensor]:
    """``model`` (a transformers model) as llama.cpp writes an ``arch`` GGUF of ``kind``
    linears into ``path``; returns the reference state dict (module docstring)."""
    w = _Writer(path, arch, kind, tok)
    WRITERS[arch](w, model, model.config)
    return w.close()
