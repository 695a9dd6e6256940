"""Quantized weights under tensor parallelism (2 gloo ranks on the CPU): greedy float32 tokens
equal the one-rank engine's on the same quantized checkpoint, and transformers' on its
dequantized weights.

The checkpoints are ``tests/test_quantization.py``'s (packers written from the formats'
documentation). Widths are chosen so every rank holds whole groups (groups of 32 inputs over
64-input halves); GPTQ act-order spreads each group unevenly over the ranks, so the
row-parallel layers' groups are regathered and padded. The GDN hybrid (Qwen3.5) quantizes its
``in_proj_qkvz`` / ``in_proj_ba`` (column-parallel, 4 blocks cut separately) and ``out_proj``
(row-parallel). A split inside a group is an error naming the layer.
"""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.distributed.parallel_state import set_tensor_parallel
from pagefold.layers.linear import column_linear, row_linear
from pagefold.quantization import Quantizer, resolve
from pagefold.testing.oracle import hf_greedy
from tests.test_quantization import N_NEW, PROMPTS, awq, gptq, write_quantized

DENSE = dict(intermediate_size=128)  # down_proj: 64 inputs a rank, two groups of 32
# 16 value heads: the b / a rows (8 a rank) fill GPTQ's 8-row words; out_proj 128 inputs a rank.
GDN = dict(linear_num_value_heads=16, linear_value_head_dim=16)
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


def _tokens(model_dir, tp: int, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              max_num_batched_tokens=9, tensor_parallel_size=tp, threads_per_rank=1, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "fmt"), [
    ("llama", "gptq-int4-g32-actorder"),
    ("llama", "awq-int4-g32"),
    ("llama", "ct-w4a16-g32"),
    ("llama", "fp8-block"),
    ("qwen3_5", "gptq-int4-g32-actorder"),
    ("qwen3_5", "ct-w8a16-channel"),
])
def test_tp2_quantized_checkpoint_matches_one_rank(tiny_model_factory, tmp_path, arch, fmt):
    src = tiny_model_factory(arch, **(DENSE if arch == "llama" else GDN))
    n = write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt)
    assert n >= 8
    one = _tokens(tmp_path / "q", 1)
    assert one == hf_greedy(tmp_path / "ref", PROMPTS, N_NEW)
    assert _tokens(tmp_path / "q", 2) == one


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_tp2_quantization_on_load_matches_one_rank(tiny_model_factory, kind):
    """Each rank quantizes its part as the one-rank model does: row-parallel per-channel
    scales take the maximum over the ranks (o_proj: 64 inputs, per channel; down_proj: groups
    of 128, one a rank)."""
    src = tiny_model_factory("qwen3", intermediate_size=256, head_dim=16)
    assert _tokens(src, 2, quantization=kind) == _tokens(src, 1, quantization=kind)


@pytest.mark.slow
def test_tp2_granite_shared_mlp_quantized_on_load_matches_one_rank(tiny_model_factory):
    """Granite-4.0-H's shared ``input_linear`` is cut by its model's loader (gate rows then up
    rows a rank, declared as ``loader_cuts``): FP8 on load takes the same cut (it was refused
    under tensor parallelism)."""
    src = tiny_model_factory("granitemoehybrid")
    assert _tokens(src, 2, quantization="fp8") == _tokens(src, 1, quantization="fp8")


def test_split_inside_a_group_names_the_layer(tiny_model_factory, tmp_path):
    """The tiny llama's down_proj has 160 inputs: 80 a rank, which groups of 32 do not tile."""
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r", "awq-int4-g32")
    with pytest.raises(Exception, match=r"mlp\.down_proj: awq group size 32 does not divide "
                                        r"its 80 input features .*tensor parallelism"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
            tensor_parallel_size=2, threads_per_rank=1)


GPTQ_CFG = dict(quant_method="gptq", bits=4, group_size=32, desc_act=True)
AWQ_CFG = dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm")


def _rank_layer(plain, qcfg: dict, stored: dict, shard: str | None):
    """``plain`` (this rank's layer) converted by the loader and loaded from full tensors."""
    holder = torch.nn.Module()
    holder.lin = plain
    quant = Quantizer(resolve({"quantization_config": qcfg}, None))
    for name, t in stored.items():
        quant.before_load(holder, f"lin.{name}", t)
        p = getattr(holder.lin, name)
        p.tp_loader(p, t, shard)
    holder.lin.finalize()
    return holder.lin


@pytest.mark.parametrize("qcfg", [GPTQ_CFG, AWQ_CFG])
def test_ranks_hold_blocks_of_the_full_weight(qcfg):
    """Row-parallel: the ranks' partial products sum to the full layer's (act-order groups
    regathered and padded); column-parallel: each rank's rows of each fused shard."""
    gen = torch.Generator().manual_seed(3)
    k, n = 192, 48  # 96 inputs a rank: three groups of 32, spread unevenly by act-order
    w = torch.randn(n, k, generator=gen)
    stored, deq = (gptq(w, 4, 32, True, gen) if qcfg is GPTQ_CFG else awq(w, 32))
    x = torch.randn(5, k, generator=gen)
    partial = []
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            lin = _rank_layer(row_linear(k, n, bias=False, reduce=False), qcfg, stored, None)
            assert lin.in_features == k // 2
            partial.append(lin(x[:, rank * k // 2:(rank + 1) * k // 2].contiguous()))
            if qcfg is GPTQ_CFG:
                assert lin.in_index is not None  # act-order: padded groups
        torch.testing.assert_close(partial[0] + partial[1], x @ deq.t(), rtol=1e-5, atol=1e-4)
        # Column-parallel, fused: shard "a" of 16 rows and "b" of 32 (8 and 16 a rank).
        w2 = torch.randn(n, 64, generator=gen)
        parts = {s: (gptq(w2[r], 4, 32, False, gen) if qcfg is GPTQ_CFG else awq(w2[r], 32))
                 for s, r in (("a", slice(0, 16)), ("b", slice(16, 48)))}
        x2 = torch.randn(3, 64, generator=gen)
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            holder = torch.nn.Module()
            holder.lin = column_linear(64, {"a": 16, "b": 32}, bias=False)
            quant = Quantizer(resolve({"quantization_config": qcfg}, None))
            for s, (st, _) in parts.items():
                for name, t in st.items():
                    quant.before_load(holder, f"lin.{name}", t)
                    p = getattr(holder.lin, name)
                    p.tp_loader(p, t, s)
            holder.lin.finalize()
            want = torch.cat([parts["a"][1][rank * 8:(rank + 1) * 8],
                              parts["b"][1][rank * 16:(rank + 1) * 16]])
            torch.testing.assert_close(holder.lin(x2), x2 @ want.t(), rtol=1e-5, atol=1e-4)
    finally:
        set_tensor_parallel(0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ct-w8a16-channel", "int4"])
def test_tp2_quantized_experts_match_one_rank(tiny_model_factory, tmp_path, how):
    """Qwen3-Next's quantized experts split their intermediate dimension over the ranks as the
    stacked ones do (a checkpoint's per-expert tensors, or int4 on load: the down projections'
    per-channel scales over all 32 inputs, 16 a rank)."""
    src = tiny_model_factory("qwen3_next", head_dim=16)  # o_proj: 64 inputs, per channel
    if how == "int4":
        assert _tokens(src, 2, quantization=how) == _tokens(src, 1, quantization=how)
        return
    write_quantized(src, tmp_path / "q", tmp_path / "ref", how, plain=("linear_attn",))
    one = _tokens(tmp_path / "q", 1)
    assert one == hf_greedy(tmp_path / "ref", PROMPTS, N_NEW)
    assert _tokens(tmp_path / "q", 2) == one


@pytest.mark.slow
def test_ep2_quantized_experts(tiny_model_factory, tmp_path):
    """Expert parallelism: int4 on load quantizes each rank's whole experts as the one-rank
    model does (the same tokens); a checkpoint storing its experts quantized (per-expert names
    with global ids) is refused naming the layer."""
    src = tiny_model_factory("qwen3_next", head_dim=16)
    assert (_tokens(src, 2, quantization="int4", enable_expert_parallel=True)
            == _tokens(src, 1, quantization="int4"))
    write_quantized(src, tmp_path / "q", tmp_path / "ref", "ct-w8a16-channel",
                    plain=("linear_attn",))
    with pytest.raises(Exception, match=r"mlp\.experts: experts stored quantized in the "
                                        r"checkpoint are not supported with "
                                        r"enable_expert_parallel"):
        _tokens(tmp_path / "q", 2, enable_expert_parallel=True)
