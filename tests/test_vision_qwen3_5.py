"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration) against transformers, float32 greedy.

The tiny checkpoint (``pagefold.testing.tiny_vl_models``) has a 2-block vision tower; images of
24..32 pixels become 12..16 placeholder tokens. The reference is transformers' own model on
the same pixels: the image processor built from the checkpoint's preprocessor settings, the
placeholders expanded here, ``generate`` with ``pixel_values`` / ``image_grid_thw`` /
``mm_token_type_ids`` (M-RoPE from transformers' ``get_rope_index``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_vl_models import IMAGE_PROCESSOR, build_tiny_qwen3_5_vl, image_prompt

N_NEW = 6
MAX_MODEL_LEN = 96


def _image(seed: int, h: int, w: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


IMG_A, IMG_B, IMG_C = _image(1, 32, 32), _image(2, 24, 32), _image(3, 32, 24)
IMG_D = _image(4, 32, 32)

# (text before, text after, images): one image, another image, two images, text only.
CASES = [
    ("import os\ndef f(", "):\n    return os.path", [IMG_A]),
    ("class A:\n", "    def run(self):", [IMG_B]),
    ("x = ", " + ", [IMG_A, IMG_C]),
    ("for i in range(10):\n    print(", ")", []),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def reference(vl_dir):
    return make_reference(vl_dir)


def make_reference(vl_dir: Path):
    """(text before, text after, images) -> transformers' greedy tokens and their logprobs
    (cached)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        vl_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(vl_dir)
    proc = Qwen2VLImageProcessorPil(
        **{k: v for k, v in IMAGE_PROCESSOR.items() if k != "image_processor_type"})
    image_id = hf.config.image_token_id
    vocab = hf.config.text_config.vocab_size
    cache: dict = {}

    def run(before: str, after: str, images: list) -> tuple[list[int], list[float]]:
        key = (before, after, tuple(id(i) for i in images))
        if key in cache:
            return cache[key]
        ids = tok.encode(image_prompt(before, after, len(images)))
        kw = {}
        if images:
            px = proc(images=images, return_tensors="pt")
            sizes = iter((px["image_grid_thw"].prod(-1) // 4).tolist())
            ids = [x for t in ids for x in ([image_id] * next(sizes) if t == image_id else [t])]
            kw = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        inp = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                              mm_token_type_ids=(inp == image_id).int(), max_new_tokens=N_NEW,
                              do_sample=False, eos_token_id=[vocab], pad_token_id=0, **kw)
            new = out[0, len(ids):]
            # The chosen tokens' logprobs, teacher-forced in one pass.
            hf.model.rope_deltas = None
            logits = hf(input_ids=out, mm_token_type_ids=(out == image_id).int(), **kw).logits
            lp = torch.log_softmax(logits[0, len(ids) - 1:-1].float(), -1)
        cache[key] = new.tolist(), lp.gather(1, new[:, None])[:, 0].tolist()
        return cache[key]

    return run


def _request(before: str, after: str, images: list) -> dict:
    req = {"prompt": image_prompt(before, after, len(images))}
    if images:
        req["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return req


PARAMS = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)


def _check(out, ref: tuple[list[int], list[float]]) -> None:
    """Tokens equal; each chosen token's logprob within 1e-4 of transformers' (the logprobs
    see the image even where this tiny model's greedy tokens do not)."""
    tokens, lps = ref
    assert list(out.token_ids) == tokens
    got = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(lps, abs=1e-4)


def _llm(vl_dir: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    return LLM(str(vl_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, warm_up=False, **kw)


@pytest.mark.parametrize("engine_kw", [
    {},  # whole prompts in one step, batched
    {"max_num_batched_tokens": 7},  # odd chunks cut through the image tokens
    {"kv_cache_memory": 16 * 8192, "max_num_batched_tokens": 19},  # preemption
], ids=["batched", "chunk7", "preempt"])
def test_images_equal_transformers(vl_dir, reference, engine_kw) -> None:
    """Single, batched, two-image and text-only requests through the VL checkpoint give
    transformers' tokens; every image is encoded once per (re)computation."""
    cases = CASES + [(b + "#", a, imgs) for b, a, imgs in CASES]  # 8 requests
    llm = _llm(vl_dir, **engine_kw)
    outs = llm.generate([_request(*c) for c in cases], PARAMS, use_tqdm=False)
    for o, c in zip(outs, cases):
        _check(o.outputs[0], reference(*c))
    n_images = sum(len(c[2]) for c in cases)
    encoded = llm.engine.runner.encoders.num_encoded
    if "kv_cache_memory" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
        assert encoded >= n_images
    else:
        assert encoded == n_images  # once per image, across chunks
    llm.engine.kv.check_whole()


def test_image_changes_the_output(vl_dir, reference) -> None:
    """The image is seen: two same-sized images in the same prompt give logprobs apart by
    far more than the comparison's tolerance (guards it against an ignored encoder)."""
    before, after, _ = CASES[0]
    a, b = reference(before, after, [IMG_A])[1], reference(before, after, [IMG_D])[1]
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-2


def test_prefix_cache_keys_on_the_image(vl_dir, reference) -> None:
    """The same image again hits past its tokens (no second encoder run) and still equals
    transformers; a different image at the same place never shares a block."""
    llm = _llm(vl_dir, state_checkpoint_interval=16)
    before, after = "y = ", " * 2\nprint(y, y, y, y, y, y, y, y)"
    first, = llm.generate(_request(before, after, [IMG_A]), PARAMS, use_tqdm=False)
    enc = llm.engine.runner.encoders
    n = enc.num_encoded
    same, = llm.generate(_request(before, after, [IMG_A]), PARAMS, use_tqdm=False)
    image_end = first.prompt_token_ids.index(llm.engine.hf_config.vision_end_token_id)
    assert same.num_cached_tokens > image_end
    assert enc.num_encoded == n  # the hit covered the whole image
    _check(same.outputs[0], reference(before, after, [IMG_A]))
    other, = llm.generate(_request(before, after, [IMG_D]), PARAMS, use_tqdm=False)
    image_start = other.prompt_token_ids.index(llm.engine.hf_config.image_token_id)
    assert other.num_cached_tokens <= image_start
    assert enc.num_encoded == n + 1
    _check(other.outputs[0], reference(before, after, [IMG_D]))
    llm.engine.kv.check_whole()


def test_bad_image_inputs_are_named(vl_dir) -> None:
    llm = _llm(vl_dir, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(_request("a", "b", [IMG_A, IMG_B]), PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        llm.generate({"prompt": image_prompt("a", "b", 2),
                      "multi_modal_data": {"image": IMG_A}}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="not a PIL.Image"):
        llm.generate({"prompt": image_prompt("a", "b", 1),
                      "multi_modal_data": {"image": b"\x89PNG"}}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="only an 'image' entry"):
        llm.generate({"prompt": "a", "multi_modal_data": {"video": IMG_A}}, PARAMS,
                      use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_encoder_budget_cuts_before_an_image(vl_dir, reference) -> None:
    """With 24 tokens a step, the first chunk reaches both 16-token images; the encoder budget
    (24) takes the first only, so the chunk ends right before the second image."""
    llm = _llm(vl_dir, max_num_batched_tokens=24)
    case = ("x = ", " + ", [IMG_A, IMG_D])
    rid = llm.add_request(_request(*case), PARAMS)
    req = llm.engine.scheduler.requests[rid]
    second = req.mm_inputs.features[1].offset
    assert second < 24  # the token budget alone would reach into the second image
    outs = llm.step()
    assert llm.engine.runner.encoders.num_encoded == 1
    assert req.num_computed_tokens == second
    while llm.engine.has_unfinished():
        outs += llm.step()
    _check([o for o in outs if o.finished][0].outputs[0], reference(*case))


def test_image_urls_are_data_urls_only() -> None:
    import base64
    import io

    from pagefold.multimodal.processor import decode_image_url

    buf = io.BytesIO()
    IMG_B.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert np.array_equal(np.asarray(decode_image_url(url)), np.asarray(IMG_B))
    for bad, match in [("https://x/a.png", "no network"),
                       ("file:///etc/passwd", "allowed-local-media-path"),
                       ("/etc/passwd", "data:image"), ("data:text/plain;base64,AA==",
                                                       "data:image"),
                       ("data:image/png;base64,AAAA", "malformed image")]:
        with pytest.raises(ValueError, match=match):
            decode_image_url(bad)


def test_file_urls_only_under_the_allowed_local_media_path(tmp_path) -> None:
    """vLLM's --allowed-local-media-path: a file:// image under the directory is read (the same
    pixels as the file), one outside it (also through a symlink inside it), a missing file or
    one on another host is refused naming why; without the option every file URL is."""
    import os

    from pagefold.config import EngineConfig
    from pagefold.multimodal.processor import decode_image_url

    root, outside = tmp_path / "media", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    IMG_B.save(root / "b.png")
    IMG_A.save(outside / "a.png")
    os.symlink(outside / "a.png", root / "link.png")
    got = decode_image_url(f"file://{root / 'b.png'}", str(root))
    assert np.array_equal(np.asarray(got), np.asarray(IMG_B))
    assert np.array_equal(np.asarray(decode_image_url(f"file://{root}/sub/../b.png", str(root))),
                          np.asarray(IMG_B))
    for url, match in [(f"file://{outside / 'a.png'}", "outside --allowed-local-media-path"),
                       (f"file://{root / 'link.png'}", "outside --allowed-local-media-path"),
                       (f"file://{root}/../private/a.png", "outside"),
                       (f"file://{root / 'none.png'}", "no image file"),
                       (f"file://otherhost{root / 'b.png'}", "names a host")]:
        with pytest.raises(ValueError, match=match):
            decode_image_url(url, str(root))
    with pytest.raises(ValueError, match="allowed-local-media-path DIR"):
        decode_image_url(f"file://{root / 'b.png'}")
    with pytest.raises(ValueError, match="is not a directory"):
        EngineConfig(model=str(tmp_path), allowed_local_media_path=str(root / "b.png"))


def test_chat_reads_a_file_url_under_the_allowed_path(vl_dir, tmp_path) -> None:
    """``LLM.chat`` with a file:// image under allowed_local_media_path gives the tokens of the
    same image sent as a data URL."""
    import base64
    import io

    IMG_A.save(tmp_path / "a.png")
    buf = io.BytesIO()
    IMG_A.save(buf, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(vl_dir, allowed_local_media_path=str(tmp_path))

    def chat(url: str) -> list[int]:
        msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "what is it"}]}]
        return llm.chat(msg, PARAMS)[0].outputs[0].token_ids

    assert chat(f"file://{tmp_path / 'a.png'}") == chat(data)
    with pytest.raises(ValueError, match="outside"):
        chat(f"file://{vl_dir}/config.json")


def test_prefix_hit_inside_an_image(vl_dir, reference) -> None:
    """A hit that ends inside an image (block 0 holds its first tokens): the rest of the image
    is encoded again and its rows are the encoder's tail; tokens equal transformers'."""
    llm = _llm(vl_dir, state_checkpoint_interval=16)
    before = "y = "
    llm.generate(_request(before, " * 2\nprint(y, y, y, y, y)", [IMG_A]), PARAMS,
                 use_tqdm=False)
    other = (before, " - 1\nreturn [y for y in range(3)]", [IMG_A])
    out, = llm.generate(_request(*other), PARAMS, use_tqdm=False)
    ids = out.prompt_token_ids
    image_id = llm.engine.hf_config.image_token_id
    first, last = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
    assert first < out.num_cached_tokens == 16 < last
    assert llm.engine.runner.encoders.num_encoded == 2
    _check(out.outputs[0], reference(*other))


def test_parallel_sampling_with_an_image(vl_dir, reference) -> None:
    """n = 2 greedy: the family shares the image prefill and both children give
    transformers' tokens."""
    llm = _llm(vl_dir)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=0, n=2)
    out, = llm.generate(_request(*CASES[1]), params, use_tqdm=False)
    assert len(out.outputs) == 2
    for comp in out.outputs:
        _check(comp, reference(*CASES[1]))
    assert llm.engine.runner.encoders.num_encoded == 1
    llm.engine.kv.check_whole()


def test_chat_with_an_image_url(vl_dir, reference) -> None:
    """``LLM.chat`` takes ``image_url`` parts (data URLs) as the server does."""
    import base64
    import io

    buf = io.BytesIO()
    IMG_B.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(vl_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    out, = llm.chat(msgs, PARAMS, use_tqdm=False)
    case = ("<|im_start|>user\nWhat?\n", "<|im_end|>\n<|im_start|>assistant\n", [IMG_B])
    _check(out.outputs[0], reference(*case))
