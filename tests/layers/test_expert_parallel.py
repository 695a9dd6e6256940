"""Expert parallelism's placement and combine in one process, against the one-rank MoE block.

Two ranks' :class:`SparseMoeBlock` shards (``enable_expert_parallel`` at TP=2: each holds half
of the experts, whole) are loaded from the one-rank block's checkpoint (stacked or per-expert
tensors) and run one after the other; the collective is stood in for by summing the two ranks'
buffers (what a two-rank all-reduce returns). Without a shared expert each rank's output must
be the one-rank block's bit for bit (the combine adds a token's contributions in ascending
expert order, as one rank's ``index_add_`` does); with a tensor-parallel shared expert it must
agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.distributed import parallel_state as ps
from pagefold.layers import expert_parallel
from pagefold.layers.linear import load_into
from pagefold.layers.moe import ExpertWeightRouter, SparseMoeBlock

H, E, K, INTER, SHARED, T = 32, 6, 3, 20, 24, 37
RENAME = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _build(rank: int, size: int, ep: bool, shared: int) -> SparseMoeBlock:
    ps.set_tensor_parallel(rank, size)
    ps.set_expert_parallel(ep)
    try:
        return SparseMoeBlock(H, E, K, INTER, norm_topk_prob=True, shared_inter=shared)
    finally:
        ps.set_tensor_parallel(0, 1)
        ps.set_expert_parallel(False)


def _checkpoint(ref: SparseMoeBlock, per_expert: bool) -> dict[str, torch.Tensor]:
    """The one-rank block's weights as a checkpoint names them."""
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    if "shared_expert.gate_up_proj.weight" in sd:
        gate, up = sd.pop("shared_expert.gate_up_proj.weight").chunk(2)
        sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"] = gate, up
    if per_expert:
        gu, dn = sd.pop("experts.gate_up_proj"), sd.pop("experts.down_proj")
        for e in range(E):
            sd[f"experts.{e}.gate_proj.weight"], sd[f"experts.{e}.up_proj.weight"] = (
                gu[e].chunk(2))
            sd[f"experts.{e}.down_proj.weight"] = dn[e]
    return sd


def _load(block: SparseMoeBlock, rank: int, ckpt: dict[str, torch.Tensor]) -> set[str]:
    model = torch.nn.Module()
    model.mlp = block  # checkpoint names carry a prefix before ``experts``
    ps.set_tensor_parallel(rank, 2)  # the loaders cut this rank's part
    try:
        router = ExpertWeightRouter(model)
        named = ((f"mlp.{k}", v) for k, v in ckpt.items())
        loaded = load_into(model, router.route(named), rename=RENAME)
        return {k.removeprefix("mlp.") for k in loaded | router.complete()}
    finally:
        ps.set_tensor_parallel(0, 1)


def _run_two_ranks(blocks, x, monkeypatch) -> list[torch.Tensor]:
    """Each rank's output when the collective sums both ranks' buffers."""
    bufs: list[torch.Tensor] = []
    monkeypatch.setattr(expert_parallel, "all_reduce", lambda b: bufs.append(b.clone()) or b)
    with torch.no_grad():
        for b in blocks:
            b(x)
    total = bufs[0] + bufs[1]
    monkeypatch.setattr(expert_parallel, "all_reduce", lambda b: b.copy_(total))
    with torch.no_grad():
        return [b(x) for b in blocks]


@pytest.mark.parametrize("per_expert", [False, True])
def test_ep_routed_sum_is_one_ranks_bits(monkeypatch, per_expert: bool) -> None:
    torch.manual_seed(0)
    ref = _build(0, 1, False, 0)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(T, H)
    with torch.no_grad():
        want = ref(x)
    ckpt = _checkpoint(ref, per_expert)
    blocks = [_build(r, 2, True, 0) for r in range(2)]
    for r, b in enumerate(blocks):
        assert b.experts.num_experts == E // 2 and b.experts.inter == INTER
        assert b.experts.first_expert == r * E // 2
        loaded = _load(b, r, ckpt)
        assert {"experts.gate_up_proj", "experts.down_proj"} <= loaded
        # This rank's experts, whole: the one-rank block's rows r*E/2 .. (r+1)*E/2.
        own = slice(r * E // 2, (r + 1) * E // 2)
        assert torch.equal(b.experts.gate_up_proj, ref.experts.gate_up_proj[own])
        assert torch.equal(b.experts.down_proj, ref.experts.down_proj[own])
    # Every expert gets tokens on both ranks, so both halves feed the sum.
    assert set(ref.route(x)[1].flatten().tolist()) == set(range(E))
    outs = _run_two_ranks(blocks, x, monkeypatch)
    for out in outs:
        assert torch.equal(out, want)


def test_ep_with_tensor_parallel_shared_expert(monkeypatch) -> None:
    torch.manual_seed(1)
    ref = _build(0, 1, False, SHARED)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(T, H)
    with torch.no_grad():
        want = ref(x)
    ckpt = _checkpoint(ref, False)
    blocks = [_build(r, 2, True, SHARED) for r in range(2)]
    for r, b in enumerate(blocks):
        assert b.shared_expert.inter == SHARED // 2  # the shared expert stays split
        _load(b, r, ckpt)
    outs = _run_two_ranks(blocks, x, monkeypatch)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)


def test_expert_count_not_dividing_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by the "
                                         r"expert-parallel size 4"):
        _build(0, 4, True, 0)
    assert _build(0, 4, False, 0).experts.num_experts == E  # without EP: TP splits inter
