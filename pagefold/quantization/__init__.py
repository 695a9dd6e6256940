"""Quantized weights: formats (:mod:`.formats`), which one a model loads with
(:mod:`.config`), the quantized linear layer (:mod:`.linear`), its loading
(:mod:`.loader`), MoE experts (:mod:`.experts`) and tensor-parallel splits (:mod:`.tp`)."""

from pagefold.quantization.config import ON_LOAD, QUANTIZATIONS, QuantPlan, resolve
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.linear import QuantLinear, finalize_all, weights_summary
from pagefold.quantization.loader import Quantizer, quantize_loaded

__all__ = ["ON_LOAD", "QUANTIZATIONS", "QuantLinear", "QuantPlan", "QuantizationError",
           "Quantizer", "finalize_all", "quantize_loaded", "resolve", "weights_summary"]
