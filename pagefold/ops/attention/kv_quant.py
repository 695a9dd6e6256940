"""FP8 (e4m3) KV cache: per-head scales, K smoothing, saturating casts.

What went wrong on SmolLM2-135M-Instruct ("The capital of France is Paris." became "L'Étoile,
la Marsebeau, ..."): the reply's first token is a near-tie ("The" vs "L", 0.1 nat apart in
float32). e4m3 keeps 3 mantissa bits (up to 1/16 relative error per element; quantizing K
alone flips the answer, V alone does not), and the FP8 cache took the torch fallback, which
rounded the dequantized scores to bf16 on top. Saturation was not the cause there (|K| <= ~20,
|V| <= ~12, far under e4m3's 448) but must never turn into NaN. FP8 attention therefore runs in
float32 on dequantized values (``backend.py``), and the stored encoding reduces the rounding
error where it is largest, K's outlier channels (large, nearly constant across tokens):

per attention layer (vLLM's ``calculate_kv_scales`` idea plus K smoothing):

* ``k_shift`` (kv_heads, head_dim): the mean key of the calibration tokens, subtracted before
  quantizing. Softmax is invariant to adding one constant to all logits of a query, and
  ``q . (k - shift) = q . k - q . shift`` shifts every key's logit by the same amount, so the
  shift never has to be added back: reads use the stored ``k - shift`` as is. What remains to
  quantize is the per-token variation, much smaller than the outlier channels' offset.
* ``k_scale``/``v_scale`` (kv_heads,): ``amax / (448 / HEADROOM)`` of the calibration
  activations, so the format's range is used (no subnormals) with headroom for later tokens;
  values beyond it saturate at +-448 (explicit clamp, never NaN).
* Calibration: the first real batch's K/V of each layer (warm-up's dummy tokens are skipped),
  or scales a checkpoint provides. Fixed from then on: every cached block of a layer shares
  one encoding, so prefix-cache hits read the same values a fresh prefill would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HEADROOM = 2.0  # later tokens may exceed the calibration amax this much before saturating
MIN_CALIBRATION_TOKENS = 8  # fewer: plain e4m3 (unit scales, no shift), stats too thin


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@dataclass(slots=True)
class KVScales:
    """One attention layer's FP8 encoding: stored K = (k - k_shift) / k_scale, V = v / v_scale
    (per KV head), both cast with saturation. Dequantized K omits the shift (see module doc).
    """

    k_scale: torch.Tensor  # (kv_heads,) float32
    v_scale: torch.Tensor  # (kv_heads,) float32
    k_shift: torch.Tensor  # (kv_heads, head_dim) float32
    source: str = "calibrated"

    @classmethod
    def calibrate(cls, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> KVScales:
        """From one batch's k, v (T, kv_heads, head_dim)."""
        if k.shape[0] < MIN_CALIBRATION_TOKENS:
            return cls.unit(k.shape[1], k.shape[2], k.device)
        kf, vf = k.float(), v.float()
        shift = kf.mean(0)
        limit = fp8_max(dtype) / HEADROOM
        k_amax = (kf - shift).abs().amax(dim=(0, 2))
        v_amax = vf.abs().amax(dim=(0, 2))
        tiny = torch.finfo(torch.float32).tiny
        return cls((k_amax / limit).clamp_min(tiny), (v_amax / limit).clamp_min(tiny), shift)

    @classmethod
    def unit(cls, kv_heads: int, head_dim: int, device: torch.device) -> KVScales:
        one = torch.ones(kv_heads, device=device)
        return cls(one, one.clone(), torch.zeros(kv_heads, head_dim, device=device), "unit")

    def quantize(self, k: torch.Tensor, v: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (T, kv_heads, head_dim) -> their stored form, saturated to the format's range."""
        m = fp8_max(dtype)
        kq = ((k.float() - self.k_shift) / self.k_scale[:, None]).clamp_(-m, m).to(dtype)
        vq = (v.float() / self.v_scale[:, None]).clamp_(-m, m).to(dtype)
        return kq, vq

    def dequantize(self, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``kv`` (..., 2, kv_heads, head_dim) stored -> K (shift omitted) and V in ``dtype``."""
        scale = torch.stack((self.k_scale, self.v_scale))[:, :, None]  # (2, kvh, 1)
        return (kv.float() * scale).to(dtype)
