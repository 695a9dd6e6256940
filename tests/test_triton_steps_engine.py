"""End to end with ``PAGEFOLD_KERNELS=triton`` (the interpreter without CUDA): the state
layers' capture steps and speculative verify steps run on the Triton kernels of
``pagefold.ops.{gdn,ssd}.triton``, never on the torch fallback, for a Gated DeltaNet (qwen3_5)
and a Mamba-2 hybrid (nemotron_h) tiny model.

* Prefix caching with in-kernel captures: one prefill step per prompt takes checkpoints at
  16 and 32 tokens inside the chunk; the second pass hits 32 tokens from them; greedy tokens
  equal transformers both times, and the checkpoints hold the torch path's states (same keys;
  the same values up to float32 rounding: the layers before them run other kernels).
* Speculative decoding (n-gram config, drafts from an oracle that corrupts some positions so
  that every accepted length occurs): greedy tokens equal transformers.

The torch fallbacks are made to raise while Triton is on, and the Triton entry points are
counted, so these tests cannot pass through the fallback.
"""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.kernels import dispatch
from pagefold.testing.oracle import hf_greedy

dispatch.prepare_interpreter()  # before triton is first imported (no-op with CUDA)
pytest.importorskip("triton")

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# One state layer and one attention layer each (the interpreter's time is per layer).
MODELS = {"qwen3_5": dict(num_hidden_layers=2, layer_types=["linear_attention",
                                                           "full_attention"]),
          "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention"])}


def _forbid(*_a, **_k):
    raise AssertionError("the torch fallback ran while the Triton kernels are on")


def _triton_steps(monkeypatch) -> dict[str, int]:
    """Triton on (the caller restores the mode), the torch capture / verify helpers of the
    state layers forbidden, and the Triton capture and verify entry points counted."""
    from pagefold.ops import conv1d, gdn, ssd
    from pagefold.ops.gdn import triton as gdn_triton
    from pagefold.ops.ssd import triton as ssd_triton

    dispatch.set_mode("triton")
    calls = {"capture_conv_and_plan": 0}
    for mod, name in ((gdn_triton, "capture_conv_and_plan"), (ssd_triton, "capture_conv_and_plan"),
                      (gdn_triton, "gdn_verify_layer"), (ssd_triton, "mamba_verify_layer")):
        calls.setdefault(name, 0)
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    for mod in (gdn, ssd):
        monkeypatch.setattr(mod, "causal_conv1d_state_at", _forbid)
    monkeypatch.setattr(conv1d, "causal_conv1d_verify", _forbid)
    monkeypatch.setattr(gdn, "gdn_verify", _forbid)
    monkeypatch.setattr(ssd, "ssd_verify", _forbid)
    return calls


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _checkpoints(llm) -> dict:
    """{checkpoint key: {component: state}} of every state group's first layer."""
    kv, out = llm.engine.kv, {}
    for key, e in kv.pool.entries.items():
        if key[0] == "ckpt":
            view = llm.engine.runner.cache.state[kv.config.groups[key[1]].layer_names[0]]
            out[key] = view.gather(torch.tensor([[b.block_id for b in e.blocks]]))
    return out


def _capture_pass(model, prompts, ref):
    llm = LLM(str(model), max_model_len=64, state_checkpoints_in_kernel=True,
              state_checkpoint_interval=16, max_num_batched_tokens=96)
    assert llm.engine.kv.capture_in_kernel
    assert _ids(_run(llm, prompts)) == ref
    again = _run(llm, prompts)
    assert _ids(again) == ref
    assert [o.num_cached_tokens for o in again] == [32] * len(prompts)
    ck = _checkpoints(llm)
    llm.engine.kv.check_whole()
    return ck


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_triton_captures_and_verify_match_transformers(arch, tiny_model_factory,
                                                       random_prompts):
    model = tiny_model_factory(arch, **MODELS[arch])
    # Captures: 2 prompts of 40 tokens, prefilled in one step each (targets 16 and 32).
    prompts = random_prompts(2, 40, 40, 512, seed=31)
    ref = hf_greedy(model, prompts, NEW)
    verify = "gdn_verify_layer" if arch == "qwen3_5" else "mamba_verify_layer"
    before = dispatch.mode()
    dispatch.set_mode("torch")
    try:
        torch_ck = _capture_pass(model, prompts, ref)  # the reference: the torch path
    finally:
        dispatch.set_mode(before)
    with pytest.MonkeyPatch.context() as mp:
        calls = _triton_steps(mp)
        try:
            ck = _capture_pass(model, prompts, ref)
            assert calls["capture_conv_and_plan"] > 0
            assert ck.keys() == torch_ck.keys() and len(ck) >= 2 * len(prompts)
            for key in ck:
                for name, v in ck[key].items():
                    torch.testing.assert_close(v, torch_ck[key][name], atol=1e-5, rtol=1e-5)

            # Speculative decoding: prompts that repeat themselves, drafts from an oracle.
            sprompts = [p + p[:8] for p in random_prompts(2, 12, 20, 512, seed=32)]
            sref = hf_greedy(model, sprompts, NEW)
            # Prefix caching on: verify chunks end on block boundaries (decode checkpoints).
            llm = LLM(str(model), max_model_len=64,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
            table = {tuple(p): r for p, r in zip(sprompts, sref, strict=True)}

            def propose(req, k):
                n = req.num_output_tokens
                d = list(table[tuple(req.prompt_token_ids)][n : n + k])
                return [(t + 1) % 512 if (n + j) % 3 == 2 else t for j, t in enumerate(d)]

            llm.engine.spec.propose_fn = propose
            assert _ids(_run(llm, sprompts)) == sref
            m = llm.engine.spec.metrics
            assert 0 < m.num_accepted_tokens < m.num_draft_tokens
            assert calls[verify] > 0
            llm.engine.kv.check_whole()
        finally:
            dispatch.set_mode(before)
