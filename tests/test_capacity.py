"""Capacity planner: layer specs from configs, vLLM's hybrid arithmetic, pagefold's pool, CLI.

The vLLM numbers are those of the tech note on Qwen3.5-27B (64 layers, every 4th full
attention) at TP 2 with an FP8 KV cache and 52.89 GiB per GPU.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagefold.core.capacity import capacity_report, log_capacity, render_report  # noqa: E402
from pagefold.core.kv_cache_planner import group_layers, plan_pagefold  # noqa: E402
from pagefold.core.kv_cache_spec import (  # noqa: E402
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
    cdiv,
)
from pagefold.core.spec_from_config import layer_specs_from_config  # noqa: E402
from pagefold.core.vllm_layout import plan_vllm, vllm_attention_block_size  # noqa: E402
from pagefold.entrypoints import capacity_cmd  # noqa: E402

GIB = 2**30
MEM = int(52.89 * GIB)
BF16 = torch.bfloat16


def qwen35_config() -> dict:
    """Shaped like Qwen3.5-27B's config.json: multimodal wrapper, nested text_config."""
    n = 64
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "hidden_size": 5120,
            "num_hidden_layers": n,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "full_attention_interval": 4,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)
            ],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144,
        },
        "vision_config": {"depth": 27, "hidden_size": 1152},
    }


def qwen35_specs(kv="fp8", tp=2, k=0):
    return layer_specs_from_config(
        qwen35_config(),
        model_dtype=BF16,
        kv_cache_dtype=kv,
        tensor_parallel_size=tp,
        num_speculative_tokens=k,
    )


def nemotron_config(pattern: str = "M-M*-ME-M*") -> dict:
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 256,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_num_heads": 16,
        "mamba_head_dim": 32,
        "n_groups": 4,
        "ssm_state_size": 64,
        "conv_kernel": 4,
        "expand": 2,
        "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------- specs from configs


def test_qwen35_specs_per_rank():
    specs = qwen35_specs()
    assert len(specs) == 64
    full = [k for k, s in specs.items() if isinstance(s, FullAttentionSpec)]
    assert full == [f"layers.{i}" for i in range(3, 64, 4)]
    assert specs["layers.3"] == FullAttentionSpec(2, 256, torch.float8_e4m3fn)
    gdn = specs["layers.0"]
    assert gdn.kind == "gdn" and [c.name for c in gdn.components] == ["conv", "ssm"]
    # conv_dim = 2*16*128 + 48*128 = 10240 channels, halved by TP; last 3 inputs in BF16.
    assert gdn.component("conv") == StateComponent("conv", (5120, 3), BF16)
    assert gdn.component("ssm") == StateComponent("ssm", (24, 128, 128), torch.float32)
    assert gdn.unpadded_bytes == 24 * 128 * 128 * 4 + 30 * 1024 == 1_603_584


def test_transformers_config_objects_match_dicts():
    from transformers import (
        BambaConfig,
        GraniteMoeHybridConfig,
        NemotronHConfig,
        Qwen3_5Config,
    )

    q = qwen35_config()
    obj = Qwen3_5Config(text_config=q["text_config"], vision_config=q["vision_config"])
    kw = dict(model_dtype=BF16, tensor_parallel_size=2)
    assert layer_specs_from_config(obj, **kw) == layer_specs_from_config(q, **kw)

    n = nemotron_config()
    fields = {k: v for k, v in n.items() if k not in ("architectures", "num_hidden_layers")}
    nobj = NemotronHConfig(**fields)
    assert layer_specs_from_config(nobj, **kw) == layer_specs_from_config(n, **kw)

    mamba = dict(mamba_n_heads=16, mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4)
    base = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, mamba_expand=2)
    types = ["mamba", "attention", "mamba", "mamba"]
    g_dict = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid"}
    g_dict |= base | mamba | {"num_hidden_layers": 4, "layer_types": types}
    gobj = GraniteMoeHybridConfig(num_hidden_layers=4, layer_types=types, **base, **mamba)
    assert layer_specs_from_config(gobj, **kw) == layer_specs_from_config(g_dict, **kw)

    b_dict = {"architectures": ["BambaForCausalLM"], "model_type": "bamba"}
    b_dict |= base | mamba | {"num_hidden_layers": 4, "attn_layer_indices": [1]}
    bobj = BambaConfig(num_hidden_layers=4, attn_layer_indices=[1], **base, **mamba)
    specs = layer_specs_from_config(bobj, **kw)
    assert specs == layer_specs_from_config(b_dict, **kw) == layer_specs_from_config(g_dict, **kw)
    # A single B/C group is replicated per rank: conv = (256 + 2*2*32) / 2 channels.
    assert specs["layers.0"].component("conv").shape == (192, 3)
    assert specs["layers.0"].component("ssm").shape == (8, 16, 32)
    assert specs["layers.1"] == FullAttentionSpec(1, 32, BF16)


def test_nemotron_pattern_and_mamba2_state_formula():
    specs = layer_specs_from_config(nemotron_config(), model_dtype=BF16)
    # M-M*-ME-M*: mamba at 0,2,5,8; attention at 3,9; MLP (-) and MoE (E) cache nothing.
    assert list(specs) == [f"layers.{i}" for i in (0, 2, 3, 5, 8, 9)]
    m = specs["layers.0"]
    assert m.kind == "mamba2" and [c.name for c in m.components] == ["conv", "ssm"]
    heads, head_dim, groups, state, kernel = 16, 32, 4, 64, 4
    inner = heads * head_dim
    # NemotronHConfig's SSM cache dtype defaults to float32; conv is in the model dtype.
    expected = (kernel - 1) * (inner + 2 * groups * state) * 2 + heads * head_dim * state * 4
    assert m.unpadded_bytes == expected
    assert specs["layers.3"] == FullAttentionSpec(2, 32, BF16)

    tp2 = layer_specs_from_config(
        nemotron_config(), model_dtype=BF16, tensor_parallel_size=2, num_speculative_tokens=2
    )["layers.0"]
    assert tp2.component("conv").shape == ((inner + 2 * groups * state) // 2, kernel - 1 + 2)
    assert tp2.component("ssm").shape == (heads // 2, head_dim, state)

    listed = nemotron_config()
    del listed["hybrid_override_pattern"]
    listed["layers_block_type"] = ["mamba", "mlp", "mamba", "attention"]
    got = layer_specs_from_config(listed, model_dtype=BF16)
    assert list(got) == ["layers.0", "layers.2", "layers.3"]


def test_ssm_dtype_precedence():
    q = qwen35_config()
    ssm = lambda cfg, **kw: layer_specs_from_config(cfg, model_dtype=BF16, **kw)[
        "layers.0"
    ].component("ssm")
    assert ssm(q).dtype == torch.float32  # the config's mamba_ssm_dtype
    assert ssm(q, mamba_ssm_cache_dtype="bfloat16").dtype == BF16  # the flag wins
    assert ssm(q, mamba_ssm_cache_dtype="auto").dtype == torch.float32
    del q["text_config"]["mamba_ssm_dtype"]
    assert ssm(q).dtype == BF16  # neither: the model dtype


def test_attention_models_and_tp():
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    specs = layer_specs_from_config(llama, model_dtype=BF16, tensor_parallel_size=4)
    # head_dim from hidden/heads; 2 KV heads over 4 ranks are replicated, one per rank.
    assert set(specs.values()) == {FullAttentionSpec(1, 64, BF16)}
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    specs = layer_specs_from_config(qwen3, model_dtype=BF16, kv_cache_dtype="float16")
    assert specs["layers.0"] == SlidingWindowSpec(4, 64, torch.float16, 128)
    assert specs["layers.1"] == FullAttentionSpec(4, 64, torch.float16)


def test_unknown_layer_type_and_architecture():
    q = qwen35_config()
    q["text_config"]["layer_types"][5] = "mamba_attention"
    with pytest.raises(ValueError, match=r"layer 5 .*'mamba_attention'.*linear_attention"):
        layer_specs_from_config(q, model_dtype=BF16)
    with pytest.raises(ValueError, match=r"'X'.*supported layer types"):
        layer_specs_from_config(nemotron_config("M*X"), model_dtype=BF16)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ValueError, match=r"unsupported architecture.*gpt2.*qwen3_5.*nemotron_h"):
        layer_specs_from_config(cfg, model_dtype=BF16)
    with pytest.raises(ValueError, match="not divisible"):
        layer_specs_from_config(qwen35_config(), model_dtype=BF16, tensor_parallel_size=32)


# ---------------------------------------------------------------- vLLM's arithmetic


@pytest.mark.parametrize(
    "max_len, per_request, concurrency, tokens",
    [
        (8192, 12, 184.17, 1_508_693),
        (32768, 27, 81.85, 2_682_121),
        (132096, 91, 24.29, 3_208_045),
        (262144, 174, 12.70, 3_329_530),
    ],
)
def test_vllm_table2(max_len, per_request, concurrency, tokens):
    r = capacity_report(
        qwen35_specs(),
        layout="vllm",
        memory_bytes=MEM,
        max_model_len=max_len,
        enable_prefix_caching=True,
    )
    assert r["attention_block_size"] == 1568
    assert r["page_size_bytes"] == 1568 * 1024 == 1_605_632
    assert r["state_page_bytes"] == 1_603_584 and r["padding_bytes"] == 2048
    assert r["layers_per_group"] == 16 and r["group_sizes"] == [16, 16, 16, 16]
    assert r["num_blocks"] == 2210
    assert r["blocks_per_request"] == per_request
    assert round(r["max_concurrency"], 2) == concurrency
    assert r["kv_cache_size_tokens"] == tokens


def test_vllm_block_sizes_and_spec_blocks():
    block = lambda **kw: vllm_attention_block_size(qwen35_specs(**kw))
    assert block(kv="bfloat16") == 784
    assert block(k=3) == 1600
    assert block(kv="bfloat16", k=3) == 800
    assert block(tp=4) == 1568
    # Prefix caching off: one block per GDN group (85 + 3); with 3 draft tokens, K more each.
    v = plan_vllm(
        qwen35_specs(), memory_bytes=MEM, max_model_len=132096, enable_prefix_caching=False
    )
    assert v.blocks_per_request == 85 + 3 and v.num_blocks == 2210
    v = plan_vllm(
        qwen35_specs(k=3),
        memory_bytes=MEM,
        max_model_len=132096,
        enable_prefix_caching=True,
        num_speculative_tokens=3,
    )
    assert v.attention_block_size == 1600
    assert v.blocks_per_request == cdiv(132096, 1600) + 3 * (2 + 3)


def test_vllm_pure_attention():
    specs = {f"layers.{i}": FullAttentionSpec(8, 128, BF16) for i in range(32)}
    r = capacity_report(
        specs, layout="vllm", memory_bytes=4 * GIB, max_model_len=8192, enable_prefix_caching=True
    )
    assert r["attention_block_size"] == 16 and r["padding_bytes"] == 0
    assert r["num_blocks"] == 4 * GIB // (32 * 16 * 4096)
    assert r["kv_cache_size_tokens"] == r["num_blocks"] * 16


# ---------------------------------------------------------------- pagefold's layout


def test_pagefold_layout_numbers():
    specs = qwen35_specs()
    r = capacity_report(
        specs, memory_bytes=MEM, max_model_len=132096, enable_prefix_caching=True
    )
    page = 16 * 1024
    assert r["attention_block_size"] == 16 and r["page_size_bytes"] == page
    assert r["pages_per_state"] == cdiv(1_603_584, page) == 98
    # The state's waste is under one page per group.
    assert 0 <= r["padding_bytes"] < page
    for g in r["groups"]:
        if g["pages_per_state"]:
            assert g["pages_per_state"] * page - 1_603_584 < page
    cfg = plan_pagefold(specs, 16, MEM)
    assert r["num_blocks"] == cfg.num_blocks == MEM // (16 * page)
    assert r["usable_blocks"] == cfg.num_blocks - 1
    assert r["blocks_per_request"] == cdiv(132096, 16) + 3 * 98 * 2
    assert r["max_concurrency"] == r["usable_blocks"] / r["blocks_per_request"]
    assert r["kv_cache_size_tokens"] == int(r["max_concurrency"] * 132096)
    assert r["fixed_state_blocks_per_sequence"] == 3 * 98 * 2
    assert r["fixed_state_bytes_per_sequence"] == 3 * 98 * 2 * 16 * page
    assert r["bytes_per_token"] == 16 * 1024
    by_len = {c["tokens"]: c for c in r["concurrency"]}
    assert sorted(by_len) == [1024, 4096, 32768, 132096]
    assert by_len[1024]["blocks_per_request"] == 64 + 588
    assert by_len[1024]["max_requests"] == r["usable_blocks"] // 652
    off = capacity_report(specs, memory_bytes=MEM, max_model_len=132096)
    assert off["blocks_per_request"] == cdiv(132096, 16) + 3 * 98


@pytest.mark.parametrize(
    "counts, size, groups",
    [
        ((16, 48), 16, [16, 16, 16, 16]),  # Qwen3.5: one attention group, three GDN groups
        ((13, 12), 13, [13, 12]),  # under 1.5x apart: one group of the larger count each
        ((4, 6), 4, [4, 4, 2]),  # 6 >= 1.5 * 4: the smaller count, a short last group
        ((10, 52), 10, [10] + [10] * 5 + [2]),
    ],
)
def test_group_size_rule(counts, size, groups):
    attn = FullAttentionSpec(2, 64, BF16)
    state = StateSpec("gdn", (StateComponent("conv", (64, 3), BF16),))
    specs = {f"a{i}": attn for i in range(counts[0])}
    specs |= {f"s{i}": state for i in range(counts[1])}
    got_size, grouped = group_layers(specs)
    assert got_size == size
    assert [len(names) for _, names in grouped] == groups
    # Every layer once, by name, in first-seen order (the runner finds its tensors by name).
    assert [n for _, names in grouped for n in names] == list(specs)
    r = capacity_report(specs, memory_bytes=GIB, max_model_len=4096)
    assert r["layers_per_group"] == size and r["group_sizes"] == groups
    assert r["padding_layers"] == size * len(groups) - sum(counts)


# ---------------------------------------------------------------- errors, report, logs, CLI


@pytest.mark.parametrize("layout", ["pagefold", "vllm"])
def test_too_little_memory(layout):
    specs = qwen35_specs()
    with pytest.raises(ValueError) as e:
        capacity_report(specs, layout=layout, memory_bytes=400 * 2**20, max_model_len=132096)
    msg = str(e.value)
    if layout == "pagefold":
        need = (cdiv(132096, 16) + 3 * 98 + 1) * 16 * 16 * 1024
    else:
        need = (85 + 3) * 16 * 1_605_632
    assert f"needs {need:,} bytes for one request of max_model_len 132,096" in msg
    assert "raise kv_cache_memory or lower max_model_len" in msg


def test_render_and_log(caplog):
    r = capacity_report(
        qwen35_specs(),
        layout="vllm",
        memory_bytes=MEM,
        max_model_len=132096,
        enable_prefix_caching=True,
    )
    text = render_report(r)
    for needle in ("1,568 tokens", "2,210 in the pool", "3,208,045 tokens", "24.29x"):
        assert needle in text
    assert "fixed state  6 blocks" in text
    logger = logging.getLogger("pagefold.test_capacity")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_capacity(logger, r)
    assert "3,208,045 tokens" in caplog.text and "24.29x" in caplog.text


def write_config(tmp_path, cfg) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


QWEN_ARGS = [
    "--tensor-parallel-size",
    "2",
    "--kv-cache-dtype",
    "fp8",
    "--kv-cache-memory",
    "52.89GiB",
    "--max-model-len",
    "132096",
    "--enable-prefix-caching",
]


def test_cli_json(tmp_path, capsys):
    path = write_config(tmp_path, qwen35_config())
    assert capacity_cmd.main([path, *QWEN_ARGS, "--layout", "vllm", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in (
        "attention_block_size",
        "state_page_bytes",
        "page_size_bytes",
        "padding_bytes",
        "layers_per_group",
        "group_sizes",
        "num_blocks",
        "blocks_per_request",
        "max_concurrency",
        "kv_cache_size_tokens",
    ):
        assert key in r
    assert r["kv_cache_size_tokens"] == 3_208_045 and r["attention_block_size"] == 1568

    cfg_file = os.path.join(path, "config.json")
    assert capacity_cmd.main(["capacity", cfg_file, *QWEN_ARGS, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    for key in ("pages_per_state", "fixed_state_bytes_per_sequence", "bytes_per_token"):
        assert key in p
    assert p["layout"] == "pagefold" and p["pages_per_state"] == 98
    assert [c["tokens"] for c in p["concurrency"]] == [1024, 4096, 32768, 132096]


def test_cli_text_and_errors(tmp_path, capsys):
    path = write_config(tmp_path, qwen35_config())
    assert capacity_cmd.main([path, *QWEN_ARGS, "--layout", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "3,208,045 tokens" in out and "1,568 tokens" in out
    assert capacity_cmd.main([path, *QWEN_ARGS[:5], "512MiB"]) == 1
    assert "raise kv_cache_memory or lower max_model_len" in capsys.readouterr().err
    assert capacity_cmd.main([str(tmp_path / "nowhere"), "--kv-cache-memory", "1e9"]) == 1
    assert "no config.json" in capsys.readouterr().err
    # max_model_len defaults to the config's max_position_embeddings.
    nem_dir = tmp_path / "nemotron"
    nem_dir.mkdir()
    nem = write_config(nem_dir, nemotron_config() | {"max_position_embeddings": 4096})
    assert capacity_cmd.main([nem, "--kv-cache-memory", "4GB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["max_model_len"] == 4096 and r["layer_counts"] == {"mamba2": 4, "full_attention": 2}


def test_attention_layers_must_share_one_page_size():
    """Two attention page sizes cannot share a pool: refused, naming both and the block size."""
    from pagefold.core.kv_cache_planner import page_bytes_for

    a, b = FullAttentionSpec(2, 64, BF16), FullAttentionSpec(2, 32, BF16)
    with pytest.raises(ValueError) as e:
        page_bytes_for([a, b, a], 16)
    assert str(e.value) == ("attention layers have different page sizes [4096, 8192] at "
                            "block_size 16; pagefold needs one page size per pool")
    assert page_bytes_for([a, a], 16) == 16 * 2 * 2 * 64 * 2 == 8192


def test_state_pages_must_be_whole_16_byte_units():
    """A page of 8 bytes (1 token x 2 x 1 head x 2 dims x fp16) cannot carry a state's 16-byte
    aligned components, though it divides the state's widest element (4 bytes)."""
    from pagefold.core.kv_cache_planner import page_bytes_for

    attn = FullAttentionSpec(1, 2, torch.float16)
    state = StateSpec("gdn", (StateComponent("ssm", (2, 4), torch.float32),))
    with pytest.raises(ValueError) as e:
        page_bytes_for([attn, state], 1)
    assert str(e.value) == ("a gdn state (32 bytes) cannot be split into pages of 8 bytes: the "
                            "page must be a multiple of 16 bytes; change block_size")
    assert page_bytes_for([attn, state], 2) == 16


def test_no_cached_layers_is_refused():
    with pytest.raises(ValueError) as e:
        plan_pagefold({}, 16, GIB)
    assert str(e.value) == "the model declares no cached layers"


def test_a_budget_under_one_block_has_no_usable_block():
    """A one-page state and a budget smaller than that page: no block at all, so not even
    one request fits (the null block is never handed out)."""
    spec = StateSpec("gdn", (StateComponent("ssm", (4,), torch.float32),))  # 16 bytes
    with pytest.raises(ValueError, match="gives 0 usable blocks"):
        capacity_report({"s": spec}, memory_bytes=10, max_model_len=8)
    r = _report_or_refusal({"s": spec}, memory_bytes=32, max_model_len=8)
    assert not isinstance(r, str), r  # one usable block holds exactly one request
    assert (r["num_blocks"], r["usable_blocks"], r["blocks_per_request"]) == (2, 1, 1)
    assert r["concurrency"][-1]["max_requests"] == 1


def _report_or_refusal(specs, **kw):
    """The report, or the refusal's message (so that a wrong refusal fails an assertion)."""
    try:
        return capacity_report(specs, **kw)
    except ValueError as e:
        return f"refused: {e}"


def test_a_pool_holding_exactly_one_request_reports_one():
    attn = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    page = attn.page_bytes(16)
    r = _report_or_refusal({"a": attn}, memory_bytes=5 * page, max_model_len=64)
    assert not isinstance(r, str), r  # 4 usable blocks; a request of 64 tokens takes 4
    assert (r["usable_blocks"], r["blocks_per_request"], r["max_concurrency"]) == (4, 4, 1.0)
    r = _report_or_refusal({"a": attn}, memory_bytes=4 * page, max_model_len=64)
    assert isinstance(r, str) and "gives 3 usable blocks" in r, r


# ---- capacity_report's own fields on hand-sized models (issue 44: mutmut's survivors) ----
_A = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 128-byte page at 4
_S = StateSpec("gdn", (StateComponent("ssm", (48,), torch.float32),))  # 192 bytes: 2 pages


def test_report_fields_of_a_hybrid():
    """One attention layer and one state: pages of 128 bytes, the state in 2 of them (64
    bytes of padding), 21 blocks; 1 token of attention is 128 / 4 = 32 bytes, so the fixed
    state (2 blocks, 256 bytes) is worth 8 tokens."""
    r = capacity_report({"a": _A, "s": _S}, memory_bytes=21 * 128, max_model_len=16,
                        block_size=4, lengths=(0, 1, 8), max_num_batched_tokens=8)
    assert r["max_num_batched_tokens"] == 8
    assert (r["page_size_bytes"], r["pages_per_state"], r["padding_bytes"]) == (128, 2, 64)
    assert (r["state_page_bytes"], r["state_bytes_per_sequence"]) == (192, 192)
    assert (r["num_blocks"], r["block_bytes"], r["pool_bytes"]) == (21, 128, 21 * 128)
    assert (r["fixed_state_blocks_per_sequence"], r["fixed_state_bytes_per_sequence"]) == (2,
                                                                                          256)
    assert (r["attention_block_size"], r["bytes_per_token"]) == (4, 32.0)
    assert r["state_equivalent_tokens"] == 8
    assert [c["tokens"] for c in r["concurrency"]] == [1, 8, 16]
    assert [c["blocks_per_request"] for c in r["concurrency"]] == [1 + 2, 2 + 2, 4 + 2]


def test_report_fields_without_attention_or_without_state():
    s = capacity_report({"s": _S}, memory_bytes=9 * 192, max_model_len=8, block_size=4)
    assert (s["attention_block_size"], s["bytes_per_token"]) == (None, 0.0)
    assert s["state_equivalent_tokens"] == 0
    a = capacity_report({"a": _A}, memory_bytes=9 * 128, max_model_len=8, block_size=4)
    assert (a["pages_per_state"], a["padding_bytes"], a["state_page_bytes"]) == (0, 0, 0)
    assert a["state_bytes_per_sequence"] == 0
    v = capacity_report({"a": _A}, layout="vllm", memory_bytes=1 << 20, max_model_len=8,
                        block_size=4)
    assert v["pages_per_state"] == 0
    vh = capacity_report({"a": _A, "s": _S}, layout="vllm", memory_bytes=1 << 20,
                         max_model_len=8, block_size=4)
    assert vh["pages_per_state"] == 1
    assert [g["pages_per_state"] for g in vh["groups"]] == [0, 1]


def test_report_window_group_uses_the_step_budget():
    """A window of 8 at blocks of 4, 64 tokens: a prefill chunk of 4 holds the pages of a
    span of 8 - 1 + 4 tokens, cdiv(10, 4) + 1 = 4 pages; a chunk of 64 holds all 16."""
    w = SlidingWindowSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, window=8)
    for budget, pages in ((4, 4), (4096, 16)):
        r = capacity_report({"w": w}, memory_bytes=40 * 128, max_model_len=64, block_size=4,
                            max_num_batched_tokens=budget)
        assert [g["blocks_per_request"] for g in r["groups"]] == [pages]


def test_report_limits_and_messages():
    r = capacity_report({"a": _A}, memory_bytes=9 * 128, max_model_len=1, block_size=4)
    assert r["blocks_per_request"] == 1
    with pytest.raises(ValueError, match=r"^the KV cache budget of 1 bytes gives 0 usable"):
        capacity_report({"a": _A}, memory_bytes=1, max_model_len=4, block_size=4)
    with pytest.raises(ValueError) as e:
        capacity_report({"a": _A}, layout="x", memory_bytes=1 << 20, max_model_len=4)
    assert str(e.value) == "layout must be one of pagefold, vllm; got 'x'"
    with pytest.raises(ValueError) as e:
        capacity_report({"a": _A}, memory_bytes=1 << 20, max_model_len=0)
    assert str(e.value) == "max_model_len must be at least 1, got 0"
    with pytest.raises(ValueError) as e:
        capacity_report({"a": _A}, memory_bytes=0, max_model_len=4)
    assert str(e.value) == "kv_cache_memory must be positive, got 0"


def test_vllm_layout_charges_a_state_block_per_speculative_token():
    """vLLM keeps one more state block per speculative token in each state group."""
    kw = dict(layout="vllm", memory_bytes=1 << 20, max_model_len=8, block_size=4)
    plain = capacity_report({"a": _A, "s": _S}, **kw)
    spec = capacity_report({"a": _A, "s": _S}, num_speculative_tokens=2, **kw)
    assert spec["blocks_per_request"] == plain["blocks_per_request"] + 2


def test_vllm_layout_takes_the_block_size():
    for bs, blocks in ((4, 16), (32, 2)):
        r = capacity_report({"a": _A}, layout="vllm", memory_bytes=1 << 20, max_model_len=64,
                            block_size=bs)
        assert (r["attention_block_size"], r["blocks_per_request"]) == (bs, blocks)


def test_vllm_layout_window_uses_the_step_budget_it_is_given():
    """vLLM's window rule cdiv(min(window - 1 + budget, len), block) + 1, with the budget the
    caller names (the CLI's ``--max-num-batched-tokens``), else vLLM's own default of 8192:
    window 8, blocks of 4, 64 tokens: a budget of 4 holds cdiv(11, 4) + 1 = 4 blocks, the
    default cdiv(64, 4) + 1 = 17. Each layout's default budget is reported as used."""
    w = SlidingWindowSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, window=8)
    got = {}
    for budget in (4, None):
        r = capacity_report({"w": w}, layout="vllm", memory_bytes=1 << 20, max_model_len=64,
                            block_size=4, max_num_batched_tokens=budget)
        got[budget] = ([g["blocks_per_request"] for g in r["groups"]],
                       r["max_num_batched_tokens"])
    assert got == {4: ([4], 4), None: ([17], 8192)}
    p = capacity_report({"w": w}, memory_bytes=40 * 128, max_model_len=64, block_size=4)
    assert p["max_num_batched_tokens"] == 4096
