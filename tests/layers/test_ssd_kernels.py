"""Mamba-2 SSD kernels and the gated RMSNorm.

* chunked / recurrent kernels agree with the naive per-token recurrence on varlen batches;
* processing a sequence in pieces with the state carried equals one pass;
* a composition of pagefold pieces reproduces transformers' Nemotron-H Mamba-2 mixer (torch
  path), for a whole prompt and for the one-token cache (decode) step after a prefix;
* GatedRMSNorm matches the HF gated norms of Nemotron-H, Bamba and GraniteMoeHybrid.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagefold.layers.mamba.gated_norm import GatedRMSNorm  # noqa: E402
from pagefold.ops.ssd.reference import (  # noqa: E402
    SSD_KERNELS,
    ssd_chunked,
    ssd_naive,
    ssd_recurrent,
)

ATOL = 1e-4


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long)


def _inputs(lens: list[int], H: int, P: int, G: int, N: int, seed: int) -> dict:
    """Random SSD inputs; the initial states are nonzero so state carry-in is exercised."""
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)
    return dict(
        x=torch.randn(T, H, P, generator=g),
        dt=torch.randn(T, H, generator=g),
        A=-(torch.rand(H, generator=g) * 1.5 + 0.05),
        B=torch.randn(T, G, N, generator=g) * 0.5,
        C=torch.randn(T, G, N, generator=g) * 0.5,
        D=torch.randn(H, generator=g),
        initial_state=torch.randn(S, H, P, N, generator=g),
        cu_seqlens=_cu(lens),
        dt_bias=torch.randn(H, generator=g) * 0.5,
    )


def _call(fn, inp: dict, **kw):
    args = {k: v for k, v in inp.items() if k != "dt_bias"}
    return fn(**args, dt_bias=inp["dt_bias"], **kw)


def _slice(inp: dict, rows: dict[int, tuple[int, int]], state: torch.Tensor) -> dict:
    """Sub-batch holding, for each sequence s in ``rows``, its tokens [a, b)."""
    cu = inp["cu_seqlens"].tolist()
    tok = torch.cat([torch.arange(cu[s] + a, cu[s] + b) for s, (a, b) in rows.items()])
    seqs = list(rows)
    return dict(
        x=inp["x"][tok],
        dt=inp["dt"][tok],
        A=inp["A"],
        B=inp["B"][tok],
        C=inp["C"][tok],
        D=inp["D"],
        initial_state=state[seqs],
        cu_seqlens=_cu([b - a for a, b in rows.values()]),
        dt_bias=inp["dt_bias"],
    )


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("kernel", ["chunked", "recurrent"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_kernels_match_naive_varlen(G: int, kernel: str, chunk_size: int) -> None:
    lens = [1, 7, 33, 64, 65, 130]
    inp = _inputs(lens, H=4, P=8, G=G, N=16, seed=G)
    kw = dict(dt_min=0.01, dt_max=4.0, chunk_size=chunk_size)
    y_ref, h_ref = _call(ssd_naive, inp, **kw)
    y, h = _call(SSD_KERNELS[kernel], inp, **kw)
    assert y.shape == inp["x"].shape and y.dtype == torch.float32
    assert h.shape == inp["initial_state"].shape and h.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=1e-4)


def test_naive_single_token_closed_form() -> None:
    """One token from a zero state: y = (C . B) dt' x + D x with dt' clamped."""
    inp = _inputs([1], H=2, P=3, G=1, N=4, seed=5)
    inp["initial_state"].zero_()
    inp["dt"] = torch.tensor([[3.0, -6.0]])
    inp["dt_bias"] = torch.zeros(2)
    # softplus gives ~3.05 and ~0.0025: head 0 is clamped to dt_max, head 1 to dt_min.
    dt_eff = torch.tensor([1.0, 0.01])
    cb = (inp["C"][0, 0] * inp["B"][0, 0]).sum()
    x = inp["x"][0]
    expect = cb * dt_eff[:, None] * x + inp["D"][:, None] * x
    for fn in SSD_KERNELS.values():
        y, h = _call(fn, inp, dt_min=0.01, dt_max=1.0)
        torch.testing.assert_close(y[0], expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            h[0], dt_eff[:, None, None] * x[..., None] * inp["B"][0, 0], atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("G", [1, 2])
def test_decode_batch_all_single_tokens(G: int) -> None:
    inp = _inputs([1] * 5, H=4, P=8, G=G, N=16, seed=11)
    y_ref, h_ref = _call(ssd_naive, inp)
    for fn in (ssd_recurrent, ssd_chunked):
        y, h = _call(fn, inp)
        torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=1e-4)


def test_empty_sequences_keep_state() -> None:
    # T == S here although lengths are not all 1: the decode fast path must not be taken.
    inp = _inputs([0, 2, 1, 0, 2], H=2, P=4, G=1, N=8, seed=3)
    y_ref, h_ref = _call(ssd_naive, inp)
    torch.testing.assert_close(h_ref[0], inp["initial_state"][0])
    for fn in (ssd_recurrent, ssd_chunked):
        y, h = _call(fn, inp)
        torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["chunked", "recurrent", "naive"])
def test_split_equals_one_pass(kernel: str) -> None:
    """Two sequences fed as 7 + 33 + 1 + rest tokens (varlen steps, state carried)."""
    lens = [150, 90]
    inp = _inputs(lens, H=4, P=8, G=2, N=16, seed=7)
    fn = SSD_KERNELS[kernel]
    y_full, h_full = _call(fn, inp, chunk_size=16)
    cu = inp["cu_seqlens"].tolist()
    state = inp["initial_state"].clone()
    y_parts = torch.empty_like(y_full)
    bounds = [0, 7, 40, 41]
    for a, b in zip(bounds, [*bounds[1:], None], strict=True):
        rows = {s: (a, lens[s] if b is None else b) for s in range(len(lens))}
        y, h = _call(fn, _slice(inp, rows, state), chunk_size=16)
        state = h.clone()
        off = 0
        for s, (ra, rb) in rows.items():
            y_parts[cu[s] + ra : cu[s] + rb] = y[off : off + rb - ra]
            off += rb - ra
    torch.testing.assert_close(y_parts, y_full, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state, h_full, atol=ATOL, rtol=1e-4)


def test_low_precision_input_dtype() -> None:
    inp = _inputs([5, 20], H=4, P=8, G=2, N=16, seed=9)
    y32, h32 = _call(ssd_chunked, inp, chunk_size=8)
    low = dict(inp, x=inp["x"].bfloat16(), B=inp["B"].bfloat16(), C=inp["C"].bfloat16())
    for fn in (ssd_chunked, ssd_recurrent):
        y, h = _call(fn, low, chunk_size=8)
        assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
        torch.testing.assert_close(y.float(), y32, atol=0.15, rtol=0.05)


# ---------------------------------------------------------------------------------------------
# Agreement with transformers' Nemotron-H Mamba-2 mixer (torch path).


def _hf_mixer(time_step_min: float):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(
        vocab_size=64,
        hidden_size=32,
        layer_types=["linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        time_step_min=time_step_min,
        # transformers >= 5.25 clamps at time_step_limit, earlier ones at time_step_min: both
        time_step_limit=(time_step_min, math.inf),
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(1234)
    mixer = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        mixer.A_log.copy_(torch.linspace(-1.0, 1.0, 4))
        mixer.D.copy_(torch.randn(4))
        # Head 3's strongly negative bias drives softplus below time_step_min, so the HF dt
        # clamp is live in the prefill test.
        mixer.dt_bias.copy_(torch.tensor([0.5, -0.5, 1.0, -9.0]))
        mixer.norm.weight.copy_(1.0 + 0.3 * torch.randn(32))
        mixer.conv1d.weight.copy_(0.4 * torch.randn_like(mixer.conv1d.weight))
        mixer.conv1d.bias.copy_(0.1 * torch.randn_like(mixer.conv1d.bias))
    return cfg, mixer


def _local_conv(xbc: torch.Tensor, conv_state: torch.Tensor, mixer) -> tuple[torch.Tensor, ...]:
    """Causal depthwise conv + SiLU over (T, C) with a (K-1, C) history; returns new history."""
    w = mixer.conv1d.weight[:, 0, :]  # (C, K)
    K = w.shape[1]
    full = torch.cat([conv_state, xbc], dim=0)
    T = xbc.shape[0]
    out = sum(full[k : k + T] * w[:, k] for k in range(K)) + mixer.conv1d.bias
    return F.silu(out), full[-(K - 1) :]


def _ours(mixer, cfg, h: torch.Tensor, conv_state, ssm_state, kernel) -> tuple[torch.Tensor, ...]:
    """pagefold composition of the mixer on one sequence h (T, hidden)."""
    H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
    inter = H * P
    proj = mixer.in_proj(h)
    gate, xbc, dt = proj.split([inter, inter + 2 * G * N, H], dim=-1)
    xbc, conv_state = _local_conv(xbc, conv_state, mixer)
    x, B, C = xbc.split([inter, G * N, G * N], dim=-1)
    T = h.shape[0]
    y, ssm_state = kernel(
        x.view(T, H, P),
        dt,
        -torch.exp(mixer.A_log.float()),
        B.view(T, G, N),
        C.view(T, G, N),
        mixer.D,
        ssm_state,
        _cu([T]),
        dt_bias=mixer.dt_bias,
        dt_min=mixer.time_step_limit[0],
        dt_max=mixer.time_step_limit[1],
        chunk_size=8,
    )
    norm = GatedRMSNorm(inter, cfg.layer_norm_epsilon, inter // G, norm_before_gate=False)
    norm.load_state_dict({"weight": mixer.norm.weight.detach()})
    out = mixer.out_proj(norm(y.reshape(T, inter), gate))
    return out, conv_state, ssm_state


@torch.no_grad()
def test_matches_hf_nemotron_h_mixer_prefill() -> None:
    cfg, mixer = _hf_mixer(time_step_min=0.01)
    assert mixer.time_step_limit == (0.01, math.inf)
    h = torch.randn(1, 37, cfg.hidden_size)
    ref = mixer(h)
    K, C = cfg.conv_kernel, mixer.conv_dim
    zeros_state = torch.zeros(1, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
    for kernel in (ssd_chunked, ssd_naive):
        out, _, _ = _ours(mixer, cfg, h[0], torch.zeros(K - 1, C), zeros_state, kernel)
        torch.testing.assert_close(out, ref[0], atol=ATOL, rtol=1e-4)
    # The clamp matters here: dropping it must change the result.
    _, no_clamp = _hf_mixer(time_step_min=0.0)
    assert not torch.allclose(no_clamp(h), ref, atol=1e-3)


@torch.no_grad()
def test_matches_hf_nemotron_h_mixer_decode_step() -> None:
    # HF's single-token cache path does not clamp dt (only the chunk path does), so run both
    # with time_step_min=0 to compare like with like.
    from transformers import DynamicCache

    cfg, mixer = _hf_mixer(time_step_min=0.0)
    cache = DynamicCache(config=cfg)
    prefix = torch.randn(1, 21, cfg.hidden_size)
    step = torch.randn(1, 1, cfg.hidden_size)
    ref_prefix = mixer(prefix, cache=cache)
    ref_step = mixer(step, cache=cache)
    ref_state = cache.get_recurrent_state(0)

    K, C = cfg.conv_kernel, mixer.conv_dim
    state = torch.zeros(1, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
    out_p, conv_state, state = _ours(
        mixer, cfg, prefix[0], torch.zeros(K - 1, C), state, ssd_chunked
    )
    torch.testing.assert_close(out_p, ref_prefix[0], atol=ATOL, rtol=1e-4)
    out_s, _, state = _ours(mixer, cfg, step[0], conv_state, state, ssd_recurrent)
    torch.testing.assert_close(out_s, ref_step[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state, ref_state.float(), atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# GatedRMSNorm


def _hf_norm_classes():
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridRMSNormGated,
    )
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    return [NemotronHRMSNormGated, BambaRMSNormGated, GraniteMoeHybridRMSNormGated]


@pytest.mark.parametrize("cls_idx", [0, 1, 2])
@pytest.mark.parametrize("group_size", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_gated_norm_matches_hf(cls_idx: int, group_size: int, dtype: torch.dtype) -> None:
    hf = _hf_norm_classes()[cls_idx](32, group_size=group_size, eps=1e-5).to(dtype)
    hf.weight.copy_(1.0 + 0.5 * torch.randn(32))
    ours = GatedRMSNorm(32, 1e-5, group_size).to(dtype)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 32, dtype=dtype) * 3.0
    gate = torch.randn(3, 5, 32, dtype=dtype)
    for g in (gate, None):
        ref = hf(x, g)
        got = ours(x, g)
        assert got.dtype == dtype
        torch.testing.assert_close(got, ref.to(dtype), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_gated_norm_groups_and_norm_before_gate() -> None:
    x, gate = torch.randn(4, 16), torch.randn(4, 16)
    w = torch.randn(16)
    after = GatedRMSNorm(16, 1e-6, 4)
    before = GatedRMSNorm(16, 1e-6, 4, norm_before_gate=True)
    for m in (after, before):
        m.weight.copy_(w)

    def rms(z: torch.Tensor) -> torch.Tensor:
        zg = z.view(4, 4, 4)
        return (zg / zg.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).view(4, 16)

    torch.testing.assert_close(after(x, gate), rms(x * F.silu(gate)) * w)
    torch.testing.assert_close(before(x, gate), rms(x) * w * F.silu(gate))
    # Per-group statistics: scaling one group leaves the others' outputs untouched.
    x2 = x.clone()
    x2[:, :4] *= 10.0
    torch.testing.assert_close(after(x2, gate)[:, 4:], after(x, gate)[:, 4:])
    with pytest.raises(ValueError):
        GatedRMSNorm(16, 1e-6, 5)


def test_chunked_groups_of_sequences_are_bitwise_one_group(monkeypatch) -> None:
    """``ssd_chunked``'s torch form takes sequences through a chunk position in cache-sized
    groups; any grouping (one sequence at a time, pairs, all) gives the same bits: outputs,
    final states and captures, including captures inside and at the end of chunks of later
    groups."""
    from pagefold.ops.ssd import reference as ssd

    lens = [37, 70, 5, 66, 32, 1]
    inp = _inputs(lens, H=4, P=8, G=2, N=8, seed=11)
    # Sequences run longest first (1, 3, 0, ...): captures inside chunks of the first, second
    # and third (offsets 20, 40, 10), at a chunk end of sequence 3 (offset 63), at its last
    # token and at the end of the short sequence 4.
    after = torch.tensor([37 + 20, 112 + 40, 10, 112 + 63, 112 + 65, 178 + 31])
    runs = []
    for group_bytes in (1, 4 * 32 * 32 * 4 * 2, 1 << 30):  # 1, 2 and all sequences per group
        monkeypatch.setattr(ssd, "GROUP_BYTES", group_bytes)
        out = torch.empty(len(after), 4, 8, 8)
        y, final = _call(ssd_chunked, inp, chunk_size=32, capture=(after, out), compiled=False)
        runs.append((y, final, out))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    naive_y, naive_final = _call(ssd_naive, inp)
    torch.testing.assert_close(runs[0][0], naive_y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(runs[0][1], naive_final, atol=ATOL, rtol=ATOL)
