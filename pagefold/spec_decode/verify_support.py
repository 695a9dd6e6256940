"""Which state layers can run a speculative verify pass, checked on a built model.

Kept apart from ``spec_decode/config.py`` (read by ``EngineConfig`` in every process) because
it needs the model classes; only the engine, which holds the model, imports it.
"""

from __future__ import annotations

from typing import Any

from pagefold.layers.mamba.mamba1 import Mamba1Mixer
from pagefold.models.falcon_h1 import FalconH1Mixer
from pagefold.models.kimi_linear import KimiDeltaAttention
from pagefold.models.lfm2 import Lfm2ShortConv
from pagefold.models.mamba2_hybrid import Mamba2Mixer
from pagefold.models.minimax import LightningAttention
from pagefold.models.qwen3_5 import GatedDeltaNet

__all__ = ["check_verify_support"]


def check_verify_support(model: Any, state_layers: set[str], what: str = "this model") -> None:
    """Raise ``ValueError`` when a state layer of ``model`` (a module whose ``layer_name`` is
    in ``state_layers``) cannot run a verify pass (return the state after every token instead
    of storing it): speculating on it would leave rejected drafts in its recurrent state.
    Every state layer pagefold serves can: Gated DeltaNet (Qwen3.5 / Qwen3-Next), the Mamba-2
    mixer (Nemotron-H, Bamba, Granite-4.0-H, Mamba-2, Zamba2) and Falcon-H1's, the Mamba-1
    mixer (Jamba, Mamba, Falcon-Mamba), LFM2's short conv, MiniMax's lightning attention and
    Kimi Linear's KDA. A module is checked by its ``forward`` function, so a subclass
    qualifies only if it keeps a verify forward; a new state layer is refused until its
    forward is listed here."""
    able = (GatedDeltaNet.forward, Mamba2Mixer.forward, FalconH1Mixer.forward,
            Mamba1Mixer.forward, Lfm2ShortConv.forward, LightningAttention.forward,
            KimiDeltaAttention.forward)
    for m in model.modules():
        name = getattr(m, "layer_name", None)
        if name in state_layers and getattr(type(m), "forward", None) not in able:
            raise ValueError(
                f"speculative decoding cannot verify drafts on {what}'s "
                f"{type(m).__name__} state layers yet (their states would absorb rejected "
                f"drafts); supported state layers: Gated DeltaNet, Mamba-2, Mamba-1, short "
                f"conv, lightning attention and KDA. Turn "
                f"speculative_config off for this model.")
