"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) and quantization on load, against
transformers running the same weights dequantized.

The quantized checkpoints are written here from tiny random models by packers written in this
file from the formats' documentation (nothing of ``pagefold.quantization`` is imported to make
or read them): GPTQ's v1 layout (inputs packed in int32 words, zeros stored minus one,
act-order ``g_idx``), AWQ's GEMM layout (outputs packed in AWQ's nibble order),
compressed-tensors' pack-quantized symmetric ints, fp8 with per-tensor, per-channel and block
scales. The same code writes the dequantized float32 weights, which transformers runs as the
oracle: the quantized model's own function, so greedy tokens must be equal. On-load
quantization (``quantization="fp8"`` / ``int8`` / ``int4``) is checked the same way against
the documented rule (per-channel fp8 scales amax / 448; symmetric int with groups of 128
inputs, per channel where 128 does not divide) applied here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy

N_NEW = 8
PROMPTS = [[5, 17, 99, 23, 41, 8, 77], [300, 12, 4, 250, 31, 66, 90, 145, 9, 14, 200]]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of 32-bit words -> int32 (two's complement)."""
    x = x % (1 << 32)
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _quantizable(name: str, t: torch.Tensor, n_div: int, k_div: int) -> bool:
    return (t.dim() == 2 and ".layers." in name and name.endswith(".weight")
            and not any(s in name for s in ("norm", "embed", "conv1d"))
            and t.shape[0] % n_div == 0 and t.shape[1] % k_div == 0)


# --------------------------------------------------------------------------- packers
def gptq(w: torch.Tensor, bits: int, group: int, act_order: bool, gen: torch.Generator):
    n, k = w.shape
    per, top = 32 // bits, (1 << bits) - 1
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group  # the group of each input, in act-order
    groups = k // group
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    q = torch.empty(k, n, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.min(dim=1).values, wg.max(dim=1).values
        s = ((hi - lo) / top).clamp(min=1e-6).half().float()
        z = torch.round(-lo / s).clamp(1, top).long()  # >= 1: the v1 layout stores zero - 1
        scales[g], zeros[g] = s, z
        q[cols] = (torch.round(wg / s[:, None]) + z[:, None]).clamp(0, top).long().t()
    deq = torch.empty(n, k)
    for kk in range(k):
        g = int(g_idx[kk])
        deq[:, kk] = scales[g] * (q[kk] - zeros[g]).float()
    qweight = torch.zeros(k // per, n, dtype=torch.int64)
    for kk in range(k):
        qweight[kk // per] += q[kk] << (bits * (kk % per))
    qzeros = torch.zeros(groups, n // per, dtype=torch.int64)
    for nn_ in range(n):
        qzeros[:, nn_ // per] += (zeros[:, nn_] - 1) << (bits * (nn_ % per))
    return {"qweight": _to_i32(qweight), "qzeros": _to_i32(qzeros), "scales": scales.half(),
            "g_idx": g_idx.to(torch.int32)}, deq


def awq(w: torch.Tensor, group: int):
    n, k = w.shape
    groups = k // group
    wg = w.reshape(n, groups, group)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    s = ((hi - lo) / 15).clamp(min=1e-6).half().float()  # (n, groups)
    z = torch.round(-lo / s).clamp(0, 15).long()
    q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15).long().reshape(n, k)
    deq = ((q.reshape(n, groups, group) - z[..., None]).float() * s[..., None]).reshape(n, k)
    qt, zt = q.t(), z.t()  # (k, n), (groups, n)
    qweight = torch.zeros(k, n // 8, dtype=torch.int64)
    qzeros = torch.zeros(groups, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for i, col in enumerate(AWQ_ORDER):
            qweight[:, c] += qt[:, 8 * c + col] << (4 * i)
            qzeros[:, c] += zt[:, 8 * c + col] << (4 * i)
    scales = s.t().contiguous().half()
    return {"qweight": _to_i32(qweight), "qzeros": _to_i32(qzeros), "scales": scales}, deq


def packed_int(w: torch.Tensor, bits: int, group: int):
    """compressed-tensors pack-quantized, symmetric: scale = amax / qmax per group."""
    n, k = w.shape
    g = k if group < 0 else group
    qmax = (1 << (bits - 1)) - 1
    wg = w.reshape(n, k // g, g)
    s = (wg.abs().amax(dim=2) / qmax).clamp(min=1e-8)
    q = torch.round(wg / s[..., None]).clamp(-qmax - 1, qmax).long().reshape(n, k)
    deq = (q.reshape(n, k // g, g).float() * s[..., None]).reshape(n, k)
    per = 32 // bits
    packed = torch.zeros(n, k // per, dtype=torch.int64)
    for kk in range(k):
        packed[:, kk // per] += (q[:, kk] + (1 << (bits - 1))) << (bits * (kk % per))
    return {"weight_packed": _to_i32(packed), "weight_scale": s,
            "weight_shape": torch.tensor([n, k])}, deq


def fp8(w: torch.Tensor, scale: str, block: tuple[int, int] = (16, 32)):
    n, k = w.shape
    if scale == "tensor":
        s = (w.abs().max() / 448).clamp(min=1e-8)
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s.reshape(())}, q.float() * s
    if scale == "channel":
        s = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-8)
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}, q.float() * s
    bn, bk = block
    s = torch.empty(n // bn, -(-k // bk))
    deq, q = torch.empty(n, k), torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(n // bn):
        for j in range(s.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = (tile.abs().max() / 448).clamp(min=1e-8)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s[i, j]).to(torch.float8_e4m3fn)
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = \
                q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j]
    return {"weight": q, "weight_scale_inv": s}, deq


FORMATS = {
    "gptq-int4-g32-actorder": (
        dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False,
             checkpoint_format="gptq"), 8, 32,
        lambda w, gen: gptq(w, 4, 32, True, gen)),
    "gptq-int8-g64": (
        dict(quant_method="gptq", bits=8, group_size=32, desc_act=False, sym=False), 4, 32,
        lambda w, gen: gptq(w, 8, 32, False, gen)),
    "awq-int4-g32": (
        dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"), 8, 32,
        lambda w, gen: awq(w, 32)),
    "ct-w4a16-g32": (
        dict(quant_method="compressed-tensors", format="pack-quantized", ignore=["lm_head"],
             config_groups={"group_0": {"targets": ["Linear"], "input_activations": None,
                                        "weights": {"num_bits": 4, "type": "int",
                                                    "strategy": "group", "group_size": 32,
                                                    "symmetric": True}}}), 1, 32,
        lambda w, gen: packed_int(w, 4, 32)),
    "ct-w8a16-channel": (
        dict(quant_method="compressed-tensors", format="pack-quantized",
             config_groups={"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}),
        1, 4, lambda w, gen: packed_int(w, 8, -1)),
    "fp8-tensor": (dict(quant_method="fp8", activation_scheme="dynamic"), 1, 1,
                   lambda w, gen: fp8(w, "tensor")),
    "fp8-block": (dict(quant_method="fp8", weight_block_size=[16, 32]), 16, 1,
                  lambda w, gen: fp8(w, "block")),
    "ct-fp8-channel": (
        dict(quant_method="compressed-tensors", format="float-quantized",
             config_groups={"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "float", "strategy": "channel"}}}),
        1, 1, lambda w, gen: fp8(w, "channel")),
}


def write_quantized(src: Path, dst: Path, ref: Path, fmt: str, plain: tuple[str, ...] = ()
                    ) -> int:
    """``dst``: ``src`` with its layers' linears quantized in ``fmt`` (but those whose name
    holds one of ``plain``); ``ref``: the same weights dequantized, plain float32. Returns how
    many linears were quantized."""
    qcfg, n_div, k_div, quant = FORMATS[fmt]
    gen = torch.Generator().manual_seed(7)
    for d in (dst, ref):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    qt, rt, count = {}, {}, 0
    for name, t in tensors.items():
        if _quantizable(name, t, n_div, k_div) and not any(p in name for p in plain):
            stored, deq = quant(t.float(), gen)
            prefix = name.removesuffix(".weight")
            qt.update({f"{prefix}.{k}": v for k, v in stored.items()})
            rt[name] = deq.to(t.dtype)
            count += 1
        else:
            qt[name] = rt[name] = t
    save_file(qt, str(dst / "model.safetensors"))
    save_file(rt, str(ref / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    return count


def _pagefold(model_dir: Path, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              max_num_batched_tokens=9, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                        use_tqdm=False)
    llm.engine.kv.check_whole()
    return [list(o.outputs[0].token_ids) for o in outs]


def _oracle(ref: Path) -> list[list[int]]:
    return hf_greedy(ref, PROMPTS, N_NEW)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dense_formats_match_dequantized_transformers(tiny_model_factory, tmp_path, fmt, caplog):
    src = tiny_model_factory("llama")
    n = write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt)
    assert n >= 8  # q, k, v, o, gate, up, down of two layers (some formats skip a width)
    with caplog.at_level(logging.INFO, logger="pagefold"):
        got = _pagefold(tmp_path / "q")
    assert got == _oracle(tmp_path / "ref")
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    family = "fp8" if "fp8" in fmt else FORMATS[fmt][0]["quant_method"]
    assert summary and f"{family}" in summary[-1], summary


# Widths a packed format takes in every fused shard (GPTQ packs 8 output rows a word): the
# GDN layers' b / a projections have one row per value head.
STATE_ARCHS = {"qwen3_5": dict(linear_num_value_heads=8), "nemotron_h": {}}


@pytest.mark.parametrize("arch", list(STATE_ARCHS))
@pytest.mark.parametrize("fmt", ["gptq-int4-g32-actorder", "ct-fp8-channel"])
def test_state_layer_projections_quantize(tiny_model_factory, tmp_path, arch, fmt):
    """GDN and Mamba-2 in/out projections quantize like any linear (conv weights, A_log,
    dt_bias and norms stay as stored)."""
    src = tiny_model_factory(arch, **STATE_ARCHS[arch])
    n = write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    state_proj = [k for k in tensors if ("linear_attn" in k or "mixer.in_proj" in k
                                         or "mixer.out_proj" in k)
                  and k.endswith((".qweight", ".weight")) and tensors[k].dtype in
                  (torch.int32, torch.float8_e4m3fn)]
    assert n > 4 and state_proj, sorted(tensors)[:20]
    assert _pagefold(tmp_path / "q") == _oracle(tmp_path / "ref")


def _on_load_reference(w: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp8":
        return fp8(w, "channel")[1]
    bits = 8 if kind == "int8" else 4
    group = 128 if w.shape[1] % 128 == 0 else -1
    return packed_int(w, bits, group)[1]


@pytest.mark.parametrize(("arch", "kind"), [("qwen3", "fp8"), ("qwen3", "int8"),
                                          ("qwen3", "int4"), ("nemotron_h", "int4")])
def test_quantization_on_load(tiny_model_factory, tmp_path, arch, kind):
    """Every linear but the lm_head, quantized on load (the Mamba-2 hybrid's mixer in / out
    projections too; its conv, A_log, D, dt_bias and norms stay as loaded)."""
    src = tiny_model_factory(arch)
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    out = {k: (_on_load_reference(t.float(), kind).to(t.dtype)
               if _quantizable(k, t, 1, 8) else t) for k, t in tensors.items()}
    save_file(out, str(ref / "model.safetensors"))
    assert _pagefold(src, quantization=kind) == _oracle(ref)


def test_on_load_memory_is_smaller(tiny_model_factory, caplog):
    src = tiny_model_factory("qwen3")
    sizes = {}
    for q in (None, "int4"):
        with caplog.at_level(logging.INFO, logger="pagefold"):
            caplog.clear()
            LLM(str(src), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
                quantization=q)
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
        sizes[q] = float(line[-1].split()[1])
    assert sizes["int4"] < 0.6 * sizes[None]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("option, match", [
    ("int3", "unknown quantization 'int3'"),
    ("gguf", "needs a checkpoint stored in that format"),
    ("gptq", "needs a checkpoint stored in that format"),
])
def test_bad_options(tiny_model_factory, option, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model_factory("llama")), quantization=option)


def test_option_contradicting_checkpoint(tiny_model_factory, tmp_path):
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r", "awq-int4-g32")
    with pytest.raises(ValueError, match="awq-quantized; quantization 'fp8' does not apply"):
        LLM(str(tmp_path / "q"), dtype="float32", quantization="fp8")


def test_truncated_tensor_names_tensor_and_format(tiny_model_factory, tmp_path):
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r",
                    "gptq-int4-g32-actorder")
    f = tmp_path / "q" / "model.safetensors"
    t = load_file(str(f))
    key = "model.layers.1.mlp.down_proj.qweight"
    t[key] = t[key][:-1].clone()  # one packed row short
    save_file(t, str(f))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.qweight: gptq "
                                         r"tensor of shape"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


def test_group_size_must_divide(tiny_model_factory, tmp_path):
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r", "awq-int4-g32")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48  # divides no layer's inputs (64, 160)
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: awq group size 48 "
                                         r"does not divide its 160 input features"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


@pytest.mark.parametrize("qcfg, match", [
    (dict(quant_method="gptq", bits=3, group_size=32), "gptq with 3-bit weights"),
    (dict(quant_method="awq", version="gemv"), "awq version 'gemv'"),
    (dict(quant_method="bitsandbytes"), "bitsandbytes-quantized, which pagefold does not load"),
    (dict(quant_method="frobnicate"), "unknown quantization method 'frobnicate'"),
])
def test_unsupported_layouts(tiny_model_factory, tmp_path, qcfg, match):
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r",
                    "gptq-int4-g32-actorder")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


def test_fused_layer_with_mixed_shards_is_refused(tiny_model_factory, tmp_path):
    """A fused layer whose checkpoint shards are partly plain (here the GDN b / a projections,
    4 rows, which GPTQ's 8-row words cannot pack) is an error naming the layer, never a layer
    with rows silently missing."""
    write_quantized(tiny_model_factory("qwen3_5"), tmp_path / "q", tmp_path / "r",
                    "gptq-int4-g32-actorder")
    with pytest.raises(ValueError, match=r"linear_attn\.in_proj.*(plain|do not align)"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


@pytest.mark.parametrize("qcfg, name", [
    (dict(quant_method="fp8", weight_block_size=[128, 128]), "weight_scale_inv"),
    (dict(quant_method="gptq", bits=4, group_size=128), "g_idx"),
    (dict(quant_method="awq", bits=4, group_size=96), "qzeros"),
])
def test_quantizer_knows_the_format_tensors_of_any_block(qcfg, name):
    """The loader recognises a format's tensors whatever its group or block size (a 128-row
    fp8 block once made the tensor lookup raise for a width it did not divide)."""
    from pagefold.quantization import Quantizer, resolve

    quantizer = Quantizer(resolve({"quantization_config": qcfg}, None))
    assert quantizer.is_format_tensor(name) and not quantizer.is_format_tensor("weight_x")
