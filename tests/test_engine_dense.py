"""End-to-end engine checks on the dense tiny models against Hugging Face transformers.

Every scenario runs 16 prompts of 5..90 tokens together (lengths straddle block boundaries),
greedy in float32, and must reproduce ``hf_greedy`` token for token and ``hf_logprobs`` to
~1e-4, then leave the block pool whole. Scenarios: an ample pool, chunked prefill at odd token
budgets (7, 33), a pool so small that requests are preempted and recomputed, and the priority
policy on that small pool. The rest (sampling, stops, chat, abort, fp8/bf16) use Llama.
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy, hf_logprobs, load_hf_model
from pagefold.testing.tiny_models import EOS_ID, IM_END_ID, IM_START_ID

LENS = [5, 11, 15, 16, 17, 23, 31, 32, 33, 40, 55, 64, 71, 80, 89, 90]
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(5, 512) for _ in range(n)] for n in LENS]
NEW = 12
MAX_LEN = 128  # 90 + 12 tokens fit; one request needs at most 8 blocks of 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)


def _inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _block_bytes(llm: LLM) -> int:
    cfg = llm.engine.kv_config
    return cfg.layers_per_group * cfg.page_bytes


def _check_text(llm: LLM, outs) -> None:
    """Incremental detokenization ends where a one-shot decode of the tokens does.

    Random prompts may end inside a multi-byte character (byte-level BPE), and then the first
    output bytes complete the prompt's character, as in vLLM: only prompts that end on a
    character boundary are held to the equality, and most do.
    """
    tok = llm.get_tokenizer()
    checked = 0
    for o in outs:
        if tok.decode(o.prompt_token_ids[-5:]).endswith("\ufffd"):
            continue
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        checked += 1
    assert checked >= len(outs) // 2


class Case:
    """One architecture: its directory, the oracle's tokens and top logprobs (computed once)."""

    def __init__(self, arch: str, model_dir: Path) -> None:
        self.arch = arch
        self.dir = model_dir
        self.ref = hf_greedy(model_dir, PROMPTS, NEW)
        self.ref_lp = [hf_logprobs(model_dir, p + r, 6)[len(p) - 1 : -1]
                       for p, r in zip(PROMPTS, self.ref)]
        self.block_bytes = 0

    def check_logprobs(self, outs) -> None:
        for o, ref_rows in zip(outs, self.ref_lp):
            c = o.outputs[0]
            assert len(c.logprobs) == NEW
            lp_sum = 0.0
            for tok, got, ref in zip(c.token_ids, c.logprobs, ref_rows):
                vals = sorted(ref.values(), reverse=True)
                assert abs(got[tok].logprob - ref[tok]) < 1e-4
                assert got[tok].rank == 1  # greedy picks the top token
                lp_sum += got[tok].logprob
                for tid, v in ref.items():
                    if v - vals[5] > 1e-3 and v >= vals[4]:  # a top-5 id, clear of the 6th
                        assert tid in got, (self.arch, tid)
                        assert abs(got[tid].logprob - v) < 1e-4
            assert c.cumulative_logprob == pytest.approx(lp_sum, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request, tiny_model_factory) -> Case:
    return Case(request.param, tiny_model_factory(request.param))


SCENARIOS = {
    "ample": dict(kv_cache_memory=1 << 21),
    "chunk7": dict(kv_cache_memory=1 << 21, max_num_batched_tokens=7),
    "chunk33": dict(kv_cache_memory=1 << 21, max_num_batched_tokens=33),
    "preempt": dict(pool_blocks=11),
    "priority": dict(pool_blocks=11, scheduling_policy="priority"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(case: Case, scenario: str):
    kw = dict(SCENARIOS[scenario])
    blocks = kw.pop("pool_blocks", None)
    if blocks is not None:
        if not case.block_bytes:
            probe = LLM(str(case.dir), max_model_len=MAX_LEN, kv_cache_memory=1 << 20)
            case.block_bytes = _block_bytes(probe)
        kw["kv_cache_memory"] = (blocks + 1) * case.block_bytes  # + the null block
    llm = LLM(str(case.dir), max_model_len=MAX_LEN, **kw)
    priority = [(i * 7) % 3 for i in range(len(PROMPTS))] if "scheduling_policy" in kw else None
    outs = llm.generate(_inputs(PROMPTS), GREEDY, use_tqdm=False, priority=priority)
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (g, r) in enumerate(zip(got, case.ref)) if g != r]
    assert not mismatched, f"{case.arch}/{scenario}: prompts {mismatched} differ from HF"
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    if blocks is not None:
        assert llm.engine.kv.pool.num_usable == blocks
        assert llm.engine.scheduler.num_preemptions > 0
    case.check_logprobs(outs)
    _check_text(llm, outs)
    llm.engine.kv.check_whole()
    assert not llm.engine.has_unfinished()


# ------------------------------------------------------------------ Llama-only checks
@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=MAX_LEN, kv_cache_memory=1 << 21)


@pytest.fixture(scope="module")
def llama_ref(llama_dir: Path) -> list[list[int]]:
    return hf_greedy(llama_dir, PROMPTS, NEW)


def _first_token_agreement(llm: LLM, ref: list[list[int]]) -> tuple[float, list]:
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(_inputs(PROMPTS), plain, use_tqdm=False)
    llm.engine.kv.check_whole()
    agree = sum(o.outputs[0].token_ids[0] == r[0] for o, r in zip(outs, ref)) / len(ref)
    return agree, outs


def test_fp8_kv_cache_mostly_agrees_with_float32(llama_dir: Path, llama_ref):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, kv_cache_memory=1 << 20,
              kv_cache_dtype="fp8")
    assert llm.engine.runner.cache.attn["layers.0"].dtype == torch.float8_e4m3fn
    # One fp8 page holds the same tokens in a quarter of the float32 bytes.
    assert llm.engine.kv_config.page_bytes == 16 * 2 * 2 * 16
    agree, outs = _first_token_agreement(llm, llama_ref)
    assert agree >= 0.8, agree
    # Where fp8 rounding flips the argmax, it lands on a near-tie: still in HF's top 5.
    for p, o in zip(PROMPTS, outs):
        top5 = hf_logprobs(llama_dir, p, 5)[-1]
        assert o.outputs[0].token_ids[0] in top5


def test_bf16_model_runs_and_mostly_agrees(llama_dir: Path, llama_ref):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, kv_cache_memory=1 << 20, dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    agree, outs = _first_token_agreement(llm, llama_ref)
    assert agree >= 0.8, agree
    assert all(len(o.outputs[0].token_ids) == NEW for o in outs)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=NEW, ignore_eos=True)


def test_seeded_sampling_reproducible_and_batch_independent(llama: LLM, llama_dir: Path):
    target = PROMPTS[7]
    alone = llama.generate(_inputs([target]), _seeded(42), use_tqdm=False)[0].outputs[0]
    again = llama.generate(_inputs([target]), _seeded(42), use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == again.token_ids
    # Short prompts near block boundaries: in the small pool below they all grow a block soon.
    others = [PROMPTS[i] for i in (3, 2, 4, 5, 6, 1, 8)]
    batch = _inputs(others[:4] + [target] + others[4:])
    params = [_seeded(100 + i) if i % 2 else SamplingParams(temperature=0.8, max_tokens=NEW,
                                                               ignore_eos=True)
              for i in range(8)]
    params[4] = _seeded(42)
    outs = llama.generate(batch, params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone.token_ids
    other_seed = llama.generate(_inputs([target]), _seeded(43), use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids
    # Preemption recomputes the cache but must not replay or reset the request's generator.
    small = LLM(str(llama_dir), max_model_len=MAX_LEN,
                kv_cache_memory=9 * _block_bytes(llama))  # 8 usable: one max_model_len
    outs_small = small.generate(batch, [_seeded(100 + i) for i in range(8)], use_tqdm=False)
    outs_big = llama.generate(batch, [_seeded(100 + i) for i in range(8)], use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs_small] == [
        o.outputs[0].token_ids for o in outs_big]
    small.engine.kv.check_whole()
    llama.engine.kv.check_whole()


def test_stop_string_is_cut_from_text(llama: LLM):
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    full = llama.generate(_inputs(PROMPTS), plain, use_tqdm=False)
    # A short ASCII stop string from the middle of some output's text.
    for i, o in enumerate(full):  # noqa: B007 - i is used after the loop
        text = o.outputs[0].text
        m = re.search(r"[A-Za-z0-9]{2}", text[len(text) // 3 :])
        if m:
            break
    else:
        pytest.fail("no output text holds two ASCII alphanumerics in a row")
    stop = m.group(0)
    cut = text.find(stop)
    out = llama.generate(_inputs([PROMPTS[i]]), SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:cut]
    assert c.token_ids == o.outputs[0].token_ids[: len(c.token_ids)]
    assert len(c.token_ids) < NEW
    kept = llama.generate(_inputs([PROMPTS[i]]), SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    llama.engine.kv.check_whole()


def _hf_with_stops(model_dir: Path, prompt: list[int], stop_ids: list[int], min_new: int,
                   max_new: int) -> list[int]:
    """transformers' greedy generate that stops on ``stop_ids`` after ``min_new`` tokens."""
    model = load_hf_model(model_dir)
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.num_beams = False, 1
    gc.max_new_tokens, gc.min_new_tokens, gc.max_length = max_new, min_new, None
    gc.eos_token_id, gc.pad_token_id = stop_ids, 0
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        setattr(gc, name, None)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt) :].tolist()


def test_stop_token_ids_and_min_tokens(llama: LLM, llama_dir: Path, llama_ref):
    # A prompt whose greedy output brings a fresh token at index 2 (the stop token).
    i = next(j for j, r in enumerate(llama_ref) if r[2] not in r[:2])
    ref, stop = llama_ref[i], llama_ref[i][2]
    c = llama.generate(_inputs([PROMPTS[i]]), SamplingParams(
        temperature=0, max_tokens=NEW, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref[:3]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    # min_tokens bans the stop ids (and eos) until 6 tokens exist: the path changes, and
    # transformers' min_new_tokens does the same.
    c = llama.generate(_inputs([PROMPTS[i]]), SamplingParams(
        temperature=0, max_tokens=NEW, stop_token_ids=[stop], min_tokens=6),
        use_tqdm=False)[0].outputs[0]
    expect = _hf_with_stops(llama_dir, PROMPTS[i], [stop, EOS_ID, IM_END_ID], 6, NEW)
    assert c.token_ids == expect
    assert len(c.token_ids) >= 6 and stop not in c.token_ids[:6]
    assert c.finish_reason == ("stop" if expect[-1] == stop else "length")
    c = llama.generate(_inputs([PROMPTS[i]]), SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref[:4] and c.finish_reason == "length"
    llama.engine.kv.check_whole()


def test_max_model_len_caps_output(llama: LLM, llama_ref):
    prompt = PROMPTS[-1] + PROMPTS[-2][: MAX_LEN - 3 - len(PROMPTS[-1])]
    assert len(prompt) == MAX_LEN - 3
    c = llama.generate(_inputs([prompt]), SamplingParams(
        temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    llama.engine.kv.check_whole()


def test_chat_returns_text(llama: LLM, llama_dir: Path):
    msgs = [{"role": "user", "content": "def main():"}]
    out = llama.chat(msgs, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(out) == 1
    o = out[0]
    assert o.prompt_token_ids[0] == IM_START_ID
    tok = llama.get_tokenizer()
    assert tok.decode(o.prompt_token_ids).endswith("<|im_start|>assistant\n")
    c = o.outputs[0]
    assert isinstance(c.text, str) and c.token_ids
    assert c.token_ids == hf_greedy(llama_dir, [o.prompt_token_ids], 6, ignore_eos=False)[0]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    llama.engine.kv.check_whole()


def test_abort_keeps_pool_whole_and_others_correct(llama: LLM, llama_ref):
    # One token per step: the aborts land while every request is still running.
    with llama.engine.single_steps():
        _abort_scenario(llama, llama_ref)


def _abort_scenario(llama: LLM, llama_ref) -> None:
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    picks = [0, 4, 8, 12, 15]
    ids = {llama.add_request(_inputs([PROMPTS[i]])[0], plain): i for i in picks}
    rids = list(ids)
    for _ in range(3):
        llama.step()
    late = llama.add_request(_inputs([PROMPTS[1]])[0], plain)  # still waiting when aborted
    aborted = {rids[1], rids[3], late}
    llama.abort(sorted(aborted))
    done = {}
    engine = llama.engine
    while engine.has_unfinished():
        for out in llama.step():
            assert out.request_id not in aborted
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                # Finished requests give their blocks back on the step that finished them.
                assert all(out.request_id not in m.req_blocks for m in engine.kv.managers)
    assert set(done) == set(rids) - aborted
    for rid, toks in done.items():
        assert toks == llama_ref[ids[rid]]
    engine.kv.check_whole()


@pytest.mark.parametrize("model", ["qwen3_dir", "qwen3_5_dir"])
def test_warm_up_leaves_cache_and_counters_untouched(model, request):
    """The start-up warm-up forward writes only into the null block and puts its bytes back:
    the whole pool (NaN-filled here) is bit-identical afterwards, and no counter moved."""
    llm = LLM(str(request.getfixturevalue(model)), kv_cache_memory=1 << 22, max_model_len=128,
              max_num_batched_tokens=100, warm_up=False)
    runner = llm.engine.runner
    for t in runner.cache.shared:
        t.view(torch.float32).fill_(float("nan"))
    before = [t.clone() for t in runner.cache.shared]
    assert runner.warm_up(100, seq_len=37) > 0  # 37 + 37 + 26 tokens, chunks of odd sizes
    assert all(torch.equal(a, b) for a, b in zip(before, runner.cache.shared))
    assert runner.num_forward_tokens == 0
