"""Draft-model speculation: a small model sharing the target's tokenizer, run by the same
runner, its caches in the target's block pool.

Loading (:func:`draft_layer_specs`, :func:`load_draft_model`): the draft's cached layers are
named ``draft.layers.{i}`` and join the pool's cache groups next to the target's (a spec
equal to a target spec lands in the same groups, sharing block tables), so the capacity
planner, admission and preemption count them, prefix caching caches them, a fork copies them
and freeing a request frees them. The draft's vocabulary must equal the target's, and its
attention pages must have the target's page size (one page size per pool).

Invariant of :class:`DraftModelProposer`: at the end of every step the draft has computed
exactly the tokens the target has (same positions, same pages), so every cached block, state
checkpoint, swapped page and forked page holds a valid draft cache too.

* A step without drafts: the draft runs the step's tokens (:meth:`~DraftModelProposer.sync`).
* A verify step (request with last token ``t`` at position ``s`` and ``k`` drafts): pass 0
  runs every request's step tokens (a drafted request: ``t`` alone) and drafts ``d_1`` from
  the last row; pass ``j = 1..k`` runs ``d_j`` at ``s + j`` (one token per drafted request,
  from the state after ``d_{j-1}``) and drafts ``d_{j+1}`` (pass ``k`` only writes caches).
  State layers run in verify mode: their pages are untouched and the state after every token
  is kept; :meth:`~DraftModelProposer.commit` stores the state after the last kept token
  (``t, d_1..d_a``), picked from pass ``a``. Rejected drafts' attention KV lies past the
  computed length and is overwritten when those positions are computed again. Nothing is
  recomputed, for any layer type.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagefold.checkpoint import load_hf_config, text_config
from pagefold.core.kv_cache_planner import page_bytes_for
from pagefold.core.kv_cache_spec import LayerSpec, StateSpec, is_attention
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.input_batch import StepInputs
from pagefold.executor.runner_state import StepBatch
from pagefold.models.registry import load_model
from pagefold.spec_decode.config import SpeculativeConfig, check_model_supports
from pagefold.spec_decode.drafting import (
    PLACEHOLDER,
    DraftResult,
    Proposer,
    draft_tokens,
    forward_pass,
)

__all__ = ["DRAFT_PREFIX", "DraftModelProposer", "draft_layer_specs", "load_draft_model",
           "prefix_layer_names"]

logger = logging.getLogger("pagefold")

DRAFT_PREFIX = "draft."


def prefix_layer_names(model: torch.nn.Module, prefix: str) -> None:
    """Rename every cached layer of ``model`` (``layer_name`` attributes) to ``prefix + name``
    so its cache entries cannot collide with the target's."""
    for m in model.modules():
        name = getattr(m, "layer_name", None)
        if isinstance(name, str) and not name.startswith(prefix):
            m.layer_name = prefix + name


def draft_layer_specs(target: dict[str, LayerSpec], draft: dict[str, LayerSpec],
                      block_size: int) -> dict[str, LayerSpec]:
    """The draft's specs under ``draft.`` names; raises ``ValueError`` when its attention
    pages cannot share the target's pool."""
    out = {DRAFT_PREFIX + n: s for n, s in draft.items()}
    t_attn = [s for s in target.values() if is_attention(s)]
    d_attn = [s for s in draft.values() if is_attention(s)]
    if t_attn and d_attn:
        tp, dp = t_attn[0].page_bytes(block_size), d_attn[0].page_bytes(block_size)
        if tp != dp:
            d = d_attn[0]
            raise ValueError(
                f"the draft model's attention pages ({d.num_kv_heads} kv heads x head_dim "
                f"{d.head_dim}, {d.dtype}: {dp} bytes per block) differ from the target's "
                f"({tp} bytes); pagefold keeps one page size per pool, so a draft model needs "
                f"the target's num_key_value_heads x head_dim")
    page_bytes_for([*target.values(), *out.values()], block_size)  # raises if states misfit
    return out


def load_draft_model(path: str, target_hf_config, dtype: torch.dtype, max_positions: int,
                     device: torch.device):
    """``(model, hf_config)`` of the draft at ``path`` (layer names prefixed)."""
    if not Path(path).is_dir():
        raise ValueError(f"speculative_config 'model' {path!r} is not a local model folder")
    arch, cfg = load_hf_config(path)
    check_model_supports(SpeculativeConfig("draft_model", 1, model=path), target_hf_config, cfg)
    max_pos = getattr(text_config(cfg), "max_position_embeddings", None) or max_positions
    model = load_model(Path(path), cfg, arch, dtype, max(max_positions, max_pos), device)
    prefix_layer_names(model, DRAFT_PREFIX)
    return model, cfg


class DraftModelProposer(Proposer):
    """Drafts with a small model in the runner (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, has_state: bool) -> None:
        self.model = model
        self.has_state = has_state  # the draft has state layers (GDN, Mamba-2, ...)

    @classmethod
    def for_specs(cls, model: torch.nn.Module, specs: dict[str, LayerSpec]
                  ) -> DraftModelProposer:
        return cls(model, any(isinstance(s, StateSpec) for s in specs.values()))

    def sync(self, runner, batch: StepBatch, inp: StepInputs, hidden: torch.Tensor,
             emitted: dict[int, list[int]]) -> None:
        ctx = ForwardContext(runner.cache, inp.attn_meta, inp.state_meta)
        self.model(inp.input_ids, inp.positions, ctx)

    def propose(self, runner, batch: StepBatch, drafts: list[list[int]]) -> DraftResult:
        reqs, starts, counts = batch.reqs, batch.starts, batch.counts
        drafts = [list(d) for d in drafts]
        probs: list[list[torch.Tensor | None]] = [[] for _ in reqs]
        # Pass 0: every request's tokens of this step (a drafted one: its last token).
        tokens = [r.token_ids[s : s + (1 if d else n)]
                  for r, s, n, d in zip(reqs, starts, counts, drafts, strict=True)]
        hidden, inp, ctx0 = forward_pass(self.model, runner, reqs, tokens, starts,
                                         verify=self.has_state)
        ends = torch.cumsum(torch.tensor([len(t) for t in tokens]), 0) - 1
        live = [i for i, d in enumerate(drafts) if d]
        rows = {i: int(ends[i]) for i in live}  # request -> its row in the previous pass
        passes = [(ctx0.spec_states, dict(rows))]
        self._fill(runner, reqs, drafts, probs, live, 0, hidden, rows)
        j = 1
        while True:
            live = [i for i in live if len(drafts[i]) >= j]
            if not live:
                break
            initial = None
            if self.has_state:
                prev_states, prev_rows = passes[-1]
                idx = torch.tensor([prev_rows[i] for i in live], dtype=torch.long,
                                   device=runner.device)
                initial = {layer: {c: t.index_select(0, idx) for c, t in comps.items()}
                           for layer, comps in prev_states.items()}
            hidden, _, ctx = forward_pass(
                self.model, runner, [reqs[i] for i in live], [[drafts[i][j - 1]] for i in live],
                [starts[i] + j for i in live], verify=self.has_state, initial=initial)
            rows = {i: n for n, i in enumerate(live)}
            passes.append((ctx.spec_states, rows))
            self._fill(runner, reqs, drafts, probs, live, j, hidden, rows)
            j += 1
        out_probs = [torch.stack(p) if p and all(q is not None for q in p) else None
                     for p in probs]
        return DraftResult(drafts, out_probs, (ctx0, passes))

    def _fill(self, runner, reqs, drafts, probs, live: list[int], j: int,
              hidden: torch.Tensor, rows: dict[int, int]) -> None:
        """Draft ``d_{j+1}`` for the requests whose draft ``j`` (0-based) is a placeholder,
        from the pass's hidden rows."""
        want = [i for i in live if len(drafts[i]) > j and drafts[i][j] == PLACEHOLDER]
        if not want:
            return
        sel = torch.tensor([rows[i] for i in want], dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, sel))
        toks, qs = draft_tokens(logits, [reqs[i] for i in want],
                                runner.generator_for)
        for i, t, q in zip(want, toks, qs, strict=True):
            drafts[i][j] = t
            probs[i].append(q)

    def commit(self, runner, batch: StepBatch, res: DraftResult, keep: list[int],
               inp: StepInputs, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        if not self.has_state:
            return  # attention KV needs no commit (see the module docstring)
        ctx0, passes = res.state
        counts = [len(d) for d in res.drafts]
        base = []  # first row of each pass in the concatenation below
        off = 0
        for states, _ in passes:
            base.append(off)
            off += next(iter(next(iter(states.values())).values())).shape[0]
        n0 = [1 if res.drafts[i] else batch.counts[i] for i in range(len(keep))]
        end0 = torch.cumsum(torch.tensor(n0), 0) - 1
        pick = []
        for i, k in enumerate(keep):
            a = k - 1 if counts[i] else 0  # accepted drafts
            if a == 0:
                pick.append(int(end0[i]))
            else:
                pick.append(base[a] + passes[a][1][i])
        idx = torch.tensor(pick, dtype=torch.long, device=runner.device)
        for layer in passes[0][0]:
            comps = {c: torch.cat([p[0][layer][c] for p in passes]).index_select(0, idx)
                     for c in passes[0][0][layer]}
            ctx0.store_states(layer, comps)
