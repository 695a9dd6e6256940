"""Tiny random-weight models and a small BPE tokenizer for tests and demos.

Everything here is built offline from material present on every machine: the tokenizer is trained
on a fixed list of Python standard-library modules, and the models are random-initialised
transformers models saved in the ordinary Hugging Face layout (``config.json``,
``generation_config.json``, ``model.safetensors`` or shards plus ``model.safetensors.index.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``).

Invariants:
  * Token ids 0..4 are the special tokens, in the order of :data:`SPECIAL_TOKENS`
    (``<|pad|>``=0, ``<|bos|>``=1, ``<|eos|>``=2, ``<|im_start|>``=3, ``<|im_end|>``=4).
  * Every model's ``config.vocab_size`` equals ``len(tokenizer)`` (default 512).
  * ``config.eos_token_id`` is ``<|eos|>``; ``generation_config.eos_token_id`` is the list
    ``[<|eos|>, <|im_end|>]`` (a multi-eos setup, like Qwen checkpoints).
  * The tokenizer does not add bos/eos automatically when encoding.
  * Same seed + same arch + same overrides + same stdlib files -> bit-identical weights and vocab.
"""

from __future__ import annotations

import copy
import functools
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "ARCHS",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "IM_END_ID",
    "IM_START_ID",
    "NUM_SPECIAL_TOKENS",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "arch_config_kwargs",
    "build_demo_model",
    "build_tiny_model",
    "build_tokenizer",
    "random_prompts",
]

SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)

# ChatML. `add_generation_prompt` opens an assistant turn; the model is expected to close it with
# <|im_end|>, which is why <|im_end|> is also in generation_config.eos_token_id.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Long-lived stdlib modules (single .py files in 3.10-3.13). A fixed, sorted list rather than
# "first N files of the directory" so that platform-specific files (e.g. _sysconfigdata_*) and
# modules removed in newer Pythons never change the training text. Missing files are skipped.
_TRAINING_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "difflib", "enum", "fractions", "functools", "getopt",
    "gettext", "glob", "heapq", "inspect", "ipaddress", "locale", "numbers", "operator",
    "optparse", "pprint", "queue", "random", "shlex", "shutil", "statistics", "string",
    "subprocess", "tempfile", "textwrap", "threading", "tokenize", "typing", "uuid", "warnings",
)  # fmt: skip
_TRAINING_CHAR_CAP = 2_000_000  # keeps BPE training well under a second


def _training_texts() -> list[str]:
    stdlib = Path(os.path.dirname(os.__file__))
    texts: list[str] = []
    total = 0
    for name in _TRAINING_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[: _TRAINING_CHAR_CAP - total])
        total += len(texts[-1])
        if total >= _TRAINING_CHAR_CAP:
            break
    if not texts:
        raise RuntimeError(f"no stdlib training text found under {stdlib}")
    return texts


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per process and vocab size; return its JSON serialisation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + NUM_SPECIAL_TOKENS:
        raise ValueError(f"vocab_size must be >= {256 + NUM_SPECIAL_TOKENS}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # Byte-level pre-tokenizer + the full 256-byte initial alphabet: any UTF-8 string encodes
    # without <unk> and decodes back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _training_texts()
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok.to_str()


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Build (or reuse the in-process trained) tokenizer and ``save_pretrained`` it to ``out_dir``.

    Returns a ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad set, ``<|im_start|>`` and
    ``<|im_end|>`` registered as additional special tokens, and the ChatML :data:`CHAT_TEMPLATE`.
    ``len(tokenizer) == vocab_size``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Per-arch configs. Shapes are deliberately awkward: GQA/MQA, head_dim != hidden/heads, key and
# value head dims that differ, odd conv kernels, Mamba chunk sizes smaller than typical prompts
# (so the chunked scan crosses chunk boundaries), partial RoPE, llama3 RoPE scaling, NoPE
# attention, Granite's scalar multipliers. `initializer_range` is raised above the usual 0.02 so
# the random logits are peaked enough that greedy argmax is stable across float32 implementations.
# ---------------------------------------------------------------------------------------------

_INIT_RANGE = 0.1
_MAX_POS = 4096

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    # Dense, tied embeddings, GQA 4:2, llama3 RoPE scaling active at small positions
    # (wavelengths > 512/low_freq_factor are divided by `factor`).
    "llama": dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=512,
        ),
    ),
    # Dense, untied, MQA (1 kv head), q/k/v biases (always on in Qwen2), intermediate not a power
    # of two.
    "qwen2": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Dense, untied, head_dim (32) != hidden/heads (16), q_norm/k_norm, odd layer count.
    "qwen3": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Gated DeltaNet hybrid (text-only Qwen3_5ForCausalLM): GDN,GDN,GDN,attention. Tied.
    # GDN: 2 key heads x 16, 4 value heads x 24 (dv != dk), conv kernel 3.
    # Attention: gated output, partial RoPE (0.25 * 32 = 8 rotary dims), mrope sections summing
    # to 4 = rotary_dim / 2 (text-only positions make mrope equal to plain RoPE).
    "qwen3_5": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=3,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1], mrope_interleaved=True,
        ),
    ),
    # Gated DeltaNet + MoE (Qwen3NextForCausalLM): GDN,GDN,GDN,attention, every layer sparse MoE
    # (4 experts, top-2, expert width 32) plus a gated shared expert of width 48. Untied.
    "qwen3_next": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
        ),
    ),
    # Qwen3.5-MoE (Qwen3_5MoeForCausalLM): GDN,attention,GDN,GDN, every layer a sparse MoE
    # (6 experts, top-3 renormalised, width 24) plus a gated shared expert of width 40; GDN with
    # dv (24) != dk (16), conv kernel 3; partial RoPE. Untied. Experts saved per expert.
    "qwen3_5_moe": dict(
        hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=3,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
        ),
    ),
    # Nemotron-H: one mixer per layer, pattern "M-*-M-" (Mamba-2, MLP, attention, MLP, Mamba-2,
    # MLP). Attention has no positional encoding. Mamba-2: 8 heads x 16, 2 groups, state 16,
    # conv kernel 4, chunk 16. MLP is relu^2 without gate. Untied (tying is unsupported there).
    "nemotron_h": dict(
        hidden_size=64, intermediate_size=128,
        layers_block_type=[
            "linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp",
        ],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, expand=2, use_conv_bias=True, mamba_proj_bias=False,
        mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
        residual_in_fp32=False, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
    ),
    # Granite-4.0-H style: Mamba-2, attention, Mamba-2, Mamba-2; NoPE attention; MoE (4 experts,
    # top-2, width 32) plus a shared MLP (width 96) in every layer; Granite multipliers set to
    # non-trivial values (the published 12/4/0.22 make random tied weights just echo the input
    # token, hiding the layers); tied. Mamba-2: 8 heads x 16 (= 2*64/8), 1 group, state 16,
    # conv kernel 3, chunk 16. Use num_local_experts=0 for the dense variant.
    "granitemoehybrid": dict(
        hidden_size=64, intermediate_size=32, shared_intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=3,
        mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False,
        position_embedding_type=None,
        embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5,
        attention_multiplier=0.0625,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=_MAX_POS,
    ),
    # Bamba: Mamba-2 x2, attention, Mamba-2; SwiGLU MLP after every mixer; attention uses partial
    # RoPE (0.5, hardcoded by the config). Mamba-2: 8 heads x 16, 2 groups, state 16, conv 4,
    # chunk 16. Untied.
    "bamba": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[2],
        num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # Mamba-2 only (no attention): 3 layers, hidden 40, 10 heads x 8 (= 2 * 40), 2 groups,
    # state 12, conv kernel 3, chunk 16. Untied.
    "mamba2": dict(
        hidden_size=40, num_hidden_layers=3, num_heads=10, head_dim=8, n_groups=2, state_size=12,
        expand=2, conv_kernel=3, chunk_size=16, use_bias=False, use_conv_bias=True,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    ),
    # Mamba-1 only: 3 layers, hidden 40, width 80 (expand 2), state 12, conv 3, dt rank 3;
    # biased projections. Untied (tied, a tiny random Mamba-1 repeats its input token: the
    # residual stream dominates). Falcon-Mamba: the same shapes with 4 layers and its weightless
    # dt/B/C norms (eps 1e-5).
    "mamba": dict(
        hidden_size=40, num_hidden_layers=3, state_size=12, expand=2, conv_kernel=3,
        time_step_rank=3, use_bias=True, use_conv_bias=True, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    ),
    "falcon_mamba": dict(
        hidden_size=40, num_hidden_layers=4, state_size=12, expand=2, conv_kernel=3,
        time_step_rank=3, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5,
        mixer_rms_eps=1e-5, tie_word_embeddings=False,
    ),
    # Llama-4 text: 5 layers, NoPE (full attention, temperature tuning with floor_scale 6 so
    # it varies within a prompt) at 2 and 4, chunked local RoPE attention (chunk 13: prompts
    # cross chunks) elsewhere, q/k L2 norm; MoE (5 experts, top-2, width 40, shared expert) at
    # 1, 3, 4, dense MLP (width 72) at 0, 2; 4 heads x 12, 2 kv heads. Untied.
    "llama4": dict(
        hidden_size=48, intermediate_size=40, intermediate_size_mlp=72, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=5,
        num_experts_per_tok=2, moe_layers=[1, 3, 4], no_rope_layers=[1, 1, 0, 1, 0],
        attention_chunk_size=13, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=6,
        attn_scale=0.3, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # Gemma 3 text: 7 layers, sliding 5:1 (layers 0-4 and 6 sliding, 5 full), window 11 (prompts
    # cross it), local/global RoPE thetas, the global one linearly scaled; 3 heads x 24, 1 kv
    # head, query_pre_attn_scalar 20, final logit soft cap 30. Tied.
    "gemma3": dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=20, sliding_window=11,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
        ),
    ),
    # gpt-oss: 4 layers alternating sliding (window 9) and full attention, attention sinks,
    # biases; MoE of 5 experts, top-2, width 40, clamped SwiGLU; YaRN RoPE. 3 heads x 20, 1 kv
    # head. Untied.
    "gpt_oss": dict(
        hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=1, head_dim=20, sliding_window=9, num_local_experts=5,
        num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=_MAX_POS, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=1024),
    ),
    # LFM2: conv, conv, attention, conv, attention; short conv kernel 3 with biases; 4 heads x
    # 12, 2 kv heads; MLP width auto-adjusted from 96 to 72 (2/3, rounded up to 24). Tied.
    "lfm2": dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=True, block_multiple_of=24,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, norm_eps=1e-5,
        layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
        max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Falcon-H1: 3 layers, each attention (3 heads x 16, 1 kv head) and Mamba-2 in parallel;
    # Mamba-2 width 60 given by mamba_d_ssm = 5 heads x 12, 1 group, state 12, conv 3, chunk 16,
    # gated grouped RMSNorm; every multiplier set to a distinct non-trivial value. Untied.
    "falcon_h1": dict(
        hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, mamba_d_ssm=60, mamba_n_heads=5, mamba_d_head=12,
        mamba_n_groups=1, mamba_d_state=12, mamba_d_conv=3, mamba_chunk_size=16,
        mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_conv_bias=True,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
        embedding_multiplier=1.5, lm_head_multiplier=0.8, mlp_multipliers=[0.9, 1.2],
        key_multiplier=0.7, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.85,
        ssm_out_multiplier=1.15,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0),
    ),
    # Zamba2: 5 Mamba-2 layers, of which 1, 3 and 4 also run a shared attention block (2 blocks
    # alternating: uses 1 and 4 share block 0's weights) with per-use LoRA adapters (rank 6) and
    # a per-layer linear; attention sees [hidden | embeddings] (2 x 40), 4 heads x 20 (the
    # adapters need as many kv heads), RoPE. Mamba-2: 5 heads x 16, 1 group, state 12, conv
    # 3, chunk 16. Tied.
    "zamba2": dict(
        hidden_size=40, intermediate_size=72, num_hidden_layers=5,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=5, mamba_d_state=12,
        mamba_d_conv=3, mamba_expand=2, mamba_ngroups=1, chunk_size=16, num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=6, use_mem_rope=True,
        hidden_act="gelu", rms_norm_eps=1e-5, max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # Jamba: 6 layers, attention (no positional encoding) at 1 and 4, Mamba-1 elsewhere; MoE
    # (5 experts, top-2, width 56) at odd layers, dense SwiGLU at even ones. Mamba-1: width 80
    # (expand 2), state 12, conv 3, dt rank 3; 4 heads x 10, 2 kv heads. Untied.
    "jamba": dict(
        hidden_size=40, intermediate_size=56, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=5, num_experts_per_tok=2, mamba_d_state=12,
        mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=3, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=_MAX_POS,
    ),
    # MiniMax-Text-01 style: lightning (linear) attention at 0, 2, 3, full attention (GQA 4:2,
    # RoPE) at 1; lightning blocks of 16 tokens (prompts span several); 4 heads x 12; MoE of 4
    # experts, top-2, width 40, in every layer; distinct alpha/beta residual factors. Untied.
    "minimax": dict(
        hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"],
        block_size=16, full_attn_alpha_factor=1.2, full_attn_beta_factor=0.9,
        linear_attn_alpha_factor=0.8, linear_attn_beta_factor=1.1, mlp_alpha_factor=1.05,
        mlp_beta_factor=0.95, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=_MAX_POS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # Kimi Linear: KDA at 0, 1, 3 (3 heads x 10, conv 3), MLA at 2 (3 heads, q LoRA rank 20,
    # KV latent 24 + shared rope key 8, nope 12, v 10; no positional encoding); dense MLP at 0,
    # MoE elsewhere (4 experts in 2 groups, 1 group kept, top-2, width 24, sigmoid router with
    # scaling 1.5, one shared expert). Untied.
    "kimi_linear": dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=3, q_lora_rank=20, kv_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=3, linear_head_dim=10, linear_conv_kernel_dim=3,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        n_shared_experts=1, routed_scaling_factor=1.5, n_group=2, topk_group=1,
        norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=_MAX_POS,
    ),
}  # fmt: skip

ARCHS: tuple[str, ...] = tuple(_ARCH_CONFIGS)

# Config class names in transformers; looked up lazily so importing this module stays cheap.
_CONFIG_CLASSES: dict[str, str] = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_5": "Qwen3_5TextConfig",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "bamba": "BambaConfig",
    "mamba2": "Mamba2Config",
    "mamba": "MambaConfig",
    "falcon_mamba": "FalconMambaConfig",
    "llama4": "Llama4TextConfig",
    "gemma3": "Gemma3TextConfig",
    "gpt_oss": "GptOssConfig",
    "lfm2": "Lfm2Config",
    "falcon_h1": "FalconH1Config",
    "zamba2": "Zamba2Config",
    "jamba": "JambaConfig",
    "minimax": "MiniMaxConfig",
    "kimi_linear": "KimiLinearConfig",
}

# Keys whose default is derived from the layer count: dropped when the caller changes the layer
# count without giving a pattern, so the config class derives a consistent one.
_LAYER_PATTERN_KEYS = ("layer_types", "attn_layer_indices")


def arch_config_kwargs(arch: str, **config_overrides: Any) -> dict[str, Any]:
    """The config keyword arguments :func:`build_tiny_model` uses for ``arch`` (a fresh copy)."""
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kwargs = copy.deepcopy(_ARCH_CONFIGS[arch])
    if "num_hidden_layers" in config_overrides:
        for key in _LAYER_PATTERN_KEYS:
            if key not in config_overrides:
                kwargs.pop(key, None)
    kwargs.setdefault("initializer_range", _INIT_RANGE)
    kwargs.update(config_overrides)
    return kwargs


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    vocab_size: int = 512,
    **config_overrides: Any,
) -> Path:
    """Build a random ``arch`` model plus tokenizer into ``out_dir`` and return the path.

    ``config_overrides`` replace entries of the arch defaults (see :func:`arch_config_kwargs`);
    ``vocab_size`` sizes both tokenizer and embedding. With ``max_shard_size`` (e.g. ``"100KB"``)
    the weights are split into shards with a ``model.safetensors.index.json``. Weights are saved
    in the checkpoint ("original") key layout, e.g. per-expert MoE tensors, as published
    checkpoints are. Deterministic for a given (arch, seed, overrides, dtype).
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs = arch_config_kwargs(arch, **config_overrides)
    out = Path(out_dir)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size)
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config = getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, IM_END_ID],
        pad_token_id=PAD_ID,
        do_sample=False,
    )
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    return out


def build_demo_model(cache_dir: str | Path) -> Path:
    """The default model of ``pagefold generate``: a small random Qwen3 in ``cache_dir/demo-qwen3``.

    Built once; an existing directory with a ``config.json`` and weights is reused as is.
    Shape: hidden 256, 4 layers, 8 heads x 32, 4 kv heads, intermediate 512, vocab 512.
    """
    out = Path(cache_dir) / "demo-qwen3"
    has_weights = (out / "model.safetensors").is_file() or (
        out / "model.safetensors.index.json"
    ).is_file()
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file() and has_weights:
        return out
    # Build next to the target and rename, so an interrupted build never looks complete.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    build_tiny_model(
        "qwen3",
        tmp,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    )
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def random_prompts(
    n: int,
    min_len: int,
    max_len: int,
    vocab: int,
    seed: int = 0,
    *,
    low: int = NUM_SPECIAL_TOKENS,
) -> list[list[int]]:
    """``n`` prompts of random token ids in ``[low, vocab)``, lengths uniform in [min_len, max_len].

    Special tokens (ids below ``NUM_SPECIAL_TOKENS``) are excluded by default so prompts never
    contain eos/pad. Deterministic in ``seed`` and independent of global RNG state.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if not 0 <= low < vocab:
        raise ValueError(f"need 0 <= low < vocab, got low={low}, vocab={vocab}")
    rng = random.Random(seed)
    return [
        [rng.randrange(low, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)
    ]


def describe(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes in a saved model directory (handy when writing weight loaders)."""
    from safetensors import safe_open

    names: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                names[key] = tuple(f.get_slice(key).get_shape())
    return names
