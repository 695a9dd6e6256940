"""Gemma 3 with images (Gemma3ForConditionalGeneration) against transformers, float32 greedy.

The tiny checkpoint (``pagefold.testing.tiny_vl_models.build_tiny_gemma3_vl``) has a 2-layer
SigLIP tower; every image becomes 16 soft tokens, which attend to each other both ways, and
its text layers slide over 11 keys (fewer than an image's tokens). The reference is
transformers' own model: the prompt's ``<start_of_image>`` expanded here to ``"\\n\\n"
<start_of_image> <image_soft_token> x 16 <end_of_image> "\\n\\n"`` (each ``"\\n\\n"``
tokenized alone, as vLLM expands it), ``generate`` with ``pixel_values`` and
``token_type_ids`` (the bidirectional image mask).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_vl_models import GEMMA3_IMAGE_PROCESSOR, build_tiny_gemma3_vl

N_NEW = 6
MAX_MODEL_LEN = 128
BOI = "<start_of_image>"
TOKENS_PER_IMAGE = 16


def _image(seed: int, h: int, w: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


IMG_A, IMG_B, IMG_C, IMG_D = _image(1, 32, 32), _image(2, 24, 40), _image(3, 40, 24), \
    _image(4, 32, 32)

# (text before, text after, images): one image, another, two images, text only.
CASES = [
    ("import os\ndef f(", "):\n    return os.path", [IMG_A]),
    ("class A:\n", "    def run(self):", [IMG_B]),
    ("x = ", " + " + BOI + " - 1", [IMG_A, IMG_C]),
    ("for i in range(10):\n    print(", ")", []),
]


def _prompt(before: str, after: str, images: list) -> str:
    return before + (BOI if images else "") + after


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))


def make_reference(model_dir: Path):
    """(text before, text after, images) -> transformers' greedy tokens and their logprobs,
    and the expanded prompt ids (cached)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = Gemma3ImageProcessorPil(
        **{k: v for k, v in GEMMA3_IMAGE_PROCESSOR.items() if k != "image_processor_type"})
    cfg = hf.config
    newlines = tok.encode("\n\n", add_special_tokens=False)
    image = ([*newlines, cfg.boi_token_index] + [cfg.image_token_index] * TOKENS_PER_IMAGE
             + [cfg.eoi_token_index, *newlines])
    cache: dict = {}

    def run(before: str, after: str, images: list):
        key = (before, after, tuple(id(i) for i in images))
        if key in cache:
            return cache[key]
        ids = [x for t in tok.encode(_prompt(before, after, images))
               for x in (image if t == cfg.boi_token_index else [t])]
        inp = torch.tensor([ids])
        kw = {"token_type_ids": (inp == cfg.image_token_index).long()}
        if images:
            kw["pixel_values"] = torch.from_numpy(
                proc(images=images, return_tensors="np")["pixel_values"])
        with torch.no_grad():
            out = hf.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                              max_new_tokens=N_NEW, do_sample=False, eos_token_id=[10**6],
                              pad_token_id=0, **kw)
            new = out[0, len(ids):]
            kw["token_type_ids"] = (out == cfg.image_token_index).long()
            logits = hf(input_ids=out, **kw).logits  # the chosen tokens' logprobs, one pass
            lp = torch.log_softmax(logits[0, len(ids) - 1:-1].float(), -1)
        cache[key] = ids, new.tolist(), lp.gather(1, new[:, None])[:, 0].tolist()
        return cache[key]

    run.hf, run.proc = hf, proc
    return run


@pytest.fixture(scope="module")
def reference(vl_dir):
    return make_reference(vl_dir)


def _request(before: str, after: str, images: list) -> dict:
    req = {"prompt": _prompt(before, after, images)}
    if images:
        req["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return req


PARAMS = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)


def _check(out, ref) -> None:
    """Tokens equal; each chosen token's logprob within 1e-4 of transformers' (an image, or
    its bidirectional mask, moves them by more than 1e-2: ``test_image_is_seen_both_ways``)."""
    ids, tokens, lps = ref
    assert list(out.token_ids) == tokens
    got = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(lps, abs=1e-4)


def _llm(vl_dir: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    return LLM(str(vl_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, warm_up=False, **kw)


@pytest.mark.parametrize("engine_kw", [
    {},  # whole prompts in one step, batched
    {"kv_cache_memory": 180_000, "max_num_batched_tokens": 19},  # chunks of 19, preemption
], ids=["batched", "preempt"])
def test_images_equal_transformers(vl_dir, reference, engine_kw) -> None:
    """Single, batched, two-image and text-only requests give transformers' prompt ids,
    tokens and logprobs; every image is encoded once per (re)computation."""
    # Preemption needs more requests than the pool holds at once.
    cases = CASES + [(b + "#", a, imgs) for b, a, imgs in CASES] if engine_kw else CASES
    llm = _llm(vl_dir, **engine_kw)
    outs = llm.generate([_request(*c) for c in cases], PARAMS, use_tqdm=False)
    for o, c in zip(outs, cases):
        ref = reference(*c)
        assert o.prompt_token_ids == ref[0]
        _check(o.outputs[0], ref)
    encoded, images = llm.engine.runner.encoders.num_encoded, sum(len(c[2]) for c in cases)
    if engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0 and encoded >= images
    else:
        assert encoded == images
    llm.engine.kv.check_whole()


def test_image_is_seen_both_ways(vl_dir, reference) -> None:
    """Guards the comparison: another image at the same place moves the logprobs far beyond
    its tolerance, and so does a causal mask over the image (transformers without
    ``token_type_ids``), so neither an ignored encoder nor a lost bidirectional mask passes."""
    before, after, _ = CASES[0]
    ids, tokens, lps = reference(before, after, [IMG_A])
    assert max(abs(x - y) for x, y in zip(lps, reference(before, after, [IMG_D])[2])) > 1e-2
    llm = _llm(vl_dir)
    out, = llm.generate(_request(before, after, [IMG_A]),
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    pixels = torch.from_numpy(reference.proc(images=[IMG_A], return_tensors="np")
                              ["pixel_values"])
    inp = torch.tensor([ids])
    with torch.no_grad():  # no token_type_ids: transformers' causal mask over the image
        logits = reference.hf(input_ids=inp, pixel_values=pixels).logits[0]
    causal = torch.log_softmax(logits.float(), -1)[:-1].gather(1, inp[0, 1:, None])[:, 0]
    mine = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(mine, causal.tolist())) > 1e-2


def test_chunks_never_end_inside_an_image(vl_dir, reference) -> None:
    """With 16 tokens a step the first chunk would end inside the image: it stops right
    before the image's soft tokens, the next chunk is the whole image (16 rows: on the CPU
    they attend as decode rows, then the image rows are redone both ways), and the tokens
    equal transformers'. An image above the step budget is refused naming it."""
    llm = _llm(vl_dir, max_num_batched_tokens=16)
    case = CASES[0]
    rid = llm.add_request(_request(*case), PARAMS)
    req = llm.engine.scheduler.requests[rid]
    image = req.mm_inputs.features[0]
    assert image.offset < 16 < image.offset + image.length
    outs = llm.step()
    assert req.num_computed_tokens == image.offset
    outs += llm.step()
    assert req.num_computed_tokens == image.offset + image.length
    while llm.engine.has_unfinished():
        outs += llm.step()
    _check([o for o in outs if o.finished][0].outputs[0], reference(*case))
    small = _llm(vl_dir, max_num_batched_tokens=15)
    with pytest.raises(ValueError, match="16 tokens, above max_num_batched_tokens 15"):
        small.generate(_request(*case), PARAMS, use_tqdm=False)


def test_prefix_cache_keys_on_the_image(vl_dir, reference) -> None:
    """The same image again hits past its tokens (no second encoder run) and still equals
    transformers; a different image at the same place never shares a block; a hit that ends
    inside an image resumes there (the rest of the image in one chunk) and is exact."""
    llm = _llm(vl_dir)
    before, after = "y = ", " * 2\nprint(y, y, y, y, y, y, y, y)"
    first, = llm.generate(_request(before, after, [IMG_A]), PARAMS, use_tqdm=False)
    enc = llm.engine.runner.encoders
    same, = llm.generate(_request(before, after, [IMG_A]), PARAMS, use_tqdm=False)
    image = llm.engine.hf_config.image_token_index
    ids = first.prompt_token_ids
    image_end = len(ids) - ids[::-1].index(image)
    assert same.num_cached_tokens >= image_end and enc.num_encoded == 1
    _check(same.outputs[0], reference(before, after, [IMG_A]))
    other, = llm.generate(_request(before, after, [IMG_D]), PARAMS, use_tqdm=False)
    assert other.num_cached_tokens <= ids.index(image)
    assert enc.num_encoded == 2
    _check(other.outputs[0], reference(before, after, [IMG_D]))
    inside = (before, " - 1\nreturn [y for y in range(3)]", [IMG_A])
    out, = llm.generate(_request(*inside), PARAMS, use_tqdm=False)
    assert ids.index(image) < out.num_cached_tokens == 16 < image_end
    _check(out.outputs[0], reference(*inside))
    llm.engine.kv.check_whole()
