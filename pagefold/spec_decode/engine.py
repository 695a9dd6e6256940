"""The engine side of speculative decoding: proposing drafts before a step, and counters.

Per step: :meth:`SpecDecoder.propose` leaves drafts for every eligible decoding request in
``Scheduler.spec_token_ids``; the scheduler gives such a request ``1 + k`` tokens (its native
unit stays "n tokens for request X") and puts the drafts it kept in the step message; the
runner runs the verify forward (its verify path, ``spec_decode.verify``) and
``Scheduler.update_from_output`` advances each request by ``1 + accepted`` computed tokens,
appending the accepted drafts and the one sampled token (stopping at the first stop token,
exactly as single-token steps would).

With a draft model or MTP heads the drafts are made in the runner
(``spec_decode.drafting``): the scheduler sends ``k`` placeholders and the runner's proposer
fills them before the verify forward.

Not speculated: requests with structured output, requests driven token by token from outside
(beam search: paused or forked through ``EngineCore.fork_request``), prefill chunks, every
request on steps with at least ``disable_by_batch_size`` running requests, and (models with
state layers, the draft's included) every request on steps that also carry prefill work.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pagefold.core.sched_output import SchedulerOutput, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.drafting import PLACEHOLDER
from pagefold.spec_decode.ngram import ngram_propose

__all__ = ["SpecDecoder", "SpecMetrics"]

logger = logging.getLogger("pagefold")
LOG_INTERVAL_S = 10.0  # the periodic spec-decode log line (while verify steps run)

# With no explicit disable_by_batch_size, speculation stops at this many running requests:
# a verify step costs 1 + k tokens per request, which only pays while decode is memory-bound.
AUTO_DISABLE_BY_BATCH_SIZE = 8


@dataclass(slots=True)
class SpecMetrics:
    """Counters since start-up: verify rounds with drafts, drafted and accepted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify round (accepted drafts + the sampled one)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        return (f"spec decode: {self.num_drafts} rounds, {self.num_draft_tokens} drafted, "
                f"{self.num_accepted_tokens} accepted ({100 * self.acceptance_rate:.1f}%), "
                f"mean accepted length {self.mean_accepted_length:.2f}")


class SpecDecoder:
    """Holds the proposer, the counters and the requests excluded from speculation."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 has_state: bool = False) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # State layers run a verify step token by token for *every* request in it; a prefill
        # chunk sharing that step would lose the chunked kernels, so hybrids draft only on
        # steps without prefill work.
        self.has_state = has_state
        self.metrics = SpecMetrics()
        self.excluded: set[str] = set()
        self.disable_by_batch_size = config.disable_by_batch_size or AUTO_DISABLE_BY_BATCH_SIZE
        # (request, k) -> up to k drafted ids; tests swap in drafters with known acceptance.
        # A draft model or MTP heads draft in the runner: the scheduler sends placeholders.
        self.propose_fn = self._ngram if config.method == "ngram" else self._in_runner
        self._step = 0
        self._last_log = time.monotonic()
        self._backoff: dict[str, tuple[int, int]] = {}  # id -> (no drafts before step, fails)
        self._k: dict[str, int] = {}  # adaptive_k: each request's k for its next round

    def observe(self, out: SchedulerOutput, sampled: dict) -> None:
        """Count a verify step's drafted and accepted tokens and update each request's
        back-off: a round with nothing accepted doubles the number of steps the request then
        decodes without drafts (up to ``MAX_BACKOFF``); any acceptance resets it. So a request
        whose drafts keep failing costs about one wasted verify every ``MAX_BACKOFF`` steps."""
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            logger.info("%s", self.metrics.summary())
        for rid, d in out.spec_token_ids.items():
            v = sampled.get(rid)
            if isinstance(v, VerifiedTokens):
                self.metrics.observe(len(d), v.num_accepted)
                if self.config.adaptive_k:
                    self._k[rid] = self.next_k(len(d), v.num_accepted)
                if v.num_accepted:
                    self._backoff.pop(rid, None)
                else:
                    fails = self._backoff.get(rid, (0, 0))[1] + 1
                    wait = min(1 << fails, self.MAX_BACKOFF)
                    self._backoff[rid] = (self._step + wait, fails)

    def exclude(self, request_id: str) -> None:
        self.excluded.add(request_id)

    def forget(self, request_id: str) -> None:
        self.excluded.discard(request_id)

    MAX_BACKOFF = 16

    def next_k(self, drafted: int, accepted: int) -> int:
        """adaptive_k: after a round that accepted every draft, one more (up to the configured
        k); else one more than were accepted (the drafts past the first rejection were wasted
        verify work). A round accepting nothing also starts the back-off."""
        if accepted >= drafted:
            return min(self.config.num_speculative_tokens, drafted + 1)
        return max(1, accepted + 1)

    def propose(self, scheduler: Scheduler) -> None:
        """Fill ``scheduler.spec_token_ids`` for this step."""
        drafts: dict[str, list[int]] = {}
        scheduler.spec_token_ids = drafts
        self._step += 1
        if len(self.excluded) + len(self._backoff) > 4 * len(scheduler.requests) + 64:
            self.excluded &= scheduler.requests.keys()
            self._backoff = {k: v for k, v in self._backoff.items() if k in scheduler.requests}
            self._k = {k: v for k, v in self._k.items() if k in scheduler.requests}
        running = scheduler.running
        if not running or len(running) >= self.disable_by_batch_size:
            return
        if self.has_state and (scheduler.num_waiting or any(
                r.num_tokens - r.num_computed_tokens > 1 for r in running)):
            return
        c = self.config
        for r in running:
            if (r.paused or r.request_id in self.excluded
                    or r.sampling_params.structured_outputs is not None):
                continue  # (grammar rows are not applied to verify rows)
            wait = self._backoff.get(r.request_id)
            if wait is not None and self._step < wait[0]:
                continue
            if r.num_tokens - r.num_computed_tokens != 1 or not r.output_token_ids:
                continue
            # Never draft past max_tokens or max_model_len: the last emitted token is sampled.
            room = self.max_model_len - r.num_tokens - 1
            mt = r.sampling_params.max_tokens
            if mt is not None:
                room = min(room, mt - r.num_output_tokens - 1)
            k = min(self._k.get(r.request_id, c.num_speculative_tokens), room)
            if k <= 0:
                continue
            d = self.propose_fn(r, k)
            if d:
                drafts[r.request_id] = d

    def _ngram(self, r, k: int) -> list[int]:
        c = self.config
        return ngram_propose(np.asarray(r.all_token_ids, dtype=np.int64), k,
                             c.prompt_lookup_min, c.prompt_lookup_max).tolist()

    @staticmethod
    def _in_runner(r, k: int) -> list[int]:
        return [PLACEHOLDER] * k
