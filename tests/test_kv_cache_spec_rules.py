"""``core/kv_cache_spec.py``'s byte layouts with every figure worked out by hand from the module
docstring: dtype sizes, page sizes and shapes per attention spec, state component offsets at
16-byte alignment, the first key each attention kind reads (written for mutmut's survivors)."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
    TPSplit,
    align_up,
    cdiv,
    dtype_size,
    first_key,
    is_attention,
)


@pytest.mark.parametrize("dtype, size", [
    (torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2),
    (torch.int8, 1), (torch.uint8, 1), (torch.float8_e4m3fn, 1), (torch.int32, 4),
])
def test_dtype_size(dtype, size) -> None:
    assert dtype_size(dtype) == size


def test_cdiv_and_align_up() -> None:
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert [align_up(n) for n in (0, 1, 15, 16, 17, 31, 32, 33)] == [0, 16, 16, 16, 32, 32, 32,
                                                                      48]
    assert [align_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]


def test_attention_pages_by_hand() -> None:
    # 2 (K and V) x heads x head_dim x dtype bytes per token; a page is block_size tokens.
    full = FullAttentionSpec(num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    assert full.bytes_per_token == 1024
    assert full.page_bytes(16) == 16384
    assert full.page_shape(16) == (16, 2, 4, 64)
    swa = SlidingWindowSpec(num_kv_heads=2, head_dim=128, dtype=torch.float32, window=8)
    assert swa.bytes_per_token == 2048
    assert swa.page_bytes(32) == 65536
    assert swa.page_shape(32) == (32, 2, 2, 128)
    chunked = ChunkedLocalAttentionSpec(num_kv_heads=1, head_dim=8, dtype=torch.float16,
                                        chunk=4)
    assert chunked.bytes_per_token == 32
    assert chunked.page_bytes(3) == 96
    assert chunked.page_shape(3) == (3, 2, 1, 8)
    # MLA: one latent row per token, no K/V pair and no heads.
    mla = MLASpec(latent_dim=576, dtype=torch.bfloat16)
    assert mla.bytes_per_token == 1152
    assert mla.page_bytes(16) == 18432
    assert mla.page_shape(16) == (16, 576)
    kinds = [s.manager_kind for s in (full, swa, chunked, mla)]
    assert kinds == ["full_attention", "sliding_window", "chunked_local", "full_attention"]


def test_split_is_not_part_of_equality() -> None:
    split = TPSplit(axis=2, blocks=((8, 1),))
    a = FullAttentionSpec(4, 64, torch.bfloat16, split=split)
    b = FullAttentionSpec(4, 64, torch.bfloat16)
    assert a == b and hash(a) == hash(b)
    assert SlidingWindowSpec(2, 64, torch.float16, 8, split=split) == SlidingWindowSpec(
        2, 64, torch.float16, 8)
    assert ChunkedLocalAttentionSpec(2, 64, torch.float16, 4, split=split) == (
        ChunkedLocalAttentionSpec(2, 64, torch.float16, 4))
    assert MLASpec(64, torch.float16, split=split) == MLASpec(64, torch.float16)
    assert StateComponent("c", (2,), torch.float32, split=split) == StateComponent(
        "c", (2,), torch.float32)
    # The fields that size a page do count.
    assert FullAttentionSpec(4, 64, torch.bfloat16) != FullAttentionSpec(4, 64, torch.float16)
    assert SlidingWindowSpec(2, 64, torch.float16, 8) != SlidingWindowSpec(2, 64, torch.float16, 9)


def test_state_layout_by_hand() -> None:
    conv = StateComponent("conv", (3, 1024), torch.bfloat16)
    ssm = StateComponent("ssm", (8, 64, 16), torch.float32)
    assert conv.nbytes == 6144 and ssm.nbytes == 32768
    # 5 B at 0; 12 B at align_up(5) = 16; 4 B at align_up(16 + 12) = 32; ends at 36.
    a = StateComponent("a", (5,), torch.int8)
    b = StateComponent("b", (3,), torch.float32)
    c = StateComponent("c", (2,), torch.float16)
    spec = StateSpec("mamba2", (a, b, c))
    assert spec.offsets == (0, 16, 32)
    assert spec.state_bytes == 36
    assert spec.unpadded_bytes == 21
    assert spec.manager_kind == "state"
    one = StateSpec("gdn", (b,))
    assert (one.offsets, one.state_bytes, one.unpadded_bytes) == ((0,), 12, 12)
    assert spec.component("a") is a and spec.component("b") is b and spec.component("c") is c
    dup = StateSpec("gdn", (a, StateComponent("a", (1,), torch.float32)))
    assert dup.component("a") is a  # the first of that name
    with pytest.raises(KeyError) as err:
        spec.component("x")
    assert err.value.args == ("x",)


def test_is_attention_and_first_key() -> None:
    full = FullAttentionSpec(1, 8, torch.float16)
    swa = SlidingWindowSpec(1, 8, torch.float16, window=8)
    chunked = ChunkedLocalAttentionSpec(1, 8, torch.float16, chunk=4)
    mla = MLASpec(8, torch.float16)
    state = StateSpec("gdn", (StateComponent("s", (2,), torch.float32),))
    assert [is_attention(s) for s in (full, swa, chunked, mla, state)] == [
        True, True, True, True, False]
    # Sliding window of 8: the query at p reads p-7..p (never below 0).
    assert [first_key(swa, p) for p in (0, 6, 7, 8, 20)] == [0, 0, 0, 1, 13]
    # Chunks of 4: the query at p reads from its chunk's start.
    assert [first_key(chunked, p) for p in (0, 3, 4, 7, 10)] == [0, 0, 4, 4, 8]
    assert [first_key(s, 50) for s in (full, mla, state)] == [0, 0, 0]
