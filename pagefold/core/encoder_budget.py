"""The vision encoder's share of a step (vLLM's encoder budget).

Each step may start encoding images of at most ``limit`` placeholder tokens in all (the
engine's ``max_num_batched_tokens``): a prefill chunk that would reach an image the budget
cannot take is cut just before that image, which then starts a later step. The first image of
a step is always taken, whatever its size, so an image larger than the budget still runs.

An image counts once per request until the request is preempted: the runner keeps a request's
encoder outputs across its chunks (``multimodal.encoder_cache``) and drops them at preemption,
and ``Request.mm_encoded`` mirrors that here.
"""

from __future__ import annotations

from pagefold.request import Request

__all__ = ["EncoderBudget"]


class EncoderBudget:
    def __init__(self, limit: int) -> None:
        self.left = limit
        self.taken = False  # an image was charged this step

    def _new_images(self, req: Request, start: int, n: int):
        mm = req.mm_inputs
        if mm is None:
            return
        for i, f in enumerate(mm.features):
            if f.offset < start + n and start < f.offset + f.length and i not in req.mm_encoded:
                yield i, f

    def cap(self, req: Request, start: int, n: int) -> int:
        """The chunk length (at most ``n``) from ``start`` whose new images fit the budget."""
        left, taken = self.left, self.taken
        for _, f in self._new_images(req, start, n):
            if taken and f.length > left:
                return max(0, f.offset - start)
            left -= f.length
            taken = True
        return n

    def charge(self, req: Request, start: int, n: int) -> None:
        """Count the images a scheduled chunk reaches (call once it is scheduled)."""
        for i, f in list(self._new_images(req, start, n)):
            self.left -= f.length
            self.taken = True
            req.mm_encoded.add(i)
