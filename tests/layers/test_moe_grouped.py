"""The MoE experts' grouped many-token path (``layers/moe_rows.py``) against oracles.

Steps of more tokens than the experts' GEMVs take go through ``grouped_forward``: runs of at
most ``max_rows`` positions through the GEMVs in one C call, longer ones through the GEMM
library, and one C call summing each token's weighted rows. The oracles are per-expert loops
of torch ops over the product kernels themselves (never the grouping code):

* without GEMVs, the block's output is the general path's (the Python loop over experts) bit
  for bit;
* with them, every row is a per-expert loop whose products are the chosen GEMV (whose row bits
  do not depend on the rows beside it) for runs of at most ``max_rows`` positions, the AMX
  tile GEMV up to 1,024 where it runs (up to 32 where the widths are not multiples of 32),
  and the GEMM path past that (``matmul_t``: oneDNN or the float32-upcast
  GEMM), summed per token in ascending expert order with torch's bf16 roundings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_helpers import general_path, random_experts

from pagefold.csrc import cpu_ops, gemv_choice, gemv_registry
from pagefold.csrc.gemm import matmul_t
from pagefold.layers import moe, moe_rows
from pagefold.layers.moe import MoEExperts

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="C++ kernels unavailable")

E, H, INTER = 8, 96, 48  # hidden 96: GEMVs' k tails (not a multiple of 32 or 64)


def _experts() -> MoEExperts:
    return random_experts(E, H, INTER)


def _routing(t: int, k: int, seed: int, skew: float = 0.0):
    """x (t, H), ids (t, k) distinct per token, renormalised bf16 weights. ``skew`` > 0 makes
    low-numbered experts draw many more tokens than high ones (long and short runs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    bias = -skew * torch.arange(E, dtype=torch.float32)
    p = (torch.randn(t, E, generator=g) + bias).softmax(-1)
    w, idx = p.topk(k, -1)
    return x, idx, (w / w.sum(-1, keepdim=True)).bfloat16()


def _pair(rows: int) -> tuple:
    """The default GEMV choice with its row limit set to ``rows``."""
    c = cpu_ops.default_choice()
    if c.fn is None:
        pytest.skip("no GEMV on this CPU/build")
    ch = gemv_choice.make_choice(cpu_ops.kernels(), c.name, rows)
    return ch, ch


def _amx_runs() -> bool:
    """The spec: on a CPU whose AMX tile GEMV runs, with no kernel forced, runs past the chosen
    GEMV's rows take the tile GEMV: up to 1,024 positions when hidden and expert widths are
    multiples of 32, else up to 32."""
    return (any(c.name == "amx" for c in gemv_registry.available(cpu_ops.kernels()))
            and gemv_choice.requested() in ("auto", "flags"))


def _tile_top(m: MoEExperts) -> int:
    """The longest run the tile GEMV takes: 1,024 where the widths are multiples of 32, else
    32."""
    return 1024 if m.gate_up_proj.shape[2] % 32 == 0 and m.inter % 32 == 0 else 32


def _product(n: int, cap: int, top: int = 32):
    """The product a run of ``n`` positions takes: (x, w) -> x @ w.T."""
    lib = cpu_ops.kernels()
    if n <= cap:
        fn = getattr(lib, gemv_registry.by_name(cpu_ops.default_choice().name).symbol)
    elif n <= top and _amx_runs():
        fn = lib.pf_linear_bf16_amx  # past 32 rows its blocked path (test_cpu_kernels.py)
    else:  # the GEMM path every product past the GEMVs takes (tests/test_onednn_rows.py)
        return matmul_t
    return lambda x, w: gemv_registry.call(fn, x.contiguous(), w, None)


def _oracle(m: MoEExperts, x, idx, w, cap: int, experts=None) -> torch.Tensor:
    """Per expert (ascending unless ``experts`` gives the order), its tokens ascending, the
    product its run length takes, then each token's weighted rows added with bf16 roundings."""
    out = torch.zeros_like(x)
    for e in (range(m.num_experts) if experts is None else experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)  # tokens ascending
        if tok.numel() == 0:
            continue
        mm = _product(tok.numel(), cap, _tile_top(m))
        gate, up = mm(x[tok], m.gate_up_proj[e]).split(m.inter, -1)
        y = mm(F.silu(gate) * up, m.down_proj[e])
        out[tok] += y * w[tok, slot, None]  # ids distinct per token: no duplicate rows
    return out


_general = general_path


@pytest.mark.parametrize("t,k", [(40, 2), (67, 3), (200, 4)])
def test_grouped_without_gemv_is_the_general_path(t: int, k: int, monkeypatch) -> None:
    """``use_gemv`` off: every run takes the GEMM; the sum is the loop's bit for bit."""
    monkeypatch.setattr(MoEExperts, "use_gemv", False)
    calls = []
    real = moe.grouped_forward
    monkeypatch.setattr(moe, "grouped_forward", lambda *a: calls.append(1) or real(*a))
    m = _experts()
    for seed in range(4):
        x, idx, w = _routing(t, k, seed, skew=0.3 * seed)
        assert torch.equal(m(x, idx, w), _general(m, x, idx, w))
    assert len(calls) == 4


@pytest.mark.parametrize("cap", [1, 4, 16, 32])
@pytest.mark.parametrize("t,k,skew", [(40, 2, 0.0), (90, 3, 0.6), (300, 4, 1.0), (33, 8, 0.0)])
def test_grouped_matches_per_expert_oracle(t: int, k: int, skew: float, cap: int) -> None:
    """Short runs (GEMV) and long runs (GEMM) in one step, each row the oracle's bits."""
    m = _experts()
    pair = _pair(cap)
    mixed = 0
    for seed in range(3):
        x, idx, w = _routing(t, k, seed, skew)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        mixed += int(bool((counts > cap).any()) and bool(((counts > 0) & (counts <= cap)).any()))
        got = moe_rows.grouped_forward(x, idx, w, m.gate_up_proj, m.down_proj, pair)
        assert got is not None
        assert torch.equal(got, _oracle(m, x, idx, w, cap))
    if cap in (4, 16) and skew > 0:
        assert mixed > 0  # the routing really mixes short and long runs


def test_grouped_many_small_runs_in_parallel() -> None:
    """Many experts with a few rows each (a decode batch over a wide MoE): the C call runs the
    experts in parallel over threads; same bits as one after another."""
    m = random_experts(64, H, INTER, seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, H, generator=g).bfloat16()
    w, idx = torch.rand(48, 64, generator=g).softmax(-1).topk(6, -1)
    w = w.bfloat16()
    pair = _pair(32)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(moe_rows.grouped_forward(x, idx, w, m.gate_up_proj, m.down_proj, pair))
    finally:
        torch.set_num_threads(before)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ref = torch.zeros_like(x)
    for e in range(64):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            gate, up = cpu_ops.linear(x[tok], m.gate_up_proj[e], None).split(INTER, -1)
            y = cpu_ops.linear(F.silu(gate) * up, m.down_proj[e], None)
            ref[tok] += y * w[tok, slot, None]
    assert torch.equal(outs[0], ref)


@pytest.mark.parametrize("inter", [INTER, 64], ids=["k48", "k64"])
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
def test_amx_takes_runs_past_the_chosen_rows(forced: bool, inter: int, monkeypatch) -> None:
    """With the chosen GEMVs limited to 2 rows, runs of 3-1,024 take the tile GEMV on AMX
    (3-32 where the expert width, 48, is not a multiple of 32), longer runs the GEMM (the
    oracle's products); a forced kernel (``PAGEFOLD_GEMV``) is never replaced: those runs
    take the GEMM then."""
    if forced:
        monkeypatch.setenv("PAGEFOLD_GEMV", cpu_ops.default_choice().name)
    m = random_experts(E, H, inter)
    pair = _pair(2)
    x, idx, w = _routing(1700, 2, 4, skew=0.8)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    for lo, hi in ((3, 32), (33, 1024), (1025, 10**6)):  # every kind of run, in one step
        assert bool(((counts >= lo) & (counts <= hi)).any()), (lo, hi, counts)
    kinds = [(lo, hi, p[0].name) for p, lo, hi in moe_rows.run_kernels(pair, H, inter)]
    assert kinds[0] == (1, 2, pair[0].name)
    top = 1024 if inter % 32 == 0 else 32
    assert (kinds[1:] == [(3, top, "amx")]) == (_amx_runs() and not forced)
    got = moe_rows.grouped_forward(x, idx, w, m.gate_up_proj, m.down_proj, pair)
    assert torch.equal(got, _oracle(m, x, idx, w, 2))


def test_grouped_mutants_are_caught() -> None:
    """A wrong expert, a dropped weight, another summation order: each changes the output."""
    m = _experts()
    pair = _pair(8)
    x, idx, w = _routing(64, 4, 2, skew=0.5)
    ref = _oracle(m, x, idx, w, 8)
    run = lambda i, ww: moe_rows.grouped_forward(x, i, ww, m.gate_up_proj, m.down_proj, pair)  # noqa: E731
    assert torch.equal(run(idx, w), ref)
    assert not torch.equal(run((idx + 1) % E, w), ref)
    assert not torch.equal(run(idx, torch.ones_like(w)), ref)
    # Descending expert order per token rounds the bf16 sums differently somewhere.
    assert not torch.equal(_oracle(m, x, idx, w, 8, experts=reversed(range(E))), ref)


def test_combine_rejects_a_bad_order() -> None:
    """``pf_moe_combine`` refuses an order that is not a permutation (nothing read past it)."""
    lib = cpu_ops.kernels()
    t, k = 3, 2
    ys = torch.zeros(t * k, H, dtype=torch.bfloat16)
    rows_at = torch.arange(t * k, dtype=torch.int64) * (H * 2) + ys.data_ptr()
    w = torch.ones(t, k, dtype=torch.bfloat16)
    out = torch.empty(t, H, dtype=torch.bfloat16)
    for bad in ([0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 4, 6], [-1, 1, 2, 3, 4, 5]):
        order = torch.tensor(bad, dtype=torch.int64)
        assert lib.pf_moe_combine(rows_at.data_ptr(), order.data_ptr(), t, k, w.data_ptr(), H,
                                  out.data_ptr(), 1) == -1


def test_grouped_declines_float32_and_loops_for_it() -> None:
    m = _experts().float()
    x, idx, w = _routing(40, 2, 0)
    assert not m._grouped_ok(x.float(), idx, w.float())
    ref = torch.zeros(40, H)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            gate, up = F.linear(x[tok].float(), m.gate_up_proj[e]).split(INTER, -1)
            ref[tok] += F.linear(F.silu(gate) * up, m.down_proj[e]) * w.float()[tok, slot, None]
    torch.testing.assert_close(m(x.float(), idx, w.float()), ref, rtol=1e-5, atol=1e-5)


def test_engine_prefill_grouped_is_the_loop_bits(qwen3_next_dir, random_prompts,
                                                monkeypatch) -> None:
    """bf16 Qwen3-Next, prompts of 40-60 tokens (prefill steps through the grouped path), the
    GEMVs off: tokens and logprobs equal the Python loop's, and the path is really taken."""
    from pagefold import LLM, SamplingParams

    monkeypatch.setattr(MoEExperts, "use_gemv", False)
    prompts = random_prompts(3, 40, 60, 512, seed=11)

    def run():
        llm = LLM(str(qwen3_next_dir), dtype="bfloat16", max_model_len=96,
                  kv_cache_memory=4 << 20)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids,
                 [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
                for o in outs]

    calls = []
    real = moe.grouped_forward
    monkeypatch.setattr(moe, "grouped_forward", lambda *a: calls.append(1) or real(*a))
    grouped = run()
    assert calls
    monkeypatch.setattr(MoEExperts, "_grouped_ok", lambda self, *a: False)
    assert grouped == run()
