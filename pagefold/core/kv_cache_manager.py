"""Coordinates the per-group managers over one BlockPool.

* Allocation is all-or-nothing across groups.
* Prefix hits: the longest prefix P (a multiple of the block size, at most ``num_tokens - 1``
  so the last token's logits get computed) that *every* group can serve: attention groups
  serve any P up to their cached chain, state groups only P where a checkpoint exists. An
  attention hit is never thrown away for a state miss when a shorter common P exists.
* Checkpoint targets: prefill chunks end exactly where a state checkpoint is wanted: the last
  block boundary of the prompt and the one 3 blocks before it (a shared system prompt followed
  by a short question ends in between: >= 90% reuse for questions up to ~47 tokens), every
  ``checkpoint_interval`` tokens, and where an attention hit ran past the deepest checkpoint
  (a proven branch point). Decoding passes every boundary anyway.
* In-flight prefixes: a waiting request whose next uncached block is being computed right now
  by a running request's prefill is deferred (not admitted this step) so it can hit once that
  prefill lands, instead of recomputing the same prefix in parallel.
* Page copies (restores for hits, forks, copy-on-write, saves for checkpoints) are queued here
  and leave with the next step's message (``take_copies``): the runner runs them all, in order,
  before that step's forward (one copy point per step). Their pinned pages (restore sources,
  checkpoint destinations) stay pinned until ``release_pins`` after that step. A checkpoint
  saved after step N is copied at the start of step N+1; its source pages are not written
  before then (forwards run after the copies, swap-ins after the copies too).
* ``capture_in_kernel`` (every state layer of the model can capture): chunks are not cut at
  targets; a target strictly inside a step's chunk becomes a ``StateCapture`` in the step's
  message (pages taken after scheduling by ``plan_captures``, written by the layers' kernels
  during the forward, registered as a cache entry by ``after_step``), so no prompt pays extra
  steps for its checkpoints.
* With a KV connector (``attach_connector``: offload tiers), hits also count keys stored
  outside the pool. An entry the pool evicts is offered to the connector first (a save in the
  next step's ops). A hit that needs any page from outside makes the request *loading*: its
  pages are allocated and the loads queued, but it computes nothing until the worker reports
  them (``finish_load``: then its computed length jumps to the hit; a failed key is forgotten
  and the request starts over, so a bad page is recomputed, never used).
* Prefill/decode disaggregation's prompt tail (``core/prompt_tail.py``): a producer's
  ``do_remote_decode`` request takes its state after all but the last prompt token (a capture
  or a copy at ``L - 1``); a consumer's hit may load it, computing only the last token.
* Staging pages (``core/capture_staging.py``): with offload tiers, a capture the full pool
  cannot hold goes to the tiers through a reserved page set.
"""

from __future__ import annotations

import logging

from pagefold.core.block_pool import Block, BlockPool, CacheEntry
from pagefold.core.capture_staging import CaptureStaging, stage_captures
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_connector import (
    ConnectorOutput,
    KVConnectorScheduler,
    KVOps,
    key_from_name,
    key_group,
)
from pagefold.core.managers import GroupManager, PageCopy, StateCapture, make_manager
from pagefold.core.prefix_cache import PrefixCacheStats, update_block_hashes
from pagefold.core.prompt_tail import export_entries, tail_len, takes_tail, wants_tail
from pagefold.core.swap import (
    HostPool,
    PreemptionCost,
    PreemptionLog,
    SwapOp,
    SwappedRequest,
    SwapStats,
    swap_in_pages,
    swap_out_pages,
)
from pagefold.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, *, enable_prefix_caching: bool = False,
                 checkpoint_interval: int = 256, capture_in_kernel: bool = False) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers: list[GroupManager] = [
            make_manager(self.pool, g, i, config.block_size) for i, g in enumerate(config.groups)
        ]
        self.caching = enable_prefix_caching
        self.has_state = any(m.wants_checkpoints() for m in self.managers)
        self._hit_order = sorted(self.managers, key=lambda m: m.wants_checkpoints())
        bs = self.block_size
        self.checkpoint_interval = max(bs, (checkpoint_interval // bs) * bs)
        self.stats = PrefixCacheStats()
        self._targets: dict[str, list[int]] = {}
        self._inflight: dict[bytes, str] = {}  # prompt block hash -> producing request
        self._copies: list[PageCopy] = []
        self._pins: list[list[Block]] = []  # pins of the queued copies
        # Per step message not yet applied, oldest first: the pins of the copies it carries.
        self._pins_in_flight: list[list[list[Block]]] = []
        self.capture_in_kernel = capture_in_kernel
        # Preemption by swap (off until ``attach_swap``).
        self.host: HostPool | None = None
        self.preemption_mode = "recompute"
        self.cost: PreemptionCost | None = None
        self.swapped: dict[str, SwappedRequest] = {}
        self._swaps: list[SwapOp] = []
        self.swap_stats = SwapStats()
        self.preempt_log = PreemptionLog()
        # KV connector (off until ``attach_connector``); requests whose hit is loading:
        # request id -> (hit tokens, tokens of it only the connector could serve).
        self.connector: KVConnectorScheduler | None = None
        self._loading: dict[str, tuple[int, int]] = {}
        self.staging: CaptureStaging | None = None
        # Consumers whose hit takes a prompt tail (``core/prompt_tail.py``): group -> key.
        self._tail: dict[str, dict] = {}

    # ------------------------------------------------------------------ KV connector
    def attach_connector(self, connector: KVConnectorScheduler) -> None:
        if not self.caching:
            raise ValueError("a KV connector (kv_offloading_size / kv_offloading_dir) needs "
                             "enable_prefix_caching")
        self.connector = connector
        self.pool.on_evict = self._save_evicted

    def enable_capture_staging(self) -> None:
        """Offload tiers: checkpoints captured in the kernels reach the connector through
        staging pages when the pool has no room (``core/capture_staging.py``); a capture in
        a short pool is planned deepest target first."""
        if self.capture_in_kernel and self.connector is not None:
            self.staging = stage_captures(self.pool, self.connector, self.managers)

    def _save_evicted(self, e: CacheEntry) -> None:
        if self.connector.wants(e.key):
            self.connector.record_save(e.key, key_group(e.key), [b.block_id for b in e.blocks],
                                       e.saved_tokens)

    def offload_cached(self) -> None:
        """Queue a save of every cached entry nobody holds (at shutdown: the pool's prefixes
        survive on disk); run a step to execute it."""
        if self.connector is None:
            return
        for e in list(self.pool.entries.values()):
            if e.evictable:
                self._save_evicted(e)

    @property
    def _stored(self):
        return self.connector.contains if self.connector is not None else None

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._loading

    def take_kv_ops(self, idle: bool = False) -> KVOps:
        """The connector's ops for the step being sent; ``idle``: it computes nothing else."""
        if self.connector is None:
            return KVOps()
        ops = self.connector.take_ops()
        ops.poll = bool(self._loading)  # loads may land in this step
        ops.idle = idle
        return ops

    def apply_connector_output(self, out: ConnectorOutput) -> None:
        if self.connector is not None:
            self.connector.apply_output(out)

    def finish_load(self, req: Request, failed_names: list[str]) -> bool:
        """``req``'s loads ran. True: its computed length is now the hit. False: a page was
        bad; the good ones stay cached, the request holds nothing and starts over."""
        hit_tokens, tier_tokens = self._loading.pop(req.request_id)
        failed = {key_from_name(n) for n in failed_names}
        for m in self.managers:
            m.finish_tier_load(req.request_id, failed)
        if failed:
            self.free(req)
            req.num_computed_tokens = 0
            return False
        req.num_computed_tokens = hit_tokens
        self.connector.stats.tokens_loaded += tier_tokens
        return True

    def export_prompt(self, req: Request) -> dict | None:
        """A finished prefill leaves for another engine: the pages of its prompt
        (``prompt_tail.export_entries``: the cached blocks and the tail, or the deepest
        checkpoint when no tail was taken) go to the connector, which returns the
        ``kv_transfer_params`` (None: nothing cached, or the connector does not export).
        Call before ``free``."""
        if self.connector is None or not self.caching:
            return None
        entries, num_tokens = export_entries(self.pool, self.managers, req, self.block_size)
        return self.connector.export(req.request_id, entries, num_tokens)

    # ------------------------------------------------------------------ prefix hits
    def find_hit(self, req: Request) -> int:
        """Blocks of ``req``'s prefix servable from cache (0 when caching is off)."""
        if not self.caching or req.num_computed_tokens:
            return 0
        return self._plan_tail(req, self._find_hit(req, plan=True))

    def _plan_tail(self, req: Request, hit: int) -> int:
        """A consumer whose connector holds the prompt's whole tail, and every attention
        block before it, takes them (``allocate_slots`` loads the tail into its own pages; it
        then computes only the last prompt token), unless its own pool already serves all but
        the last token. Returns the hit in blocks."""
        self._tail.pop(req.request_id, None)
        keys = self.connector.tail_keys(req.request_id) if self.connector is not None else {}
        if not keys or not takes_tail(self.managers, req, self.block_size, keys, hit,
                                      self._stored,
                                      lambda: self._find_hit(req, False, pool_only=True)):
            return hit
        self._tail[req.request_id] = keys
        return tail_len(req) // self.block_size

    def should_defer(self, req: Request) -> bool:
        """True when the block after ``req``'s current hit is being computed by another request."""
        if not self.caching or req.num_computed_tokens:
            return False
        n = self._find_hit(req, plan=False)
        hashes = req.block_hashes
        if n >= len(hashes) or n >= (req.num_tokens - 1) // self.block_size:
            return False
        owner = self._inflight.get(hashes[n])
        return owner is not None and owner != req.request_id

    def _find_hit(self, req: Request, plan: bool, pool_only: bool = False) -> int:
        bs = self.block_size
        hashes = update_block_hashes(req, bs)
        max_blocks = (req.num_tokens - 1) // bs
        cap, sets = max_blocks, []
        stored = None if pool_only else self._stored
        # Checkpointing (state) managers last, asked only up to the others' common hit: their
        # answer is a set of lengths looked up block by block, and no hit can exceed ``cap``.
        for m in self._hit_order:
            r = m.hit_lengths(hashes, cap, stored)
            if isinstance(r, int):
                cap = min(cap, r)
            else:
                sets.append(r)
        n = cap
        if sets:
            common = set.intersection(*sets)
            n = max((x for x in common if x <= cap), default=0)
        if self.has_state and plan:
            self._plan_targets(req, attention_hit=cap, hit=n)
        return n

    def _plan_targets(self, req: Request, attention_hit: int, hit: int) -> None:
        """Where this request's prefill chunks must end so a state checkpoint can be saved."""
        bs, iv = self.block_size, self.checkpoint_interval
        prompt_end = req.num_tokens - 1  # positions after which a later prompt may continue
        targets = set(range(iv, prompt_end + 1, iv))
        last = (prompt_end // bs) * bs
        targets.update(last - k * bs for k in (0, 3))
        if attention_hit > hit:
            targets.add(attention_hit * bs)  # reuse proved to happen here
        if wants_tail(req) and self.connector is not None and not self.capture_in_kernel:
            targets.add(tail_len(req))  # a chunk ends there for a prompt tail's state
        start = hit * bs
        self._targets[req.request_id] = sorted(t for t in targets if t > start)

    def cap_chunk(self, req: Request, start: int, num_new: int) -> int:
        """Shorten a chunk starting at ``start`` so it ends on the next checkpoint target."""
        targets = self._targets.get(req.request_id)
        if not targets or self.capture_in_kernel:
            return num_new
        for t in targets:
            if start < t < start + num_new:
                return t - start
            if t >= start + num_new:
                break
        return num_new

    def plan_captures(self, reqs: list[Request], counts: list[int]) -> list[StateCapture]:
        """After scheduling: checkpoint targets strictly inside this step's chunks become
        captures for the step's message (the chunk's end is ``after_step``'s). A target is
        skipped when the pool is short or the key is cached already. The pages stay held by
        their manager until ``after_step`` registers them (or the request is freed)."""
        caps: list[StateCapture] = []
        if not (self.caching and self.has_state and self.capture_in_kernel):
            return caps
        for req, n in zip(reqs, counts):
            start, end = req.num_computed_tokens, tail_len(req)
            if start < end < start + n and wants_tail(req) and self.connector is not None:
                for m in self.managers:
                    cap = m.plan_tail(req.request_id, end) if m.wants_checkpoints() else None
                    if cap is not None:
                        caps.append(cap)
            targets = self._targets.get(req.request_id)
            start = req.num_computed_tokens
            if not targets or n < 2 or targets[-1] <= start:
                continue
            hashes = update_block_hashes(req, self.block_size)
            # Staging (a short pool): the deepest checkpoint first, the one a hit wants; it
            # alone may take a staging set (they are few).
            inside = [t for t in targets if start < t < start + n]
            if self.staging is not None:
                inside.reverse()
            for i, t in enumerate(inside):
                for m in self.managers:
                    cap = m.plan_capture(req.request_id, hashes, t, staging_ok=i == 0)
                    if cap is not None:
                        caps.append(cap)
        return caps

    def cap_spec_chunk(self, req: Request, num_new: int) -> int:
        """A verify chunk of a model with states ends at the next block boundary, so that when
        every draft is accepted the committed state lands on it and the decode checkpoint
        there is taken (checkpoints exist only at exact, accepted prefix lengths)."""
        if not (self.caching and self.has_state):
            return num_new
        start = req.num_computed_tokens
        boundary = (start // self.block_size + 1) * self.block_size
        return min(num_new, boundary - start)

    def _is_target(self, req: Request, num_computed: int) -> bool:
        if num_computed % self.block_size or num_computed == 0:
            return False
        if num_computed >= req.num_prompt_tokens:
            return True  # decode: the latest boundary serves the next conversation turn
        return num_computed in self._targets.get(req.request_id, ())

    # ------------------------------------------------------------------ allocation
    def blocks_needed(self, req: Request, num_new_tokens: int, hit_blocks: int = 0) -> int:
        """Net blocks the pool must supply to compute ``num_new_tokens`` more tokens (a
        prompt tail's pages included: state groups then take no checkpoint hit)."""
        start = req.num_computed_tokens + hit_blocks * self.block_size
        end = start + num_new_tokens
        tail = req.request_id in self._tail
        need = 0
        for m in self.managers:
            if hit_blocks and not (tail and m.wants_checkpoints()):
                need += m.hit_cost(req.block_hashes, hit_blocks, self._stored)
                need += m.num_blocks_needed("\0probe", start, end) - _hit_blocks_held(m, hit_blocks)
            elif tail:
                need += m.num_blocks_needed("\0probe", start, end)
            else:
                need += m.num_blocks_needed(req.request_id, start, end)
                need -= m.num_blocks_to_free(req.request_id, start)
        return need

    def allocate_slots(self, req: Request, num_new_tokens: int, hit_blocks: int = 0) -> bool:
        """Give ``req`` every block it needs for ``num_new_tokens`` more tokens, or nothing.

        With ``hit_blocks``, the request first takes its cached prefix (its
        ``num_computed_tokens`` jumps to the hit length); with a prompt tail planned by
        ``find_hit``, also the tail (it jumps to all but the last prompt token).
        """
        if req.request_id in self.swapped:
            return self._swap_in(req, num_new_tokens)
        if self.blocks_needed(req, num_new_tokens, hit_blocks) > self.pool.num_free:
            return False
        tail = self._tail.pop(req.request_id, None)
        if hit_blocks or tail:
            # Hold every group's hit blocks first: a state group allocating its pages takes
            # from the free queue, which could otherwise evict the attention blocks (or another
            # group's checkpoint) this very hit is about to use. With a tail, state groups
            # take no checkpoint: the tail's state loads into their own pages.
            stored, hashes = self._stored, req.block_hashes
            hit = [m for m in self.managers if hit_blocks
                   and not (tail and m.wants_checkpoints())]
            held = [b for m in hit for b in m.hit_blocks(hashes, hit_blocks, stored)]
            self.pool.touch(held)
            if stored is not None:  # ... and the tier keys, against the saves they cause
                for m in hit:
                    self.connector.pin(m.tier_keys(hashes, hit_blocks, stored))
            loads = 0
            try:
                for m in self.managers:
                    copies, tier = [], []
                    if m in hit and stored is None:
                        copies = m.take_hit(req.request_id, hashes, hit_blocks)
                    elif m in hit:
                        copies, tier = m.take_tier_hit(req.request_id, hashes, hit_blocks,
                                                       stored)
                    if tail and m.index in tail:
                        tier = tier + m.take_tail(req.request_id, tail[m.index])
                    for key, rows in tier:
                        self.connector.record_load(req.request_id, key, m.index, rows)
                    loads += len(tier)
                    for c in copies:
                        self._pins.append([self.pool.blocks[b] for b in c.src])
                    self._copies.extend(copies)
            finally:
                self.pool.free(held)
            hit_tokens = tail_len(req) if tail else hit_blocks * self.block_size
            if loads:  # computes nothing until the loads are reported (``finish_load``)
                pool_hit = self._find_hit(req, plan=False, pool_only=True)
                self._loading[req.request_id] = (hit_tokens,
                                                 hit_tokens - pool_hit * self.block_size)
                return True
            req.num_computed_tokens = hit_tokens
        end = req.num_computed_tokens + num_new_tokens
        for m in self.managers:
            m.allocate(req.request_id, req.num_computed_tokens, end, self._copies)
        return True

    def can_fork(self, parent: Request, num_children: int) -> bool:
        need = sum(m.fork_cost(parent.request_id) for m in self.managers) * num_children
        return need <= self.pool.num_free

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` continues from ``parent``'s cache: attention blocks shared (copy-on-write
        later), states copied now (the copy runs before the next forward)."""
        for m in self.managers:
            self._copies.extend(m.fork(parent.request_id, child.request_id))
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def record_admission(self, req: Request, hit_tokens: int) -> None:
        """A request was admitted with ``hit_tokens`` from cache: count it, and promise its
        own uncached prompt blocks to later arrivals (see ``should_defer``). A loading hit
        counts its own length (a prompt tail: all but the last token) and its tier part."""
        loading = self._loading.get(req.request_id)
        hit_tokens, tier = loading if loading is not None else (hit_tokens, 0)
        if self.caching:
            for h in req.block_hashes[hit_tokens // self.block_size:]:
                self._inflight.setdefault(h, req.request_id)
        self.stats.requests += 1
        self.stats.queries += req.num_tokens
        self.stats.hits += hit_tokens
        self.stats.local_hits += hit_tokens - tier
        self.stats.requests_hit += hit_tokens > 0

    def after_step(self, req: Request) -> None:
        """Cache what ``req``'s last step made reusable (full blocks, state checkpoints)."""
        if not self.caching:
            return
        hashes = update_block_hashes(req, self.block_size)
        target = self.has_state and self._is_target(req, req.num_computed_tokens)
        tail = (self.has_state and req.num_computed_tokens == tail_len(req)
                and self.connector is not None and wants_tail(req))
        for m in self.managers:
            copies = m.after_step(req.request_id, hashes, req.num_computed_tokens, target)
            if tail and m.wants_checkpoints():  # the prompt tail's state (not in a kernel)
                copies = copies + m.copy_tail(req.request_id)
            for c in copies:
                self._pins.append([self.pool.blocks[b] for b in c.dst])
            self._copies.extend(copies)

    def take_copies(self) -> list[PageCopy]:
        """The queued copies, for this step's message; their pins stay until ``release_pins``."""
        copies, self._copies = self._copies, []
        self._pins_in_flight.append(self._pins)
        self._pins = []
        if self.staging is not None:
            self.staging.step_sent()
        return copies

    def release_pins(self, oldest_only: bool = False) -> None:
        """After the step that carried them ran: unpin the copied pages (``oldest_only``: of
        the oldest message taken, when several are in flight under pipeline parallelism)."""
        done = self._pins_in_flight[:1] if oldest_only else self._pins_in_flight
        for pins in done:
            for blocks in pins:
                self.pool.free(blocks)
        self._pins_in_flight = self._pins_in_flight[len(done):]
        if self.staging is not None:
            self.staging.step_done()

    @property
    def has_pending_copies(self) -> bool:
        """Copies queued for the next step (e.g. a checkpoint saved by a request that ended)."""
        return bool(self._copies or self._swaps
                    or (self.connector is not None and self.connector.has_pending))

    # ------------------------------------------------------------------ preemption
    def attach_swap(self, num_host_blocks: int, mode: str, cost: PreemptionCost) -> None:
        """Enable swap preemption with a host pool of ``num_host_blocks`` rows."""
        self.host = HostPool(num_host_blocks) if num_host_blocks > 0 else None
        self.preemption_mode = mode if self.host is not None else "recompute"
        self.cost = cost

    def _held(self, req_id: str) -> list[list[Block]]:
        return [m.req_blocks.get(req_id, []) for m in self.managers]

    def credit_tokens(self, req: Request) -> int:
        """Tokens a recompute of ``req`` would get back from the prefix cache right now."""
        if not self.caching:
            return 0
        return self._find_hit(req, plan=False) * self.block_size

    def preempt(self, req: Request) -> str:
        """Take ``req``'s blocks back: by swap or recompute, whichever costs less. Returns
        the kind. A recompute keeps nothing but what the prefix cache holds."""
        pages = sum(1 for blocks in self._held(req.request_id) for b in blocks
                    if b is not self.pool.null_block)
        nbytes = pages * self.config.layers_per_group * self.config.page_bytes
        credit = min(self.credit_tokens(req), req.num_computed_tokens)
        kind = "recompute"
        # A swap-out runs before the step's page copies, so it would save this request's pages
        # without a copy queued into them this step (a fork's state, copy-on-write): recompute.
        if self.host is not None and pages <= self.host.num_free \
                and not self._copies_into(req.request_id):
            if self.preemption_mode == "swap":
                kind = "swap"
            elif self.preemption_mode == "auto" and self.cost is not None:
                redo = req.num_computed_tokens - credit
                if self.cost.swap_seconds(nbytes) < self.cost.recompute_seconds(redo):
                    kind = "swap"
        log = self.preempt_log
        log.decisions.append((req.request_id, kind, nbytes, req.num_computed_tokens - credit))
        del log.decisions[:-256]
        if kind == "swap":
            self._swap_out(req, nbytes)
            log.swap += 1
        else:
            log.recompute += 1
            log.recomputed_tokens += req.num_computed_tokens
            log.credited_tokens += credit
            self.free(req)
            req.num_computed_tokens = 0
        # DEBUG: a large family preempts many requests a step; EngineCore logs one INFO
        # summary per step (see ``EngineCore._log_preemptions``).
        logger.debug("preempting %s by %s: %d bytes to move vs %d tokens to recompute (%d "
                    "tokens creditable from the prefix cache)", req.request_id, kind, nbytes,
                    log.decisions[-1][3], credit)
        return kind

    def _swap_out(self, req: Request, nbytes: int) -> None:
        host_lists, ops = swap_out_pages(self.managers, self.pool, self.host, req.request_id)
        self._swaps.extend(ops)
        self.swapped[req.request_id] = SwappedRequest(host_lists, nbytes)
        self.swap_stats.swaps_out += 1
        self.swap_stats.bytes_out += nbytes

    def _swap_in(self, req: Request, num_new_tokens: int) -> bool:
        sw = self.swapped[req.request_id]
        start = req.num_computed_tokens
        ops = swap_in_pages(self.managers, self.pool, self.host, req.request_id, sw.host_blocks,
                            start, start + num_new_tokens, self._copies)
        if ops is None:
            return False
        self._swaps.extend(ops)
        del self.swapped[req.request_id]
        self.swap_stats.swaps_in += 1
        self.swap_stats.bytes_in += sw.num_bytes
        return True

    def take_swaps(self) -> list[SwapOp]:
        swaps, self._swaps = self._swaps, []
        return swaps

    def free(self, req: Request) -> None:
        sw = self.swapped.pop(req.request_id, None)
        if sw is not None:  # finished or aborted while parked on the host
            self.host.free([h for hl in sw.host_blocks for h in hl if h is not None])
        if self._copies:  # copies into this request's pages (fork, CoW, restore) are moot now
            owned = self._owned(req.request_id)
            self._copies = [c for c in self._copies
                            if not any((c.group, b) in owned for b in c.dst)]
        for m in self.managers:
            m.free(req.request_id)
        self._tail.pop(req.request_id, None)
        if self._loading.pop(req.request_id, None) is not None:
            self.connector.cancel_loads(req.request_id)  # its pages go back to the pool now
        if self.connector is not None:
            self.connector.release(req.request_id)
        self._targets.pop(req.request_id, None)
        for h in req.block_hashes:
            if self._inflight.get(h) == req.request_id:
                del self._inflight[h]

    def _owned(self, req_id: str) -> set[tuple[int, int]]:
        return {(m.index, b) for m in self.managers for b in m.block_ids(req_id)}

    def _copies_into(self, req_id: str) -> bool:
        """Whether a queued page copy writes one of ``req_id``'s pages."""
        if not self._copies:
            return False
        owned = self._owned(req_id)
        return any((c.group, b) in owned for c in self._copies for b in c.dst)

    def block_ids(self, req_id: str) -> list[list[int]]:
        return [m.block_ids(req_id) for m in self.managers]

    def min_blocks_for(self, num_tokens: int) -> int:
        """Blocks one fresh request of ``num_tokens`` tokens needs (admission sanity check)."""
        return sum(m.num_blocks_needed("\0probe", 0, num_tokens) for m in self.managers)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def check_whole(self) -> None:
        for m in self.managers:
            assert not m.req_blocks, f"requests still hold blocks: {list(m.req_blocks)[:10]}"
        assert not self._pins and not self._copies and not any(self._pins_in_flight), \
            "page copies still pending"
        assert not any(getattr(m, "pending", None) for m in self.managers), \
            "state captures still pending"
        assert not any(getattr(m, "tail", None) for m in self.managers), \
            "prompt-tail pages outlived their requests"
        assert not self._tail, "planned prompt tails outlived their requests"
        assert not self._inflight, "in-flight prefix promises outlived their requests"
        assert not self.swapped and not self._swaps, "swapped requests or swap copies remain"
        if self.host is not None:
            self.host.check_whole()
        assert not self._loading, "requests still loading pages"
        if self.connector is not None:
            self.connector.check_whole()
        if self.staging is not None:
            self.staging.check_idle()
        self.pool.check_whole()


def _hit_blocks_held(m: GroupManager, hit_blocks: int) -> int:
    """Blocks of a fresh allocation that a hit already provides (attention: the hit blocks)."""
    return 0 if m.wants_checkpoints() else hit_blocks
