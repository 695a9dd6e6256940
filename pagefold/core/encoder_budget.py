"""The vision encoder's share of a step (vLLM's encoder budget).

Each step may start encoding images of at most ``limit`` placeholder tokens in all (the
engine's ``max_num_batched_tokens``): a prefill chunk that would reach an image the budget
cannot take is cut just before that image, which then starts a later step. The first image of
a step is always taken, whatever its size, so an image larger than the budget still runs.

A model whose image tokens attend to each other both ways (Gemma 3: ``MultiModalInputs.
bidirectional``) never gets a chunk that ends strictly inside an image: such a chunk is cut
before the image, and one that starts inside or at the start of an image (after a prefix hit
that ends inside it) waits until the rest of the image fits in one step (the engine refuses
images longer than ``max_num_batched_tokens`` for such models, so it always fits in time).
An image token's keys and values depend on the image's later tokens, which therefore share
its forward; the attention layers mask within the chunk (``AttentionMetadata.image_rows``).

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
        """The chunk length (at most ``n``) from ``start`` whose new images fit the budget and,
        for a bidirectional model, that ends outside every image."""
        left, taken = self.left, self.taken
        for _, f in self._new_images(req, start, n):
            if taken and f.length > left:
                n = max(0, f.offset - start)
                break
            left -= f.length
            taken = True
        inside = req.mm_inputs.cut_inside(start, start + n) if req.mm_inputs else None
        if inside is not None:
            n = max(0, inside.offset - start)
        return n

    def charge(self, req: Request, start: int, n: int) -> None:
        """Count the images a scheduled chunk reaches (call once it is scheduled)."""
        for i, f in list(self._new_images(req, start, n)):
            self.left -= f.length
            self.taken = True
            req.mm_encoded.add(i)
