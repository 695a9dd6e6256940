"""EAGLE / EAGLE-3 heads' own logic without running the engine (issue 44: mutmut over
``spec_decode/eagle.py``): the heads' cache entries and target layers, their structure, their
forwards against references written here with recording stand-in layers (EAGLE:
``x = fc([embed(t_{p+1}) | h_p])``, the layers, ``g = x + residual``; EAGLE-3: step 0 maps the
three layer inputs through ``fc``, a chained step feeds ``g`` as it is, the mid layer attends
over ``[norm(embed) | norm(hidden)]`` with the hidden state as residual), their logits (the
draft vocabulary placed at ``i + d2t[i]``, ``-inf`` elsewhere), and loading a head folder
(``pagefold.testing.spec_models.write_eagle_head``) with each of its exact errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.spec_decode.eagle import (
    EAGLE_PREFIX,
    Eagle3Head,
    EagleHead,
    EagleProposer,
    aux_layer_ids,
    eagle_layer_specs,
    load_eagle,
    load_eagle_config,
)
from pagefold.testing.spec_models import write_eagle_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, VOCAB, EPS = 64, 48, 1e-3
CPU = torch.device("cpu")


def _dcfg(**kw) -> LlamaConfig:
    base = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=VOCAB,
                rms_norm_eps=EPS, max_position_embeddings=64)
    return LlamaConfig(**(base | kw))


def _ref_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm, written out: x / rms(x) * w."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


# -- cache entries and target layers ------------------------------------------------------

BF = torch.bfloat16


@pytest.mark.parametrize("method, names", [
    ("eagle", ["eagle.layers.0", "eagle.layers.1", "eagle.layers.2"]),
    ("eagle3", ["eagle.layers.0"]),  # one mid layer whatever the config says
])
def test_each_head_layer_gets_a_full_attention_entry(method: str, names) -> None:
    target = {"t.0": FullAttentionSpec(2, 16, BF)}
    got = eagle_layer_specs(target, _dcfg(num_hidden_layers=3), method, BF, 16)
    assert list(got) == names
    assert set(got.values()) == {FullAttentionSpec(2, 16, BF)}


def test_the_heads_kv_heads_follow_its_config_and_the_tensor_parallel_split() -> None:
    state = StateSpec("gdn", (StateComponent("conv", (4,), torch.float32),))
    # No num_key_value_heads: every query head has its own KV head (4 x 16, per rank 2 of 4).
    cfg = _dcfg(num_key_value_heads=None)
    cfg.num_key_value_heads = None
    got = eagle_layer_specs({"s": state}, cfg, "eagle3", BF, 16, tensor_parallel_size=2)
    assert got == {"eagle.layers.0": FullAttentionSpec(2, 16, BF)}
    # head_dim from hidden_size / heads when the config has none: 64 / 4 = 16.
    cfg = _dcfg(num_key_value_heads=2)
    cfg.head_dim = None
    got = eagle_layer_specs({}, cfg, "eagle3", torch.float32, 16)
    assert got == {"eagle.layers.0": FullAttentionSpec(2, 16, torch.float32)}


def test_a_head_with_another_attention_page_is_refused() -> None:
    target = {"s": StateSpec("gdn", (StateComponent("conv", (4,), torch.float32),)),
              "t": FullAttentionSpec(4, 16, BF)}
    with pytest.raises(ValueError) as e:
        eagle_layer_specs(target, _dcfg(), "eagle", BF, 16)
    # K and V x 4 heads x 16 x 16 tokens x 2 bytes.
    assert str(e.value) == ("the EAGLE head's attention pages (2 kv heads x head_dim 16) "
                            "differ from the target's (4096 bytes per block); pagefold keeps "
                            "one page size per pool")


def test_eagle3s_target_layers_come_from_the_config_else_vllms_default() -> None:
    assert aux_layer_ids(SimpleNamespace(eagle_aux_hidden_state_layer_ids=["1", 4, 7]), 32) \
        == (1, 4, 7)
    nested = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5]})
    assert aux_layer_ids(nested, 32) == (0, 3, 5)
    both = SimpleNamespace(eagle_aux_hidden_state_layer_ids=[2, 2, 2],
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5]})
    assert aux_layer_ids(both, 32) == (2, 2, 2)
    assert aux_layer_ids(SimpleNamespace(), 32) == (2, 16, 29)
    assert aux_layer_ids(SimpleNamespace(eagle_config=None), 10) == (2, 5, 7)
    assert aux_layer_ids(SimpleNamespace(eagle_config={}), 10) == (2, 5, 7)


def test_a_head_folder_needs_its_config(tmp_path) -> None:
    with pytest.raises(ValueError) as e:
        load_eagle_config(tmp_path)
    assert str(e.value) == (f"speculative_config 'model' {str(tmp_path)!r} is not a local "
                            f"EAGLE head folder (no config.json)")
    _dcfg(num_hidden_layers=3).save_pretrained(tmp_path)
    cfg = load_eagle_config(str(tmp_path))
    assert isinstance(cfg, LlamaConfig) and cfg.num_hidden_layers == 3


# -- EAGLE --------------------------------------------------------------------------------


class _Layer(nn.Module):
    """A decoder layer stand-in with the fused add + norm convention: returns
    ``(x * k, x + residual)``; records its inputs."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k, self.seen = k, []

    def forward(self, positions, x, ctx, residual):
        self.seen.append((positions.tolist(), x.clone(), ctx, residual))
        return x * self.k, x if residual is None else x + residual


def test_the_eagle_head_is_built_as_its_checkpoint_says() -> None:
    head = EagleHead(_dcfg(num_hidden_layers=3, attention_bias=True), 64, fc_bias=True,
                     own_embed=True, own_head=True)
    assert tuple(head.fc.weight.shape) == (H, 2 * H) and head.fc.bias is not None
    assert [layer.self_attn.layer_name for layer in head.layers] == [
        "eagle.layers.0", "eagle.layers.1", "eagle.layers.2"]
    assert EAGLE_PREFIX == "eagle."
    assert isinstance(head.layers[0].input_layernorm, nn.Identity)
    assert not isinstance(head.layers[1].input_layernorm, nn.Identity)
    assert head.layers[0].self_attn.qkv_proj.bias is not None  # attention_bias
    assert head.layers[0].self_attn.o_proj.bias is not None
    assert head.embed is head.embed_tokens and tuple(head.embed_tokens.weight.shape) == (VOCAB,
                                                                                         H)
    assert tuple(head.lm_head.weight.shape) == (VOCAB, H) and head.vocab_size == VOCAB
    assert head.target_logits is None
    bare = EagleHead(_dcfg(), 64, fc_bias=False, own_embed=False, own_head=False)
    assert bare.fc.bias is None and bare.embed_tokens is None and bare.embed is None
    assert bare.lm_head is None and bare.layers[0].self_attn.qkv_proj.bias is None


def test_the_eagle_forward_and_logits() -> None:
    torch.manual_seed(0)
    head = EagleHead(_dcfg(), 64, fc_bias=False, own_embed=False, own_head=True)
    layers = [_Layer(2.0), _Layer(-3.0)]
    head.layers = nn.ModuleList(layers)
    table, fc, w = torch.randn(VOCAB, H), torch.randn(H, 2 * H) / 8, torch.randn(VOCAB, H)
    head.embed = lambda ids: table[ids]
    with torch.no_grad():
        head.fc.weight.copy_(fc)
        head.lm_head.weight.copy_(w)
    ids, pos, ctx = torch.tensor([3, 7]), torch.tensor([5, 6]), object()
    hidden = torch.randn(2, H, dtype=torch.float64)
    x = torch.cat([table[ids], hidden.float()], dim=-1) @ fc.T
    g = head(ids, pos, ctx, hidden=hidden)
    # Layer 0: (2x, x); layer 1: (-6x, 2x + x); g = -6x + 3x.
    torch.testing.assert_close(g, -3 * x)
    assert layers[0].seen[0][3] is None
    torch.testing.assert_close(layers[1].seen[0][3], x)
    assert all(s[0] == [5, 6] and s[2] is ctx for a in layers for s in a.seen)
    logits = head.compute_logits(g.to(torch.float64).to(torch.float32))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, g @ w.T)
    head.lm_head = None
    head.target_logits = lambda v: ("target", v)
    tag, seen = head.compute_logits(g)
    assert tag == "target" and seen is g


# -- EAGLE-3 ------------------------------------------------------------------------------


class _Attn(nn.Module):
    """Mixes both halves of its input so their order shows: ``2 * left + right``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def forward(self, positions, x, ctx):
        self.seen.append((positions.tolist(), x.clone(), ctx))
        return 2 * x[:, :H] + x[:, H:]


class _Times(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


def test_the_eagle3_mid_layer() -> None:
    torch.manual_seed(1)
    head = Eagle3Head(_dcfg(attention_bias=True), 64, target_hidden=H, own_embed=False,
                      vocab_size=VOCAB)
    mid = head.midlayer
    attn = mid.self_attn
    assert tuple(attn.qkv_proj.weight.shape) == ((4 + 2 + 2) * 16, 2 * H)
    assert attn.qkv_proj.bias is not None and attn.layer_name == "eagle.layers.0"
    assert attn.o_proj.bias is not None
    assert mid.mlp.gate_up_proj.bias is None and mid.mlp.act is F.silu
    other = Eagle3Head(_dcfg(mlp_bias=True, hidden_act="gelu"), 64, target_hidden=H,
                       own_embed=False, vocab_size=VOCAB).midlayer.mlp
    assert other.gate_up_proj.bias is not None and other.down_proj.bias is not None
    assert other.act is F.gelu
    w_in, w_h, w_post = torch.rand(H) + 0.5, torch.rand(H) + 0.5, torch.rand(H) + 0.5
    with torch.no_grad():
        mid.input_layernorm.weight.copy_(w_in)
        mid.hidden_norm.weight.copy_(w_h)
        mid.post_attention_layernorm.weight.copy_(w_post)
    mid.self_attn, mid.mlp = _Attn(), _Times(3.0)
    e, h = torch.randn(2, H), torch.randn(2, H)
    ctx = object()
    # (the fused add + norm adds into the residual's storage: hand the layer a copy)
    out, residual = mid(torch.tensor([4, 9]), e, h.clone(), ctx)
    a = 2 * _ref_norm(e, w_in) + _ref_norm(h, w_h)
    torch.testing.assert_close(residual, a + h)
    torch.testing.assert_close(out, 3 * _ref_norm(a + h, w_post))
    assert mid.self_attn.seen[0][0] == [4, 9] and mid.self_attn.seen[0][2] is ctx


class _Mid(nn.Module):
    """Records the hidden state it is given; returns ``(embeds, 2 * hidden)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def forward(self, positions, embeds, hidden, ctx):
        self.seen.append((positions.tolist(), embeds.clone(), hidden.clone(), ctx))
        return embeds, 2 * hidden


def test_the_eagle3_head_maps_the_target_layers_once_and_feeds_g_back() -> None:
    torch.manual_seed(2)
    own = Eagle3Head(_dcfg(), 64, target_hidden=H, own_embed=True, vocab_size=VOCAB)
    assert own.embed is own.embed_tokens
    assert tuple(own.embed_tokens.weight.shape) == (VOCAB, H)
    head = Eagle3Head(_dcfg(), 64, target_hidden=H, own_embed=False, vocab_size=VOCAB)
    assert tuple(head.fc.weight.shape) == (H, 3 * H) and head.fc.bias is None
    assert head.draft_vocab == VOCAB and head.same_vocab
    assert head.draft_to_target.tolist() == list(range(VOCAB))
    assert "draft_to_target" not in head.state_dict()
    mid = _Mid()
    head.midlayer = mid
    table, fc = torch.randn(VOCAB, H), torch.randn(H, 3 * H) / 8
    head.embed = lambda ids: table[ids]
    with torch.no_grad():
        head.fc.weight.copy_(fc)
    ids, pos, ctx = torch.tensor([1, 2]), torch.tensor([0, 1]), object()
    layers_in = torch.randn(2, 3 * H, dtype=torch.float64)
    g = head(ids, pos, ctx, hidden=layers_in)
    torch.testing.assert_close(mid.seen[0][2], layers_in.float() @ fc.T)
    torch.testing.assert_close(g, table[ids] + 2 * (layers_in.float() @ fc.T))
    assert mid.seen[0][0] == [0, 1] and mid.seen[0][3] is ctx
    g1 = torch.randn(2, H)
    torch.testing.assert_close(head(ids, pos, ctx, hidden=g1, step=1), table[ids] + 2 * g1)
    torch.testing.assert_close(mid.seen[1][2], g1)


class _InPlaceMid(torch.nn.Module):
    """Writes into the hidden state it is given, as the real mid layer's fused add + norm
    writes into its residual; returns ``(embeds, hidden)``."""

    def forward(self, positions, embeds, hidden, ctx):
        hidden.add_(1.0)
        return embeds, hidden


def test_a_chained_eagle3_draft_leaves_the_callers_g_untouched() -> None:
    head = Eagle3Head(_dcfg(), 64, target_hidden=H, own_embed=False, vocab_size=VOCAB)
    head.midlayer = _InPlaceMid()
    table = torch.randn(VOCAB, H)
    head.embed = lambda ids: table[ids]
    g1 = torch.randn(2, H)
    before = g1.clone()
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 1])
    torch.testing.assert_close(head(ids, pos, object(), hidden=g1, step=1),
                               table[ids] + before + 1)
    assert torch.equal(g1, before)


def test_eagle3_logits_over_a_smaller_draft_vocabulary() -> None:
    torch.manual_seed(3)
    head = Eagle3Head(_dcfg(draft_vocab_size=3), 64, target_hidden=H, own_embed=False,
                      vocab_size=8)
    assert head.draft_vocab == 3 and not head.same_vocab and head.vocab_size == 8
    assert tuple(head.lm_head.weight.shape) == (3, H) and head.embed is None
    w, wn = torch.randn(3, H), torch.rand(H) + 0.5
    with torch.no_grad():
        head.lm_head.weight.copy_(w)
        head.norm.weight.copy_(wn)
    head.draft_to_target.copy_(torch.tensor([6, 0, 3]))
    g = torch.randn(2, H)
    small = _ref_norm(g, wn) @ w.T
    got = head.compute_logits(g)
    assert got.dtype == torch.float32 and got.shape == (2, 8)
    torch.testing.assert_close(got[:, [6, 0, 3]], small)
    assert torch.isneginf(got[:, [1, 2, 4, 5, 7]]).all()
    head.same_vocab = True
    torch.testing.assert_close(head.compute_logits(g), small)


# -- loading ------------------------------------------------------------------------------


class _Stack(nn.Module):
    captures_layer_inputs = True

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(nn.Identity() for _ in range(4))


class _Target(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Stack()

    def compute_logits(self, g):
        return ("target", g)


def _target_cfg(**kw) -> LlamaConfig:
    return _dcfg(num_hidden_layers=4, **kw)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle_target")
    _target_cfg().save_pretrained(d)
    return d


def _load(path, method: str, dtype=torch.float32, target=None):
    return load_eagle(path, method, target or _Target(), _target_cfg(), dtype, 64, CPU)


def _edit_config(path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text()) | fields
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, drop=(), prefix: str = "", **extra) -> None:
    t = {prefix + n: v for n, v in load_file(str(path / "model.safetensors")).items()
         if n not in drop}
    save_file(t | extra, str(path / "model.safetensors"))


def test_an_eagle_head_loads_onto_the_targets_embedding_and_logits(target_dir, tmp_path
                                                                   ) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle", num_layers=2, seed=4)
    ck = load_file(str(d / "model.safetensors"))
    # A converted head may ship the first layer's input norm, and a "model." prefix.
    _edit_tensors(d, prefix="model.", **{"layers.0.input_layernorm.weight": torch.ones(H)})
    target = _Target()
    prev = torch.get_default_dtype()
    head = _load(d, "eagle", torch.float64, target)
    assert torch.get_default_dtype() == prev
    assert isinstance(head, EagleHead) and len(head.layers) == 2
    assert torch.equal(head.fc.weight, ck["fc.weight"].double()) and head.fc.bias is None
    assert torch.equal(head.layers[1].input_layernorm.weight,
                       ck["layers.1.input_layernorm.weight"].double())
    assert isinstance(head.layers[0].input_layernorm, nn.Identity)
    assert not head.training and not any(p.requires_grad for p in head.parameters())
    assert head.embed_tokens is None and head.lm_head is None
    ids = torch.tensor([2, 9])
    assert torch.equal(head.embed(ids), target.model.token_embedding.weight[ids])
    assert head.compute_logits(torch.zeros(1))[0] == "target"
    assert head.vocab_size == VOCAB


def test_an_eagle_head_with_its_own_embedding_head_and_bias(target_dir, tmp_path) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle", seed=5)
    emb, lm, bias = torch.randn(VOCAB, H), torch.randn(VOCAB, H), torch.randn(H)
    _edit_tensors(d, **{"embed_tokens.weight": emb, "lm_head.weight": lm, "fc.bias": bias})
    _edit_config(d, vocab_size=VOCAB + 16)  # the head's config vocabulary is not used
    head = _load(d, "eagle")
    assert torch.equal(head.embed_tokens.weight, emb) and head.embed is head.embed_tokens
    assert torch.equal(head.lm_head.weight, lm) and torch.equal(head.fc.bias, bias)
    assert head.target_logits is None and head.vocab_size == VOCAB


def test_an_eagle3_head_places_its_draft_vocabulary(target_dir, tmp_path) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle3", draft_vocab=5, seed=6)
    emb = torch.randn(VOCAB, H)
    _edit_tensors(d, **{"embed_tokens.weight": emb})
    ck = load_file(str(d / "model.safetensors"))
    head = _load(d, "eagle3")
    assert isinstance(head, Eagle3Head) and head.draft_vocab == 5 and not head.same_vocab
    assert torch.equal(head.embed_tokens.weight, emb) and head.embed is head.embed_tokens
    assert head.draft_to_target.tolist() == (torch.arange(5) + ck["d2t"]).tolist()
    assert torch.equal(head.lm_head.weight, ck["lm_head.weight"])
    assert torch.equal(head.midlayer.hidden_norm.weight, ck["midlayer.hidden_norm.weight"])
    assert not any(p.requires_grad for p in head.parameters()) and not head.training
    full = write_eagle_head(target_dir, tmp_path / "full", "eagle3", seed=7)
    target = _Target()
    head = _load(full, "eagle3", target=target)
    assert head.same_vocab and head.draft_to_target.tolist() == list(range(VOCAB))
    ids = torch.tensor([0, 47])
    assert head.embed_tokens is None
    assert torch.equal(head.embed(ids), target.model.token_embedding.weight[ids])
    # A d2t that moves some id keeps the scatter even over the whole vocabulary.
    d2t = torch.zeros(VOCAB, dtype=torch.int64)
    d2t[0] = 1
    _edit_tensors(full, d2t=d2t)
    assert not _load(full, "eagle3").same_vocab
    # No d2t at all over the target's vocabulary: the identity.
    _edit_tensors(full, drop=("d2t",))
    head = _load(full, "eagle3")
    assert head.same_vocab and head.draft_to_target.tolist() == list(range(VOCAB))


@pytest.mark.parametrize("method, fields, extra, message", [
    ("eagle", {"hidden_size": 32}, False,
     "the EAGLE head's hidden_size 32 differs from the target's 64 and the head has no "
     "embed_tokens of its own"),
    ("eagle", {"hidden_size": 32}, True, "the EAGLE head's hidden_size 32 is not the target's 64"),
    ("eagle3", {"target_hidden_size": 48}, False,
     "the EAGLE-3 head's target_hidden_size 48 is not the target's hidden_size 64"),
])
def test_a_head_of_another_width_is_refused(target_dir, tmp_path, method, fields, extra,
                                            message) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", method)
    _edit_config(d, **fields)
    if extra:
        _edit_tensors(d, **{"embed_tokens.weight": torch.zeros(VOCAB, 32)})
    prev = torch.get_default_dtype()
    with pytest.raises(ValueError) as e:
        _load(d, method, torch.float64)
    assert str(e.value) == message
    assert torch.get_default_dtype() == prev


def test_a_head_missing_a_tensor_is_refused_by_name(target_dir, tmp_path) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle")
    _edit_tensors(d, drop=("fc.weight",))
    with pytest.raises(ValueError) as e:
        _load(d, "eagle")
    assert str(e.value) == (f"speculative method 'eagle': the head checkpoint {d} lacks 1 "
                            f"tensor(s), e.g. fc.weight")


@pytest.mark.parametrize("d2t, message", [
    (torch.zeros(4, dtype=torch.int64), "d2t has shape (4,); the draft vocabulary is 5"),
    (None, "the EAGLE-3 head's draft vocabulary (5) is not the target's (48) and the "
           "checkpoint has no d2t"),
    (torch.tensor([0, 0, 0, 0, VOCAB - 4]), "d2t maps draft ids outside the target's "
                                             "vocabulary"),
    (torch.tensor([0, -2, 0, 0, 0]), "d2t maps draft ids outside the target's vocabulary"),
])
def test_a_bad_draft_vocabulary_map_is_refused(target_dir, tmp_path, d2t, message) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle3", draft_vocab=5)
    if d2t is None:
        _edit_tensors(d, drop=("d2t",))
    else:
        _edit_tensors(d, d2t=d2t)
    with pytest.raises(ValueError) as e:
        _load(d, "eagle3")
    assert str(e.value) == message


def test_the_last_target_id_is_a_valid_draft_target(target_dir, tmp_path) -> None:
    d = write_eagle_head(target_dir, tmp_path / "h", "eagle3", draft_vocab=5)
    _edit_tensors(d, d2t=torch.tensor([0, 0, 0, 0, VOCAB - 5]))
    assert _load(d, "eagle3").draft_to_target.tolist() == [0, 1, 2, 3, VOCAB - 1]


# -- the proposer -------------------------------------------------------------------------


def test_the_proposer_checks_eagle3s_target_layers() -> None:
    head = Eagle3Head(_dcfg(), 64, target_hidden=H, own_embed=False, vocab_size=VOCAB)
    target = _Target()
    prop = EagleProposer(head, target, _target_cfg(), (0, 2, 3))
    assert prop.head is head and prop.aux_layers == (0, 2, 3)
    assert prop.logits == head.compute_logits
    assert EagleProposer(head, target, _target_cfg(), None).aux_layers is None
    with pytest.raises(ValueError) as e:
        EagleProposer(head, target, _target_cfg(), (1, 2))
    assert str(e.value) == "EAGLE-3 takes 3 target layers, got eagle_aux_hidden_state_layer_ids " \
                           "[1, 2]"
    with pytest.raises(ValueError) as e:
        EagleProposer(head, target, _target_cfg(), (0, 1, 4))
    assert str(e.value) == ("eagle_aux_hidden_state_layer_ids names layer 4; the target has "
                            "layers 0..3")


def test_eagle3_attention_keeps_a_whole_kv_head_on_each_rank_when_ranks_outnumber_them(
) -> None:
    """Rank 1 of 2 building an EAGLE-3 head with 4 query heads and 1 KV head (16 wide): its
    half of the query heads (2 x 16 rows) and the whole, replicated KV head (16 rows each for
    k and v), over the 2H inputs."""
    from pagefold.distributed.parallel_state import set_tensor_parallel

    set_tensor_parallel(1, 2)
    try:
        head = Eagle3Head(_dcfg(num_key_value_heads=1), 64, target_hidden=H,
                          own_embed=False, vocab_size=VOCAB)
    finally:
        set_tensor_parallel(0, 1)
    assert tuple(head.midlayer.self_attn.qkv_proj.weight.shape) == (2 * 16 + 16 + 16, 2 * H)
