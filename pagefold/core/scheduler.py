"""Token-budget scheduler: one currency (tokens this step), running requests first.

Each step emits ``{request_id: num_tokens}``. A request mid-prefill gets a chunk of its prompt
(chunked prefill), a decoding request gets 1 token; both kinds share the step. Admission is gated
by the block pool. When the pool runs dry for a running request, the scheduler preempts by
recompute: the victim is the lowest-priority running request (FCFS: the latest arrival;
priority policy: largest ``(priority, arrival_time)``), it frees everything and goes back to the
front of the waiting queue. The rule is deterministic: the same inputs give the same schedule.

The step contract (``core/sched_output.py``): ``schedule()`` returns the whole step as a
message; ``update_from_output(out, sampled)`` applies the runner's sampled tokens: counts the
computed tokens, appends the new tokens, applies the token-level stop rules (eos,
stop_token_ids, max_tokens, max_model_len), caches what became reusable (full blocks, state
checkpoints) and frees finished requests on that same step. Text-level stops (stop strings) are
the output processor's, which aborts. Beam search's operations (fork a request, swap its newest
token, pause it) are scheduler operations between steps.

Pipeline parallelism (``max_in_flight`` P > 1, ``engine/batch_queue.py``): messages are made
while earlier ones are still running. A request in an unapplied message is skipped (a decoding
request has no token to compute before its sampled one lands; the next chunk of a prefill
waits too, the simple rule); a message takes at most ``ceil(running / P)`` running requests;
and nothing is preempted while a message is in flight: a request that needs a preemption ends
the schedule and sets ``drain``, the engine applies every in-flight message first, and the
victims are then chosen exactly as without a pipeline.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque

from pagefold.core.decode_burst import BurstPolicy
from pagefold.core.encoder_budget import EncoderBudget
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_connector import ConnectorOutput
from pagefold.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SampledToken,
    SchedulerOutput,
    TableDiff,
    VerifiedTokens,
)
from pagefold.request import Request, RequestStatus

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerOutput"]


def table_diff(old: list[int], new: list[int]) -> TableDiff:
    """``(i, new[i:])`` from the first index where ``new`` differs from ``old``; None if equal."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return None if len(new) == n else (n, new[n:])
    i = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(n, len(new)))
    return (i, new[i:])


class _WaitingQueue:
    """FCFS deque, or a heap on ``(priority, arrival_time, seq)`` for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def push(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._dq.append(req)
        else:
            self._seq += 1
            heapq.heappush(self._heap, (req.priority, req.arrival_time, self._seq, req))

    def push_front(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._dq.appendleft(req)
        else:
            # Keeps its place by (priority, arrival); a lower seq breaks ties toward it.
            self._seq += 1
            heapq.heappush(self._heap, (req.priority, req.arrival_time, -self._seq, req))

    def peek(self) -> Request:
        return self._dq[0] if self.policy == "fcfs" else self._heap[0][3]

    def remove(self, req: Request) -> bool:
        if self.policy == "fcfs":
            try:
                self._dq.remove(req)
                return True
            except ValueError:
                return False
        for i, item in enumerate(self._heap):
            if item[3] is req:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._dq) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._dq) if self.policy == "fcfs" else (x[3] for x in sorted(self._heap))


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv_cache
        # The engine's StructuredOutputManager (grammar rows, matchers); None: no grammars.
        self.structured = None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # Multi-LoRA: most distinct adapters among running requests; None: LoRA off.
        self.max_loras: int | None = None
        self.policy = policy
        self.waiting = _WaitingQueue(policy)
        self.running: list[Request] = []
        # Admitted requests whose prefix-cache hit waits for pages from a KV connector (offload
        # tiers): they hold their blocks, compute nothing, and join ``running`` once the
        # worker reports their loads (or go back to waiting when a page was bad).
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Prompt tokens the forwards computed (not a hit's; a recompute counts again).
        self.prompt_tokens_computed = 0
        self._finished_ids: list[str] = []
        # What the runner holds: requests it has seen since their last preemption, and the
        # block tables it was last sent (diffs are taken against them).
        self._sent_tables: dict[str, list[list[int]]] = {}
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.num_aborted = 0  # cumulative requests finished as aborted (client gone, stop str)
        self.preemptions_by_kind: dict[str, int] = {}
        self.num_forks = 0
        # Speculative decoding: the drafter (``spec_decode.engine.SpecDecoder``) fills
        # ``spec_token_ids`` at the start of each schedule and counts the verified results.
        self.drafter = None
        self.spec_token_ids: dict[str, list[int]] = {}
        # Pipeline parallelism (``engine/batch_queue.py``): up to ``max_in_flight`` messages
        # at once. ``in_flight``: the requests of unapplied messages (not scheduled again);
        # ``drain``: the last schedule stopped at a preemption that waits for none in flight.
        self.max_in_flight = 1
        self.in_flight: dict[str, Request] = {}
        self.drain = False
        # Decode bursts (``core/decode_burst.py``): off unless the engine sets a budget; a
        # step's time runs from the end of ``schedule`` to ``update_from_output``.
        self.burst = BurstPolicy()
        self._scheduled_at = 0.0

    # ------------------------------------------------------------------ queue management
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request now; its blocks go back to the pool immediately."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif self.loading.pop(req_id, None) is None:
            self.waiting.remove(req)
        req.status = status
        if status == RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        self.kv.free(req)
        self._sent_tables.pop(req_id, None)
        self._finished_ids.append(req_id)
        return req

    def has_unfinished(self) -> bool:
        """Requests remain, or page copies wait for a step (a checkpoint saved by the last
        step of a request that has ended)."""
        return bool(self.requests) or self.kv.has_pending_copies

    # ------------------------------------------------------------------ driver operations
    def fork_request(self, parent_id: str, child_id: str) -> Request:
        """A new request continuing ``parent_id`` token for token (beam search): attention
        blocks shared copy-on-write, states copied. Call between steps."""
        parent = self.requests[parent_id]
        if parent_id in self.in_flight:
            raise RuntimeError(f"request {parent_id!r} is in a step in flight; fork it after")
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        if parent.status == RequestStatus.RUNNING and not self.kv.can_fork(parent, 1):
            raise RuntimeError("no free blocks to fork a request; lower beam_width or n")
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params.clone(),
                        eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
                        priority=parent.priority, all_token_ids=list(parent.all_token_ids),
                        output_token_ids=list(parent.output_token_ids),
                        extra_keys=parent.extra_keys, num_cached_tokens=parent.num_cached_tokens,
                        cumulative_logprob=parent.cumulative_logprob, mm_inputs=parent.mm_inputs,
                        lora_request=parent.lora_request)
        self.fork_now(parent, child)
        return child

    def replace_last_token(self, request_id: str, token_id: int) -> None:
        """Swap the newest sampled token (not computed yet, so nothing in the cache changes;
        the runner gets the new one with the next step's tokens)."""
        r = self.requests[request_id]
        if (not r.output_token_ids or r.num_computed_tokens >= r.num_tokens
                or request_id in self.in_flight):
            raise ValueError(f"request {request_id!r} has no uncomputed sampled token")
        r.output_token_ids[-1] = token_id
        r.all_token_ids[-1] = token_id
        if len(r.block_hashes) * self.kv.block_size >= r.num_tokens:
            r.block_hashes.pop()  # that hash covered the replaced token

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Hold a request out of scheduling (its driver decides its next token first)."""
        self.requests[request_id].paused = paused

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ the step
    # A request preempted this often is spared while any other victim exists, so it finishes.
    MAX_PREEMPTIONS_BEFORE_SPARED = 3

    def _victim(self) -> Request:
        pool = [r for r in self.running
                if r.num_preemptions < self.MAX_PREEMPTIONS_BEFORE_SPARED] or self.running
        if self.policy == "fcfs":
            return pool[-1]
        return max(pool, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        kind = self.kv.preempt(req)  # swap keeps progress; recompute resets it
        req.status = RequestStatus.PREEMPTED
        self._sent_tables.pop(req.request_id, None)  # the runner drops it; it comes back new
        req.mm_encoded.clear()  # and its encoder outputs
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_kind[kind] = self.preemptions_by_kind.get(kind, 0) + 1
        self.waiting.push_front(req)

    def _fork(self, parent: Request) -> None:
        """Create the parent's children right after it in the running list. Children that do
        not fit in the pool now start from scratch as waiting requests instead (the prefix
        cache still serves their prompt), so a family never waits on memory it cannot get."""
        k = parent.fork_children
        shared = next((m for m in range(k, 0, -1) if self.kv.can_fork(parent, m)), 0)
        for idx in range(1, k + 1):
            self.fork_now(parent, parent.spawn_child(idx), share=idx <= shared)
        parent.fork_children = 0

    def fork_now(self, parent: Request, child: Request, share: bool = True) -> None:
        """``child`` (a copy of ``parent``'s tokens) continues from the parent's cache if the
        parent is running (and ``share``), else from scratch like any waiting request."""
        self.requests[child.request_id] = child
        self.num_forks += 1
        if share and parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.status = RequestStatus.WAITING
            self.waiting.push(child)

    def _log_preemptions(self, before: dict[str, int]) -> None:
        """One INFO line per step that preempted (each preemption itself is a DEBUG line of
        the cache manager: a large family can preempt hundreds of requests)."""
        now = self.preemptions_by_kind
        delta = {k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)}
        if delta:
            logger.info("preempted %d request(s) this step (%s); %d running, %d waiting, "
                        "%d free blocks", sum(delta.values()),
                        ", ".join(f"{v} by {k}" for k, v in sorted(delta.items())),
                        self.num_running, self.num_waiting, self.kv.pool.num_free)

    def schedule(self) -> SchedulerOutput:
        before = dict(self.preemptions_by_kind)
        if self.drafter is not None:
            self.drafter.propose(self)
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self.kv.pool.tick += 1
        budget = self.max_num_batched_tokens
        encoder = EncoderBudget(self.max_num_batched_tokens)
        scheduled: dict[str, int] = {}
        pipelined = self.max_in_flight > 1
        busy = pipelined and bool(self.in_flight)
        self.drain = False
        # Pipelined, a message takes at most its share of the running requests, so that the
        # next one finds requests that are not in flight.
        seats = -(-len(self.running) // self.max_in_flight)

        # 0. Parallel sampling: families whose shared prompt prefix is computed fork now.
        for req in [r for r in self.running if r.ready_to_fork]:
            self._fork(req)

        # A burst: every running request decodes ``burst`` tokens in this message.
        so = self.structured
        idle = not (self.waiting or self.loading or pipelined or self.drafter is not None
                    or (so is not None and so.num_constrained(self.requests)))
        burst = self.burst.steps(self.running, self.kv, self.max_model_len, budget) if idle else 1
        out.decode_burst = burst > 1

        # 1. Running requests, in order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.paused or req.request_id in self.in_flight:
                i += 1
                continue
            if pipelined and len(scheduled) >= seats:
                break
            n = burst if burst > 1 else req.num_tokens - req.num_computed_tokens
            drafts = self.spec_token_ids.get(req.request_id) if n == 1 else None
            if drafts:
                n += len(drafts)
                n = self.kv.cap_spec_chunk(req, n)
            n = min(n, budget)
            n = min(n, self.max_model_len - req.num_computed_tokens)
            n = self.kv.cap_chunk(req, req.num_computed_tokens, n)
            if req.fork_children:  # stop the shared prefill where the family forks
                n = min(n, req.fork_at - req.num_computed_tokens)
            if req.mm_inputs is not None:
                n = encoder.cap(req, req.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                if busy:  # victims are chosen with nothing in flight: the engine drains
                    self.drain = True
                    break
                victim = self._victim()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    out.spec_token_ids.pop(victim.request_id, None)
                if self.running.index(victim) < i:
                    i -= 1  # (priority policy) an earlier entry leaves: req moves up one slot
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    n = 0
                    break
            if self.drain:
                break
            if n == 0:
                continue  # req was preempted; running[i] is now the next request
            scheduled[req.request_id] = n
            if req.mm_inputs is not None:
                encoder.charge(req, req.num_computed_tokens, n)
            if drafts and n > 1:
                out.spec_token_ids[req.request_id] = drafts[: n - 1]
            budget -= n
            i += 1

        # 2. Waiting requests, while budget, seats and blocks last (none if we just preempted).
        # A request whose prefix another request is computing right now waits for that hit.
        if not out.preempted_ids and not self.drain:
            loras = self._running_loras()
            for req in list(self.waiting):
                if budget <= 0 or len(self.running) + len(self.loading) >= self.max_num_seqs:
                    break
                if req.paused or self.kv.should_defer(req) or req.request_id in self.in_flight:
                    continue  # (in flight: an aborted request's id, reused)
                lid = req.lora_request.lora_int_id if req.lora_request is not None else 0
                if lid and lid not in loras and len(loras) >= (self.max_loras or 0):
                    continue  # every adapter slot is taken by running requests: wait
                if lid:
                    loras.add(lid)
                # Prompt logprobs need every prompt position computed: no prefix-cache hit.
                hit = (0 if req.sampling_params.prompt_logprobs is not None
                       else self.kv.find_hit(req))
                start = req.num_computed_tokens + hit * self.kv.block_size
                n = min(req.num_tokens - start, budget)
                n = self.kv.cap_chunk(req, start, n)
                if req.fork_children:
                    n = min(n, req.fork_at - start)
                if req.mm_inputs is not None:
                    n = encoder.cap(req, start, n)
                if not self.kv.allocate_slots(req, n, hit):
                    break
                self.waiting.remove(req)
                self.kv.record_admission(req, hit * self.kv.block_size)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = req.num_computed_tokens
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                if self.kv.is_loading(req.request_id):  # its hit's pages come in this step
                    self.loading[req.request_id] = req
                    continue
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if n:
                    scheduled[req.request_id] = n
                    budget -= n
                    if req.mm_inputs is not None:
                        encoder.charge(req, start, n)

        # Layout order: running order (stable across steps -> persistent batch friendly).
        for req in self.running:
            n = scheduled.get(req.request_id)
            if n is not None:
                out.num_scheduled[req.request_id] = n
                self._describe(req, n, out)
                if pipelined:
                    self.in_flight[req.request_id] = req
        if out.num_scheduled and self.kv.capture_in_kernel:
            # Checkpoint targets inside the chunks: taken by the kernels (no chunk was cut).
            out.captures = self.kv.plan_captures(
                [self.requests[rid] for rid in out.num_scheduled],
                list(out.num_scheduled.values()))
        out.copies = self.kv.take_copies()
        out.swaps = self.kv.take_swaps()
        out.kv_ops = self.kv.take_kv_ops(
            idle=not (out.num_scheduled or out.copies or out.swaps))
        if not scheduled and not self.running and self.waiting and not out.copies \
                and not self.loading:
            self._abort_unschedulable()
        so = self.structured
        if so is not None and so.num_constrained(self.requests):
            out.grammar_bitmask = so.step_bitmask(self.requests, out.num_scheduled)
        self._log_preemptions(before)
        self._scheduled_at = time.perf_counter()
        return out

    def _running_loras(self) -> set[int]:
        """The adapter ids of the running (and loading) requests."""
        return {r.lora_request.lora_int_id for r in [*self.running, *self.loading.values()]
                if r.lora_request is not None}

    def _describe(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """Put what the runner needs to compute ``req``'s next ``n`` tokens into ``out``."""
        rid = req.request_id
        tables = self.kv.block_ids(rid)
        sent = self._sent_tables.get(rid)
        self._sent_tables[rid] = tables
        start = req.num_computed_tokens
        if sent is None:
            out.new_reqs.append(NewRequestData(
                rid, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params,
                req.eos_token_id, tables, start, req.mm_inputs, req.lora_request))
        else:
            out.cached_reqs.append(CachedRequestData(
                rid, start, req.all_token_ids[start : start + n],
                [table_diff(o, t) for o, t in zip(sent, tables)]))

    def _abort_unschedulable(self) -> None:
        """Nothing ran although requests wait: the head request cannot fit in an empty pool."""
        head = self.waiting.peek()
        logger.error("request %s needs more blocks than the whole pool; aborting it",
                     head.request_id)
        self.finish_request(head.request_id, RequestStatus.FINISHED_LENGTH)
        self._pending_outputs.append(EngineCoreOutput(head.request_id, [],
                                                      finish_reason="length"))

    # ------------------------------------------------------------------ after the forward
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
        """Apply a step's results: scheduled tokens become computed, sampled tokens are
        appended and checked against the stop rules, full blocks and state checkpoints are
        cached, the step's copied pages are unpinned and finished requests freed. The KV
        connector's report (``RunnerOutput.kv_connector_output``) moves requests whose loads
        finished to running, or back to waiting when a page was bad."""
        self.burst.observe(out.num_scheduled, out.decode_burst,
                           time.perf_counter() - self._scheduled_at)
        kv_out = getattr(sampled, "kv_connector_output", None)
        if kv_out is not None:
            self._apply_loads(kv_out)
        if out.spec_token_ids and self.drafter is not None:
            self.drafter.observe(out, sampled)
        outputs, self._pending_outputs = self._pending_outputs, []
        stepped: list[Request] = []
        finished: list[tuple[Request, RequestStatus]] = []
        for rid, n in out.num_scheduled.items():
            r = self.requests.get(rid)
            if self.max_in_flight > 1 and self.in_flight.pop(rid, None) is not r:
                continue  # ended while in flight (the id may name a newer request now)
            if r is None:
                continue  # ended while the step ran
            self.prompt_tokens_computed += max(0, min(n, r.num_prompt_tokens
                                                      - r.num_computed_tokens))
            r.num_computed_tokens += n
            stepped.append(r)
            tok = sampled.get(rid)
            if tok is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if isinstance(tok, VerifiedTokens):
                # A burst's tokens are all the runner's own (no draft to reject).
                drafts = n - 1 if out.decode_burst else len(out.spec_token_ids.get(rid, ()))
                if self._append_verified(r, drafts, tok, outputs, finished):
                    stepped.pop()
                continue
            r.append_token(tok.token_id)
            if self.structured is not None:
                self.structured.accept(r, tok.token_id)  # advance the request's grammar
            eo = EngineCoreOutput(rid, [tok.token_id],
                                  num_cached_tokens=max(r.num_cached_tokens, 0),
                                  parent_id=r.parent_id, index=r.index)
            if tok.prompt_logprobs is not None:
                eo.prompt_logprobs = tok.prompt_logprobs
            if len(r.output_token_ids) == 1:
                eo.scheduled_time = r.first_scheduled_time
            if tok.logprobs is not None:
                eo.new_logprobs.append(tok.logprobs)
                r.cumulative_logprob += tok.logprobs[1][0]
            status = self.check_stop(r, tok.token_id)
            if status is not None:
                finished.append((r, status))
                eo.finish_reason = status.finish_reason
                eo.stop_reason = r.stop_reason
            outputs.append(eo)
        # Cache what this step made reusable (before finished requests free their pages).
        for r in stepped:
            self.kv.after_step(r)
        self.kv.release_pins(oldest_only=self.max_in_flight > 1)
        for r, status in finished:
            params = r.kv_transfer_params
            # One export per prompt: a family's children share the parent's prompt pages.
            if params and params.get("do_remote_decode") and r.parent_id is None:
                exported = self.kv.export_prompt(r)  # before its pages are freed
                for eo in outputs:
                    if eo.request_id == r.request_id:
                        eo.kv_transfer_params = exported
            self.finish_request(r.request_id, status)
        if self.structured is not None and self.structured.num_matchers:
            self.structured.retain(self.requests)  # finished / aborted requests' matchers go
        return outputs

    def _apply_loads(self, kv_out: ConnectorOutput) -> None:
        self.kv.apply_connector_output(kv_out)
        for rid in kv_out.finished:
            req = self.loading.pop(rid, None)
            if req is None:
                continue  # aborted meanwhile
            if self.kv.finish_load(req, kv_out.failed.get(rid, [])):
                req.num_cached_tokens = max(req.num_cached_tokens, req.num_computed_tokens)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:  # a bad page: start over, the hit search no longer finds that key
                self.waiting.push_front(req)

    def _append_verified(self, r: Request, drafts: int, tok: VerifiedTokens,
                         outputs: list[EngineCoreOutput],
                         finished: list[tuple[Request, RequestStatus]]) -> bool:
        """A speculative step's or a decode burst's result: of its ``1 + drafts`` computed tokens
        only ``1 + accepted`` stand (rejected drafts' KV lies past the computed length, to be
        overwritten); the accepted drafts and the sampled token go through the stop rules.
        Returns True when the request stopped before its last emitted token: its computed
        length and committed state then run past its tokens, so nothing of this step may be
        cached for it (it is freed on this step anyway)."""
        r.num_computed_tokens -= drafts - tok.num_accepted
        eo = EngineCoreOutput(r.request_id, [], num_cached_tokens=max(r.num_cached_tokens, 0),
                              parent_id=r.parent_id, index=r.index)
        outputs.append(eo)
        for j, t in enumerate(tok.token_ids):
            r.append_token(t)
            eo.new_token_ids.append(t)
            if tok.logprobs is not None:
                eo.new_logprobs.append(tok.logprobs[j])
                r.cumulative_logprob += tok.logprobs[j][1][0]
            status = self.check_stop(r, t)
            if status is not None:
                finished.append((r, status))
                eo.finish_reason = status.finish_reason
                eo.stop_reason = r.stop_reason
                if j < len(tok.token_ids) - 1:
                    r.num_computed_tokens = r.num_tokens - 1
                    return True
                break
        return False

    def check_stop(self, r: Request, token: int) -> RequestStatus | None:
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token == r.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                r.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and r.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if r.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
