"""``pagefold serve --enable-lora``: the request's ``model`` picks an adapter, ``/v1/models``
lists them, vLLM's runtime endpoints load and unload adapters, bad adapters are 400s naming
the problem. Driven with the official ``openai`` client; the oracle is peft (see
``tests/test_lora.py``)."""

from __future__ import annotations

import importlib.util

import openai
import pytest
from test_server import KEY, MODEL, Server

from pagefold.testing.lora_adapters import make_adapter, peft_greedy

# Not imported here: peft pulls in triton at collection, before the Triton tests set
# TRITON_INTERPRET (their kernels would then fail under the interpreter).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft not installed")

NEW = 5
PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]


@pytest.fixture(scope="module")
def lora_server(tiny_model_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_server")
    base = tiny_model_factory("llama")
    ads = [make_adapter(base, d / f"a{i}", rank=r, target_modules=t, seed=20 + i)
           for i, (r, t) in enumerate([(4, ["q_proj", "v_proj"]), (8, ["down_proj"]),
                                       (16, ["gate_proj", "o_proj"])])]
    srv = Server.launch(base, d / "server.log", extra_args=(
        "--enable-lora", "--lora-modules", f"a0={ads[0]}", f"a1={ads[1]}",
        "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32"))
    try:
        yield srv.ready(), base, ads
    finally:
        srv.stop()


def _tokens(client, model: str) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                  logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                          "ignore_eos": True})
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_model_selects_adapter_and_runtime_updates(lora_server):
    srv, base, ads = lora_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "a0", "a1"]
    want = [peft_greedy(d, base, [PROMPT], NEW)[0] for d in (None, ads[0], ads[1])]
    assert want[1] != want[0] or want[2] != want[0]
    assert [_tokens(client, m) for m in (MODEL, "a0", "a1")] == want
    # Runtime update: a rank above --max-lora-rank is a 400 naming it; unload, reload.
    r = srv.post("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(ads[2])})
    assert r.status_code == 400 and "rank 16, above max_lora_rank 8" in r.text, r.text
    r = srv.post("/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(ads[1])})
    assert r.status_code == 400 and "already loaded" in r.text
    r = srv.post("/v1/unload_lora_adapter", {"lora_name": "a0"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "a0")
    r = srv.post("/v1/unload_lora_adapter", {"lora_name": "a0"})
    assert r.status_code == 404
    r = srv.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(ads[0])})
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data] == [MODEL, "a1", "b"]
    assert _tokens(client, "b") == want[1]
    srv.wait_pool_whole()
