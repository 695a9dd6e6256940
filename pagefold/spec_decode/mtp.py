"""Multi-token prediction (MTP) speculation for Qwen3.5 / Qwen3-Next checkpoints that ship
``mtp.*`` tensors (``mtp_num_hidden_layers`` / ``num_nextn_predict_layers`` >= 1 in the
config; transformers drops these tensors on load, :func:`load_mtp` reads them).

The MTP block (:class:`MultiTokenPredictor`): for the row at position ``p`` it takes the
target's final hidden state ``h_p`` (after the final norm) and the embedding of the *next*
token ``t_{p+1}``; each goes through its own zero-centred RMSNorm (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), ``fc`` maps ``[embedding | hidden]`` (2H) to H, one decoder layer
of the target's kind with full attention (its own KV cache, ``mtp.layers.{i}`` in the pool)
runs at position ``p``, a final norm gives ``g_p`` and the target's (shared) ``lm_head``
gives the logits for ``t_{p+2}``. Embeddings and head are the target's.

Invariant of :class:`MtpProposer`: at the end of every step the MTP layer has computed the
same positions as the target (row ``p`` needs ``t_{p+1}``: a prompt token, a kept draft, or
the token sampled this step), so cached blocks hold valid MTP KV. Its output at the last
kept position drafts ``d_1`` for the next step (kept per request with ``g``); a verify step
then drafts ``d_{j+1}`` from the row at ``s + j - 1`` fed ``d_j`` and the previous ``g``
(the target's hidden there is not computed yet), and after verification the MTP layer reruns
every verify row with the target's hidden states (rows past the kept ones are rejected
positions, overwritten later). A request the proposer holds nothing for (swapped back in,
forked) drafts its last token repeated: a deterministic proposal, verified like any other.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from pagefold.core.kv_cache_spec import LayerSpec, is_attention
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import StepInputs
from pagefold.executor.runner_state import StepBatch
from pagefold.layers.linear import load_into
from pagefold.layers.moe import ExpertWeightRouter
from pagefold.layers.norm import RMSNorm
from pagefold.models.qwen3_5 import HybridCausalLM, HybridDecoderLayer
from pagefold.models.qwen3_next import next_mlp
from pagefold.models.weights import iter_weights
from pagefold.spec_decode.drafting import (
    PLACEHOLDER,
    DraftResult,
    Proposer,
    draft_tokens,
    forward_pass,
)

__all__ = ["MTP_PREFIX", "MtpProposer", "MultiTokenPredictor", "load_mtp", "mtp_layer_specs",
           "num_mtp_layers"]

logger = logging.getLogger("pagefold")

MTP_PREFIX = "mtp."


def num_mtp_layers(cfg) -> int:
    return int(getattr(cfg, "mtp_num_hidden_layers", 0)
               or getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_layer_specs(target: dict[str, LayerSpec], cfg) -> dict[str, LayerSpec]:
    """One full-attention cache entry per MTP layer, with the target's attention spec."""
    attn = next((s for s in target.values() if is_attention(s)
                 and getattr(s, "window", None) is None), None)
    if attn is None:
        raise ValueError("speculative method 'mtp' needs a target with full attention layers")
    return {f"{MTP_PREFIX}layers.{i}": attn for i in range(num_mtp_layers(cfg))}


class MultiTokenPredictor(nn.Module):
    """The ``mtp.*`` block (see the module docstring); ``forward`` returns ``g`` (T, H)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        n = num_mtp_layers(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # The MTP layers come after the target's in the layer numbering, all full attention.
        lcfg = copy.deepcopy(cfg)
        lcfg.layer_types = list(cfg.layer_types[: cfg.num_hidden_layers]) + [
            "full_attention"] * n
        first = cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            HybridDecoderLayer(lcfg, first + i, max_positions, next_mlp(lcfg, first + i))
            for i in range(n))
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_name = f"{MTP_PREFIX}layers.{i}"
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered=True)
        self.norm = RMSNorm(h, eps, zero_centered=True)
        # The target's embedding lookup (a function, so the embeddings stay the target's).
        self.embed = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                *, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        e = self.pre_fc_norm_embedding(self.embed(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        x = self.layers[step % len(self.layers)](positions, x, ctx)
        return self.norm(x)


def load_mtp(model_dir: str | Path, cfg, target: nn.Module, dtype: torch.dtype,
             max_positions: int, device: torch.device) -> MultiTokenPredictor:
    """Build the MTP block and fill it from the checkpoint's ``mtp.*`` tensors (raises a
    ``ValueError`` naming what is missing when the checkpoint lacks them)."""
    if not num_mtp_layers(cfg):
        raise ValueError("the config declares no MTP layers (mtp_num_hidden_layers)")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            mtp = MultiTokenPredictor(cfg, max_positions)
    finally:
        torch.set_default_dtype(prev)
    prefixes = ("mtp.", "model.mtp.", "model.language_model.mtp.")

    def stream():
        for name, t in iter_weights(Path(model_dir)):
            for p in prefixes:
                if name.startswith(p):
                    yield name[len(p):], t
                    break

    experts = ExpertWeightRouter(mtp)
    loaded = load_into(mtp, experts.route(stream()), rename=HybridCausalLM.fused_names)
    got = {n.split(":")[0] for n in loaded} | experts.complete()
    missing = [n for n, _ in mtp.named_parameters() if n not in got]
    if missing:
        raise ValueError(
            f"speculative method 'mtp' needs the checkpoint's multi-token-prediction weights "
            f"(mtp.* tensors); {model_dir} lacks {len(missing)} of them, e.g. "
            f"mtp.{missing[0]}. Use {{\"method\": \"ngram\", ...}} or a draft 'model' instead.")
    mtp.eval().requires_grad_(False)
    mtp.embed = target.model.embed_tokens.__call__
    return mtp


class MtpProposer(Proposer):
    """Drafts with the MTP block (see the module docstring)."""

    def __init__(self, mtp: MultiTokenPredictor, target: nn.Module) -> None:
        self.mtp = mtp
        self.target = target
        # request id -> (d_1, its q or None, g at the last kept position (H,))
        self.pending: dict[str, tuple[int, torch.Tensor | None, torch.Tensor]] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def propose(self, runner, batch: StepBatch, drafts: list[list[int]]) -> DraftResult:
        reqs, starts = batch.reqs, batch.starts
        drafts = [list(d) for d in drafts]
        probs: list[list[torch.Tensor | None]] = [[] for _ in reqs]
        want = [i for i, d in enumerate(drafts) if d and d[0] == PLACEHOLDER]
        g: dict[int, torch.Tensor] = {}
        for i in want:
            p = self.pending.get(reqs[i].req_id)
            if p is None:  # nothing held: a deterministic stand-in proposal
                drafts[i] = [reqs[i].token_ids[starts[i]]] * len(drafts[i])
                continue
            drafts[i][0] = p[0]
            probs[i].append(p[1])
            g[i] = p[2]
        live = list(g)
        j = 1
        while True:
            live = [i for i in live if len(drafts[i]) > j]
            if not live:
                break
            hid = torch.stack([g[i] for i in live])
            out, _, _ = forward_pass(
                self.mtp, runner, [reqs[i] for i in live], [[drafts[i][j - 1]] for i in live],
                [starts[i] + j - 1 for i in live], hidden=hid, step=j)
            toks, qs = draft_tokens(self.target.compute_logits(out), [reqs[i] for i in live],
                                    runner.generator_for)
            for n, i in enumerate(live):
                drafts[i][j] = toks[n]
                probs[i].append(qs[n])
                g[i] = out[n]
            j += 1
        out_probs = [torch.stack(p) if p and all(q is not None for q in p) else None
                     for p in probs]
        return DraftResult(drafts, out_probs)

    def commit(self, runner, batch: StepBatch, res: DraftResult, keep: list[int],
               inp: StepInputs, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        nxt: list[int] = []
        for i, (r, s, n) in enumerate(zip(batch.reqs, batch.starts, batch.counts,
                                          strict=True)):
            d = res.drafts[i]
            if d:
                row = list(d) + [d[-1]]
                row[keep[i] - 1] = emitted[i][-1]  # the token sampled after the kept ones
            else:
                row = self._next_tokens(r, s, n, emitted.get(i))
            nxt.extend(row)
        self._run(runner, batch, inp, hidden, nxt, keep, emitted)

    def sync(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             emitted: dict[int, list[int]]) -> None:
        nxt: list[int] = []
        for i, (r, s, n) in enumerate(zip(batch.reqs, batch.starts, batch.counts,
                                          strict=True)):
            nxt.extend(self._next_tokens(r, s, n, emitted.get(i)))
        self._run(runner, batch, inp, hidden, nxt, batch.counts, emitted)

    @staticmethod
    def _next_tokens(r, s: int, n: int, emitted: list[int] | None) -> list[int]:
        """``t_{p+1}`` for the rows at ``s..s+n-1``: known tokens, then the sampled one."""
        known = r.token_ids[s + 1 : s + n + 1]
        if len(known) < n:
            known = known + [emitted[-1] if emitted else r.token_ids[s + n - 1]]
        return known

    def _run(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             nxt: list[int], keep: list[int], emitted: dict[int, list[int]]) -> None:
        ids = torch.tensor(nxt, dtype=torch.long, device=inp.input_ids.device)
        ctx = ForwardContext(runner.cache, inp.attn_meta, inp.state_meta)
        g = self.mtp(ids, inp.positions, ctx, hidden=hidden, step=0)
        sampled = sorted(emitted)
        if not sampled:
            return
        starts = torch.cumsum(torch.tensor([0] + batch.counts[:-1]), 0)
        rows = torch.tensor([int(starts[i]) + keep[i] - 1 for i in sampled],
                            dtype=torch.long, device=g.device)
        last = g.index_select(0, rows)
        sreqs = [batch.reqs[i] for i in sampled]
        toks, qs = draft_tokens(self.target.compute_logits(last), sreqs,
                                runner.generator_for)
        for n, r in enumerate(sreqs):
            self.pending[r.req_id] = (toks[n], qs[n], last[n])
