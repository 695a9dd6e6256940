"""Structured output (xgrammar), token controls and prompt logprobs, offline.

Differential where possible: the packed-bitmask sampler stage against xgrammar's own kernel,
prompt logprobs against HF transformers; constraints checked under n > 1, preemption and
prefix caching, with the pool whole afterwards.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.executor.sampler import Sampler, SamplingMetadata
from pagefold.structured_output import StructuredOutputsParams as S
from pagefold.structured_output.manager import apply_token_bitmask
from pagefold.testing.oracle import hf_logprobs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"]}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("qwen3")), max_model_len=256, kv_cache_memory="8MiB")


def test_bitmask_matches_xgrammar_kernel():
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    ours = apply_token_bitmask(logits.clone(), mask, use_xgrammar=False)
    assert torch.equal(ours, apply_token_bitmask(logits.clone(), mask))
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, mask)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_sampler_token_controls():
    logits = torch.zeros(3, 8)
    logits[:, 5] = 3.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=0, logit_bias={6: 10}),
              SamplingParams(temperature=0, bad_words_token_ids=[[4, 5], [7, 5]],
                             bad_words=["x"])]
    meta = SamplingMetadata.build(params, [[], [], [3, 7]])
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert out[0] in (1, 2) and out[1] == 6 and out[2] != 5
    # A bad word only bites right after its prefix: after [3, 3] token 5 is allowed.
    assert Sampler()(logits[:1], SamplingMetadata.build(
        [params[2]], [[3, 3]])).sampled_token_ids.tolist() == [5]


def test_json_schema_n_and_seeds_valid(llm):
    outs = llm.generate(["hello", "import os"], SamplingParams(
        n=3, temperature=1.0, seed=4, max_tokens=120, structured_outputs=S(json=SCHEMA)),
        use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.engine.structured.num_matchers == 0  # freed with their requests
    llm.engine.kv.check_whole()


def test_compiled_once_per_schema(llm):
    comp = llm.engine.structured.compiler
    before = comp.num_compiles
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(
        json={"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]}))
    llm.generate(["a", "b"], sp, use_tqdm=False)
    llm.generate(["c"], sp, use_tqdm=False)
    assert comp.num_compiles == before + 1


def test_regex_choice_grammar(llm):
    outs = llm.generate(["x", "y", "z"], [
        SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                       structured_outputs=S(regex=r"[a-c]{2}-\d{3}")),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                       structured_outputs=S(choice=["alpha", "beta", "gamma"])),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=S(grammar='root ::= ("ab" | "cd")+ "!"'))],
        use_tqdm=False)
    a, b, c = (o.outputs[0].text for o in outs)
    assert re.fullmatch(r"[a-c]{2}-\d{3}", a)
    assert b in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"(ab|cd)+!", c) or outs[2].outputs[0].finish_reason == "length"


def test_bad_constraint_rejected_nothing_queued(llm):
    with pytest.raises(ValueError, match="undefined_rule"):
        llm.generate(["x"], SamplingParams(structured_outputs=S(grammar="root ::= undefined_rule")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    assert not llm.engine.has_unfinished()
    llm.engine.kv.check_whole()


def test_constraints_survive_preemption_and_prefix_hits(tiny_model_factory, random_prompts):
    """A pool too small for the batch: requests are preempted (recompute) and resumed with
    their matcher state intact; repeated prompts hit the prefix cache."""
    model = str(tiny_model_factory("qwen3"))
    llm = LLM(model, max_model_len=160, kv_cache_memory=300_000, preemption_mode="recompute")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 40, 60, 512, seed=3)] * 2
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=100,
                        structured_outputs=S(json=SCHEMA))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(llm.engine.scheduler.preemptions_by_kind.values()) > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    # Same prompt + seed -> same constrained output, with or without a cache hit.
    assert [o.outputs[0].text for o in outs[:8]] == [o.outputs[0].text for o in outs[8:]]
    llm.engine.kv.check_whole()


def test_rollback_api(llm):
    """Speculative decoding's hooks: accept a prefix of drafts, roll back rejected ones."""
    from pagefold.request import Request

    mgr = llm.engine.structured
    req = Request("spec", [1, 2], SamplingParams(structured_outputs=S(choice=["yes", "no"])),
                  eos_token_id=llm.engine.eos_token_id)
    tok = llm.get_tokenizer()
    yes = tok.encode("yes", add_special_tokens=False)
    no = tok.encode("no", add_special_tokens=False)
    mgr.check(req.sampling_params)
    assert mgr.accept_prefix(req, yes) == len(yes)
    mgr.rollback(req, len(yes))
    assert mgr.accept_prefix(req, no + no) == len(no)  # the second "no" breaks the grammar
    mask = mgr.bitmask([req], 512)
    allowed = [t for t in range(512) if mask[0, t // 32] >> (t % 32) & 1]
    assert allowed and all(t in mgr.stop_token_ids or t == req.eos_token_id for t in allowed)
    mgr.free("spec")


def test_prompt_logprobs_match_hf_chunked_and_forked(tiny_model_factory):
    model = str(tiny_model_factory("qwen3"))
    llm = LLM(model, max_model_len=256, kv_cache_memory="8MiB", max_num_batched_tokens=37)
    prompt = list(range(30, 130))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=2, prompt_logprobs=3, n=2, temperature=1.0, seed=0), use_tqdm=False)[0]
    ref = hf_logprobs(model, prompt, 3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert prompt[p] in entry
        top = {t: lp.logprob for t, lp in entry.items() if t != prompt[p] or lp.rank <= 3}
        for t, lp in ref[p - 1].items():
            assert top.get(t, entry.get(t).logprob if t in entry else None) == pytest.approx(
                lp, abs=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm.engine.kv.check_whole()


def test_truncate_and_bad_words_offline(llm):
    out = llm.generate([{"prompt_token_ids": list(range(10, 80))}], SamplingParams(
        max_tokens=1, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(75, 80))
    base = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)[0].outputs[0]
    word = llm.get_tokenizer().decode(base.token_ids)
    if llm.get_tokenizer().encode(word, add_special_tokens=False) == base.token_ids:
        again = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=1,
                                                       bad_words=[word]),
                             use_tqdm=False)[0].outputs[0]
        assert again.token_ids != base.token_ids


def _inproc_loop(core, name: str):
    """An EngineCore-process loop over inproc sockets: (loop, send, sockets, context)."""
    import os

    import msgspec
    import zmq

    from pagefold.engine.core_proc import _CoreLoop

    ctx = zmq.Context()
    socks = [ctx.socket(t) for t in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL)]
    socks[0].bind(f"inproc://{name}-in")
    socks[1].connect(f"inproc://{name}-in")
    socks[2].bind(f"inproc://{name}-out")
    socks[3].connect(f"inproc://{name}-out")
    enc = msgspec.msgpack.Encoder()
    return _CoreLoop(core, socks[1], socks[2], os.getppid()), \
        (lambda msg: socks[0].send(enc.encode(msg))), socks, ctx


def test_grammar_compiles_off_the_step_loop(tiny_model_factory):
    """In the EngineCore process a request whose grammar is not cached waits in the compile
    thread while the running requests keep stepping: here the compile is held until a plain
    request has finished all its tokens. Then it joins (cached: its twin is added at once); a
    compile error is that request's error; an abort drops a request still compiling."""
    import threading

    from pagefold.engine.core_proc import AbortRequests, AddRequest

    llm = LLM(str(tiny_model_factory("qwen3")), max_model_len=256, kv_cache_memory="8MiB")
    core = llm.engine
    compiler = core.structured.compiler
    release, entered = threading.Event(), threading.Event()
    original = compiler.compile

    def held_compile(so):
        if so.kind == "json" and "held" in json.dumps(so.json):
            entered.set()
            assert release.wait(30)
        return original(so)

    compiler.compile = held_compile
    held = {"type": "object", "properties": {"held": {"type": "integer", "minimum": 0,
                                                      "maximum": 99}}, "required": ["held"]}
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=30, temperature=0,
                                 structured_outputs=S(json=held))
    loop, send, socks, ctx = _inproc_loop(core, "compile")
    try:
        send(AddRequest("plain", [5, 6, 7], plain))
        send(AddRequest("json", [5, 6, 8], constrained))
        errors: list = []
        loop.handle_inputs(2000)
        assert set(core.scheduler.requests) == {"plain"} and len(loop._pending) == 1
        assert entered.wait(10)
        tokens = 0
        while core.has_unfinished():  # the loop's steps, with the grammar still compiling
            tokens += sum(len(o.new_token_ids) for o in core.step())
            assert not loop.admit_compiled(errors)
        assert tokens == 8 and "json" not in core.scheduler.requests
        release.set()
        loop._pending[0][0].result(30)
        assert loop.admit_compiled(errors) and not errors
        assert set(core.scheduler.requests) == {"json"} and not loop._pending
        send(AddRequest("json2", [5, 6, 9], constrained))  # cached now: no wait
        loop.handle_inputs(2000)
        assert "json2" in core.scheduler.requests and not loop._pending
        texts = {}
        while core.has_unfinished():
            for o in core.step():
                texts[o.request_id] = texts.get(o.request_id, []) + list(o.new_token_ids)
        tok = llm.get_tokenizer()
        for rid in ("json", "json2"):
            jsonschema.validate(json.loads(tok.decode(texts[rid], skip_special_tokens=True)),
                                held)
        # A compile error through the thread: the request's error, nothing queued.
        send(AddRequest("bad", [5, 6], SamplingParams(
            structured_outputs=S(grammar="root ::= undefined_rule"))))
        loop.handle_inputs(2000)
        loop._pending[0][0].exception(30)
        assert loop.admit_compiled(errors)
        assert [e.request_id for e in errors] == ["bad"] and "undefined_rule" in errors[0].message
        # An abort while compiling drops the request.
        release.clear()
        send(AddRequest("gone", [5, 6], SamplingParams(structured_outputs=S(json=dict(
            held, title="other")))))
        send(AbortRequests(["gone"]))
        loop.handle_inputs(2000)
        assert not loop._pending and not core.has_unfinished()
        release.set()
        core.flush()
        core.kv.check_whole()
    finally:
        release.set()
        loop.close()
        compiler.compile = original
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
