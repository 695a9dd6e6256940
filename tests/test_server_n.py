"""Parallel sampling (``n``, ``best_of``) through ``pagefold serve``, and the engine counters
it exports (forks, preemptions by kind, swap bytes) in ``/metrics`` and ``/v1/admin/pool``.

One server for the module, with a small pool (12 usable blocks of 16 tokens) and host swap
space, so one family of 4 samples of 50 tokens must be preempted by swap; the offline reference
``LLM`` loads in this process while the server starts. Sampled requests are compared with the
offline engine for the same parameters: child ``i`` of a seeded request uses ``seed + i``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import HEADERS, KEY, MODEL, Server

from pagefold.testing.tiny_models import random_prompts

# 312 KiB holds 13 blocks of the tiny qwen3 (3 layers x 8 KiB pages), 12 usable: one request
# of max_model_len (8 blocks) fits, a family of 4 samples of 60 tokens (4 x 4 blocks) does not.
POOL = "312KiB"
USABLE_BLOCKS = 12
MAX_MODEL_LEN = 128
SWAP = "4MiB"


@pytest.fixture(scope="module")
def setup(qwen3_dir, tmp_path_factory):
    from pagefold import LLM

    log = tmp_path_factory.mktemp("server_n") / "server.log"
    srv = Server.launch(qwen3_dir, log, kv_cache_memory=POOL, extra_args=(
        "--max-model-len", str(MAX_MODEL_LEN), "--swap-space", SWAP, "--preemption-mode", "swap",
        "--state-checkpoint-interval", "32"))
    try:
        llm = LLM(str(qwen3_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB")
        srv.ready()
        yield srv, llm
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(setup) -> Server:
    return setup[0]


@pytest.fixture(scope="module")
def offline_llm(setup):
    return setup[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metrics(server: Server) -> dict[str, float]:
    """``name{labels}`` (labels without model_name) -> value of every pagefold sample."""
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("pagefold:"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            rest = [x for x in labels.rstrip("}").split(",") if x and "model_name" not in x]
            values[name + ("{" + ",".join(rest) + "}" if rest else "")] = float(value)
    return values


def test_n3_seeded_equals_offline(client, offline_llm):
    from pagefold import SamplingParams

    prompt = random_prompts(1, 6, 6, 512, seed=5)[0]
    kw = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    want = offline_llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(n=3, seed=7, **kw), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, seed=7, temperature=1.0,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in want.outputs]
    assert len({c.text for c in r.choices}) == 3  # the children sample differently
    assert r.usage.completion_tokens == 3 * 8 and r.usage.prompt_tokens == len(prompt)
    # child i samples with seed + i: child 1 is a plain request with seed 8
    single = client.completions.create(model=MODEL, prompt=prompt, seed=8, temperature=1.0,
                                       max_tokens=8, extra_body={"ignore_eos": True})
    assert single.choices[0].text == r.choices[1].text

    msgs = [{"role": "user", "content": "pick a word"}]
    want = offline_llm.chat(msgs, SamplingParams(n=2, seed=3, **kw), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=3, max_tokens=8,
                                       temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [c.text for c in want.outputs]
    assert r.usage.completion_tokens == 16


def test_stream_n2_assembles_each_choice(client):
    kw = dict(model=MODEL, prompt="once upon a time", n=2, seed=11, temperature=1.0,
              max_tokens=10, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices  # one choice per chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    msgs = [{"role": "user", "content": "go on"}]
    ckw = dict(model=MODEL, messages=msgs, n=2, seed=4, temperature=1.0, max_tokens=6,
               extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**ckw)
    chunks = list(client.chat.completions.create(stream=True, **ckw))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_greedy_n2_identical_choices(client):
    kw = dict(model=MODEL, prompt="abc def", temperature=0, max_tokens=8,
              extra_body={"ignore_eos": True})
    one = client.completions.create(**kw).choices[0].text
    r = client.completions.create(n=2, **kw)
    assert [c.text for c in r.choices] == [one, one]
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    # several prompts: choice index = prompt index * n + sample index
    r = client.completions.create(n=2, **dict(kw, prompt=["abc def", "xyz"]))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[:2] == [one, one] and texts[2] == texts[3]
    assert r.usage.completion_tokens == 4 * 8
    # a stop string ends each sample on its own (the API aborts that child in the core)
    kw["max_tokens"] = 16
    text = client.completions.create(**kw).choices[0].text
    i = next(i for i in range(2, len(text) - 1)
             if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]
             and text.index(text[i:i + 2]) == i)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in client.completions.create(n=2, stop=text[i:i + 2], stream=True, **kw):
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason:
            finishes[c.choices[0].index].append(c.choices[0].finish_reason)
    assert texts == {0: text[:i], 1: text[:i]} and finishes == {0: ["stop"], 1: ["stop"]}


def test_best_of_returns_the_best(client, offline_llm):
    from pagefold import SamplingParams

    prompt = random_prompts(1, 5, 5, 512, seed=9)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, n=1, best_of=3, seed=21,
                                  temperature=1.0, max_tokens=6, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0] and r.usage.completion_tokens == 6
    cands = offline_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=3, seed=21, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=0),
        use_tqdm=False)[0].outputs
    best = max(cands, key=lambda c: c.cumulative_logprob)
    assert r.choices[0].text == best.text
    assert sum(r.choices[0].logprobs.token_logprobs) == pytest.approx(best.cumulative_logprob,
                                                                      abs=1e-4)


def test_bad_n_and_best_of(server, client):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for extra, param in (({"n": 0}, "n"), ({"n": 1000}, "n"), ({"n": 3, "best_of": 2},
                                                                "best_of"),
                         ({"best_of": 3, "stream": True}, "best_of")):
        r = server.post("/v1/completions", dict(body, **extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = server.post("/v1/chat/completions", {"model": MODEL, "best_of": 2, "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    # best_of == n streams like plain n
    chunks = list(client.completions.create(model=MODEL, prompt="x", n=2, best_of=2,
                                            max_tokens=2, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_disconnect_aborts_the_family(server):
    """Closing a stream mid-way aborts its forked family (one request in the metrics): every
    child still in flight is dropped and the pool is whole again. On a fast host the family
    can finish before the server sees the disconnect (the tiny model makes ~120 tokens in tens
    of ms); then it counts as finished and the attempt is repeated until one is aborted."""
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": MAX_MODEL_LEN - 8,
            "ignore_eos": True, "stream": True, "n": 3}
    ended = {reason: f'pagefold:request_success_total{{finished_reason="{reason}"}}'
             for reason in ("abort", "length")}
    for _ in range(8):
        before = _metrics(server)
        with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions",
                                                    json=body, headers=HEADERS) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        server.wait_pool_whole()  # closed mid-stream: every child aborted or finished
        assert server.get("/health").json()["num_in_flight"] == 0
        after = _metrics(server)
        got = {k: after.get(m, 0.0) - before.get(m, 0.0) for k, m in ended.items()}
        assert got["abort"] + got["length"] == 1, got
        if got["abort"]:
            return
    pytest.fail("every family finished before its disconnect was seen: nothing was aborted")


def test_family_preempted_by_swap(client, server, offline_llm):
    from pagefold import SamplingParams

    before = _metrics(server)
    prompt = random_prompts(1, 10, 10, 512, seed=2)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, temperature=0,
                                  max_tokens=50, extra_body={"ignore_eos": True})
    want = offline_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # swapped blocks come back bit for bit: every sample is the greedy continuation
    assert [c.text for c in r.choices] == [want.text] * 4
    assert r.usage.completion_tokens == 4 * 50
    pool = server.wait_pool_whole()  # device pool and host swap pool both empty
    after = _metrics(server)
    swapped = 'pagefold:num_preemptions_by_kind_total{kind="swap"}'
    assert after[swapped] > before[swapped]
    assert after["pagefold:num_swap_outs_total"] > before["pagefold:num_swap_outs_total"]
    assert after["pagefold:swap_out_bytes_total"] > before["pagefold:swap_out_bytes_total"]
    assert after["pagefold:swap_in_bytes_total"] > before["pagefold:swap_in_bytes_total"]
    assert after["pagefold:num_forks_total"] >= before["pagefold:num_forks_total"] + 3
    assert pool["preemptions_by_kind"]["swap"] == after[swapped]
    assert pool["swap_bytes_out"] == after["pagefold:swap_out_bytes_total"]
    assert pool["num_preemptions"] == sum(pool["preemptions_by_kind"].values())


def test_metrics_and_admin_view(server):
    pool = server.wait_pool_whole()  # its answer rides with fresh core stats
    values = _metrics(server)
    assert values["pagefold:num_forks_total"] > 0
    assert values["pagefold:num_forks_total"] == pool["num_forks"]
    assert values["pagefold:prefix_cache_requests_total"] == pool["prefix_requests"] > 0
    assert values["pagefold:prefix_cache_requests_hit_total"] == pool["prefix_requests_hit"]
    rate = values["pagefold:prefix_cache_hit_rate"]
    assert 0 <= rate <= 1 and rate == pytest.approx(pool["prefix_hit_rate"])
    assert values["pagefold:recomputed_tokens_total"] == pool["recomputed_tokens"]
    assert values["pagefold:recompute_credited_tokens_total"] == pool["credited_tokens"]
    # a dense model keeps no state checkpoints
    assert values["pagefold:state_checkpoints"] == pool["num_checkpoints"] == 0
    assert values["pagefold:state_checkpoint_bytes"] == pool["checkpoint_bytes"] == 0
    assert pool["num_free_blocks"] == pool["num_usable_blocks"] == USABLE_BLOCKS


def test_metrics_counters_follow_core_totals():
    """Counters add how far the core's cumulative totals moved; stale reports add nothing."""
    from pagefold.engine.core_proc import CoreStats, GroupUsage
    from pagefold.metrics import ServerMetrics

    m = ServerMetrics("m")

    def stats(**kw) -> CoreStats:
        base = dict(num_running=0, num_waiting=0, num_preemptions=0, num_free_blocks=9,
                    num_usable_blocks=10, kv_usage=0.1, groups=[GroupUsage("Attn", 2, 1)],
                    num_steps=1)
        return CoreStats(**dict(base, **kw))

    m.record_core_stats(stats(num_forks=3, preemptions_by_kind={"swap": 2}, swap_bytes_out=100,
                              num_checkpoints=2, checkpoint_bytes=4096, prefix_queries=10,
                              prefix_hits=4))
    m.record_core_stats(stats(num_forks=2, preemptions_by_kind={"swap": 1}))  # stale
    m.record_core_stats(stats(num_forks=5, preemptions_by_kind={"swap": 2, "recompute": 1},
                              swap_bytes_out=150, prefix_queries=10, prefix_hits=4))
    text = m.render().decode()

    def value(sample: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(sample)).rsplit(" ", 1)[1])

    assert value('pagefold:num_forks_total{model_name="m"}') == 5
    assert value('pagefold:num_preemptions_by_kind_total{kind="swap",model_name="m"}') == 2
    assert value('pagefold:num_preemptions_by_kind_total{kind="recompute",model_name="m"}') == 1
    assert value('pagefold:swap_out_bytes_total{model_name="m"}') == 150
    assert value('pagefold:state_checkpoints{model_name="m"}') == 0  # a gauge: the latest
    assert value('pagefold:prefix_cache_hit_rate{model_name="m"}') == pytest.approx(0.4)
