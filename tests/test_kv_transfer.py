"""Prefill/decode disaggregation (issue 38 item 3): a producer engine prefills, a consumer
engine pulls the pages (attention blocks and the state checkpoint) and decodes.

Exactness: the consumer's greedy float32 tokens equal a single engine's (cold); tokens *and*
logprobs equal, bit for bit, a single engine that prefills all but the last prompt token in one
chunk and then computes the last token alone (what producer and consumer compute together: the
pages were pulled byte-exact). The consumer computes only the prompt's last token (the
producer's partial last block and its state after ``L - 1`` tokens travel too: the prompt
tail), counted from the runner's step messages.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.engine.core_proc import core_stats
from pagefold.entrypoints.proxy import Proxy, build_app, prefill_body
from pagefold.metrics import ServerMetrics
from pagefold.offload.page_file import PageGeometry
from pagefold.testing.tiny_models import random_prompts
from pagefold.transfer import worker as transfer_worker
from pagefold.transfer.config import KVTransferConfig
from pagefold.transfer.wire import decode_pages, encode_pages

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
BS = 16


def _engine(model, **kw) -> LLM:
    return LLM(str(model), dtype="float32", max_model_len=128, kv_cache_memory="16MiB",
               warm_up=False, **kw)


def _producer(model, **extra) -> LLM:
    return _engine(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0,
                                              "kv_connector_extra_config": extra})


def _consumer(model, **kw) -> LLM:
    cfg = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"pull_timeout_s": 2}}
    return _engine(model, kv_transfer_config=cfg, **kw)


def _prefill(prod: LLM, prompt: list[int]) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = prod.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def _decode(cons: LLM, prompt: list[int], params: dict, sp: SamplingParams = GREEDY):
    sp = sp.clone()
    sp.extra_args = {"kv_transfer_params": params}
    return cons.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def _single(llm: LLM, prompt: list[int], sp: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def _lp(out):
    return [[sorted((t, lp.logprob) for t, lp in d.items()) for d in o.logprobs]
            for o in out.outputs]


def _toks(out):
    return [o.token_ids for o in out.outputs]


class StepCounter:
    """Tokens each request was scheduled for, read from the runner's step messages."""

    def __init__(self, llm: LLM) -> None:
        self.counts: dict[str, int] = {}
        runner = llm.engine.runner
        inner = runner.execute

        def execute(out):
            for rid, n in out.num_scheduled.items():
                self.counts[rid] = self.counts.get(rid, 0) + n
            return inner(out)

        runner.execute = execute

    def total(self) -> int:
        return sum(self.counts.values())


def _whole(*llms: LLM) -> None:
    for llm in llms:
        llm.engine.kv.check_whole()


def _split(model, prompt: list[int], sp: SamplingParams = GREEDY, **kw):
    """A single engine's output computing ``prompt[:-1]`` in one chunk, then its last token."""
    return _single(_engine(model, max_num_batched_tokens=len(prompt) - 1, **kw), prompt, sp)


@pytest.fixture(scope="module")
def prompts():
    # Lengths 81 (5 blocks + 1 token: no partial block in the tail), then others.
    ps = random_prompts(3, 60, 90, 512, seed=11)
    return [random_prompts(1, 81, 81, 512, seed=12)[0], *ps]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "nemotron_h"])
def test_producer_to_consumer_equals_one_engine(arch, tiny_model_factory, prompts):
    model = tiny_model_factory(arch)
    prod, cons, single = _producer(model), _consumer(model), _engine(model)
    counter = StepCounter(cons)
    for p in prompts:
        params = _prefill(prod, p)
        assert params["num_tokens"] == len(p) - 1 and params["remote_port"]
        # The tail: every state group's state after L - 1 tokens, and every attention group's
        # partial last block when L - 1 ends inside one.
        pps = params["pages_per_state"]
        tails = [k for k in params["remote_block_keys"] if k.startswith("t")]
        partial = (len(p) - 1) % BS != 0
        assert len(tails) == sum(1 for n in pps if n or partial)
        before, computed = counter.total(), cons.engine.scheduler.prompt_tokens_computed
        got = _decode(cons, p, params)
        prompt_computed = counter.total() - before - (MAX_TOKENS - 1)
        assert cons.engine.scheduler.prompt_tokens_computed - computed == 1
        cold, warm = _single(single, p), _single(single, p)
        assert _toks(got) == _toks(cold) == _toks(warm)
        assert _lp(got) == _lp(_split(model, p))  # the same computation, bit for bit
        assert got.num_cached_tokens == len(p) - 1
        assert prompt_computed == 1  # the decode instance computes only the last token
    stats = cons.engine.transfer.stats
    assert stats.requests_loaded == len(prompts) and stats.load_failures == 0
    assert stats.tokens_loaded == sum(len(p) - 1 for p in prompts)
    assert prod.engine.transfer.stats.exports == len(prompts)
    assert not prod.engine.runner.connector.outbox  # every export was pulled and freed
    _check_metrics(cons, prompts)
    _whole(prod, cons, single)


def _check_metrics(cons: LLM, prompts: list[list[int]]) -> None:
    """The decode instance's /metrics (vLLM's names too): each prompt's last token computed
    here, the rest loaded through the connector."""
    metrics = ServerMetrics("m")
    metrics.record_core_stats(core_stats(cons.engine))
    text = metrics.render().decode()

    def value(sample: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(sample)).split()[-1])

    pulled = sum(len(p) - 1 for p in prompts)
    for prefix in ("pagefold", "vllm"):
        by = f'{prefix}:prompt_tokens_by_source_total{{model_name="m",source='
        assert value(by + '"local_compute"}') == len(prompts)
        assert value(by + '"external_kv_transfer"}') == pulled
        assert value(by + '"local_cache_hit"}') == 0
        assert value(f'{prefix}:external_prefix_cache_hits_total{{model_name="m"}}') == pulled
        assert value(f'{prefix}:external_prefix_cache_queries_total{{model_name="m"}}') \
            == sum(len(p) for p in prompts)
        assert value(f'{prefix}:prompt_tokens_cached_total{{model_name="m"}}') == pulled
    assert value('pagefold:kv_transfer_pulls_total{model_name="m"}') == len(prompts)
    assert value('pagefold:kv_transfer_pull_seconds_total{model_name="m"}') > 0


def test_parallel_sampling_consumer(tiny_model_factory, prompts):
    model = tiny_model_factory("qwen3_5")
    prod, cons, single = _producer(model), _consumer(model), _engine(model)
    sp = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4, logprobs=1)
    p = prompts[1]
    fam = SamplingParams(temperature=0, max_tokens=1, n=2,
                         extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = prod.generate([{"prompt_token_ids": p}], fam, use_tqdm=False)[0]
    assert out.kv_transfer_params is not None  # a family exports its prompt once
    assert prod.engine.transfer.stats.exports == 1
    got = _decode(cons, p, out.kv_transfer_params, sp)
    _single(single, p, SamplingParams(temperature=0, max_tokens=1))  # same hit as the consumer
    ref = _single(single, p, sp)
    assert _toks(got) == _toks(ref) and _lp(got) == _lp(ref)
    assert cons.engine.transfer.stats.requests_loaded == 1
    _whole(prod, cons, single)


@pytest.mark.parametrize("in_kernel", [True, False])
def test_chunked_prefill_on_the_producer(in_kernel, tiny_model_factory, prompts):
    """A producer that prefills in 32-token chunks. A 65-token prompt: its last chunk is the
    last token alone, the tail's state is copied after the chunk ending at token 64 (a single
    engine chunking alike computes the same, bit for bit). Without in-kernel captures, the
    chunk of a 60-90-token prompt is cut at ``L - 1`` for the tail's state."""
    model = tiny_model_factory("qwen3_5")
    prod = _engine(model, max_num_batched_tokens=32, state_checkpoints_in_kernel=in_kernel,
                   kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})
    cons = _consumer(model)
    counter = StepCounter(cons)
    single = _engine(model, max_num_batched_tokens=32)
    p = random_prompts(1, 65, 65, 512, seed=13)[0] if in_kernel else prompts[2]
    params = _prefill(prod, p)
    assert params["num_tokens"] == len(p) - 1
    assert any(k.startswith("t1-") for k in params["remote_block_keys"])  # the tail's state
    got = _decode(cons, p, params)
    cold = _single(single, p)
    assert _toks(got) == _toks(cold) and got.num_cached_tokens == len(p) - 1
    if in_kernel:
        assert _lp(got) == _lp(cold)
    assert counter.total() == 1 + MAX_TOKENS - 1
    _whole(prod, cons, single)


def test_no_room_for_the_tail_falls_back_to_block_pages(tiny_model_factory, prompts,
                                                       qwen35_single, monkeypatch):
    """A producer whose pool gives no page for the tail's state exports the blocks and the
    deepest checkpoint; the consumer computes from that block boundary on, tokens exact."""
    from pagefold.core.managers import StateManager

    monkeypatch.setattr(StateManager, "plan_tail", lambda self, req_id, n: None)
    monkeypatch.setattr(StateManager, "copy_tail", lambda self, req_id: [])
    model = tiny_model_factory("qwen3_5")
    prod, cons = _producer(model), _consumer(model)
    p = prompts[1]
    params = _prefill(prod, p)
    n = (len(p) - 1) // BS * BS
    assert params["num_tokens"] == n
    assert not any(k.startswith("t") for k in params["remote_block_keys"])
    computed = cons.engine.scheduler.prompt_tokens_computed
    got = _decode(cons, p, params)
    assert _toks(got) == qwen35_single[1] and got.num_cached_tokens == n
    assert cons.engine.scheduler.prompt_tokens_computed - computed == len(p) - n
    _whole(prod, cons)


def test_batches_on_both_sides(tiny_model_factory, prompts, qwen35_single):
    """Four prefills in one batch (exports of several requests in one step), then four
    decodes in one batch (several pulls in flight at once)."""
    model = tiny_model_factory("qwen3_5")
    prod, cons = _producer(model), _consumer(model)
    pre = SamplingParams(temperature=0, max_tokens=1,
                         extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    outs = prod.generate([{"prompt_token_ids": p} for p in prompts], pre, use_tqdm=False)
    params = [o.kv_transfer_params for o in outs]
    assert len({p["remote_request_id"] for p in params}) == len(prompts)
    sps = []
    for p in params:
        sp = GREEDY.clone()
        sp.extra_args = {"kv_transfer_params": p}
        sps.append(sp)
    got = cons.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    assert [_toks(g)[0] for g in got] == [qwen35_single[i][0] for i in range(len(prompts))]
    assert [g.num_cached_tokens for g in got] == [len(p) - 1 for p in prompts]
    assert cons.engine.transfer.stats.requests_loaded == len(prompts)
    assert not prod.engine.runner.connector.outbox
    _whole(prod, cons)


@pytest.fixture(scope="module")
def qwen35_single(tiny_model_factory, prompts):
    single = _engine(tiny_model_factory("qwen3_5"))
    return {i: _toks(_single(single, p)) for i, p in enumerate(prompts)}


def test_producer_gone_the_consumer_recomputes(tiny_model_factory, prompts, qwen35_single):
    model = tiny_model_factory("qwen3_5")
    prod, cons = _producer(model), _consumer(model)
    params = _prefill(prod, prompts[0])
    prod.engine.shutdown()  # its server is gone before the consumer pulls
    t0 = time.monotonic()
    got = _decode(cons, prompts[0], params)
    assert time.monotonic() - t0 < 10
    assert _toks(got) == qwen35_single[0] and got.num_cached_tokens == 0
    stats = cons.engine.transfer.stats
    assert stats.load_failures > 0 and stats.requests_loaded == 0 and stats.tokens_loaded == 0
    _whole(cons)


def test_a_corrupt_page_is_detected_and_recomputed(tiny_model_factory, prompts, qwen35_single,
                                                   monkeypatch):
    model = tiny_model_factory("qwen3_5")
    prod, cons = _producer(model), _consumer(model)
    real = transfer_worker.encode_pages

    def flip(pages, layout, error=None):
        frames = real(pages, layout, error)
        if len(frames) > 2:  # one bit of the last page's payload flips on the wire
            last = bytearray(frames[-1])
            last[len(last) // 2] ^= 0x10
            frames[-1] = bytes(last)
        return frames

    monkeypatch.setattr(transfer_worker, "encode_pages", flip)
    got = _decode(cons, prompts[1], _prefill(prod, prompts[1]))
    assert _toks(got) == qwen35_single[1]
    stats = cons.engine.transfer.stats
    assert stats.load_failures == 1 and stats.requests_loaded == 0
    _whole(prod, cons)


def test_an_export_nobody_pulls_is_freed_after_keep_s(tiny_model_factory, prompts):
    prod = _producer(tiny_model_factory("qwen3"), keep_s=0.3)
    _prefill(prod, prompts[2])
    prod.engine.flush()
    worker = prod.engine.runner.connector
    assert worker.outbox  # the export waits for its consumer (the pool itself is whole)
    _whole(prod)
    deadline = time.monotonic() + 5
    while (worker.outbox or not worker.expired) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.outbox and worker.expired == 1


def test_a_consumer_that_hits_its_own_pool_releases_the_export(tiny_model_factory, prompts):
    model = tiny_model_factory("qwen3_5")
    prod, cons = _producer(model), _consumer(model)
    p = prompts[0]  # 5 blocks + 1 token: its own pool serves all but the last token
    _single(cons, p)  # the consumer caches the prompt itself first
    got = _decode(cons, p, _prefill(prod, p))
    assert got.num_cached_tokens == len(p) - 1  # from its own pool
    assert cons.engine.transfer.stats.requests_loaded == 0
    cons.engine.flush()  # the release leaves with the next step
    worker = prod.engine.runner.connector
    deadline = time.monotonic() + 5  # keep_s is 120 s: only the release frees it this soon
    while worker.outbox and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.outbox and worker.released == 1 and worker.expired == 0
    _whole(prod, cons)


def test_mismatched_layouts_are_refused_and_prefilled_locally(tiny_model_factory, prompts,
                                                              caplog):
    model = tiny_model_factory("qwen3")
    prod = _producer(model)
    cons = _consumer(model, block_size=32)  # another block size: another layout
    ref = _single(_engine(model, block_size=32), prompts[0])
    with caplog.at_level("WARNING"):
        got = _decode(cons, prompts[0], _prefill(prod, prompts[0]))
    assert "refused" in caplog.text and "layout" in caplog.text
    assert _toks(got) == _toks(ref) and got.num_cached_tokens == 0
    assert cons.engine.transfer.stats.refused == 1
    other = _consumer(tiny_model_factory("qwen3_5"))  # another model
    got = _decode(other, prompts[0], _prefill(prod, prompts[0]))
    assert got.num_cached_tokens == 0 and other.engine.transfer.stats.refused == 1
    _whole(cons, other)


def test_tensor_parallel_ranks_send_their_shards(tiny_model_factory, prompts, qwen35_single):
    """TP 2 on both sides of a GDN hybrid: rank r of the consumer pulls rank r's shard of every
    page from the producer's rank r (at kv_port + r)."""
    model = tiny_model_factory("qwen3_5")
    tp = dict(tensor_parallel_size=2, threads_per_rank=1)
    base = 20000 + int(time.time() * 1000) % 20000  # two consecutive ports
    prod = _engine(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": base}, **tp)
    cons = _consumer(model, **tp)
    try:
        params = _prefill(prod, prompts[0])
        assert params["remote_tp_size"] == 2 and params["remote_port"] == base
        got = _decode(cons, prompts[0], params)
        assert _toks(got) == qwen35_single[0]
        assert got.num_cached_tokens == len(prompts[0]) - 1
        assert cons.engine.transfer.stats.requests_loaded == 1
        assert cons.engine.transfer.stats.load_failures == 0
        _whole(prod, cons)
    finally:
        prod.engine.shutdown()
        cons.engine.shutdown()


@pytest.mark.parametrize("arch,prod_tp,cons_tp", [
    ("qwen3", 1, 2), ("qwen3", 2, 1), ("qwen3_5", 1, 2), ("qwen3_5", 2, 1),
    ("nemotron_h", 1, 2), ("kimi_linear", 2, 1)])
def test_mixed_tensor_parallelism_reshards(arch, prod_tp, cons_tp, tiny_model_factory, prompts):
    """A producer and a consumer of different TP sizes: each consumer rank pulls the producer
    ranks whose heads overlap its own and assembles its shard (a TP 1 producer's rank 0
    answers both TP 2 consumer ranks; a TP 1 consumer pulls both TP 2 producer ranks). Tokens
    equal a single engine's; the consumer computes only the last prompt token (its scheduler's
    counter); both pools are whole. Kimi Linear: KDA states cut by heads, MLA latent pages
    replicated on every rank."""
    model = tiny_model_factory(arch, **MIXED_TP_OVERRIDES.get(arch, {}))
    base = 20000 + int(time.time() * 1000) % 20000
    prod = _engine(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": base},
                   **_tp(prod_tp))
    cons = _consumer(model, **_tp(cons_tp))
    single = _engine(model)
    try:
        for p in prompts[:2]:
            params = _prefill(prod, p)
            assert params["remote_tp_size"] == prod_tp and params["model_layout"]
            computed = cons.engine.scheduler.prompt_tokens_computed
            got = _decode(cons, p, params)
            assert _toks(got) == _toks(_single(single, p))
            assert got.num_cached_tokens == len(p) - 1
            assert cons.engine.scheduler.prompt_tokens_computed - computed == 1  # the last
        stats = cons.engine.transfer.stats
        assert stats.requests_loaded == 2 and stats.load_failures == 0 and stats.refused == 0
        assert stats.tokens_loaded == sum(len(p) - 1 for p in prompts[:2])
        if prod_tp == 1:
            assert not prod.engine.runner.connector.outbox  # both consumer ranks pulled it
        _whole(prod, cons)
    finally:
        prod.engine.shutdown()
        cons.engine.shutdown()


MIXED_TP_OVERRIDES = {"kimi_linear": dict(num_attention_heads=4, num_key_value_heads=4,
                                          linear_num_heads=4)}


def _tp(n: int) -> dict:
    return dict(tensor_parallel_size=n, threads_per_rank=1) if n > 1 else {}


def test_a_busy_kv_port_is_a_clear_error(tiny_model_factory):
    prod = _producer(tiny_model_factory("qwen3"))
    port = prod.engine.transfer.port
    with pytest.raises(ValueError, match=f"cannot serve pages at 127.0.0.1:{port}"):
        _engine(tiny_model_factory("qwen3"),
                kv_transfer_config={"kv_role": "kv_producer", "kv_port": port})


def test_kv_transfer_params_need_a_transfer_config(tiny_model_factory, prompts):
    llm = _engine(tiny_model_factory("qwen3"))
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params":
                                                  {"do_remote_prefill": True}})
    with pytest.raises(ValueError, match="kv-transfer-config"):
        llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)


def test_transfer_config_parsing():
    cfg = KVTransferConfig.from_user(json.dumps({"kv_connector": "PagefoldConnector",
                                                 "kv_role": "kv_consumer", "kv_port": 0}))
    assert cfg.is_consumer and not cfg.is_producer and cfg.kv_rank is None
    assert KVTransferConfig.from_user({}) is None
    for bad, msg in [({"kv_role": "kv_relay"}, "kv_role"), ({"kv_connector": "Nixl"},
                     "kv_connector"), ({"kv_wat": 1}, "unknown"),
                     ({"kv_connector_extra_config": {"keep_s": -1}}, "keep_s")]:
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.from_user(bad)


def test_wire_pages_round_trip_and_damage():
    rows = torch.randint(0, 256, (2, 3, 64), dtype=torch.uint8)
    geom = PageGeometry(2, 3, 64)
    frames = encode_pages([("a0-ff", 0, rows)], "L1")
    got, err = decode_pages(frames, {"a0-ff": geom}, "L1")
    assert err is None and torch.equal(got["a0-ff"], rows)
    assert decode_pages(frames, {"a0-ff": geom}, "L2")[1] is not None  # another layout
    assert decode_pages(frames, {"a0-ff": PageGeometry(2, 2, 64)}, "L1")[0] == {}
    short = [*frames[:2], bytes(frames[2])[:-1]]
    assert decode_pages(short, {"a0-ff": geom}, "L1")[0] == {}
    flipped = bytearray(frames[2])
    flipped[100] ^= 1
    assert decode_pages([*frames[:2], bytes(flipped)], {"a0-ff": geom}, "L1")[0] == {}
    refused = encode_pages([], "L1", "no export")
    assert decode_pages(refused, {"a0-ff": geom}, "L1") == ({}, "no export")


def test_proxy_routes_round_robin_retries_and_answers_503():
    """The proxy against fake instances: prefill body, params handed on, round-robin, a dead
    decode instance retried on the next, 503 when none answers."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "min_tokens": 2, "stream": True,
            "n": 2, "stream_options": {"include_usage": True}}
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["n"] == 1
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert "min_tokens" not in pre and "stream_options" not in pre and body["max_tokens"] == 9
    seen: list[tuple[str, dict]] = []
    dead: set[str] = set()

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in dead:
            raise httpx.ConnectError("down", request=request)
        sent = json.loads(request.content)
        seen.append((host, sent))
        if host.startswith("p"):
            return httpx.Response(200, json={"kv_transfer_params": {"remote_request_id": host}})
        return httpx.Response(200, json={"from": host, "params": sent.get("kv_transfer_params")})

    proxy = Proxy(["http://p1", "http://p2"], ["http://d1", "http://d2"],
                  transport=httpx.MockTransport(handler))
    app = build_app(proxy)

    async def go():
        outs = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as c:
            req = {"model": "m", "prompt": "hi", "max_tokens": 4}
            for _ in range(2):
                outs.append((await c.post("/v1/completions", json=req)).json())
            dead.add("d1")
            outs.append((await c.post("/v1/chat/completions", json=req)).json())
            outs.append((await c.post("/v1/chat/completions", json=req)).json())
            dead.update({"d2", "p1", "p2"})
            r = await c.post("/v1/completions", json=req)
            outs.append((r.status_code, r.json()))
        return outs

    outs = asyncio.run(go())
    assert [o["from"] for o in outs[:4]] == ["d1", "d2", "d2", "d2"]
    assert [o["params"]["remote_request_id"] for o in outs[:4]] == ["p1", "p2", "p1", "p2"]
    assert [h for h, _ in seen if h.startswith("p")] == ["p1", "p2", "p1", "p2"]
    decode_bodies = [b for h, b in seen if h.startswith("d")]
    assert all(b["max_tokens"] == 4 for b in decode_bodies)  # the client's request, unchanged
    assert outs[4][0] == 503 and proxy.counts["unavailable"] == 1
    assert proxy.counts["decode_retried"] >= 3 and proxy.counts["prefill_failed"] == 2


def test_transfer_index_expectations_and_ops():
    """The consumer side's bookkeeping: what it refuses, what a load's source is, and that a
    request's keys leave with it (two requests may name the same key)."""
    from pagefold.core.kv_connector import ConnectorOutput, key_name
    from pagefold.core.prefix_cache import hash_block, root_hash
    from pagefold.request import Request
    from pagefold.transfer.index import TransferIndex

    index = TransferIndex(engine_id="e", layout="L", block_size=4, host="h", port=1,
                          producer=False, consumer=True)
    prompt = list(range(13))
    h0 = hash_block(root_hash(), prompt[:4])
    h1 = hash_block(h0, prompt[4:8])
    keys = [key_name((0, h0)), key_name((0, h1)), key_name(("ckpt", 1, h1))]
    good = {"layout": "L", "remote_host": "p", "remote_port": 9, "remote_request_id": "r1",
            "remote_block_keys": keys}

    def req(rid, salt=None):
        return Request(rid, prompt, SamplingParams(),
                       extra_keys=("cache_salt", salt) if salt else ())

    assert not index.expect(req("x"), {**good, "layout": "M"})
    assert not index.expect(req("x"), {**good, "remote_port": None})
    assert not index.expect(req("x"), {**good, "remote_block_keys": ["zz"]})
    assert not index.expect(req("x", salt="s"), good)  # another salt: another chain
    assert index.stats.refused == 4 and not index.contains((0, h0))
    assert index.expect(req("a"), good)
    assert index.contains((0, h0)) and index.contains(("ckpt", 1, h1))
    assert index.expect(req("b"), {**good, "remote_request_id": "r2",
                                   "remote_block_keys": keys[:1]})
    index.record_load("c", (0, h0), 0, [5])  # h0 now owned by b: pulled from r2
    index.record_load("c", ("ckpt", 1, h1), 1, [6, 7])  # still a's: from r1
    ops = index.take_ops()
    srcs = {(r.req_id, r.remote_request_id): r.keys for r in ops.remotes}
    assert srcs == {("c", "r2"): [keys[0]], ("c", "r1"): [keys[2]]}
    assert [ld.pages for ld in ops.loads] == [[5], [6, 7]] and not index.has_pending
    index.release("b")
    assert index.contains((0, h0)) and index.contains((0, h1))  # a still names both
    index.record_load("d", (0, h0), 0, [8])
    ops = index.take_ops()
    assert [r.remote_request_id for r in ops.remotes] == ["r1"]
    # b ended without pulling its own export: the producer is told to free it now.
    assert [(r.req_id, r.remote_request_id, r.keys) for r in ops.releases] == [("b", "r2", [])]
    index.apply_output(ConnectorOutput(finished=["a"], failed={"a": [keys[1]]}))
    assert index.stats.load_failures == 1 and index.stats.requests_loaded == 0
    assert [r.remote_request_id for r in index.take_ops().releases] == ["r1"]
    for rid in ("c", "d"):  # the requests that loaded end too
        index.release(rid)
    assert not index.take_ops()  # they pulled: nothing to release
    index.check_whole()  # a's keys left with its report
    nc = TransferIndex(engine_id="e", layout="L", block_size=4, host="h", port=1,
                       producer=True, consumer=False)
    assert not nc.expect(req("y"), good)
    params = nc.export("y", [((0, h0), 0, [3])], 4)
    assert params["remote_block_keys"] == [keys[0]] and params["remote_request_id"] == "y"
    assert params["remote_host"] == "h" and params["num_tokens"] == 4
    assert nc.take_ops().exports[0].pages == [3]


def test_mixed_tensor_parallelism_is_refused_where_pages_cannot_be_resharded(caplog):
    """A producer of another TP size is accepted only with this engine's model layout and
    specs that all carry a tensor-parallel split; else the request prefills locally."""
    from pagefold.core.kv_cache_spec import (
        FullAttentionSpec,
        StateComponent,
        StateSpec,
        TPSplit,
    )
    from pagefold.core.kv_connector import key_name
    from pagefold.core.prefix_cache import hash_block, root_hash
    from pagefold.request import Request
    from pagefold.transfer.index import TransferIndex

    attn = FullAttentionSpec(1, 8, torch.float32, TPSplit(2, ((2, 1),)))
    bare = StateSpec("mystery", (StateComponent("s", (4, 2), torch.float32),))
    prompt = list(range(9))
    params = {"layout": "P", "model_layout": "M", "remote_tp_size": 1, "remote_host": "p",
              "remote_port": 9, "remote_request_id": "r", "page_bytes": 64,
              "pages_per_state": [0, 1],
              "remote_block_keys": [key_name((0, hash_block(root_hash(), prompt[:4])))]}

    def index(*specs):
        return TransferIndex(engine_id="e", layout="C", block_size=4, host="h", port=1,
                             producer=False, consumer=True, tp_size=2, model_layout="M",
                             specs=specs, page_bytes=32, pages_per_state=(0, 1))

    def req():
        return Request("x", prompt, SamplingParams())

    assert index(attn, attn).expect(req(), params)
    assert not index(attn, attn).expect(req(), {**params, "model_layout": "N"})
    assert not index(attn, attn).expect(req(), {**params, "pages_per_state": [0]})
    refusing = index(attn, bare)
    with caplog.at_level("WARNING"):
        assert not refusing.expect(req(), params)
    assert refusing.stats.refused == 1 and "cannot be resharded" in caplog.text
    assert not refusing.contains((0, hash_block(root_hash(), prompt[:4])))
