"""FP8 KV encoding (``pagefold.ops.attention.kv_quant``) on synthetic data and tiny models.

The real-activation checks (Paris, KL bound) are in ``tests/test_smollm2.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.ops.attention import read_kv, write_kv
from pagefold.ops.attention.kv_quant import KVScales

F8 = torch.float8_e4m3fn


def _cache(n_slots: int, kvh: int, d: int) -> torch.Tensor:
    return torch.zeros((n_slots // 16, 16, 2, kvh, d), dtype=F8)


def test_casts_saturate_instead_of_nan():
    cache = _cache(16, 2, 8)
    k = torch.full((3, 2, 8), 1e4)
    v = -k
    write_kv(cache, torch.arange(3), k, v)  # unit scales
    back = read_kv(cache, torch.arange(3), torch.float32)
    assert torch.isfinite(back).all()
    assert (back[:, 0] == 448).all() and (back[:, 1] == -448).all()


def _attention(q, k, v):
    w = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, -1)
    return w @ v


def test_k_shift_removes_outlier_channel_error_and_needs_no_correction():
    """Keys with a large, nearly constant channel (as RoPE's slow dimensions give): the shift
    makes their rounding error vanish, and attention over the stored (shifted) keys equals
    attention over the true ones (softmax ignores the per-query constant q . shift)."""
    g = torch.Generator().manual_seed(0)
    t, d = 64, 64
    k = torch.randn(t, 1, d, generator=g)
    k[..., :4] += torch.tensor([60.0, -45.0, 30.0, 80.0])  # outlier channels
    v = torch.randn(t, 1, d, generator=g)
    q = torch.randn(4, d, generator=g)
    q[:, :4] *= 4
    ref = _attention(q, k[:, 0], v[:, 0])
    errs = {}
    for name, scales in (("plain", KVScales.unit(1, d, k.device)),
                         ("calibrated", KVScales.calibrate(k, v, F8))):
        cache = _cache(t, 1, d)
        write_kv(cache, torch.arange(t), k, v, scales)
        kv = read_kv(cache, torch.arange(t), torch.float32, scales)
        errs[name] = (_attention(q, kv[:, 0, 0], kv[:, 1, 0]) - ref).norm() / ref.norm()
    print(errs)
    assert errs["calibrated"] < 0.06
    assert errs["calibrated"] < errs["plain"] / 3, errs


def test_calibration_uses_range_and_short_batches_fall_back():
    k = torch.randn(32, 2, 16) * torch.tensor([1.0, 0.01])[None, :, None]
    s = KVScales.calibrate(k, k, F8)
    kq, _ = s.quantize(k, k, F8)
    amax = kq.float().abs().amax(dim=(0, 2))
    assert ((amax > 180) & (amax <= 448 / 2 + 1)).all()  # each head uses the range, headroom 2
    assert KVScales.calibrate(k[:3], k[:3], F8).source == "unit"


@pytest.fixture(scope="module")
def llama_with_scales(llama_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama_kv_scales") / "m"
    shutil.copytree(llama_dir, out)
    f = next(out.glob("*.safetensors"))
    tensors = load_file(str(f))
    n_layers = len({k.split(".")[2] for k in tensors if k.startswith("model.layers.")})
    for i in range(n_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def test_checkpoint_scales_are_taken_and_warm_up_does_not_calibrate(llama_dir: Path,
                                                                    llama_with_scales: Path):
    llm = LLM(str(llama_with_scales), kv_cache_dtype="fp8", max_model_len=64,
              kv_cache_memory=1 << 20)
    scales = llm.engine.runner.cache.kv_scales
    assert scales and all(s.source == "checkpoint" for s in scales.values())
    assert all(torch.allclose(s.k_scale, torch.tensor(0.05)) for s in scales.values())
    out = llm.generate({"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # Without checkpoint scales: none after warm-up, all calibrated after the first batch.
    llm = LLM(str(llama_dir), kv_cache_dtype="fp8", max_model_len=64, kv_cache_memory=1 << 20)
    assert llm.engine.runner.cache.kv_scales == {}
    llm.generate({"prompt_token_ids": list(range(3, 40))},
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    scales = llm.engine.runner.cache.kv_scales
    assert scales and all(s.source == "calibrated" for s in scales.values())
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_usable
