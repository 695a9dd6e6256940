"""Token-budget scheduler: one currency (tokens this step), running requests first.

Each step emits ``{request_id: num_tokens}``. A request mid-prefill gets a chunk of its prompt
(chunked prefill), a decoding request gets 1 token; both kinds share the step. Admission is gated
by the block pool. When the pool runs dry for a running request, the scheduler preempts by
recompute: the victim is the lowest-priority running request (FCFS: the latest arrival;
priority policy: largest ``(priority, arrival_time)``), it frees everything and goes back to the
front of the waiting queue. The rule is deterministic: the same inputs give the same schedule.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from dataclasses import dataclass, field

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What to run this step. ``num_scheduled`` preserves the order inputs are laid out in."""

    num_scheduled: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished_ids: set[str] = field(default_factory=set)  # freed since the last step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled


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

    def pop(self) -> Request:
        return self._dq.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

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
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = _WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_aborted = 0  # cumulative requests finished as aborted (client gone, stop str)
        self.preemptions_by_kind: dict[str, int] = {}
        self.num_forks = 0

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
        else:
            self.waiting.remove(req)
        req.status = status
        if status == RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        self.kv.free(req)
        self._finished_ids.add(req_id)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = set()
        self.kv.pool.tick += 1
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}

        # 0. Parallel sampling: families whose shared prompt prefix is computed fork now.
        for req in [r for r in self.running if r.ready_to_fork]:
            self._fork(req)

        # 1. Running requests, in order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.paused:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = min(n, self.max_model_len - req.num_computed_tokens)
            n = self.kv.cap_chunk(req, req.num_computed_tokens, n)
            if req.fork_children:  # stop the shared prefill where the family forks
                n = min(n, req.fork_at - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._victim()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                if self.running.index(victim) < i:
                    i -= 1  # (priority policy) an earlier entry leaves: req moves up one slot
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    n = 0
                    break
            if n == 0:
                continue  # req was preempted; running[i] is now the next request
            scheduled[req.request_id] = n
            budget -= n
            i += 1

        # 2. Waiting requests, while budget, seats and blocks last (none if we just preempted).
        # A request whose prefix another request is computing right now waits for that hit.
        if not out.preempted:
            for req in list(self.waiting):
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                if req.paused or self.kv.should_defer(req):
                    continue
                hit = self.kv.find_hit(req)
                start = req.num_computed_tokens + hit * self.kv.block_size
                n = min(req.num_tokens - start, budget)
                n = self.kv.cap_chunk(req, start, n)
                if req.fork_children:
                    n = min(n, req.fork_at - start)
                if not self.kv.allocate_slots(req, n, hit):
                    break
                self.waiting.remove(req)
                self.kv.record_admission(req, hit * self.kv.block_size)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = req.num_computed_tokens
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if n:
                    scheduled[req.request_id] = n
                    budget -= n

        # Layout order: running order (stable across steps -> persistent batch friendly).
        for req in self.running:
            if req.request_id in scheduled:
                out.num_scheduled[req.request_id] = scheduled[req.request_id]
                out.requests.append(req)
        return out
