"""An independent implementation of EAGLE / EAGLE-3 heads (torch only, over transformers'
hidden states) and the check that the engine's drafts equal it. Shared by the EAGLE tests.

The reference reads the head's checkpoint (``model.safetensors`` + ``config.json`` as
``pagefold.testing.spec_models.write_eagle_head`` writes them) and the target's hidden
states from transformers (the input of its layer ``i`` through a pre-hook, the final normed
output from ``output_hidden_states``), so a wrong capture in pagefold (another layer, a
missing residual, a shifted row) or a wrong embedding changes the reference's drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagefold import LLM
from pagefold.testing.oracle import load_hf_model

__all__ = ["check_drafts", "record_drafts"]


def record_drafts(llm: LLM) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(tokens up to the verified one, drafts) of every round the head drafted itself (not
    the stand-in for a request it held nothing for); keeps random heads drafting after
    rejections (back-off of one step)."""
    prop = llm.engine.runner.proposer
    llm.engine.spec.MAX_BACKOFF = 1
    seen = []
    inner = prop.propose

    def propose(runner, batch, drafts):
        held = [r.req_id in prop.pending for r in batch.reqs]
        res = inner(runner, batch, drafts)
        for r, s, old, new, h in zip(batch.reqs, batch.starts, drafts, res.drafts, held):
            if old and old[0] < 0 and h:
                seen.append((tuple(r.token_ids[: s + 1]), tuple(new)))
        return res

    prop.propose = propose
    return seen


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos[:, None].double() * inv[None]).float()
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(w: dict, p: str, cfg: dict, attn_in: torch.Tensor, residual: torch.Tensor
           ) -> torch.Tensor:
    """A Llama layer's attention (causal over all rows, positions 0..R-1) and MLP; returns
    the layer's output (residual stream)."""
    t = attn_in.shape[0]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pos = torch.arange(t)
    q = (attn_in @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, nh, d)
    k = (attn_in @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (attn_in @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, nkv, d)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, nh * d)
    x = residual + o @ w[f"{p}.self_attn.o_proj.weight"].T
    h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    g = torch.nn.functional.silu(h @ w[f"{p}.mlp.gate_proj.weight"].T)
    return x + (g * (h @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[f"{p}.mlp.down_proj.weight"].T


def _head_rows(method: str, w: dict, cfg: dict, emb: torch.Tensor, hid: torch.Tensor,
               own: torch.Tensor) -> torch.Tensor:
    """The head's output rows for embeddings ``emb`` (R, H): the first ``hid.shape[0]`` rows
    take the target's hidden rows ``hid``, the rest the head's own outputs ``own``."""
    eps = cfg["rms_norm_eps"]
    if method == "eagle":
        x = torch.cat([emb, torch.cat([hid, own])], -1) @ w["fc.weight"].T
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}"
            a = x if i == 0 else _rms(x, w[f"{p}.input_layernorm.weight"], eps)
            x = _layer(w, p, cfg, a, x)
        return x
    h = torch.cat([hid @ w["fc.weight"].T, own])
    a = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"], eps),
                   _rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
    return _layer(w, "midlayer", cfg, a, h)


def _drafts(method: str, w: dict, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor,
            hid: torch.Tensor, tokens: tuple[int, ...], k: int) -> list[int]:
    """Greedy drafts after ``tokens`` (the last one at position s): row p < s takes the
    target's hidden row p and token p + 1; chained rows take the previous draft and row."""
    s = len(tokens) - 1
    ids = list(tokens[1:])
    own = torch.zeros(0, cfg["hidden_size"])
    drafts: list[int] = []
    for _ in range(k):
        rows = _head_rows(method, w, cfg, embed[torch.tensor(ids)], hid[:s], own)
        g = rows[-1]
        if method == "eagle":
            tok = int((g @ lm_head.T).argmax())
        else:
            small = int((_rms(g, w["norm.weight"], cfg["rms_norm_eps"])
                         @ w["lm_head.weight"].T).argmax())
            tok = small + int(w["d2t"][small])
        drafts.append(tok)
        ids.append(tok)
        own = torch.cat([own, g[None]])
    return drafts


def _hf_layers(hf) -> torch.nn.ModuleList:
    n = hf.config.get_text_config().num_hidden_layers
    return next(m for name, m in hf.named_modules()
                if name.endswith("layers") and isinstance(m, torch.nn.ModuleList) and len(m) == n)


def _target_rows(hf, method: str, aux: list[int], seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' rows for the head over each of ``seqs`` (one right-padded batch: a
    causal model's rows before the padding do not see it): the final normed output (EAGLE),
    or the hidden states entering layers ``aux`` concatenated (EAGLE-3), taken by pre-hooks
    on its decoder layers (its ``output_hidden_states`` tuples start at different places per
    model: Mamba's legacy loop records layer outputs only)."""
    got: dict[int, torch.Tensor] = {}

    def hook(i):
        def fn(module, args, kwargs):
            got.setdefault(i, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
        return fn

    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(_hf_layers(hf)) if i in aux]
    try:
        with torch.inference_mode():
            out = hf(ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    rows = (out.hidden_states[-1] if method == "eagle"
            else torch.cat([got[i].float() for i in aux], -1))
    return [rows[b, : len(s)] for b, s in enumerate(seqs)]


_HIDDEN: dict = {}  # (target, method, sequences) -> transformers' rows per sequence


def check_drafts(target: Path, head: Path, method: str, sequences: list[list[int]],
                 seen: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Every recorded round's drafts equal the reference head's on transformers' hidden
    states (``sequences``: the full greedy sequences the rounds belong to; EAGLE-3 reads
    vLLM's default layers ``(2, n // 2, n - 3)`` clamped to the target); returns how many
    rounds were checked."""
    hf = load_hf_model(target)
    w = load_file(str(Path(head) / "model.safetensors"))
    cfg = json.loads((Path(head) / "config.json").read_text())
    n = hf.config.get_text_config().num_hidden_layers
    aux = [min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)]
    embed = hf.get_input_embeddings().weight.detach()
    lm_head = hf.get_output_embeddings().weight.detach()
    of = [next(i for i, v in enumerate(sequences) if tuple(v[: len(t)]) == t) for t, _ in seen]
    key = (str(target), method, tuple(map(tuple, sequences)))
    if key not in _HIDDEN and seen:
        _HIDDEN[key] = _target_rows(hf, method, aux, sequences)
    for (tokens, drafts), i in zip(seen, of):
        with torch.inference_mode():
            want = _drafts(method, w, cfg, embed, lm_head, _HIDDEN[key][i], tokens,
                           len(drafts))
        assert list(drafts) == want, (tokens, drafts, want)
    return len(seen)
