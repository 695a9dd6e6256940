"""Which state layers can run a speculative verify pass, checked on a built model.

Kept apart from ``spec_decode/config.py`` (read by ``EngineConfig`` in every process) because
it needs the model classes; only the engine, which holds the model, imports it.
"""

from __future__ import annotations

from typing import Any

from pagefold.models.mamba2_hybrid import Mamba2Mixer
from pagefold.models.qwen3_5 import GatedDeltaNet

__all__ = ["check_verify_support"]


def check_verify_support(model: Any, state_layers: set[str], what: str = "this model") -> None:
    """Raise ``ValueError`` when a state layer of ``model`` (a module whose ``layer_name`` is
    in ``state_layers``) cannot run a verify pass (return the state after every token instead
    of storing it): speculating on it would leave rejected drafts in its recurrent state.
    Gated DeltaNet (Qwen3.5 / Qwen3-Next) and the Mamba-2 mixer (Nemotron-H, Bamba,
    Granite-4.0-H, Mamba-2) can; subclasses qualify only if they keep the verify forward."""
    able = (GatedDeltaNet.forward, Mamba2Mixer.forward)
    for m in model.modules():
        name = getattr(m, "layer_name", None)
        if name in state_layers and getattr(type(m), "forward", None) not in able:
            raise ValueError(
                f"speculative decoding cannot verify drafts on {what}'s "
                f"{type(m).__name__} state layers yet (their states would absorb rejected "
                f"drafts); supported state layers: Gated DeltaNet and Mamba-2. Turn "
                f"speculative_config off for this model.")
