"""Runs one step message: page moves, flat inputs -> model forward -> logits -> sampler.

The runner reads only the step message (``core/sched_output.py``) and its own request state
(``executor/runner_state.py``); it never imports the scheduler's request module.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import StateSpec, cdiv
from pagefold.core.kv_connector import ConnectorOutput
from pagefold.core.managers import PageCopy
from pagefold.core.sched_output import (
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
    VerifiedTokens,
)
from pagefold.core.swap import SwapOp
from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import broadcast_ints, pp_is_last, tp_rank
from pagefold.executor.cache_tensors import CacheTensors, wide_rows
from pagefold.executor.copy_stream import CopyStream
from pagefold.executor.cuda_graphs import DecodeGraphs
from pagefold.executor.forward_context import ForwardContext
from pagefold.executor.host_malloc import keep_freed_memory
from pagefold.executor.huge_pages import weights_on_huge_pages
from pagefold.executor.input_batch import (
    StepInputs,
    advance_small_decode,
    build_inputs,
    can_advance,
)
from pagefold.executor.runner_state import CachedRequestState, RunnerRequests, StepBatch
from pagefold.executor.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    gather_logprobs,
    make_generator,
    plain_greedy,
)
from pagefold.executor.thread_guard import ThreadGuard
from pagefold.executor.thread_guard import enabled as thread_guard_enabled
from pagefold.multimodal.encoder_cache import EncoderCache
from pagefold.spec_decode.verify import verify_drafts

__all__ = ["ModelRunner", "SampledToken"]

# A CPU step whose work (tokens x weight elements) is below this runs on one thread: its ops are
# too small for a parallel region to pay, and on a loaded machine every parallel region waits
# for a thread the OS may have descheduled (spinning, for milliseconds). Kept small: the
# compiled kernels decide per op whether a parallel region pays (e.g. the GEMV from 256K
# weights), and above ~4M parameters a batch-1 decode step on one thread took up to twice the
# time of two (2-core Xeon: a 25M-parameter dense model 4.84 -> 2.87 ms, a 56M GDN hybrid
# 14.9 -> 7.4 ms; a 3.6M model level).
SMALL_STEP_WORK = 1 << 22


def step_inference_mode(fn):
    """``@torch.inference_mode()`` for a step's method, through the C++ guard that decorator
    enters (``torch._C._InferenceMode``) without its per-call Python context object: the same
    mode for the same span, at a third of the cost (~0.7 us against ~2.4 hot, more in a
    batch-1 CPU decode step of ~1 ms, where the step's caches are cold)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._C._InferenceMode(True):
            return fn(*args, **kwargs)
    return run


@contextmanager
def _threads_for(device: torch.device, work: int, guard: ThreadGuard | None = None):
    """One torch thread for a CPU step whose ``work`` (tokens x weight elements) is below
    ``SMALL_STEP_WORK``, or while ``guard`` finds this host's cores taken by other processes
    (``thread_guard.py``); the caller's thread count is restored afterwards."""
    threads = torch.get_num_threads()
    want = threads
    if device.type == "cpu" and threads > 1:
        want = 1 if work < SMALL_STEP_WORK else guard.threads(threads) if guard else threads
    if want != threads:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if want != threads:
            torch.set_num_threads(threads)


def weight_elements(model: torch.nn.Module) -> int:
    """The model's weight elements, the per-token work ``_threads_for`` weighs: every
    parameter's elements, and for a layer that holds its weight outside parameters (a GGUF
    layer's raw blocks, packed codes) its logical ``out x in`` (or ``rows x dim``) instead,
    so a kept-quantized model is not taken for a tiny one (its steps ran on one thread). A
    plain model's count is its parameters' (a tied weight once)."""
    total = sum(p.numel() for p in model.parameters())
    for mod in model.modules():
        own = sum(p.numel() for p in mod.parameters(recurse=False))
        n = getattr(mod, "out_features", None) or getattr(mod, "num_embeddings", None)
        k = getattr(mod, "in_features", None) or getattr(mod, "embedding_dim", None)
        if isinstance(n, int) and isinstance(k, int) and n * k > own:
            total += n * k - own
    return total


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_config: KVCacheConfig, device: torch.device,
                 cache_fill: float | None = None, num_host_blocks: int = 0) -> None:
        self.model = model
        self.weight_elements = weight_elements(model)
        if device.type == "cpu":  # bf16 linears: a GEMV per weight shape, else oneDNN
            weights_on_huge_pages(model)  # before any weight pointer is cached
            cpu_ops.use_fast_linears(model)
            keep_freed_memory()  # activations reuse faulted-in pages from step to step
        self.kv_config = kv_config
        self.device = device
        # Steps drop to one thread while other processes hold the cores (thread_guard.py).
        self.thread_guard = (ThreadGuard() if device.type == "cpu" and thread_guard_enabled()
                             else None)
        self.cache = CacheTensors(kv_config, device, fill=cache_fill)
        # Host pool for swapped-out pages: same geometry, CPU memory (pinned with a GPU).
        pin = device.type == "cuda"
        self.host = [torch.zeros((num_host_blocks, kv_config.page_bytes), dtype=torch.uint8,
                                 pin_memory=pin)
                     for _ in range(kv_config.layers_per_group if num_host_blocks else 0)]
        self.copier = CopyStream(device)  # swaps on a copy stream on CUDA
        self.sampler = Sampler()
        self.requests = RunnerRequests()
        self._grammar: dict[str, bytes] = {}  # this step's structured-output rows
        self.num_forward_tokens = 0
        self.graphs = None  # DecodeGraphs once enable_cuda_graphs() ran (CUDA + Triton)
        # Speculative decoding with a draft model or MTP heads: the runner-side proposer
        # (spec_decode.drafting.Proposer); None for n-gram or no speculation.
        self.proposer = None
        # The KV connector's worker side (core.kv_connector.KVConnectorWorker: offload tiers).
        self.connector = None
        # Image inputs: encoder outputs per request (models with a vision tower only).
        self.encoders = (EncoderCache(model) if getattr(model, "visual", None) is not None
                         else None)
        # Multi-LoRA (pagefold.lora.manager.LoRAModelManager) when enabled: each step's rows'
        # adapters are set before the forward; None: LoRA off, nothing runs for it.
        self.lora = None

    @property
    def captures_in_kernel(self) -> bool:
        """True when every state layer of the model takes state checkpoints inside its
        kernels (a module with that ``layer_name`` whose own class declares
        ``captures_checkpoints``: a subclass with its own ``forward`` does not inherit the
        promise); with any other state layer the scheduler keeps cutting chunks at targets."""
        state_layers = {name for g in self.kv_config.groups if isinstance(g.spec, StateSpec)
                        for name in g.layer_names}
        able = {getattr(m, "layer_name", None) for m in self.model.modules()
                if type(m).__dict__.get("captures_checkpoints", False)}
        return state_layers <= able

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int,
                           capture: bool | None = None) -> None:
        """Replay all-decode steps of up to ``max_batch`` rows from CUDA graphs over static
        buffers (:mod:`pagefold.executor.cuda_graphs`); ``capture=False`` runs the same padded
        static step eagerly (how CPU tests check it)."""
        self.graphs = DecodeGraphs(self.model, self.cache, self.kv_config, max_batch,
                                   max_model_len, self.device, capture=capture)

    def warm_up(self, num_tokens: int, seq_len: int) -> float:
        """One forward of ``num_tokens`` prompt tokens (sequences of at most ``seq_len``) and
        the logits of their last rows, before serving, so that the first real batch of that
        size does not pay one-time costs (oneDNN primitives for that row count, the kernels'
        buffers, the allocator's first touch); vLLM's start-up profile run does the same.

        Every block table points at the null block (block 0); its bytes in every shared tensor
        are saved first and restored afterwards, so no cache content changes. No request,
        counter or generator sees the run. Returns the seconds it took."""
        if num_tokens < 1:
            return 0.0
        t = time.perf_counter()
        seq_len = max(1, min(seq_len, num_tokens))
        counts = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            counts.append(num_tokens % seq_len)
        bs = self.kv_config.block_size
        per_group = []
        for group in self.kv_config.groups:
            width = group.pages_per_state if isinstance(group.spec, StateSpec) else None
            per_group.append([[0] * (width or cdiv(n, bs)) for n in counts])
        saved = [t_[0].clone() for t_ in self.cache.shared]
        try:
            with _threads_for(self.device, num_tokens * self.weight_elements), \
                    torch.inference_mode():
                tokens = [[1] * n for n in counts]
                inp = build_inputs(self.kv_config, tokens, [0] * len(counts), counts, counts,
                                   per_group, self.device)
                ctx = ForwardContext(self.cache, inp.attn_meta, inp.state_meta, calibrate=False)
                hidden = self.model(inp.input_ids, inp.positions, ctx)
                if pp_is_last():  # an earlier pipeline stage has no head
                    self.model.compute_logits(hidden[inp.logits_rows])
        finally:
            for t_, row in zip(self.cache.shared, saved):
                t_[0].copy_(row)
        return time.perf_counter() - t

    def generator_for(self, st: CachedRequestState) -> torch.Generator | None:
        """The request's own sampling generator (seeded, non-greedy requests only: None
        otherwise), made on first use and kept until the request ends; the proposers and
        the verify step draw from it too, so a seeded request's draws form one sequence."""
        seed = st.sampling_params.seed
        if seed is None or st.sampling_params.is_greedy:
            return None
        gens = self.requests.generators
        g = gens.get(st.req_id)
        if g is None:
            g = gens[st.req_id] = make_generator(seed, self.device)
        return g

    @torch.inference_mode()
    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy whole pages within the pool, in every layer of each copy's group, with the
        effect of running the copies one after another in list order.

        Copies are batched into runs in which no copy touches a page an earlier copy of the
        run writes (a checkpoint saved last step may be restored by a hit this step); each run
        is one gather and one scatter per group and layer."""
        run: dict[int, tuple[list[int], list[int]]] = {}
        written: set[int] = set()
        for c in copies:
            if written and (not written.isdisjoint(c.src) or not written.isdisjoint(c.dst)):
                self._copy_run(run)
                run, written = {}, set()
            src, dst = run.setdefault(c.group, ([], []))
            src.extend(c.src)
            dst.extend(c.dst)
            written.update(c.dst)
        if run:
            self._copy_run(run)

    def _copy_run(self, by_group: dict[int, tuple[list[int], list[int]]]) -> None:
        for g, (src, dst) in by_group.items():
            s = torch.tensor(src, dtype=torch.int64, device=self.device)
            d = torch.tensor(dst, dtype=torch.int64, device=self.device)
            for si in range(len(self.kv_config.groups[g].layer_names)):
                t = wide_rows(self.cache.shared[si])  # words, not bytes: ~10x faster
                t.index_copy_(0, d, t.index_select(0, s))

    @torch.inference_mode()
    def swap(self, ops: list[SwapOp]) -> None:
        """Move whole pages between the device pool and the host pool, in op order."""
        for op in ops:
            dev = torch.tensor(op.device, dtype=torch.int64, device=self.device)
            host = torch.tensor(op.host, dtype=torch.int64)
            for si in range(len(self.kv_config.groups[op.group].layer_names)):
                pool, hpool = wide_rows(self.cache.shared[si]), wide_rows(self.host[si])
                if op.to_host:
                    self.copier.to_host(pool, hpool, dev, host)
                else:
                    self.copier.to_device(pool, hpool, dev, host)

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step message; returns the tokens of the rows that reached the end of their
        request's tokens.

        Before the forward: the KV connector's ops (offload tiers: drops, saves, loads), then
        swap-outs (their device pages may be reused this step), then page copies (prefix-hit
        restores, forks, copy-on-write, last step's checkpoint saves), then swap-ins. With
        connector ops the result is a ``RunnerOutput`` carrying the connector's report.

        On the CPU a small step (see ``SMALL_STEP_WORK``) runs with one torch thread; the
        caller's thread count is restored afterwards."""
        batch = self.requests.apply(out)
        if self.proposer is not None:
            self.proposer.forget(out.finished_ids + out.preempted_ids)
        if self.encoders is not None:
            self.encoders.forget(out.finished_ids + out.preempted_ids)
        self._grammar = out.grammar_bitmask
        # A burst's forwards are one row per request each: weigh one of them.
        rows = len(batch.reqs) if out.decode_burst else batch.num_tokens
        with _threads_for(self.device, rows * self.weight_elements, self.thread_guard):
            report = self.move_pages(out)
            if not batch.reqs:
                result = {}
            elif out.spec_token_ids:  # speculative verify step (pagefold.spec_decode)
                result = self._execute_verify(batch, out.spec_token_ids)
            elif out.decode_burst:  # several decode steps (core/decode_burst.py)
                result = self._execute_burst(batch)
            else:
                result = self._execute(batch)
        if report is not None:
            result = RunnerOutput(result)
            result.kv_connector_output = report
        return result

    def move_pages(self, out: SchedulerOutput) -> ConnectorOutput | None:
        report = None
        if out.kv_ops and self.connector is not None:
            # First: a save reads pages this step's copies, swaps or forward may overwrite.
            report = self.connector.run(out.kv_ops)
        if out.swaps:
            self.swap([op for op in out.swaps if op.to_host])
        if out.copies:
            self.copy_pages(out.copies)
        if out.swaps:
            self.swap([op for op in out.swaps if not op.to_host])
        return report

    def _forward(self, batch: StepBatch, tokens: list[list[int]], totals: list[int], *,
                 captures=None, drafted: list[bool] | None = None
                 ) -> tuple[StepInputs, ForwardContext, torch.Tensor]:
        """The step's flat inputs and the model's forward over ``tokens`` (request ``i``'s at
        positions ``batch.starts[i]...``; ``totals[i]`` its token count with them).

        ``drafted`` marks a verify step's requests with drafts: their state layers keep the
        state after every token (``ctx.spec_states``) and store nothing. Any other step may
        replay from the decode CUDA graphs."""
        reqs = batch.reqs
        per_group = [[r.block_ids[g] for r in reqs] for g in range(len(self.kv_config.groups))]
        spans = (self.encoders.bidirectional_spans(reqs, batch.starts, batch.counts)
                 if self.encoders is not None else None)
        inp = build_inputs(self.kv_config, tokens, batch.starts, batch.counts, totals,
                           per_group, self.device, captures, image_spans=spans)
        self.num_forward_tokens += int(inp.input_ids.numel())
        positions, mm_embeds = inp.positions, None
        if self.encoders is not None:  # image rows and M-RoPE positions
            positions, mm_embeds = self.encoders.step_inputs(reqs, batch.starts, batch.counts,
                                                             inp.positions)
        lora_rows = self.lora is not None and self.lora.set_step(
            [r.lora_request for r in reqs], [len(t) for t in tokens])
        # An EAGLE-3 proposer reads the inputs of chosen target layers (spec_decode.aux_hidden).
        aux = getattr(self.proposer, "aux_layers", None)
        if drafted is not None:
            spec_rows = torch.tensor(drafted, device=self.device)
            for m in inp.state_meta:
                if m is not None:
                    m.spec_rows = spec_rows
            ctx = ForwardContext(self.cache, inp.attn_meta, inp.state_meta, spec_states={},
                                 mm_embeds=mm_embeds, lora_rows=lora_rows, aux_layers=aux)
            return inp, ctx, self.model(inp.input_ids, positions, ctx)
        ctx = ForwardContext(self.cache, inp.attn_meta, inp.state_meta, mm_embeds=mm_embeds,
                             lora_rows=lora_rows, aux_layers=aux)
        hidden = None
        # Graphs hold neither image rows nor the LoRA hooks' terms, and a replay runs no
        # layer hooks (EAGLE-3's captures).
        if (self.graphs is not None and mm_embeds is None and positions.dim() == 1
                and not lora_rows and aux is None):
            hidden = self.graphs.run(inp.input_ids, positions, inp.attn_meta, inp.state_meta)
        if hidden is None:
            hidden = self.model(inp.input_ids, positions, ctx)
        return inp, ctx, hidden

    @step_inference_mode
    def _execute_verify(self, batch: StepBatch, spec_token_ids: dict[str, list[int]]
                        ) -> dict[str, VerifiedTokens]:
        """A step where some requests carry drafts. A drafted request is decoding: its count
        is ``1 + len(drafts)`` and its tokens are its last token followed by the drafts (which
        never enter the runner's copy of the request). The proposer (draft model / MTP) first
        fills placeholder drafts; after the forward, ``spec_decode.verify`` accepts or rejects
        them and commits the kept tokens' states."""
        reqs, starts, counts = batch.reqs, batch.starts, batch.counts
        drafts = [spec_token_ids.get(r.req_id, []) for r in reqs]
        drafted = None
        if self.proposer is not None:  # fills the placeholders (spec_decode.drafting)
            drafted = self.proposer.propose(self, batch, drafts)
            drafts = drafted.drafts
        elif any(t < 0 for d in drafts for t in d):
            raise ValueError("drafts to fill in the runner, but the runner has no proposer")
        tokens = []
        for r, s, n, d in zip(reqs, starts, counts, drafts, strict=True):
            if d:
                if n != 1 + len(d) or s + 1 != len(r.token_ids):
                    raise ValueError(f"request {r.req_id}: drafts need a decode step of 1 + k")
                tokens.append(r.token_ids[s : s + 1] + list(d))
            else:
                tokens.append(r.token_ids[s : s + n])
        totals = [len(r.token_ids) + len(d) for r, d in zip(reqs, drafts, strict=True)]
        inp, ctx, hidden = self._forward(batch, tokens, totals,
                                         drafted=[bool(d) for d in drafts])
        return verify_drafts(self, batch, drafts, drafted, inp, ctx, hidden)

    @step_inference_mode
    def _execute_burst(self, batch: StepBatch) -> dict[str, VerifiedTokens]:
        """A decode burst: request ``i`` decodes ``batch.counts[i]`` tokens, one forward per
        token over the requests with tokens left, each sampled token written into the
        runner's copy of its request and fed to the next forward. Every forward and sampling
        call is the plain decode step's (same rows, inputs, generators and penalties' view of
        the outputs), so the tokens are those steps' bits. Returns each request's tokens as
        one ``VerifiedTokens``, all accepted (the scheduler drops those after a stop).

        While the rows stay the same, a small CPU step's inputs and forward context are
        advanced in place (``advance_small_decode``, ``ForwardContext.burst_step``) instead
        of built again: the same values, and the native decode step reuses its lookups; for
        greedy rows the model may then make each such step, head and argmax included, in one
        compiled call (``CausalLMHead.greedy_run``: the same kernels, so the same bits)."""
        reqs, starts, counts = batch.reqs, batch.starts, batch.counts
        ids: list[list[int]] = [[] for _ in reqs]
        lps: list[list] = [[] for _ in reqs]
        greedy = not self._grammar and all(plain_greedy(r.sampling_params) for r in reqs)
        head = getattr(self.model, "greedy_tokens", None)  # greedy rows without the logits
        inp = ctx = tables = None  # tables: set while the inputs may be advanced in place
        run = None  # while set: the model's later greedy steps in one compiled call each
        rows: list[int] = []
        for j in range(max(counts)):
            live = [i for i, c in enumerate(counts) if c > j]
            step = StepBatch([reqs[i] for i in live], [starts[i] + j for i in live],
                             [1] * len(live))
            tokens = [r.token_ids[s : s + 1] for r, s in zip(step.reqs, step.starts)]
            toks = hidden = None
            if tables is not None and live == rows:
                advance_small_decode(inp, self.kv_config, [t[0] for t in tokens], step.starts,
                                     tables)
                ctx.burst_step = j
                self.num_forward_tokens += len(live)
                if run is not None:
                    toks = run()
                else:
                    hidden = self.model(inp.input_ids, inp.positions, ctx)
            else:
                inp, ctx, hidden = self._forward(step, tokens, [s + 1 for s in step.starts])
                rows, tables, run = live, None, None
                if (self.graphs is None and self.encoders is None and not ctx.lora_rows
                        and ctx.aux_layers is None and can_advance(inp, len(live))):
                    tables = [[r.block_ids[g] for r in step.reqs]
                              for g in range(len(self.kv_config.groups))]
                    greedy_run = getattr(self.model, "greedy_run", None)
                    if greedy and greedy_run is not None:
                        run = greedy_run(inp.input_ids, inp.positions, ctx)
            if hidden is not None:
                every = len(inp.sample_req_idx) == hidden.shape[0] and hidden.is_contiguous()
                final = hidden if every else hidden[inp.logits_rows]
                toks = head(final) if greedy and head is not None else None
            if greedy:  # what ``sample`` does for such rows, without its per-row results
                if toks is None:
                    toks = Sampler.argmax(self.model.compute_logits(final)).tolist()
                got = [(t, None) for t in toks]
            else:
                logits = self.model.compute_logits(final)
                sampled = self.sample(logits, step.reqs)
                got = [(sampled[r.req_id].token_id, sampled[r.req_id].logprobs)
                       for r in step.reqs]
            for i, r, s, (t, lp) in zip(live, step.reqs, step.starts, got):
                r.write(s + 1, [t])
                ids[i].append(t)
                lps[i].append(lp)
        return {r.req_id: VerifiedTokens(ids[i], len(ids[i]) - 1,
                                         lps[i] if lps[i][0] is not None else None)
                for i, r in enumerate(reqs)}

    @step_inference_mode
    def _execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        reqs, starts, counts = batch.reqs, batch.starts, batch.counts
        tokens = [r.token_ids[s : s + n] for r, s, n in zip(reqs, starts, counts)]
        inp, ctx, hidden = self._forward(batch, tokens, [len(r.token_ids) for r in reqs],
                                         captures=batch.captures)
        if not pp_is_last():
            return {}  # this pipeline stage handed its hidden states on; the last one samples
        self._prompt_logprobs(reqs, starts, counts, hidden)
        if not inp.sample_req_idx:
            if self.proposer is not None:
                self.proposer.sync(self, batch, inp, ctx.drafter_hidden(hidden), {})
            return {}
        # Every row sampled (rows ascending, so all of them in order): no gather copy.
        every = len(inp.sample_req_idx) == hidden.shape[0] and hidden.is_contiguous()
        logits = self.model.compute_logits(  # a collective under TP
            hidden if every else hidden[inp.logits_rows])
        if tp_rank() != 0:  # sampling happens once, on rank 0
            if self.proposer is not None:  # its collectives pair with rank 0's
                emitted = {}
                if self.proposer.reads_sampled:  # EAGLE / MTP: rank 0's sampled tokens
                    got = broadcast_ints([0] * len(inp.sample_req_idx))
                    emitted = {i: [t] for i, t in zip(inp.sample_req_idx, got, strict=True)}
                self.proposer.sync(self, batch, inp, ctx.drafter_hidden(hidden), emitted)
            return {}
        sreqs = [reqs[i] for i in inp.sample_req_idx]
        sampled = self.sample(logits, sreqs)
        if self.proposer is not None:  # the draft model / MTP computes this step's tokens too
            toks = [sampled[reqs[i].req_id].token_id for i in inp.sample_req_idx]
            if self.proposer.reads_sampled:
                broadcast_ints(toks)  # to the other ranks' proposers (a no-op alone)
            self.proposer.sync(self, batch, inp, ctx.drafter_hidden(hidden),
                               {i: [t] for i, t in zip(inp.sample_req_idx, toks, strict=True)})
        return sampled

    def sample(self, logits: torch.Tensor,
               sreqs: list[CachedRequestState]) -> dict[str, SampledToken]:
        if not self._grammar and all(plain_greedy(r.sampling_params) for r in sreqs):
            # The sampler's whole work for such rows (no metadata to build).
            out = SamplerOutput(Sampler.argmax(logits))
        else:
            out = self._sample_all(logits, sreqs)
        ids = out.sampled_token_ids.tolist()
        result = {}
        lp_ids = out.logprobs_token_ids.tolist() if out.logprobs_token_ids is not None else None
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        ranks = out.ranks.tolist() if out.ranks is not None else None
        for row, r in enumerate(sreqs):
            lp = None
            k = r.sampling_params.logprobs
            chosen = out.chosen_logprobs.get(row)
            if chosen is not None:
                # The sampled token, then the asked ids (best first; each once).
                pairs = sorted((p for p in zip(r.sampling_params.logprob_token_ids, chosen)
                                if p[0] != ids[row]), key=lambda p: -p[1])
                lp = ([ids[row]] + [t for t, _ in pairs], [lps[row][0]] + [v for _, v in pairs],
                      ranks[row])
            elif k is not None and lp_ids is not None:
                lp = (lp_ids[row][: 1 + k], lps[row][: 1 + k], ranks[row])
            result[r.req_id] = SampledToken(ids[row], lp)
            k = r.sampling_params.prompt_logprobs
            if (k is not None and not r.output_token_ids
                    and len(r.prompt_logprobs) == len(r.prompt_token_ids) - 1):
                result[r.req_id].prompt_logprobs = r.prompt_logprobs
        return result

    def _sample_all(self, logits: torch.Tensor,
                    sreqs: list[CachedRequestState]) -> SamplerOutput:
        gens = {}
        for row, r in enumerate(sreqs):
            g = self.generator_for(r)
            if g is not None:
                gens[row] = g
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sreqs],
            [r.output_token_ids for r in sreqs],
            [r.prompt_token_ids for r in sreqs],
            gens,
            eos_token_ids=[r.eos_token_id for r in sreqs],
            device=self.device,
        )
        if self._grammar:
            meta.token_bitmask = self._bitmask(self._grammar, sreqs, logits.shape[1])
        return self.sampler(logits, meta)

    @staticmethod
    def _bitmask(grammar: dict[str, bytes], sreqs: list[CachedRequestState],
                 vocab: int) -> torch.Tensor:
        """The step's packed allowed-token rows in sampling-row order (unconstrained rows
        allow everything)."""
        mask = torch.full((len(sreqs), (vocab + 31) // 32), -1, dtype=torch.int32)
        for row, r in enumerate(sreqs):
            b = grammar.get(r.req_id)
            if b is not None:
                mask[row] = torch.frombuffer(bytearray(b), dtype=torch.int32)
        return mask

    def _prompt_logprobs(self, reqs: list[CachedRequestState], starts: list[int],
                         counts: list[int], hidden: torch.Tensor) -> None:
        """Append to ``state.prompt_logprobs`` the entries of the prompt positions this step
        computed, for requests that ask for them and have no output yet (positions already
        recorded are skipped; a request that resumes mid-prompt records nothing)."""
        offset = 0
        for r, start, n in zip(reqs, starts, counts):
            k = r.sampling_params.prompt_logprobs
            if k is None:  # most requests: skip the bounds below (a few us a decode step)
                offset += n
                continue
            first = max(start, len(r.prompt_logprobs))
            end = min(start + n, len(r.prompt_token_ids) - 1)
            if (not r.output_token_ids and start <= len(r.prompt_logprobs)
                    and first < end):
                rows = torch.arange(offset + first - start, offset + end - start,
                                    device=hidden.device)
                logits = self.model.compute_logits(hidden[rows]).float()
                t = r.sampling_params.prompt_logprobs_temperature
                if t != 1.0:
                    logits = logits / t
                targets = torch.tensor(r.token_ids[first + 1:end + 1], dtype=torch.int64,
                                       device=logits.device)
                ids, lps, ranks = gather_logprobs(torch.log_softmax(logits, dim=1), targets, k)
                r.prompt_logprobs.extend(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
            offset += n
