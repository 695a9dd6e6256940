"""Greedy tokens with ``PAGEFOLD_KERNELS=triton`` equal transformers' for a dense, a Gated
DeltaNet and a Mamba-2 tiny model, under chunked prefill, preemption and prefix hits.

Without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), so prompts
are few and short; the kernels themselves are checked at awkward shapes in
``test_triton_kernels.py``. Each scenario also asserts that the Triton path actually ran
(a counter on the dispatch point) and that the block pool is whole again.
"""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.kernels import dispatch
from pagefold.testing.oracle import hf_greedy

dispatch.prepare_interpreter()  # before triton is first imported (no-op with CUDA)
pytest.importorskip("triton")

N_NEW = 10
PARAMS = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
# Pools that hold one request and little more (pages of 4 / 8 / 4 KiB), 7 tokens per step:
# with 4 requests in flight some are preempted (the schedule is the same whatever the kernels,
# so these were found with the fast paths).
ENGINE = {"llama": dict(kv_cache_memory=8 * 4096, max_num_batched_tokens=7),
          "qwen3_5": dict(kv_cache_memory=7 * 8192, max_num_batched_tokens=7),
          "nemotron_h": dict(kv_cache_memory=22 * 4096, max_num_batched_tokens=7)}
# The GDN hybrid with one GDN and one attention layer (the interpreter's time is per layer).
SMALL = {"qwen3_5": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])}
FIXTURES = {"llama": "llama_dir", "nemotron_h": "nemotron_h_dir"}


@pytest.fixture
def triton_mode(monkeypatch):
    """Force the Triton kernels for one test and count the layer calls that reached them."""
    calls = {"n": 0}
    before = dispatch.mode()
    dispatch.set_mode("triton")
    real = dispatch.use_triton

    def counting(device):
        on = real(device)
        calls["n"] += on
        return on

    monkeypatch.setattr(dispatch, "use_triton", counting)
    # Prefill chunks of the state layers must reach the chunked kernels.
    from pagefold.ops.gdn import triton_chunked as gdn_chunked
    from pagefold.ops.ssd import triton_chunked as ssd_chunked

    for mod, name in ((gdn_chunked, "gdn_chunked_paged"), (ssd_chunked, "ssd_chunked_paged")):
        calls[name] = 0
        real_fn = getattr(mod, name)

        def chunked(*a, _real=real_fn, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, chunked)
    yield calls
    dispatch.set_mode(before)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "nemotron_h"])
def test_triton_greedy_matches_transformers(arch, request, random_prompts, triton_mode):
    if arch in SMALL:
        model_dir = request.getfixturevalue("tiny_model_factory")(arch, **SMALL[arch])
    else:
        model_dir = request.getfixturevalue(FIXTURES[arch])
    # 4 prompts; two share an 18-token prefix so that the second pass hits the prefix cache.
    base = random_prompts(4, 5, 16, 512, seed=21)
    shared = random_prompts(1, 18, 18, 512, seed=22)[0]
    prompts = base[:2] + [shared + base[2][:2], shared + base[3][:4]]
    ref = hf_greedy(model_dir, prompts, N_NEW)

    # Chunked prefill (7 tokens a step, chunks mixed with decodes) in a small pool:
    # preemption; then the shared-prefix prompts again: prefix hits.
    llm = LLM(str(model_dir), max_model_len=32, **ENGINE[arch])
    assert _ids(_run(llm, prompts)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert triton_mode["n"] > 0
    chunked = {"qwen3_5": "gdn_chunked_paged", "nemotron_h": "ssd_chunked_paged"}.get(arch)
    assert chunked is None or triton_mode[chunked] > 0
    again = _run(llm, prompts[2:])
    assert _ids(again) == ref[2:]
    assert all(o.num_cached_tokens >= 16 for o in again)
    llm.engine.kv.check_whole()


def test_modes_route_as_documented(monkeypatch):
    from pagefold.csrc import cpu_ops

    before = dispatch.mode()
    try:
        dispatch.set_mode("torch")
        assert dispatch.backend(torch.device("cpu")) == "torch" and cpu_ops.kernels() is None
        dispatch.set_mode("cpu")
        assert not dispatch.use_triton(torch.device("cpu"))
        dispatch.set_mode("triton")
        assert dispatch.backend(torch.device("cpu")) == "triton"
        assert cpu_ops.kernels() is None  # forced Triton: no C++ kernel runs
        dispatch.set_mode("auto")
        assert not dispatch.use_triton(torch.device("cpu"))  # CPU tensors: C++ or torch
        with pytest.raises(ValueError, match="PAGEFOLD_KERNELS"):
            dispatch.set_mode("cuda")
    finally:
        dispatch.set_mode(before)
