"""Building the runner-side proposer a ``speculative_config`` asks for (a draft model, MTP
heads, an EAGLE / EAGLE-3 head), on the engine's runner at TP 1 or on every tensor-parallel
rank. Under tensor parallelism every method's drafter is sharded like the target (the
layers' own shards: attention heads, MLP columns, vocabulary rows; an EAGLE / MTP ``fc`` and
norms are replicated), its caches in each rank's share of the pool; the target's hidden
states it reads are whole on every rank.

Invariant under tensor parallelism: every rank runs the same proposer passes (their
collectives pair up) and ends each pass with the same drafts, rank 0's
(:func:`pagefold.spec_decode.drafting.draft_tokens` broadcasts them), so the verify forward
sees the same tokens on every rank; a hidden-state drafter (EAGLE, MTP) also reads the
tokens sampled after a step, which rank 0 broadcasts (``Proposer.reads_sampled``).
"""

from __future__ import annotations

import torch

from pagefold.checkpoint import text_config
from pagefold.core.kv_cache_spec import LayerSpec
from pagefold.csrc import cpu_ops
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.draft_model import DraftModelProposer, load_draft_model
from pagefold.spec_decode.drafting import Proposer
from pagefold.spec_decode.eagle import (
    EagleProposer,
    aux_layer_ids,
    load_eagle,
    load_eagle_config,
)
from pagefold.spec_decode.mtp import MtpProposer, load_mtp

__all__ = ["build_proposer"]


def build_proposer(sc: SpeculativeConfig | None, model_dir: str, target: torch.nn.Module,
                   hf_config, dtype: torch.dtype, max_positions: int, device: torch.device,
                   spec_specs: dict[str, LayerSpec]) -> Proposer | None:
    """The runner-side proposer of ``sc`` for ``target`` (None for n-gram or no
    speculation); ``spec_specs``: the cache specs the method added to the pool."""
    if sc is None or sc.method == "ngram":
        return None
    tcfg = text_config(hf_config)
    if sc.method == "mtp":
        head = load_mtp(model_dir, tcfg, target, dtype, max_positions, device)
    elif sc.method in ("eagle", "eagle3"):
        head = load_eagle(sc.model, sc.method, target, tcfg, dtype, max_positions, device)
    else:
        head, _ = load_draft_model(sc.model, hf_config, dtype, max_positions, device)
    if device.type == "cpu":
        cpu_ops.use_fast_linears(head)
    if sc.method == "mtp":
        return MtpProposer(head, target)
    if sc.method in ("eagle", "eagle3"):
        aux = None
        if sc.method == "eagle3":
            aux = aux_layer_ids(load_eagle_config(sc.model), tcfg.num_hidden_layers)
        return EagleProposer(head, target, tcfg, aux)
    return DraftModelProposer.for_specs(head, spec_specs)
