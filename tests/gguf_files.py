"""Tiny random GGUF files for the kept-quantized GGUF tests, written with the ``gguf``
package (llama.cpp's gguf-py) from its documentation: metadata keys per architecture, tensor
names ``blk.N.attn_q.weight`` ..., Q4_0 / Q4_1 / Q8_0 tensors quantized by
``gguf.quants.quantize``; Q4_K / Q5_K / Q6_K (which gguf-py cannot quantize) as random
super-blocks with small f16 scales. The tokenizer is SmolLM2's (copied from the shipped GGUF:
transformers needs one to read the file). Nothing of ``pagefold.quantization`` is used.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

K_SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
# Mamba-1 (``mamba``): inner channels (expand 2), state size, dt rank, conv kernel.
SSM_INNER, SSM_STATE, SSM_RANK, SSM_CONV = 2 * HIDDEN, 16, 16, 4


@contextmanager
def one_parse():
    """Within the block, ``gguf.GGUFReader`` parses each file once (transformers parses the
    whole metadata again for its config and its tensors: seconds each for SmolLM2's 49k-token
    vocabulary, which every tiny GGUF here carries)."""
    original = gguf.GGUFReader
    readers: dict = {}

    def reader(p, mode="r"):
        key = (str(Path(p).resolve()), mode)
        if key not in readers:
            readers[key] = original(p, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(src: Path) -> dict:
    r = gguf.GGUFReader(str(src))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key):
        f = r.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    return {"tokens": strings("tokenizer.ggml.tokens"),
            "merges": strings("tokenizer.ggml.merges"),
            "types": [int(r.fields["tokenizer.ggml.token_type"].parts[i][0])
                      for i in r.fields["tokenizer.ggml.token_type"].data],
            "bos": scalar("tokenizer.ggml.bos_token_id"),
            "eos": scalar("tokenizer.ggml.eos_token_id")}


def _k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 256
    b = rng.integers(0, 256, (rows, nb, K_SIZES[kind]), dtype=np.uint8)
    if kind == "Q6_K":
        b[..., 208:210] = (rng.random((rows, nb, 1)) * 1e-4 + 2e-5).astype(
            np.float16).view(np.uint8)
    else:
        # Sub-block mins equal to their scales and dmin = d * (mid code): weights centred on 0
        # (random mins would bias every weight one way and the model would repeat a token).
        d = rng.random((rows, nb)) * 4e-4 + 1e-4
        mid = 7.5 if kind == "Q4_K" else 15.5
        b[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
        b[..., 2:4] = (d * mid).astype(np.float16)[..., None].view(np.uint8)
        b[..., 8:12] = b[..., 4:8]
        nib = b[..., 12:16] & 0x0F
        b[..., 12:16] = nib | (nib << 4)
    return b.reshape(rows, -1)


def _quantized(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if kind in K_SIZES:
        return _k_blocks(kind, rows, cols, rng)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def write_tiny_gguf(path: Path, tokenizer_src: Path, arch: str = "llama", kind: str = "Q4_0",
                    embed_kind: str | None = None, tied: bool = True,
                    kinds: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A 2-layer ``arch`` (``llama``, ``qwen2``, ``qwen3``, ``lfm2``: short-conv hybrid,
    ``mamba``: Mamba-1) GGUF whose linears are ``kind`` (``kinds``: per tensor-name suffix,
    e.g. ``{"attn_v": "Q6_K"}``), embedding ``embed_kind`` (default ``kind``), lm_head tied or
    its own ``output.weight``. Mamba's state tensors are F32 as llama.cpp writes them:
    ``ssm_a`` = -exp(A_log), ``ssm_conv1d`` (channels, kernel), ``ssm_d``, ``ssm_dt`` (its
    16 inputs are not whole blocks); ``ssm_in`` / ``ssm_x`` / ``ssm_out`` are ``kind``."""
    rng = np.random.default_rng(seed)
    # transformers reads no head_dim from a qwen3 GGUF: Qwen3Config's default (128) it is.
    head_dim = 128 if arch == "qwen3" else HEAD_DIM
    tok = _tokenizer_fields(tokenizer_src)
    vocab = len(tok["tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    if arch == "mamba":
        w.add_uint32("mamba.ssm.conv_kernel", SSM_CONV)
        w.add_uint32("mamba.ssm.inner_size", SSM_INNER)
        w.add_uint32("mamba.ssm.state_size", SSM_STATE)
        w.add_uint32("mamba.ssm.time_step_rank", SSM_RANK)
    if arch == "lfm2":  # a short-conv layer, then an attention layer (KV heads 0: no attention)
        w.add_head_count_kv([0, KV_HEADS])
        w.add_uint32("lfm2.shortconv.l_cache", 3)
    else:
        w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    kinds = kinds or {}

    def lin(name: str, rows: int, cols: int) -> None:
        short = name.split(".")[-2]
        k = kinds.get(short, kind)
        w.add_tensor(name, _quantized(k, rows, cols, rng),
                     raw_dtype=gguf.GGMLQuantizationType[k])

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    ek = embed_kind or kind
    w.add_tensor("token_embd.weight", _quantized(ek, vocab, HIDDEN, rng),
                 raw_dtype=gguf.GGMLQuantizationType[ek])
    norm("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", HIDDEN)
    if not tied:
        lin("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", HIDDEN)
        if arch == "mamba":
            def f32(name: str, a: np.ndarray) -> None:
                w.add_tensor(name, a.astype(np.float32))

            lin(f"{b}.ssm_in.weight", 2 * SSM_INNER, HIDDEN)
            f32(f"{b}.ssm_conv1d.weight", 0.3 * rng.standard_normal((SSM_INNER, SSM_CONV)))
            f32(f"{b}.ssm_conv1d.bias", 0.1 * rng.standard_normal(SSM_INNER))
            lin(f"{b}.ssm_x.weight", SSM_RANK + 2 * SSM_STATE, SSM_INNER)
            f32(f"{b}.ssm_dt.weight", 0.2 * rng.standard_normal((SSM_INNER, SSM_RANK)))
            f32(f"{b}.ssm_dt.bias", rng.uniform(-4.0, -2.0, SSM_INNER))
            f32(f"{b}.ssm_a", -rng.uniform(0.5, 4.0, (SSM_INNER, SSM_STATE)))
            f32(f"{b}.ssm_d", 1.0 + 0.1 * rng.standard_normal(SSM_INNER))
            lin(f"{b}.ssm_out.weight", HIDDEN, SSM_INNER)
            continue
        norm(f"{b}.ffn_norm.weight", HIDDEN)
        lin(f"{b}.ffn_gate.weight", FFN, HIDDEN)
        lin(f"{b}.ffn_up.weight", FFN, HIDDEN)
        lin(f"{b}.ffn_down.weight", HIDDEN, FFN)
        if arch == "lfm2" and i == 0:
            w.add_tensor(f"{b}.shortconv.conv.weight",
                         (0.3 * rng.standard_normal((HIDDEN, 3))).astype(np.float32))
            lin(f"{b}.shortconv.in_proj.weight", 3 * HIDDEN, HIDDEN)
            lin(f"{b}.shortconv.out_proj.weight", HIDDEN, HIDDEN)
            continue
        lin(f"{b}.attn_q.weight", HEADS * head_dim, HIDDEN)
        lin(f"{b}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        lin(f"{b}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        lin(f"{b}.attn_output.weight", HIDDEN, HEADS * head_dim)
        if arch == "qwen2":  # q/k/v biases, F32
            for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w.add_tensor(f"{b}.attn_{name}.bias", (0.1 * rng.standard_normal(
                    rows * head_dim)).astype(np.float32))
        if arch in ("qwen3", "lfm2"):
            norm(f"{b}.attn_q_norm.weight", head_dim)
            norm(f"{b}.attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The prompts and length of the GGUF exactness tests (test_gguf_quantized, test_gguf_hybrids).
PROMPTS = [[5, 17, 99, 23, 41, 8, 77], [300, 12, 4, 250, 31, 66, 90, 145, 9, 14, 200]]
N_NEW = 8


def hf_greedy(model) -> list[list[int]]:
    """A transformers model's greedy continuation of each of :data:`PROMPTS` (:data:`N_NEW`
    tokens, EOS never stops it): the tests' reference."""
    import torch

    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=N_NEW, eos_token_id=[10**9], pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def pagefold_greedy(model: str, **kw) -> list[list[int]]:
    """pagefold's float32 greedy continuation of :data:`PROMPTS`, in 9-token prefill chunks."""
    from pagefold import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              max_num_batched_tokens=9, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
