"""Engine-side matcher state of structured-output requests.

Invariants:

* a request with ``sampling_params.structured_outputs`` has its constraint compiled when it
  is added (:meth:`StructuredOutputManager.check`), so a bad constraint rejects the request
  before anything is queued; the engine-core process calls :meth:`check` in a worker thread
  before ``add_request`` (:meth:`is_compiled` says whether it must), so compiling never runs
  on the step loop -- :meth:`check` and :meth:`is_compiled` are thread-safe, everything else
  runs on the loop's thread;
* its matcher is created on first use and fed every output token the request already has,
  so children of a parallel-sampling family, forked beams and preempted requests all get the
  right state without any hand-over (the matcher depends on the output tokens only);
* :meth:`accept` advances the matcher with each token appended to the request; a token the
  matcher refuses (impossible when the bitmask was applied) is reported, never ignored;
* :meth:`rollback` undoes the last ``n`` accepted tokens (speculative decoding: rejected
  drafts), up to ``max_rollback_tokens``;
* :meth:`free` drops the matcher when the request leaves the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from pagefold.structured_output.backend import GrammarCompiler

logger = logging.getLogger("pagefold")


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *,
                        use_xgrammar: bool = True) -> torch.Tensor:
    """Set ``logits[i, t] = -inf`` where bit ``t`` of row ``i`` of the packed int32 ``bitmask``
    ``(B, ceil(V / 32))`` is 0 (in place; returns ``logits``). On the CPU xgrammar's kernel
    (about 3x faster); elsewhere, or with ``use_xgrammar=False``, pure torch."""
    if use_xgrammar and logits.device.type == "cpu" and logits.dtype == torch.float32 \
            and logits.is_contiguous():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous())
        return logits
    b, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(b, -1)[:, :v].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


class StructuredOutputManager:
    """One per EngineCore. ``tokenizer_loader`` is called once, on the first structured
    request (the core otherwise never needs a tokenizer)."""

    def __init__(self, tokenizer_loader, vocab_size: int, stop_token_ids: list[int],
                 max_rollback_tokens: int = 16) -> None:
        self._loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_rollback_tokens = max_rollback_tokens
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, object] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            with self._compiler_lock:  # the first structured request may come from a thread
                if self._compiler is None:
                    self._compiler = GrammarCompiler(self._loader(), self.vocab_size,
                                                     self.stop_token_ids)
        return self._compiler

    # ------------------------------------------------------------------ lifecycle
    def check(self, params) -> None:
        """Compile (or find cached) the request's constraint; ValueError when impossible.
        Also builds what the first step of the request needs (the JSON control-character
        mask), so nothing slow is left for the step loop."""
        so = params.structured_outputs
        if so is not None:
            self.compiler.compile(so)
            kind, _, compact = so.key()
            if compact and kind in ("json", "json_object"):
                self.compiler.json_safe_mask()

    def is_compiled(self, so) -> bool:
        """Whether ``so``'s grammar is cached (adding its request costs no compile)."""
        return self._compiler is not None and self._compiler.is_cached(so)

    def _matcher(self, req):
        m = self._matchers.get(req.request_id)
        if m is None:
            import xgrammar as xgr

            sp = req.sampling_params
            stops = sorted(sp.all_stop_token_ids(req.eos_token_id) | set(self.stop_token_ids))
            m = xgr.GrammarMatcher(self.compiler.compile(sp.structured_outputs),
                                   override_stop_tokens=stops or None,
                                   max_rollback_tokens=self.max_rollback_tokens)
            for t in req.output_token_ids:  # a child, a fork or a resumed request
                if not m.accept_token(t):
                    logger.warning("request %s: output token %d breaks its grammar",
                                   req.request_id, t)
                    break
            self._matchers[req.request_id] = m
        return m

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def retain(self, live) -> None:
        """Drop the matchers of requests no longer in ``live`` (finished, aborted)."""
        for rid in [r for r in self._matchers if r not in live]:
            del self._matchers[rid]

    @staticmethod
    def num_constrained(requests: dict) -> int:
        return sum(1 for r in requests.values() if r.sampling_params.structured_outputs)

    def step_bitmask(self, requests: dict, num_scheduled: dict[str, int]) -> dict[str, bytes]:
        """Per constrained request that samples this step (its scheduled tokens reach its
        last token), its allowed-token row as little-endian int32 bytes."""
        reqs = [requests[rid] for rid, n in num_scheduled.items()
                if requests[rid].sampling_params.structured_outputs
                and requests[rid].num_computed_tokens + n >= requests[rid].num_tokens]
        if not reqs:
            return {}
        mask = self.bitmask(reqs, self.vocab_size)
        return {r.request_id: mask[i].numpy().astype("<i4").tobytes()
                for i, r in enumerate(reqs)}

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    # ------------------------------------------------------------------ per step
    def bitmask(self, reqs: Sequence, vocab_size: int) -> torch.Tensor | None:
        """Packed allowed-token bitmask ``(len(reqs), ceil(V/32))`` int32 for one sampling
        step, or None when no request is constrained (the sampler then skips the stage).
        Unconstrained rows allow everything."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs]
        if not rows:
            return None
        mask = torch.full((len(reqs), bitmask_width(vocab_size)), -1, dtype=torch.int32)
        for i in rows:
            m = self._matcher(reqs[i])
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
                kind, _, compact = reqs[i].sampling_params.structured_outputs.key()
                if compact and kind in ("json", "json_object"):
                    mask[i] &= self.compiler.json_safe_mask()
            else:  # finished grammar: only a stop token may follow
                mask[i].zero_()
                for t in self.stop_token_ids + [reqs[i].eos_token_id]:
                    if t is not None and t < vocab_size:
                        mask[i, t // 32] |= 1 << (t % 32)
        return mask

    def accept(self, req, token: int) -> bool:
        """Advance ``req``'s matcher with a token appended to it; False if refused. A
        matcher created now replays the request's output, which already holds ``token``."""
        if req.sampling_params.structured_outputs is None:
            return True
        if req.request_id not in self._matchers:
            self._matcher(req)
            return True
        m = self._matcher(req)
        if m.is_terminated():
            return token in self.stop_token_ids or token == req.eos_token_id
        ok = m.accept_token(token)
        if not ok:
            logger.warning("request %s: token %d refused by its grammar", req.request_id, token)
        return ok

    # ------------------------------------------------------------------ speculative decoding
    def accept_prefix(self, req, tokens: Sequence[int]) -> int:
        """Accept draft tokens in order while the grammar allows them; returns how many
        were accepted (the rest must be rejected; call :meth:`rollback` to undo them all)."""
        if req.sampling_params.structured_outputs is None:
            return len(tokens)
        m = self._matcher(req)
        n = 0
        for t in tokens:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        return n

    def rollback(self, req, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most ``max_rollback_tokens``)."""
        if num_tokens <= 0 or req.sampling_params.structured_outputs is None:
            return
        if num_tokens > self.max_rollback_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens (max "
                             f"{self.max_rollback_tokens})")
        self._matcher(req).rollback(num_tokens)
