"""Pipeline parallelism's batch queue: up to P step messages in flight (vLLM's batch queue).

With P stages and one message at a time, each stage idles (P-1)/P of the time: stage 1 waits
for stage 0's hidden states, then stage 0 waits for the engine's next message, which waits for
the last stage's tokens. Here ``step`` submits a message and, while fewer than ``depth`` are in
flight and the scheduler has requests outside them, makes and submits another; then it
collects the oldest and applies it. Stage ``s`` runs message k+1 while stage ``s+1`` runs k:
the hand-offs are point-to-point and every rank runs its messages in order.

Invariants (the scheduler keeps them, ``core/scheduler.py``):

* A request is in at most one in-flight message; it is scheduled again only once that
  message is applied (its tokens and computed length are the scheduler's only then).
* Every message made is submitted, and applied in the order made (the copies' pins are
  released per message, oldest first: ``KVCacheManager.release_pins``).
* Nothing is preempted while a message is in flight (``Scheduler.drain``): the queue is
  emptied first, so the victims are the ones the engine without a pipeline would choose.
* Blocks freed while a message is in flight (an aborted request's) may go to a request of a
  later message: on every rank that message runs after the one in flight, whose result for
  the aborted request is dropped when it is collected.

At P = 1 the engine never builds a queue: its step stays schedule, execute, update.
"""

from __future__ import annotations

import os
from collections import deque

from pagefold.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagefold.core.scheduler import Scheduler

__all__ = ["ENV_IN_FLIGHT", "BatchQueue", "batches_in_flight"]

ENV_IN_FLIGHT = "PAGEFOLD_PP_BATCHES_IN_FLIGHT"


def batches_in_flight(pipeline_parallel_size: int) -> int:
    """How many step messages the engine keeps in flight: one per stage, unless
    ``PAGEFOLD_PP_BATCHES_IN_FLIGHT`` says otherwise (1: the stages run one after another)."""
    text = os.environ.get(ENV_IN_FLIGHT)
    if not text:
        return pipeline_parallel_size
    try:
        depth = int(text)
    except ValueError:
        depth = 0
    if depth < 1:
        raise ValueError(f"{ENV_IN_FLIGHT}={text!r}: give a positive number of step messages")
    return depth


class BatchQueue:
    """The engine's step with up to ``depth`` messages in flight on ``executor`` (a
    ``TPExecutor``: ``submit`` / ``collect``)."""

    def __init__(self, scheduler: Scheduler, executor, depth: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        scheduler.max_in_flight = depth
        self.queue: deque[SchedulerOutput] = deque()
        self.peak = 0  # the most messages with tokens in flight at once (observed)
        self.num_submitted = 0

    def __len__(self) -> int:
        return len(self.queue)

    def _has_more_work(self) -> bool:
        """Whether a schedule now could find a request outside the in-flight messages."""
        s = self.scheduler
        if s.drain:
            return False  # a preemption waits until nothing is in flight
        if any(not r.paused and r.request_id not in s.in_flight for r in s.running):
            return True
        return bool(s.waiting) and len(s.running) + len(s.loading) < s.max_num_seqs

    def step(self) -> list[EngineCoreOutput]:
        """Fill the queue, then collect and apply the oldest message (one per call)."""
        while len(self.queue) < self.depth and (not self.queue or self._has_more_work()):
            out = self.scheduler.schedule()
            self.executor.submit(out)
            self.queue.append(out)
            self.num_submitted += 1
            if not out.has_tokens:
                break  # nothing more until a collect changes the scheduler's state
            self.peak = max(self.peak, sum(1 for o in self.queue if o.has_tokens))
        out = self.queue.popleft()
        return self.scheduler.update_from_output(out, self.executor.collect(out))
