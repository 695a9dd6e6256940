"""The vision encoder's share of a step (``core/encoder_budget.py``), without a model: where a
chunk is cut for the images it reaches, worked out by hand from the documented rule (each
step encodes images of at most ``limit`` placeholder tokens, its first image whatever its
size; a bidirectional model's chunk never ends strictly inside an image)."""

from __future__ import annotations

import pytest

from pagefold.core.encoder_budget import EncoderBudget
from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams


def _req(spans: list[tuple[int, int]], bidirectional: bool = False, rid: str = "r"
         ) -> Request:
    feats = [ImageFeature(off, n, f"img{i}", b"", [0], [1, 1, 1])
             for i, (off, n) in enumerate(spans)]
    return Request(rid, list(range(64)), SamplingParams(max_tokens=1),
                   mm_inputs=MultiModalInputs(feats, bidirectional=bidirectional))


@pytest.mark.parametrize("limit, start, n, want", [
    (24, 0, 40, 20),  # images at 4 (16) and 20 (16): 16 + 16 > 24, cut before the second
    (32, 0, 40, 40),  # both fit exactly
    (8, 0, 40, 20),  # the first image of a step is taken whatever its size
    (24, 0, 20, 20),  # the chunk ends right before the second image: nothing to cut
    (24, 0, 21, 20),  # one token into the second image: cut
    (24, 10, 30, 10),  # starts inside the first (not encoded yet): both new, cut at 20
    (24, 36, 10, 10),  # past both images
    (0, 0, 3, 3),  # no image in the chunk: no budget needed
    (16, 20, 16, 16),  # image 0 ends where the chunk starts: only image 1 (16) is new
])
def test_a_chunk_is_cut_before_the_image_the_budget_cannot_take(limit, start, n, want):
    assert EncoderBudget(limit).cap(_req([(4, 16), (20, 16)]), start, n) == want


def test_charged_images_count_once_per_request_and_use_up_the_step():
    b = EncoderBudget(24)
    r = _req([(4, 16), (20, 16)])
    assert b.cap(r, 0, 12) == 12
    b.charge(r, 0, 12)  # image 0 (16 tokens): 8 left
    assert (b.left, b.taken, r.mm_encoded) == (8, True, {0})
    # r's next chunk starts inside image 0 (encoded: free); image 1 (16) does not fit in 8
    assert b.cap(r, 12, 20) == 8
    assert b.cap(r, 20, 16) == 0  # starts at image 1, which does not fit: waits
    # another request in the same step: its image 0 (4) fits in 8, its image 1 (8) not in 4
    assert b.cap(_req([(0, 4), (4, 8)], rid="o"), 0, 20) == 4
    b3 = EncoderBudget(24)
    b3.charge(r, 0, 20)  # ends right before image 1: not charged
    assert (b3.left, r.mm_encoded) == (24, {0})
    b2 = EncoderBudget(24)  # the next step: only image 1 is new
    b2.charge(r, 0, 40)
    assert (b2.left, r.mm_encoded) == (8, {0, 1})
    assert b2.cap(r, 0, 40) == 40  # encoded images cost nothing again


def test_a_bidirectional_chunk_never_ends_inside_an_image():
    r = _req([(4, 16), (20, 16)], bidirectional=True)
    b = EncoderBudget(100)
    assert b.cap(r, 0, 10) == 4  # would end inside image 0: cut before it
    assert b.cap(r, 0, 20) == 20  # ends at image 0's end
    assert b.cap(r, 4, 10) == 0  # starts at the image: waits for the whole image
    assert b.cap(r, 0, 30) == 20  # ends inside image 1
    assert EncoderBudget(100).cap(_req([(4, 16)]), 0, 10) == 10  # causal: no cut
