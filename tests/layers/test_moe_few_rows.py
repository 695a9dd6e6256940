"""The MoE experts' few-token (decode) path against the general path and a per-token oracle.

``MoEExperts._few_rows`` groups tokens by expert on the host and calls the GEMV on each
expert's weight slices. With ``use_gemv`` off its products are ``F.linear``'s, so the block's
output must be the general path's bit for bit; with it on, every output row must be a naive
per-token loop over the token's experts (ascending) whose products are ``cpu_ops.linear`` (the
GEMV's row bits do not depend on how many rows share a call).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_helpers import general_path, random_experts

from pagefold.csrc import cpu_ops, gemv_choice
from pagefold.layers import moe
from pagefold.layers.moe import MoEExperts

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="C++ kernels unavailable")

E, H, INTER, K = 6, 64, 16, 2


@pytest.fixture(autouse=True)
def _few_row_limit(monkeypatch) -> None:
    """The few-token path takes steps of up to as many tokens as the experts' GEMVs take,
    which depends on the CPU and its measurements: 2 for the dot-product GEMV where the CPU has
    native bf16 GEMM but no AMX, 32 elsewhere. These tests use steps of up to 5 tokens and
    4-request engine decode steps, so every GEMV takes at least 8 rows here (each takes any
    number of rows, each row's bits independent of the others)."""
    make = gemv_choice.make_choice
    monkeypatch.setattr(gemv_choice, "make_choice", lambda lib, name, rows: make(
        lib, name, max(rows, 8) if name != gemv_choice.TORCH else rows))
    monkeypatch.setattr(cpu_ops, "_defaults", {})


def _experts() -> MoEExperts:
    return random_experts(E, H, INTER)


def _routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    p = torch.rand(t, E, generator=g).softmax(-1)
    w, idx = p.topk(K, -1)
    return x, idx, (w / w.sum(-1, keepdim=True)).bfloat16()


_general = general_path


def _oracle(m: MoEExperts, x, idx, w) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(K), key=lambda j: int(idx[t, j])):
            e = int(idx[t, j])
            gate, up = cpu_ops.linear(x[t : t + 1], m.gate_up_proj[e], None).split(INTER, -1)
            y = cpu_ops.linear(F.silu(gate) * up, m.down_proj[e], None)
            out[t : t + 1] += y * w[t, j]
    return out


@pytest.mark.parametrize("t", [1, 2, 3, 5])
def test_few_rows_without_gemv_is_the_general_path(t: int, monkeypatch) -> None:
    m = _experts()
    monkeypatch.setattr(MoEExperts, "use_gemv", False)
    for seed in range(8):
        x, idx, w = _routing(t, seed)
        assert m._few_rows(x, idx, w) is not None
        assert torch.equal(m(x, idx, w), _general(m, x, idx, w))


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("t", [1, 2, 3, 5])
def test_few_rows_gemv_matches_per_token_oracle(t: int, native: bool, monkeypatch) -> None:
    """Both the one-call C path (csrc/moe.cpp) and the Python loop are the oracle's bits."""
    monkeypatch.setattr(moe, "NATIVE", native)
    calls = []
    real = MoEExperts._few_rows_native
    monkeypatch.setattr(MoEExperts, "_few_rows_native",
                        lambda self, *a: calls.append(1) or real(self, *a))
    m = _experts()
    for seed in range(8):
        x, idx, w = _routing(t, seed)
        got = m._few_rows(x, idx, w)
        assert got is not None
        assert torch.equal(got, _oracle(m, x, idx, w))
        # Same arithmetic contract as the general path: float32 sums, one rounding per op.
        torch.testing.assert_close(got, _general(m, x, idx, w), rtol=2e-2, atol=2e-2)
    assert bool(calls) == native


def test_few_rows_c_call_takes_a_repeated_expert() -> None:
    """The one-call C path with the same expert in both slots of every token (an expert's run
    then has more positions than the step has tokens): every position computed, the oracle's
    bits (slots of one expert summed in slot order)."""
    m = _experts()
    x, idx, w = _routing(3, 2)
    idx = torch.full_like(idx, 4)
    got = m._few_rows_native(x, idx, w)
    assert got is not None
    assert torch.equal(got, _oracle(m, x, idx, w))


def test_few_rows_mutants_are_caught() -> None:
    """A wrong expert row or a dropped routing weight must change the output."""
    m = _experts()
    x, idx, w = _routing(3, 1)
    ref = _oracle(m, x, idx, w)
    assert not torch.equal(m._few_rows(x, (idx + 1) % E, w), ref)
    assert not torch.equal(m._few_rows(x, idx, torch.ones_like(w)), ref)


def test_few_rows_declines_float32_and_large_steps() -> None:
    m = _experts()
    x, idx, w = _routing(2, 0)
    assert m.float()._few_rows(x.float(), idx, w.float()) is None
    m = _experts()
    x, idx, w = _routing(cpu_ops.gemv_max_rows() + 1, 0)
    assert m._few_rows(x, idx, w) is None
    assert torch.equal(m(x, idx, w), _general(m, x, idx, w))


def _engine_run(model_dir, prompts):
    from pagefold import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=64, kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def test_engine_decode_few_rows_is_module_path_bits(qwen3_next_dir, random_prompts,
                                                    monkeypatch) -> None:
    """bf16 Qwen3-Next: decode steps through the few-token path (F.linear products) give the
    general path's tokens and logprobs exactly, and the path is really taken."""
    prompts = random_prompts(4, 5, 24, 512, seed=3)
    monkeypatch.setattr(MoEExperts, "use_gemv", False)
    calls = []
    few = MoEExperts._few_rows

    def counting(self, *args):
        out = few(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(MoEExperts, "_few_rows", counting)
    fast = _engine_run(qwen3_next_dir, prompts)
    assert sum(calls) > 0
    monkeypatch.setattr(MoEExperts, "_few_rows", lambda self, *args: None)
    assert fast == _engine_run(qwen3_next_dir, prompts)
