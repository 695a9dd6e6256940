"""Quantized weights: formats (:mod:`.formats`), which one a model loads with
(:mod:`.config`), and the quantized linear layer and its loading (:mod:`.linear`)."""

from pagefold.quantization.config import ON_LOAD, QUANTIZATIONS, QuantPlan, resolve
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.linear import (
    Quantizer,
    QuantLinear,
    finalize_all,
    quantize_loaded,
    weights_summary,
)

__all__ = ["ON_LOAD", "QUANTIZATIONS", "QuantLinear", "QuantPlan", "QuantizationError",
           "Quantizer", "finalize_all", "quantize_loaded", "resolve", "weights_summary"]
