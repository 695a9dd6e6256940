"""``core/vllm_layout.py``'s arithmetic on hand-built specs (no model), every figure worked out
by hand from the module docstring's five steps: the state page, the attention block raised to
hold it, the padding, blocks per request per group kind, the pool and the concurrency
(written for mutmut's survivors; the model-level checks are in ``test_models_landscape.py``)."""

from __future__ import annotations

import re

import pytest
import torch

from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.core.vllm_layout import (
    VllmGroup,
    plan_vllm,
    spec_kind,
    vllm_attention_block_size,
    vllm_state_page_bytes,
)

F32 = torch.float32
FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype=F32)  # 2 * 8 * 4 = 64 B per token


def _state(nbytes: int, kind: str = "mamba2") -> StateSpec:
    """A state whose unpadded page is ``nbytes`` (float32 components: nbytes / 4 values)."""
    return StateSpec(kind, (StateComponent("conv", (4,), F32),
                            StateComponent("ssm", ((nbytes - 16) // 4,), F32)))


def test_spec_kind() -> None:
    specs = [FULL, SlidingWindowSpec(1, 8, F32, 4), ChunkedLocalAttentionSpec(1, 8, F32, 4),
             MLASpec(8, F32), _state(64, "gdn"), _state(64, "mamba2")]
    assert [spec_kind(s) for s in specs] == [
        "full_attention", "sliding_window", "chunked_local", "mla", "gdn", "mamba2"]
    assert VllmGroup(_state(64, "gdn"), ("l0",), 1).kind == "gdn"


def test_state_page_is_the_largest_unpadded_state() -> None:
    assert vllm_state_page_bytes({"a": FULL}) == 0
    # Unpadded: 5 + 12 bytes (aligned, the layout would be 16 + 12).
    odd = StateSpec("gdn", (StateComponent("a", (5,), torch.int8), StateComponent("b", (3,), F32)))
    assert vllm_state_page_bytes({"s": odd, "a": FULL}) == 17
    assert vllm_state_page_bytes({"s": odd, "t": _state(400), "u": _state(100)}) == 400


def test_attention_block_size_by_hand() -> None:
    assert vllm_attention_block_size({"s": _state(4500)}) is None
    assert vllm_attention_block_size({"a": FULL}) == 16
    assert vllm_attention_block_size({"a": FULL}, block_size=32) == 32
    # 4500-byte state, 64 B per token: 16 * cdiv(4500, 16 * 64) = 16 * 5 = 80 tokens.
    specs = {"s": _state(4500), "a": FULL}
    assert vllm_attention_block_size(specs) == 80
    assert vllm_attention_block_size(specs, block_size=96) == 96
    assert vllm_attention_block_size(specs, alignment=8) == 72  # 8 * cdiv(4500, 512) = 8 * 9
    # Exactly one 16-token page (1024 B) fits; one byte more needs 32 tokens.
    assert vllm_attention_block_size({"s": _state(1024), "a": FULL}) == 16
    assert vllm_attention_block_size({"s": _state(1028), "a": FULL}) == 32
    assert vllm_attention_block_size({"s": _state(100), "a": FULL}, block_size=32) == 32
    # A block_size under the alignment: raised to 16 by a 1-byte state, kept with no state.
    one = StateSpec("gdn", (StateComponent("a", (1,), torch.int8),))
    assert vllm_attention_block_size({"s": one, "a": FULL}, block_size=8) == 16
    assert vllm_attention_block_size({"a": FULL}, block_size=8) == 8
    msg = ("attention layers store different bytes per token [64, 128]; vLLM's hybrid layout "
           "needs one attention page size")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        vllm_attention_block_size({"a": FULL, "b": FullAttentionSpec(2, 8, F32)})


def test_errors_exact() -> None:
    with pytest.raises(ValueError, match="^the model declares no cached layers$"):
        plan_vllm({}, memory_bytes=1 << 20, max_model_len=16, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="^max_model_len must be at least 1, got 0$"):
        plan_vllm({"a": FULL}, memory_bytes=1 << 20, max_model_len=0,
                  enable_prefix_caching=False)


def test_pure_attention_pool() -> None:
    specs = {f"l{i}": FULL for i in range(4)}
    lay = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=100, enable_prefix_caching=True)
    # One group of 4 layers; page 16 * 64 = 1024 B; 2**20 // (4 * 1024) = 256 blocks.
    assert (lay.attention_block_size, lay.state_page_bytes, lay.page_size_bytes,
            lay.padding_bytes, lay.layers_per_group, lay.num_blocks) == (16, 0, 1024, 0, 4, 256)
    assert [(g.kind, g.layer_names, g.blocks_per_request) for g in lay.groups] == [
        ("full_attention", ("l0", "l1", "l2", "l3"), 7)]  # cdiv(100, 16)
    assert lay.blocks_per_request == 7
    assert lay.max_concurrency == 256 / 7
    assert lay.kv_cache_size_tokens == 3657  # int(36.571... * 100)
    assert (lay.max_model_len, lay.enable_prefix_caching, lay.num_speculative_tokens,
            lay.max_num_batched_tokens) == (100, True, 0, 8192)
    assert [lay.blocks_for_length(n) for n in (1, 16, 17, 160)] == [1, 1, 2, 10]


def test_state_only_pool() -> None:
    specs = {f"m{i}": _state(4864) for i in range(3)}
    lay = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=100, enable_prefix_caching=True,
                    num_speculative_tokens=1)
    # The page is the state page itself (no padding); one group of 3 layers:
    # 2**20 // (3 * 4864) = 71 blocks; 2 + 1 (speculative) blocks per request.
    assert (lay.attention_block_size, lay.state_page_bytes, lay.page_size_bytes,
            lay.padding_bytes, lay.layers_per_group, lay.num_blocks) == (
        None, 4864, 4864, 0, 3, 71)
    assert lay.blocks_per_request == 3
    off = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=100, enable_prefix_caching=False)
    assert off.blocks_per_request == 1
    assert off.blocks_for_length(10_000) == 1
    assert lay.blocks_for_length(10_000) == 3  # prefix caching and drafts: 2 + 1


def test_hybrid_pool() -> None:
    specs = {"s0": _state(4500), "s1": _state(4500), "s2": _state(4500), "a": FULL}
    lay = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=100, enable_prefix_caching=False)
    # Block 80 tokens (above); page 80 * 64 = 5120 B = 4500 + 620 padding; groups of one
    # layer (three state groups, one attention group): 2**20 // 5120 = 204 blocks.
    assert (lay.attention_block_size, lay.state_page_bytes, lay.page_size_bytes,
            lay.padding_bytes, lay.layers_per_group, lay.num_blocks) == (
        80, 4500, 5120, 620, 1, 204)
    assert sorted(g.blocks_per_request for g in lay.groups) == [1, 1, 1, 2]  # cdiv(100, 80)
    assert lay.blocks_per_request == 5
    assert lay.blocks_for_length(500) == 3 + 7
    aligned8 = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=100,
                         enable_prefix_caching=True, alignment=8, num_speculative_tokens=2)
    assert (aligned8.attention_block_size, aligned8.page_size_bytes) == (72, 72 * 64)
    assert aligned8.blocks_per_request == 3 * (2 + 2) + 2  # cdiv(100, 72) = 2


def test_window_and_chunk_blocks() -> None:
    swa = SlidingWindowSpec(1, 8, F32, window=8)
    chunked = ChunkedLocalAttentionSpec(1, 8, F32, chunk=13)
    mla = MLASpec(16, F32)  # 64 B per token, the same page as FULL
    lay = plan_vllm({"w": swa}, memory_bytes=1 << 20, max_model_len=100,
                    enable_prefix_caching=False, max_num_batched_tokens=10)
    # Window 8 and 10 tokens a step: min(7 + 10, len) tokens, plus one block.
    assert lay.blocks_per_request == 3  # cdiv(17, 16) + 1
    assert [lay.blocks_for_length(n) for n in (5, 16, 17, 1000)] == [2, 2, 3, 3]
    w7 = plan_vllm({"w": SlidingWindowSpec(1, 8, F32, window=7)}, memory_bytes=1 << 20,
                   max_model_len=100, enable_prefix_caching=False, max_num_batched_tokens=10)
    assert w7.blocks_per_request == 2  # min(6 + 10, 100) = 16 tokens: one block, plus one
    default = plan_vllm({"w": swa}, memory_bytes=1 << 20, max_model_len=10_000,
                        enable_prefix_caching=False, block_size=32)
    assert default.attention_block_size == 32
    assert default.blocks_per_request == 257 + 1  # cdiv(min(7 + 8192, 10000), 32) + 1
    ch = plan_vllm({"c": chunked}, memory_bytes=1 << 20, max_model_len=72,
                   enable_prefix_caching=True, max_num_batched_tokens=19)
    # min(13 + 19, len) tokens: cdiv(32, 16) = 2.
    assert ch.blocks_per_request == 2
    assert [ch.blocks_for_length(n) for n in (16, 17, 33)] == [1, 2, 2]
    m = plan_vllm({"m": mla}, memory_bytes=1 << 20, max_model_len=33,
                  enable_prefix_caching=False)
    assert (m.page_size_bytes, m.blocks_per_request) == (1024, 3)
    tiny = plan_vllm({"a": FULL}, memory_bytes=1 << 20, max_model_len=1,
                     enable_prefix_caching=False)  # the smallest max_model_len allowed
    assert (tiny.blocks_per_request, tiny.kv_cache_size_tokens) == (1, 1024)
