"""Request lengths at their exact edges on every route (issue 44).

A prompt of ``max_model_len - 1`` tokens leaves room for exactly one output token; a prompt
of ``max_model_len`` or more has none. ``max_tokens`` at the room left is accepted, one past it
is refused. Each refusal is asserted whole: HTTP status, error ``code``, ``param`` and the
numbers in the message, so a check moved by one fails here, not in some later check.
"""

from __future__ import annotations

import pytest
from test_server import MAX_MODEL_LEN, MODEL, Server

from pagefold import LLM, SamplingParams

L = MAX_MODEL_LEN


def _ids(n: int) -> list[int]:
    return [(7 * i) % 400 + 20 for i in range(n)]  # ordinary tokens, never EOS


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = Server.launch(qwen3_dir, tmp_path_factory.mktemp("edges") / "server.log")
    try:
        yield srv.ready()
    finally:
        srv.stop()


def _refused(r, param: str, *numbers: int) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (
        "context_length_exceeded", param, "invalid_request_error"), err
    for n in numbers:
        assert f"{n}" in err["message"], (n, err["message"])
    return err["message"]


# ----------------------------------------------------------------------------- completions
def _complete(server, n_prompt: int, max_tokens: int | None) -> dict:
    # max_tokens null: no limit but the context (omitted, the protocol's default of 16 applies)
    body = {"model": MODEL, "prompt": _ids(n_prompt), "temperature": 0, "ignore_eos": True,
            "max_tokens": max_tokens}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text  # an assertion, not the client's exception
    return r.json()


@pytest.mark.parametrize("n_prompt,max_tokens", [(L - 1, 1), (L - 1, None), (L - 4, 4),
                                                 (10, L - 10)])
def test_completion_fills_the_context_exactly(server, n_prompt, max_tokens):
    r = _complete(server, n_prompt, max_tokens)
    assert r["usage"]["prompt_tokens"] == n_prompt
    assert r["usage"]["completion_tokens"] == L - n_prompt
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("n_prompt", [L, L + 1, L + 40])
def test_completion_prompt_without_room(server, n_prompt):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": _ids(n_prompt),
                                        "max_tokens": 1})
    msg = _refused(r, "prompt", L, n_prompt)
    assert f"the prompt has {n_prompt} tokens" in msg and f"shorter than {L}" in msg


@pytest.mark.parametrize("n_prompt,max_tokens", [(L - 1, 2), (L - 4, 5), (10, L - 9)])
def test_completion_max_tokens_past_the_room(server, n_prompt, max_tokens):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": _ids(n_prompt),
                                        "max_tokens": max_tokens})
    msg = _refused(r, "max_tokens", L, n_prompt + max_tokens)
    assert f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} " \
        "for the completion)" in msg and msg.endswith("reduce the prompt or max_tokens.")


# ----------------------------------------------------------------------------- chat
def _chat(server, n_prompt: int, **kw):
    body = {"model": MODEL, "messages": [], "prompt_token_ids": _ids(n_prompt),
            "temperature": 0, "ignore_eos": True, **kw}
    return server.post("/v1/chat/completions", body)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_edges(server, field):
    r = _chat(server, L - 1, **{field: 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"
    msg = _refused(_chat(server, L - 1, **{field: 2}), field, L, L + 1)
    assert f"({L - 1} in the prompt, 2 for the completion)" in msg
    assert msg.endswith(f"reduce the prompt or {field}.")
    _refused(_chat(server, L - 3, **{field: 4}), field, L, L + 1)
    for n in (L, L + 1):
        msg = _refused(_chat(server, n, **{field: 1}), "messages", L, n)
        assert f"the prompt has {n} tokens" in msg


# ----------------------------------------------------------------------------- tokenize
def test_tokenize_counts_past_the_limit_without_refusing(server, qwen3_dir):
    """``/tokenize`` is a count, not a generation: vLLM answers any length with the count and
    ``max_model_len``; the count is the tokenizer's own (transformers)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    texts, m = {}, 1
    while max(texts, default=0) <= L + 1:  # texts of every count the words can make
        text = " ".join(f"w{i % 13}" for i in range(m))
        texts.setdefault(len(tok(text).input_ids), text)
        m += 1
    below = max(n for n in texts if n < L)
    for want in (below, min(n for n in texts if n >= L), max(texts)):
        r = server.post("/tokenize", {"model": MODEL, "prompt": texts[want]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["count"], out["max_model_len"], len(out["tokens"])) == (want, L, want)
    assert below >= L - 3 and max(texts) > L  # the texts straddle the edge


# ----------------------------------------------------------------------------- offline
def test_offline_llm_edges(qwen3_dir):
    llm = LLM(str(qwen3_dir), max_model_len=64, kv_cache_memory="4MiB", warm_up=False)
    greedy = dict(temperature=0, ignore_eos=True)
    (o,) = llm.generate({"prompt_token_ids": _ids(63)}, SamplingParams(max_tokens=1, **greedy),
                        use_tqdm=False)
    assert (len(o.outputs[0].token_ids), o.outputs[0].finish_reason) == (1, "length")
    # Offline, max_tokens past the room is not an error: the context ends the request.
    (o,) = llm.generate({"prompt_token_ids": _ids(60)}, SamplingParams(max_tokens=9, **greedy),
                        use_tqdm=False)
    assert (len(o.outputs[0].token_ids), o.outputs[0].finish_reason) == (4, "length")
    for n in (64, 65):
        with pytest.raises(ValueError) as e:
            llm.generate({"prompt_token_ids": _ids(n)}, SamplingParams(max_tokens=1, **greedy),
                         use_tqdm=False)
        assert f"prompt has {n} tokens but max_model_len is 64" in str(e.value)
    llm.engine.kv.check_whole()
