"""Mixed tensor parallelism for transferred pages (issue 38): ``transfer.reshard`` against an
independent slicing of full-width tensors.

The reference cuts each full-width tensor the way the layers load their weights, written out
here per case (GDN conv channels ``q | k | v`` each cut by heads, the SSM by value heads,
Mamba-2's ``x | B | C`` with one B/C group replicated, attention KV heads, replicated when
fewer than ranks), packs each rank's pieces at the spec's offsets, and checks that the
reshard builds every consumer rank's page bytes from the producer ranks' pages exactly."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec, align_up
from pagefold.core.spec_families import mamba2_state
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.transfer.reshard import reshard_rows, source_ranks, spec_at, why_not

BS = 4
QWEN35 = dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              layer_types=["linear_attention", "full_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
              linear_value_head_dim=6, linear_conv_kernel_dim=3)


def _gdn_conv(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    q, k, v = full.split([8, 8, 24])  # 2 key heads x 4, 2 x 4, 4 value heads x 6
    return torch.cat([t.chunk(tp)[r] for t in (q, k, v)])


def _mamba_conv(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    x, b, c = full.split([4 * 3, 5, 5])  # 4 heads x 3, one group of state 5 (replicated)
    return torch.cat([x.chunk(tp)[r], b, c])


def _heads(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:  # (..., heads, dim) pages
    n = full.shape[-2]
    if n >= tp:
        return full.chunk(tp, dim=-2)[r]
    return full[..., [r * n // tp], :]


def _pack_state(spec: StateSpec, comps: list[torch.Tensor], page_bytes: int) -> torch.Tensor:
    flat = torch.zeros(align_up(spec.state_bytes, page_bytes), dtype=torch.uint8)
    pos = 0
    assert len(comps) == len(spec.components)
    for t in comps:
        b = t.contiguous().view(torch.uint8).reshape(-1)
        flat[pos:pos + b.numel()] = b
        pos = align_up(pos + b.numel())
    return flat.view(-1, page_bytes)


def _check(src_tp, dst_tp, spec_of, rows_of, page_bytes, dst_pages, states=1):
    for tp in (src_tp, dst_tp):  # another rank's spec, derived from one rank's split
        assert spec_at(spec_of(dst_tp), tp) == spec_of(tp)
    for dst in range(dst_tp):
        src = {r: rows_of(src_tp, r) for r in source_ranks(spec_of(dst_tp), src_tp, dst_tp, dst)}
        got = reshard_rows(spec_of(src_tp), spec_of(dst_tp), BS, src, page_bytes, dst_pages,
                           src_tp, dst_tp, dst, states)
        assert torch.equal(got, rows_of(dst_tp, dst)), (src_tp, dst_tp, dst)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 2)])
def test_gdn_state_reshards_exactly(src_tp, dst_tp):
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(40, 2, generator=g)
    ssm = torch.randn(4, 4, 6, generator=g)

    def spec_of(tp):
        specs = layer_specs_from_config(QWEN35, model_dtype=torch.float32,
                                        tensor_parallel_size=tp)
        return specs["layers.0"]

    def rows_of(tp, r):
        return _pack_state(spec_of(tp), [_gdn_conv(conv, tp, r), ssm.chunk(tp)[r]], 64)

    assert why_not(spec_of(1), src_tp, dst_tp) is None
    _check(src_tp, dst_tp, spec_of, rows_of, 64, rows_of(dst_tp, 0).shape[0])


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4)])
def test_mamba2_state_with_a_replicated_group_reshards_exactly(src_tp, dst_tp):
    g = torch.Generator().manual_seed(2)
    conv = torch.randn(22, 3, generator=g)
    ssm = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)

    def spec_of(tp):
        return mamba2_state(heads=4, head_dim=3, groups=1, state=5, kernel=4, tp=tp,
                            num_spec=0, conv_dtype=torch.float32, ssm_dtype=torch.float64)

    def rows_of(tp, r):
        return _pack_state(spec_of(tp), [_mamba_conv(conv, tp, r), ssm.chunk(tp)[r]], 48)

    _check(src_tp, dst_tp, spec_of, rows_of, 48, rows_of(dst_tp, 0).shape[0])


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4), (4, 1)])
def test_attention_pages_reshard_exactly(kv_heads, src_tp, dst_tp):
    cfg = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=2, head_dim=8,
               num_attention_heads=4, num_key_value_heads=kv_heads)
    pages = 3
    full = torch.randn(pages, BS, 2, kv_heads, 8, generator=torch.Generator().manual_seed(3))

    def spec_of(tp):
        return layer_specs_from_config(cfg, model_dtype=torch.float32,
                                       tensor_parallel_size=tp)["layers.1"]

    def rows_of(tp, r):
        shard = _heads(full, tp, r).contiguous().view(torch.uint8).reshape(pages, -1)
        return torch.cat([shard, torch.zeros(pages, 8, dtype=torch.uint8)], dim=1)  # padding

    assert isinstance(spec_of(1), FullAttentionSpec)
    for tp in (src_tp, dst_tp):
        assert spec_of(tp).page_bytes(BS) + 8 == rows_of(tp, 0).shape[1]
    _check(src_tp, dst_tp, spec_of, rows_of, rows_of(dst_tp, 0).shape[1], pages)


def test_a_spec_without_a_split_is_refused():
    spec = StateSpec("mystery", (StateComponent("s", (4, 2), torch.float32),))
    assert "no tensor-parallel split" in why_not(spec, 1, 2)



def _family_specs(factory, arch: str, tp: int, **overrides) -> dict:
    """One rank's specs of the tiny ``arch`` (its config.json) at ``tp`` ranks."""
    import json

    cfg = json.loads((factory(arch, **overrides) / "config.json").read_text())
    return layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=tp)


def _chunks(t: torch.Tensor, parts: int, tp: int, r: int) -> torch.Tensor:
    """Rank ``r``'s rows of ``t``: ``t`` is ``parts`` equal row blocks, each cut in ``tp``."""
    return torch.cat([p.chunk(tp)[r] for p in t.chunk(parts)])


KIMI = dict(num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4)


@pytest.mark.parametrize("arch,overrides", [
    ("mamba", {}),  # Mamba-1: conv and ssm channels
    ("lfm2", {}),  # the short conv's channels
    ("minimax", {}),  # the lightning kv state, by heads
    ("kimi_linear", KIMI)])  # KDA: the q | k | v conv channels by heads, the ssm by heads
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1)])
def test_family_states_reshard_exactly(arch, overrides, src_tp, dst_tp, tiny_model_factory):
    """Each state component's channels (rows) cut by ranks as the layers load their weights,
    written out independently of the specs' splits."""
    specs = _family_specs(tiny_model_factory, arch, 1, **overrides)
    name = next(k for k, s in specs.items() if isinstance(s, StateSpec))
    full_spec = specs[name]
    g = torch.Generator().manual_seed(5)
    fulls = [torch.randn(*c.shape, generator=g).to(c.dtype) for c in full_spec.components]

    def spec_of(tp):
        return _family_specs(tiny_model_factory, arch, tp, **overrides)[name]

    def rows_of(tp, r):
        return _pack_state(spec_of(tp), [
            _chunks(t, 3 if (full_spec.kind, c.name) == ("kda", "conv") else 1, tp, r)
            for c, t in zip(full_spec.components, fulls)], 64)

    assert why_not(spec_of(1), src_tp, dst_tp) is None
    _check(src_tp, dst_tp, spec_of, rows_of, 64, rows_of(dst_tp, 0).shape[0])


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1)])
def test_mla_latent_pages_are_replicated(src_tp, dst_tp, tiny_model_factory):
    """Kimi Linear's MLA latent rows: every rank keeps the whole page; a consumer rank copies
    the lowest producer rank's."""
    from pagefold.core.kv_cache_spec import MLASpec

    specs = _family_specs(tiny_model_factory, "kimi_linear", 1, **KIMI)
    name = next(k for k, s in specs.items() if isinstance(s, MLASpec))
    pages = 2
    full = torch.randn(pages, *specs[name].page_shape(BS),
                       generator=torch.Generator().manual_seed(6))

    def spec_of(tp):
        return _family_specs(tiny_model_factory, "kimi_linear", tp, **KIMI)[name]

    def rows_of(tp, r):
        return full.view(torch.uint8).reshape(pages, -1).clone()

    assert why_not(spec_of(1), src_tp, dst_tp) is None
    assert source_ranks(spec_of(dst_tp), src_tp, dst_tp, dst_tp - 1) == [0]
    _check(src_tp, dst_tp, spec_of, rows_of, rows_of(1, 0).shape[1], pages)
