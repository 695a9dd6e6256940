"""Images through ``pagefold serve`` with the ``openai`` client: a chat ``image_url`` part
carrying a data URL gives the tokens ``LLM.generate`` gives for the same image, and bad image
parts are 400s naming the problem (the server keeps serving)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
from PIL import Image
from test_server import KEY, MODEL, Server

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_vl_models import build_tiny_qwen3_5_vl, image_prompt

N_NEW = 5


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMG = Image.fromarray((np.random.RandomState(5).rand(32, 24, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl_server")
    model = build_tiny_qwen3_5_vl(d / "model")
    srv = Server.launch(model, d / "server.log", extra_args=(
        "--dtype", "float32", "--limit-mm-per-prompt", '{"image": 1}', "--no-warm-up"))
    try:
        llm = LLM(str(model), dtype="float32", max_model_len=128, kv_cache_memory=4 << 20,
                  warm_up=False)
        yield srv.ready(), llm
    finally:
        srv.stop()


def test_chat_image_url_equals_offline(vl_server) -> None:
    srv, llm = vl_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": _data_url(IMG)}},
    ]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N_NEW,
                                       temperature=0, extra_body={"ignore_eos": True})
    # The same conversation rendered by the template the server uses (ChatML), offline.
    prompt = ("<|im_start|>user\nWhat is this?\n" + image_prompt("", "")
              + "<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    (ref,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": IMG}}, params,
                          use_tqdm=False)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # placeholders expanded

    def bad(part: dict, match: str, n: int = 1) -> None:
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(
                model=MODEL, max_tokens=2,
                messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]
                           + [part] * n}])

    bad({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        "remote image URLs are not fetched")
    bad({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        "malformed image")
    bad({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
        "invalid base64")
    bad({"type": "image_url", "image_url": {"url": _data_url(IMG)}}, "limit_mm_per_prompt",
        n=2)
    bad({"type": "input_audio", "input_audio": {}}, "input_audio")
    srv.wait_pool_whole()


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory):
    from pagefold.testing.tiny_vl_models import build_tiny_gemma3_vl

    d = tmp_path_factory.mktemp("gemma3_server")
    model = build_tiny_gemma3_vl(d / "model")
    srv = Server.launch(model, d / "server.log", extra_args=(
        "--dtype", "float32", "--max-num-batched-tokens", "20", "--no-warm-up"))
    try:
        yield srv.ready(), model
    finally:
        srv.stop()


def test_gemma3_chat_with_two_images_equals_transformers(gemma3_server) -> None:
    """Gemma 3 through the server: a message with two ``image_url`` parts (each rendered as
    ``<start_of_image>``) gives transformers' tokens for the same conversation (chunks of 20
    tokens, moved off the images); the second request, the same images again, hits the
    prefix cache past them and gives the same text."""
    from test_vision_gemma3 import IMG_A, IMG_C, make_reference

    srv, model = gemma3_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": _data_url(IMG_A)}},
        {"type": "image_url", "image_url": {"url": _data_url(IMG_C)}},
        {"type": "text", "text": "and say which of the two is brighter, then why"},
    ]}]

    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=N_NEW, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True})

    first, again = ask(), ask()
    ids, tokens, _ = make_reference(model)(
        "<|im_start|>user\nCompare\n",
        "\n<start_of_image>\nand say which of the two is brighter, then why<|im_end|>\n"
        "<|im_start|>assistant\n",
        [IMG_A, IMG_C])
    from transformers import AutoTokenizer

    assert first.choices[0].message.content == AutoTokenizer.from_pretrained(model).decode(
        tokens[:N_NEW])
    assert first.usage.prompt_tokens == len(ids)
    assert again.choices[0].message.content == first.choices[0].message.content
    image_token = json.loads((model / "config.json").read_text())["image_token_index"]
    image_end = len(ids) - ids[::-1].index(image_token)
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= image_end
