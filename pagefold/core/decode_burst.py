"""Decode bursts: several decode steps of the same batch in one step message.

A batch-1 decode step of a small model is mostly fixed cost: scheduling, applying the result,
output processing and the runner's per-step set-up take several hundred microseconds, as much
as the forward itself (a 7.6M-parameter hybrid: ~1 ms a token, of which ~0.6 ms kernels). When
every running request is decoding and nothing waits, a burst of ``k`` steps is one message:
each request is scheduled for ``k`` tokens (its last token, then the ``k - 1`` tokens it is
about to sample), the runner runs ``k`` one-token forwards, each feeding the tokens it sampled
into the next, and returns every request's ``k`` tokens as one :class:`VerifiedTokens` (all
accepted). The scheduler applies them one by one through the stop rules, as it applies a
speculative step's: a request that stops inside the burst ends there, the tokens after its
stop dropped.

Each forward of a burst is the step the engine would have run alone (the same rows, inputs and
kernels), so a burst changes no token's bits: only when outputs are handed out. What it costs
is latency for everything else: a request that arrives during a burst waits for its end, and
streamed tokens come ``k`` at a time. So :class:`BurstPolicy` sizes bursts by time: ``k`` is
the number of steps that fit ``budget_s`` (the ``decode_burst_ms`` option) at the measured
time of a decode step, at most :data:`MAX_STEPS`. A model whose decode step takes longer than
the budget never bursts; a tiny model's batch-1 steps burst up to the cap.

Where a burst is not taken (the scheduler's and the engine's conditions):

* something waits, loads or is in flight, a request is paused, forks or has sampled nothing yet
  (its first token may carry prompt logprobs), or a request is mid-prompt;
* structured output (its grammar advances between tokens in the scheduler), speculative
  decoding, pipeline or tensor parallelism, or a KV connector (the engine sets no budget);
* a state-keeping model with prefix caching: a burst ends on the next block boundary, where a
  state checkpoint is due (``KVCacheManager.cap_spec_chunk``, as a verify step does), so no
  checkpoint falls strictly inside it;
* the pool cannot hold every request's ``k`` tokens without preempting.
"""

from __future__ import annotations

from dataclasses import dataclass

# Most steps in one burst: past ~16 the fixed cost saved per token is within noise.
MAX_STEPS = 16
# Weight of the newest decode step in the running mean of a step's time.
_SMOOTHING = 0.25


@dataclass(slots=True)
class BurstPolicy:
    """How many decode steps the next message may hold, from the measured time of a step.

    ``budget_s`` 0 turns bursts off (``limit`` stays 1). Invariant: ``1 <= limit <=
    max_steps``; ``limit`` is 1 until a decode step has been measured."""

    budget_s: float = 0.0
    max_steps: int = MAX_STEPS
    step_s: float | None = None  # running mean of one decode step's seconds
    limit: int = 1

    def observe(self, num_scheduled: dict[str, int], burst: bool, seconds: float) -> None:
        """Account a step that took ``seconds``: an all-decode step (every request one token)
        or a burst (``burst``: the most steps any request took). Other steps (prefill
        chunks, verify steps, idle ones) say nothing about a decode step's time."""
        if self.budget_s <= 0 or not num_scheduled:
            return
        counts = num_scheduled.values()
        if burst:
            per_step = seconds / max(counts)
        elif all(c == 1 for c in counts):
            per_step = seconds
        else:
            return
        self.step_s = (per_step if self.step_s is None
                       else self.step_s + _SMOOTHING * (per_step - self.step_s))
        fits = int(self.budget_s / self.step_s) if self.step_s > 0 else self.max_steps
        self.limit = max(1, min(self.max_steps, fits))

    def steps(self, running: list, kv, max_model_len: int, token_budget: int) -> int:
        """The steps of a burst over ``running`` (every one of them decoding: one token to
        compute, at least one sampled), or 1 for a plain step. Capped by each request's
        ``max_tokens`` left and room to ``max_model_len``, the step's token budget, the next
        state checkpoint (``kv.cap_spec_chunk``) and the pool's free blocks (no preemption
        for a burst). The caller has checked the scheduler-wide conditions (see the module
        docstring)."""
        k = self.limit
        if k < 2 or not running:
            return 1
        k = min(k, token_budget // len(running))
        for r in running:
            if (r.paused or r.fork_children or not r.output_token_ids
                    or r.num_tokens - r.num_computed_tokens != 1):
                return 1
            left = r.sampling_params.max_tokens
            if left is not None:
                k = min(k, left - len(r.output_token_ids))
            k = min(k, max_model_len - r.num_computed_tokens)
            if k >= 2:
                k = kv.cap_spec_chunk(r, k)
            if k < 2:
                return 1
        if sum(kv.blocks_needed(r, k) for r in running) > kv.pool.num_free:
            return 1
        return k
