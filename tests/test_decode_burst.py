"""Decode bursts (``core/decode_burst.py``): several decode steps in one message change no
token, only when tokens are handed out.

Differential: the same requests with bursts forced (a budget no step reaches) and off give the
same tokens, logprobs and finish reasons, greedy and seeded sampling with penalties, on a
dense model and on GDN and Mamba-2 hybrids (float32 on the module path, bf16 through the
native decode step), with prefix caching on: a later prompt hits the blocks and state
checkpoints the bursts computed. Stops inside a burst (a stop token id, EOS, max_tokens) end
the request there. The pool is whole after every scenario. The policy and the scheduler's
rules are checked without a model.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.core.decode_burst import MAX_STEPS, BurstPolicy
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.executor.sampler import Sampler
from pagefold.request import Request

FORCED = 1e9  # decode_burst_ms: every eligible step bursts (up to MAX_STEPS)


def _count_bursts(llm: LLM) -> list[int]:
    """Wrap the scheduler so each burst message's largest count is recorded."""
    sched = llm.engine.scheduler
    seen: list[int] = []
    schedule = sched.schedule

    def counting():
        out = schedule()
        if out.decode_burst:
            seen.append(max(out.num_scheduled.values()))
        return out

    sched.schedule = counting
    return seen


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs,
             o.outputs[0].cumulative_logprob) for o in outs]


@pytest.mark.parametrize("arch,dtype", [("llama", None), ("qwen3_5", None),
                                        ("qwen3_5", "bfloat16"), ("nemotron_h", None)])
def test_bursts_give_the_tokens_of_single_steps(arch, dtype, tiny_model_factory,
                                                random_prompts):
    model = tiny_model_factory(arch)
    kw = {"dtype": dtype} if dtype else {}
    on = LLM(str(model), decode_burst_ms=FORCED, block_size=16, **kw)
    off = LLM(str(model), decode_burst_ms=0, block_size=16, **kw)
    bursts = _count_bursts(on)
    prompts = random_prompts(3, 9, 30, 512, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = _run(off, prompts, greedy)
    assert _run(on, prompts, greedy) == base
    assert bursts and max(bursts) > 2  # bursts ran, several steps long
    # A stop token inside a burst: each request ends at its first occurrence of the token
    # sampled 6th by the first request (the others may not meet it: they run to max_tokens).
    stop = base[0][0][5]
    stopped = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    got = _run(on, prompts, stopped)
    assert got == _run(off, prompts, stopped)
    assert got[0][0][-1] == stop and got[0][1] == "stop" and len(got[0][0]) <= 6
    # Seeded sampling with penalties and logprobs: the penalties read every earlier token of
    # the burst; the generator's draws are the single steps' draws.
    sampled = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=25 + 4 * i,
                              repetition_penalty=1.3, presence_penalty=0.4, logprobs=2,
                              ignore_eos=True) for i in range(3)]
    assert _run(on, prompts, sampled) == _run(off, prompts, sampled)
    # A prompt that continues the first output: a prefix-cache hit on the blocks (and, on a
    # hybrid, the state checkpoints) the bursts computed.
    longer = [{"prompt_token_ids": prompts[0] + base[0][0][:33]}]
    hit = on.generate(longer, greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 16  # at least a block the bursts computed
    assert hit.outputs[0].token_ids == off.generate(longer, greedy,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    for llm in (on, off):
        llm.engine.kv.check_whole()


def test_a_waiting_request_is_not_held_up_by_a_burst(tiny_model_factory):
    """While a request waits, no burst is scheduled: it is admitted on the next step."""
    llm = LLM(str(tiny_model_factory("llama")), decode_burst_ms=FORCED)
    bursts = _count_bursts(llm)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = llm.add_request({"prompt_token_ids": [5, 6, 7, 8]}, greedy)
    while not bursts:
        llm.step()
    late = llm.add_request({"prompt_token_ids": [9, 10, 11]}, greedy)
    before = len(bursts)
    llm.step()  # admits the late request: a plain step
    assert len(bursts) == before
    sched = llm.engine.scheduler
    assert sched.requests[late].num_computed_tokens > 0 and not sched.waiting
    while llm.engine.has_unfinished():
        llm.step()
    assert first != late
    llm.engine.kv.check_whole()


# ----------------------------------------------------------------------------- the policy
def test_policy_sizes_bursts_by_the_measured_step_time():
    p = BurstPolicy(budget_s=0.010)
    assert p.limit == 1  # nothing measured yet
    p.observe({"a": 1, "b": 1}, False, 0.002)  # an all-decode step of 2 ms
    assert p.limit == 5
    p.observe({"a": 5, "b": 3}, True, 0.010)  # a burst: 5 steps in 10 ms, 2 ms each
    assert p.limit == 5 and p.step_s == pytest.approx(0.002)
    p.observe({"a": 1}, False, 0.0001)  # fast steps raise it towards the cap
    for _ in range(40):
        p.observe({"a": 1}, False, 0.0001)
    assert p.limit == MAX_STEPS
    for _ in range(40):
        p.observe({"a": 1}, False, 0.5)  # slow steps (a large model): no bursts
    assert p.limit == 1


def test_policy_ignores_steps_that_are_not_decode_steps():
    p = BurstPolicy(budget_s=0.010)
    p.observe({"a": 1}, False, 0.001)
    assert p.limit == 10
    p.observe({"a": 300}, False, 5.0)  # a prefill chunk
    p.observe({"a": 1, "b": 4}, False, 5.0)  # a decode row beside a prefill / verify chunk
    p.observe({}, False, 5.0)  # an idle step
    assert p.limit == 10 and p.step_s == pytest.approx(0.001)


def test_policy_averages_its_step_time_and_takes_a_zero_time():
    p = BurstPolicy(budget_s=0.012)
    p.observe({"a": 1}, False, 0.002)
    p.observe({"a": 1}, False, 0.006)  # the running mean moves a quarter of the way
    assert p.step_s == pytest.approx(0.003) and p.limit == 4
    z = BurstPolicy(budget_s=0.010)
    z.observe({"a": 1}, False, 0.0)  # a step too short for the clock: the cap, no crash
    assert z.limit == MAX_STEPS


class _Req:
    def __init__(self, computed: int = 10, max_tokens: int | None = 50, outputs: int = 1,
                 paused: bool = False, forks: tuple = ()) -> None:
        self.paused, self.fork_children = paused, list(forks)
        self.output_token_ids = [7] * outputs
        self.num_computed_tokens, self.num_tokens = computed, computed + 1
        self.sampling_params = SamplingParams(max_tokens=max_tokens)


class _Kv:
    """``cap`` caps a burst at a checkpoint; ``free`` blocks, each token its own block."""

    def __init__(self, cap: int = 99, free: int = 99) -> None:
        self.cap, self.asked = cap, []
        self.pool = type("Pool", (), {"num_free": free})()

    def cap_spec_chunk(self, r, k: int) -> int:
        self.asked.append(k)
        return min(k, self.cap)

    def blocks_needed(self, r, k: int) -> int:
        return k


def test_policy_steps_at_their_edges():
    """``BurstPolicy.steps`` alone: every cap at its boundary."""
    p = BurstPolicy(budget_s=1.0, limit=2)
    assert p.steps([_Req()], _Kv(), 64, 64) == 2  # a burst of exactly 2
    assert p.steps([], _Kv(), 64, 64) == 1  # nothing running
    assert BurstPolicy(budget_s=1.0, limit=1).steps([_Req()], _Kv(), 64, 64) == 1
    kv = _Kv(cap=1)
    assert p.steps([_Req()], kv, 64, 64) == 1 and kv.asked == [2]  # a checkpoint right after
    p8 = BurstPolicy(budget_s=1.0, limit=8)
    got = p8.steps([_Req(), _Req()], _Kv(), 64, 7)  # token budget 7 over 2 rows
    assert got == 3 and type(got) is int
    assert p8.steps([_Req(max_tokens=2)], _Kv(), 64, 64) == 1  # one token left
    assert p8.steps([_Req(max_tokens=3)], _Kv(), 64, 64) == 2
    assert p8.steps([_Req(computed=60)], _Kv(), 64, 64) == 4  # max_model_len 64
    assert p8.steps([_Req(computed=62)], _Kv(), 64, 64) == 2
    assert p8.steps([_Req(computed=63)], _Kv(), 64, 64) == 1
    for r in (_Req(paused=True), _Req(forks=("c",)), _Req(outputs=0)):
        assert p8.steps([_Req(), r], _Kv(), 64, 64) == 1
    assert p8.steps([_Req(), _Req()], _Kv(free=16), 64, 64) == 8  # 2 x 8 blocks: all free
    assert p8.steps([_Req(), _Req()], _Kv(free=15), 64, 64) == 1


def test_policy_off_without_a_budget():
    p = BurstPolicy(budget_s=0.0)
    p.observe({"a": 1}, False, 1e-6)
    assert p.limit == 1 and p.step_s is None


def test_decode_burst_ms_must_not_be_negative(llama_dir):
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="decode_burst_ms"):
            LLM(str(llama_dir), decode_burst_ms=bad)


# ----------------------------------------------------------------------------- the scheduler
BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
STATE = StateSpec("gdn", (StateComponent("ssm", (2, 4), torch.float32),))


def _decoding(specs, caching: bool, limit: int = 8, max_tokens: int = 50, prompt: int = 5,
              blocks: int = 40) -> tuple[Scheduler, Request]:
    """A request that has sampled its first token, and a scheduler whose policy allows
    ``limit`` steps."""
    config = plan_pagefold(specs, BS, 1 << 20)
    config = plan_pagefold(specs, BS, blocks * config.layers_per_group * config.page_bytes)
    kv = KVCacheManager(config, enable_prefix_caching=caching)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    s.burst = BurstPolicy(budget_s=1.0, limit=limit)
    r = Request("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                eos_token_id=99)
    s.add_request(r)
    while not r.output_token_ids:  # the prompt (in chunks ending at checkpoints): no burst
        out = s.schedule()
        assert not out.decode_burst
        done = r.num_computed_tokens + out.num_scheduled["r"] >= r.num_tokens
        s.update_from_output(out, {"r": SampledToken(100)} if done else {})
    assert (r.num_tokens, r.num_computed_tokens) == (prompt + 1, prompt)
    return s, r


def test_a_burst_takes_the_policys_steps_and_all_its_tokens_count():
    s, r = _decoding({"a": ATTN}, caching=False, limit=6)
    out = s.schedule()
    assert out.decode_burst and out.num_scheduled == {"r": 6}
    (eo,) = s.update_from_output(out, {"r": VerifiedTokens([1, 2, 3, 4, 5, 6], 5)})
    assert eo.new_token_ids == [1, 2, 3, 4, 5, 6]
    # 5 + 6 computed; the last sampled token is not computed yet.
    assert (r.num_computed_tokens, r.num_tokens) == (11, 12)
    assert r.output_token_ids == [100, 1, 2, 3, 4, 5, 6]


def test_a_stop_inside_a_burst_ends_the_request_there():
    s, r = _decoding({"a": ATTN}, caching=False, limit=6)
    free = s.kv.pool.num_free
    out = s.schedule()
    (eo,) = s.update_from_output(out, {"r": VerifiedTokens([1, 99, 3, 4, 5, 6], 5)})
    assert eo.new_token_ids == [1, 99] and eo.finish_reason == "stop"
    assert r.output_token_ids == [100, 1, 99] and "r" not in s.requests
    assert s.kv.pool.num_free >= free
    s.kv.check_whole()


def test_a_burst_stops_at_max_tokens_and_max_model_len():
    s, r = _decoding({"a": ATTN}, caching=False, limit=8, max_tokens=4)
    out = s.schedule()
    assert out.num_scheduled == {"r": 3}  # 1 sampled, 3 left
    s2, r2 = _decoding({"a": ATTN}, caching=False, limit=8, prompt=60)
    assert s2.schedule().num_scheduled == {"r": 4}  # 60 computed of max_model_len 64


def test_a_burst_of_a_state_model_with_caching_ends_on_the_block_boundary():
    # 5 prompt tokens computed; the next checkpoint is at 8: a burst of 3 lands on it.
    s, r = _decoding({"a": ATTN, "s": STATE}, caching=True, limit=8)
    out = s.schedule()
    assert out.decode_burst and out.num_scheduled == {"r": 3}
    s.update_from_output(out, {"r": VerifiedTokens([1, 2, 3], 2)})
    assert r.num_computed_tokens == 8
    assert s.schedule().num_scheduled == {"r": 4}  # then a whole block
    # Without caching no checkpoint is due: the policy's steps.
    s2, _ = _decoding({"a": ATTN, "s": STATE}, caching=False, limit=8)
    assert s2.schedule().num_scheduled == {"r": 8}


def test_no_burst_while_a_request_waits_or_the_pool_is_short():
    s, r = _decoding({"a": ATTN}, caching=False, limit=8)
    s.add_request(Request("w", [1, 2, 3], SamplingParams(max_tokens=5)))
    out = s.schedule()
    assert not out.decode_burst and out.num_scheduled["r"] == 1
    # A pool of 4 blocks: the request holds 2 (5 + 1 tokens); 8 more tokens need 2 more
    # blocks, and two are free besides the null block only if nothing else holds them.
    s2, r2 = _decoding({"a": ATTN}, caching=False, limit=8, blocks=3)
    out2 = s2.schedule()
    assert not out2.decode_burst and out2.num_scheduled == {"r": 1}


def test_an_abort_between_bursts_frees_the_request_and_spares_the_others(tiny_model_factory,
                                                                         random_prompts):
    model = tiny_model_factory("qwen3_5")
    on = LLM(str(model), decode_burst_ms=FORCED)
    bursts = _count_bursts(on)
    prompts = random_prompts(3, 8, 20, 512, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = [t for t, *_ in _run(LLM(str(model), decode_burst_ms=0), prompts, greedy)]
    rids = [on.add_request({"prompt_token_ids": p}, greedy) for p in prompts]
    while len(bursts) < 2:
        on.step()
    on.abort([rids[1]])
    done = {}
    while on.engine.has_unfinished():
        for out in on.step():
            assert out.request_id != rids[1]
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {rids[0]: ref[0], rids[2]: ref[2]}
    on.engine.kv.check_whole()


# ----------------------------------------------------------------------------- greedy head
def test_compiled_argmax_follows_the_samplers_rule():
    """``pf_argmax_bf16``: numpy's argmax on the float32 widening (first maximum, first NaN)."""
    import ctypes

    from pagefold.csrc import cpu_ops

    lib = cpu_ops.kernels()
    if lib is None:
        pytest.skip("no compiled kernels on this machine")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 1001, generator=g).bfloat16()
    x[1, 40] = x[1, 900] = 50.0  # a tie: the first index
    x[2, 17] = float("nan")
    x[2, 5] = float("nan")  # two NaNs: the first
    x[3, 0] = float("nan")
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 1000] = 60.0  # the last column
    x[6, :] = 0.0
    x[6, 333] = -0.0  # zeros only: the first
    out = (ctypes.c_int64 * 7)()
    assert lib.pf_argmax_bf16(x.data_ptr(), 7, 1001, 1001, out) == 0
    want = x.float().numpy().argmax(axis=1).tolist()
    assert list(out) == want == [want[0], 40, 5, 0, 0, 1000, 0]
    # Rows ld apart: a strided view of wider rows.
    wide = torch.randn(3, 64, generator=g).bfloat16()
    out3 = (ctypes.c_int64 * 3)()
    assert lib.pf_argmax_bf16(wide.data_ptr(), 3, 50, 64, out3) == 0
    assert list(out3) == wide[:, :50].float().numpy().argmax(axis=1).tolist()
    assert lib.pf_argmax_bf16(wide.data_ptr(), 3, 50, 10, out3) == 1  # rows overlap: refused


def test_greedy_head_gives_the_logits_argmax(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("qwen3_5")), dtype="bfloat16")
    model = llm.engine.runner.model
    w = model.lm_head.weight
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, w.shape[1], generator=g).bfloat16()
    want = lambda rows: Sampler.argmax(model.compute_logits(rows)).tolist()  # noqa: E731
    with torch.inference_mode():
        got = model.greedy_tokens(h)
        assert got is not None and got == want(h)
        w[7] = w[300] = (h[0] * 4).bfloat16()  # row 0: tied maxima at 7 and 300 -> 7
        w[50] = float("nan")  # every row: a NaN logit at 50 -> 50 unless an earlier NaN
        got = model.greedy_tokens(h)
        assert got == want(h) == [50, 50, 50]
        w[50] = 0.0
        assert model.greedy_tokens(h)[0] == want(h)[0] == 7
        assert model.greedy_tokens(h.float()) is None  # not the bf16 GEMV's input
    llm.engine.kv.check_whole()


# ----------------------------------------------------------------------------- greedy run
def _spy_greedy_steps(monkeypatch) -> dict:
    """Count ``GreedyStep`` calls and keep the last one made."""
    from pagefold.layers import decode_native

    seen = {"calls": 0, "last": None}
    init, call = decode_native.GreedyStep.__init__, decode_native.GreedyStep.__call__

    def counting_init(self, *a, **k):
        init(self, *a, **k)
        seen["last"] = self

    def counting_call(self):
        seen["calls"] += 1
        return call(self)

    monkeypatch.setattr(decode_native.GreedyStep, "__init__", counting_init)
    monkeypatch.setattr(decode_native.GreedyStep, "__call__", counting_call)
    return seen


@pytest.mark.parametrize("arch,callbacks", [("qwen3_5", False), ("llama", False),
                                            ("qwen3_next", False), ("qwen3_5", True),
                                            ("nemotron_h", False)])
def test_greedy_run_makes_a_bursts_later_steps_with_the_same_tokens(
        arch, callbacks, tiny_model_factory, random_prompts, monkeypatch):
    """A bf16 greedy burst's later steps in one compiled call each (``greedy_run``): the
    tokens of single steps and of the burst's module-level forwards, batch 1 and batch 3;
    with ``callbacks`` every product goes through the linears' own forwards (the driver's
    callbacks), as steps above the GEMVs' rows do. Nemotron-H's forward is its own: no run."""
    from pagefold.layers import lm_head, native_record

    if callbacks:
        monkeypatch.setattr(native_record, "MAX_GEMV_ROWS", 0)
    model = str(tiny_model_factory(arch))
    prompts = random_prompts(3, 9, 30, 512, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    seen = _spy_greedy_steps(monkeypatch)
    on = LLM(model, dtype="bfloat16", decode_burst_ms=FORCED, block_size=16)
    got = [_run(on, prompts, greedy), _run(on, prompts[:1], greedy)]
    on.engine.kv.check_whole()
    if arch == "nemotron_h":
        assert seen["calls"] == 0
    else:
        assert seen["calls"] >= 30  # most of both runs' steps
        assert len(seen["last"].tokens) == 1  # the batch-1 run made its own
    calls = seen["calls"]
    monkeypatch.setattr(lm_head.CausalLMHead, "greedy_run", lambda *a, **k: None)
    assert [_run(on, prompts, greedy), _run(on, prompts[:1], greedy)] == got
    assert seen["calls"] == calls
    off = LLM(model, dtype="bfloat16", decode_burst_ms=0, block_size=16)
    assert [_run(off, prompts, greedy), _run(off, prompts[:1], greedy)] == got
    off.engine.kv.check_whole()


def test_a_greedy_step_refuses_a_stale_run_and_an_id_outside_the_table(tiny_model_factory,
                                                                       monkeypatch):
    seen = _spy_greedy_steps(monkeypatch)
    llm = LLM(str(tiny_model_factory("qwen3_5")), dtype="bfloat16", decode_burst_ms=FORCED)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                 SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    run = seen["last"]
    assert run is not None and seen["calls"] > 0
    run.native._last = None  # another step ran since: its values are not the run's
    with pytest.raises(RuntimeError, match="another step ran"):
        run()
    run.native._last = run.last
    ids = run.keep[0]
    with torch.inference_mode(), pytest.raises(ValueError, match="outside the embedding table"):
        ids[0] = run.keep[1].shape[0]  # one past the embedding table
        run()
    llm.engine.kv.check_whole()
