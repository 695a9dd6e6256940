"""State checkpoints taken inside the kernels instead of cutting prefill chunks at targets.

* the compiled GDN kernel writes, for a capture, the very bytes a call cut after that token
  leaves in the sequence's pages, and changes nothing else;
* end to end (GDN with and without the compiled kernels, Mamba-2): greedy tokens equal
  transformers with the cache off, cut, and captured; the same checkpoints exist (same keys,
  same states), the second pass hits the same lengths from them; a prompt's prefill is one
  step instead of one per target; the pool is whole afterwards.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.core.kv_cache_spec import StateComponent, StateSpec
from pagefold.csrc import cpu_ops
from pagefold.executor.cache_tensors import StateView
from pagefold.ops.gdn import cpu as gdn_cpu
from pagefold.testing.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# ---------------------------------------------------------------------------- compiled GDN
@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
@pytest.mark.parametrize("shape", [(2, 4, 16, 24, 384), (1, 2, 32, 136, 512)],
                         ids=["dv24", "dv136-rows-cross-pages"])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gdn_capture_is_bytewise_the_cut_call(dtype, ssm_dtype, shape):
    g = torch.Generator().manual_seed(11)
    hk, hv, dk, dv, page_bytes = shape
    kernel, lens = 4, [9, 1, 40, 17]
    # (sequence, tokens of it the state includes): first token, mid, two in one, last.
    caps = [(0, 1), (0, 5), (2, 2), (2, 33), (3, 16), (3, 17)]
    c = 2 * hk * dk + hv * dv
    n, t = len(lens), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    spec = StateSpec("gdn", (StateComponent("conv", (c, kernel - 1), dtype),
                             StateComponent("ssm", (hv, dk, dv), ssm_dtype)))
    pages = -(-spec.state_bytes // page_bytes)
    rows = (n + len(caps)) * pages + 1
    raw0 = torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, generator=g)
    ids = (torch.randperm(rows - 1, generator=g) + 1).view(-1, pages)
    page_ids, cap_ids = ids[:n], ids[n:]
    StateView(raw0, spec, pages).scatter(page_ids, {
        "conv": torch.randn(n, c, kernel - 1, generator=g).to(dtype),
        "ssm": (torch.randn(n, hv, dk, dv, generator=g) * 0.3).to(ssm_dtype)})
    has_init = torch.tensor([True, False, True, True])
    mixed = torch.randn(t, c, generator=g).to(dtype)
    ab = torch.randn(t, 2 * hv, generator=g).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    weight = (torch.randn(c, kernel, generator=g) * 0.5).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=g).to(dtype), torch.randn(hv, generator=g).to(dtype)
    heads = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)

    def run(raw, seqs, upto, capture=None):
        """The kernel over sequences ``seqs``, each cut after ``upto[i]`` tokens."""
        view = StateView(raw, spec, pages)
        rows_ = torch.cat([torch.arange(cu[s], cu[s] + u) for s, u in zip(seqs, upto)])
        cu_ = torch.tensor([0, *torch.tensor(upto).cumsum(0).tolist()])
        o = gdn_cpu.gdn_layer(view, page_ids[seqs], has_init[seqs], cu_, mixed[rows_], a[rows_],
                        b[rows_], weight, a_log, dt_bias, capture=capture, **heads)
        assert o is not None
        return o, view

    raw = raw0.clone()
    after = torch.tensor([int(cu[s]) + k - 1 for s, k in caps])
    # Captures given in any order: the wrapper sorts them by token.
    perm = torch.randperm(len(caps), generator=g)
    o, view = run(raw, list(range(n)), lens, (after[perm], cap_ids[perm]))
    o_plain, view_plain = run(raw0.clone(), list(range(n)), lens)
    assert torch.equal(o, o_plain)  # captures change no output ...
    for name, v in view.gather(page_ids).items():  # ... and no final state
        assert torch.equal(v, view_plain.gather(page_ids)[name])
    got = view.gather(cap_ids)
    for m, (s, k) in enumerate(caps):
        _, cut = run(raw0.clone(), [s], [k])
        ref = cut.gather(page_ids[s : s + 1])
        for name in ("conv", "ssm"):
            assert torch.equal(got[name][m], ref[name][0]), (m, name)


# ---------------------------------------------------------------------------- end to end
def _checkpoints(llm) -> dict:
    """{checkpoint key: {component: state}} of every state group's first layer."""
    kv, out = llm.engine.kv, {}
    for key, e in kv.pool.entries.items():
        if key[0] == "ckpt":
            view = llm.engine.runner.cache.state[kv.config.groups[key[1]].layer_names[0]]
            out[key] = view.gather(torch.tensor([[b.block_id for b in e.blocks]]))
    return out


def _prefill_steps(llm) -> list[int]:
    """Counts the engine steps that compute tokens from now on (not the token-free steps that
    only run queued page copies)."""
    steps = [0]
    execute = llm.engine.runner.execute

    def counting(out):
        steps[0] += out.has_tokens
        return execute(out)

    llm.engine.runner.execute = counting
    return steps


@pytest.mark.parametrize("arch,kernels", [("qwen3_5", True), ("qwen3_5", False),
                                          ("nemotron_h", True)],
                         ids=["gdn-compiled", "gdn-torch", "mamba2"])
def test_captured_checkpoints_equal_cut_ones(arch, kernels, tiny_model_factory):
    model = tiny_model_factory(arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (300, 41, 170, 97, 15, 260)]
    ref = hf_greedy(model, prompts, GREEDY.max_tokens)
    cpu_ops.set_enabled(kernels)
    try:
        runs = {}
        for mode in ("kernel", "cut", "off"):
            llm = LLM(str(model), enable_prefix_caching=mode != "off", max_model_len=512,
                      state_checkpoints_in_kernel=mode == "kernel", state_checkpoint_interval=64,
                      max_num_batched_tokens=200, kv_cache_memory="32MiB")
            assert llm.engine.kv.capture_in_kernel == (mode == "kernel")
            steps = _prefill_steps(llm)
            first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                 use_tqdm=False)
            n_steps = steps[0]
            second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                  use_tqdm=False)
            assert [o.outputs[0].token_ids for o in first] == ref, mode
            assert [o.outputs[0].token_ids for o in second] == ref, mode
            runs[mode] = (n_steps, [o.num_cached_tokens for o in second], _checkpoints(llm))
            llm.engine.kv.check_whole()
    finally:
        cpu_ops.set_enabled(True)
    (k_steps, k_hits, k_ck), (c_steps, c_hits, c_ck) = runs["kernel"], runs["cut"]
    assert k_hits == c_hits and sum(k_hits) > 0  # the same hits, from the same checkpoints
    assert k_ck.keys() == c_ck.keys() and len(k_ck) > len(prompts)
    for key in k_ck:
        for name, v in k_ck[key].items():
            torch.testing.assert_close(v, c_ck[key][name], atol=1e-5, rtol=1e-5)
    assert k_steps == runs["off"][0] < c_steps  # no step more than without caching


def test_one_prompt_prefills_in_one_step_with_every_checkpoint(qwen3_5_dir):
    prompt = [random.Random(2).randrange(5, 500) for _ in range(600)]
    saved = {}
    for mode in (True, False):
        llm = LLM(str(qwen3_5_dir), max_model_len=1024, state_checkpoints_in_kernel=mode,
                  max_num_batched_tokens=1024, kv_cache_memory="32MiB")
        steps = _prefill_steps(llm)
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        # Targets 256, 512, 544 (3 blocks before the last boundary) and 592: cut, that is
        # five steps; captured, one.
        assert steps[0] == (1 if mode else 5)
        saved[mode] = {e.saved_tokens for e in llm.engine.kv.pool.entries.values()
                       if e.is_checkpoint}
        llm.engine.kv.check_whole()
    assert saved[True] == saved[False] == {256, 512, 544, 592}


def test_a_state_layer_that_cannot_capture_keeps_the_cuts(tiny_model_factory):
    """Falcon-H1's mixer subclasses the Mamba-2 mixer with its own forward (no captures): the
    promise is not inherited, so its prompts are cut at targets, and hits stay exact."""
    model = tiny_model_factory("falcon_h1")
    prompts = [[random.Random(7).randrange(5, 500) for _ in range(150)]] * 2
    llm = LLM(str(model), max_model_len=256, state_checkpoint_interval=64,
              max_num_batched_tokens=200, kv_cache_memory="32MiB")
    assert not llm.engine.runner.captures_in_kernel and not llm.engine.kv.capture_in_kernel
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert outs[1].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    llm.engine.kv.check_whole()
