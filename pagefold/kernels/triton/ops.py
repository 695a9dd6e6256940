"""The Triton entry points :mod:`pagefold.kernels.dispatch` routes to (one import)."""

from pagefold.kernels.triton.attention import paged_attention
from pagefold.kernels.triton.elementwise import qk_norm_rope, rms_norm, rms_norm_gated, silu_and_mul
from pagefold.kernels.triton.gdn import gdn_layer
from pagefold.kernels.triton.ssd import mamba_scan_layer
from pagefold.kernels.triton.state_steps import gdn_verify_layer, mamba_verify_layer

__all__ = ["gdn_layer", "gdn_verify_layer", "mamba_scan_layer", "mamba_verify_layer",
           "paged_attention", "qk_norm_rope", "rms_norm", "rms_norm_gated", "silu_and_mul"]
