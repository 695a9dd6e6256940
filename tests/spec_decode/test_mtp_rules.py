"""The MTP block's own logic without running the engine (issue 44: mutmut over
``spec_decode/mtp.py``): the layer count a config declares, the cache entries of the MTP
layers, the block's layers (full attention, numbered after the target's, named ``mtp.``), its
forward (``norm(layer(fc([norm_e(embed(t_{p+1})) | norm_h(h_p)])))`` with zero-centred norms,
checked against a reference written here with stand-in layers) and loading the ``mtp.*``
tensors under each prefix, with the exact errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.spec_decode.mtp import (
    MTP_PREFIX,
    MtpProposer,
    MultiTokenPredictor,
    load_mtp,
    mtp_layer_specs,
    num_mtp_layers,
)
from pagefold.testing.spec_models import add_mtp_weights
from pagefold.testing.tiny_models import arch_config_kwargs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H = 64  # the tiny Qwen3.5's hidden size
EPS = 1e-3  # not RMSNorm's default (1e-6): the config's eps must reach every norm
# The target's last layer is linear attention, so an MTP layer numbered before the target's
# end would not be full attention.
TYPES = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]


def _cfg(n_mtp: int = 2, **kw):
    return transformers.Qwen3_5TextConfig(**arch_config_kwargs(
        "qwen3_5", vocab_size=64, layer_types=list(TYPES), mtp_num_hidden_layers=n_mtp,
        rms_norm_eps=EPS, **kw))


@pytest.mark.parametrize("fields, want", [
    ({"mtp_num_hidden_layers": 2}, 2),
    ({"num_nextn_predict_layers": 3}, 3),
    ({"mtp_num_hidden_layers": 1, "num_nextn_predict_layers": 3}, 1),
    ({"mtp_num_hidden_layers": 0, "num_nextn_predict_layers": 2}, 2),
    ({"mtp_num_hidden_layers": None, "num_nextn_predict_layers": None}, 0),
    ({}, 0),
])
def test_the_mtp_layer_count_of_a_config(fields, want: int) -> None:
    got = num_mtp_layers(SimpleNamespace(**fields))
    assert got == want and type(got) is int


def _state() -> StateSpec:
    return StateSpec("gdn", (StateComponent("conv", (4, 8), torch.float32),))


def test_each_mtp_layer_gets_the_targets_first_full_attention_spec() -> None:
    full = FullAttentionSpec(2, 32, torch.bfloat16)
    target = {"layers.0": SlidingWindowSpec(2, 32, torch.bfloat16, 16), "layers.1": _state(),
              "layers.2": full, "layers.3": FullAttentionSpec(4, 32, torch.bfloat16)}
    got = mtp_layer_specs(target, SimpleNamespace(mtp_num_hidden_layers=2))
    assert list(got) == ["mtp.layers.0", "mtp.layers.1"]
    assert all(s is full for s in got.values())
    assert mtp_layer_specs(target, SimpleNamespace()) == {}


def test_a_target_without_full_attention_is_refused() -> None:
    target = {"layers.0": SlidingWindowSpec(2, 32, torch.bfloat16, 16), "layers.1": _state()}
    with pytest.raises(ValueError) as e:
        mtp_layer_specs(target, SimpleNamespace(mtp_num_hidden_layers=1))
    assert str(e.value) == "speculative method 'mtp' needs a target with full attention layers"


def test_the_block_numbers_and_names_its_full_attention_layers_after_the_target() -> None:
    cfg = _cfg(2)
    mtp = MultiTokenPredictor(cfg, 64)
    assert cfg.layer_types == TYPES  # the target's config is not changed
    assert len(mtp.layers) == 2
    for i, layer in enumerate(mtp.layers):
        assert layer.layer_type == "full_attention"
        assert layer.self_attn.layer_name == f"mtp.layers.{i}"
    assert MTP_PREFIX == "mtp."
    assert tuple(mtp.fc.weight.shape) == (H, 2 * H) and mtp.fc.bias is None
    for norm in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm):
        assert norm.zero_centered and norm.eps == EPS and tuple(norm.weight.shape) == (H,)
    assert mtp.embed is None  # the target's, set by load_mtp


def test_each_mtp_layer_gets_the_feed_forward_of_its_own_index() -> None:
    """Qwen3-Next: the MLP kind follows the layer index (here 4 is sparse, 5 in
    ``mlp_only_layers``)."""
    cfg = transformers.Qwen3NextConfig(**arch_config_kwargs(
        "qwen3_next", vocab_size=64, layer_types=list(TYPES), mlp_only_layers=[5],
        mtp_num_hidden_layers=2))
    mtp = MultiTokenPredictor(cfg, 64)
    assert [hasattr(layer.mlp, "experts") for layer in mtp.layers] == [True, False]


class _Layer(nn.Module):
    """Records its inputs and scales them by ``k``."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k, self.seen = k, []

    def forward(self, positions, x, ctx):
        self.seen.append((positions.tolist(), x.clone(), ctx))
        return x * self.k


def _ref_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Zero-centred RMSNorm, written out: x / rms(x) * (1 + w)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * (1 + w)


def test_the_forward_concatenates_embedding_then_hidden_and_picks_the_layer_by_step() -> None:
    torch.manual_seed(0)
    mtp = MultiTokenPredictor(_cfg(2), 64)
    layers = [_Layer(2.0), _Layer(-3.0)]
    mtp.layers = nn.ModuleList(layers)
    table = torch.randn(10, H)
    mtp.embed = lambda ids: table[ids]
    w_e, w_h, w_o = torch.full((H,), 0.5), torch.full((H,), -0.25), torch.linspace(-1, 1, H)
    fc = torch.randn(H, 2 * H) / 8
    with torch.no_grad():
        mtp.pre_fc_norm_embedding.weight.copy_(w_e)
        mtp.pre_fc_norm_hidden.weight.copy_(w_h)
        mtp.norm.weight.copy_(w_o)
        mtp.fc.weight.copy_(fc)
    ids, pos = torch.tensor([3, 7]), torch.tensor([5, 6])
    hidden = torch.randn(2, H, dtype=torch.float64)  # cast to the embedding's dtype
    ctx = object()
    x = torch.cat([_ref_norm(table[ids], w_e), _ref_norm(hidden.float(), w_h)], dim=-1) @ fc.T
    for step, k, layer in [(0, 2.0, 0), (1, -3.0, 1), (2, 2.0, 0), (3, -3.0, 1)]:
        got = mtp(ids, pos, ctx, hidden=hidden, step=step)
        torch.testing.assert_close(got, _ref_norm(x * k, w_o))
        p, seen_x, seen_ctx = layers[layer].seen[-1]
        assert p == [5, 6] and seen_ctx is ctx
        torch.testing.assert_close(seen_x, x)
    assert [len(a.seen) for a in layers] == [2, 2]
    torch.testing.assert_close(mtp(ids, pos, ctx, hidden=hidden), _ref_norm(x * 2.0, w_o))


class _Stack(nn.Module):
    captures_layer_inputs = True

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(64, H)


class _Target(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Stack()

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return g


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """A checkpoint folder holding only the ``mtp.*`` tensors of one MTP layer (random)."""
    d = tmp_path_factory.mktemp("mtp_rules")
    _cfg(0).save_pretrained(d)
    save_file({"model.embed_tokens.weight": torch.zeros(64, H)}, str(d / "model.safetensors"))
    add_mtp_weights(d, num_layers=1, seed=3)
    return d


def _with_prefix(src, dst, prefix: str, drop: str | None = None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    t = load_file(str(src / "model.safetensors"))
    t = {(prefix + n.removeprefix("mtp.") if n.startswith("mtp.") else n): v
         for n, v in t.items() if n != drop}
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("prefix", ["mtp.", "model.mtp.", "model.language_model.mtp."])
def test_the_mtp_tensors_load_under_each_prefix(mtp_dir, tmp_path, prefix: str) -> None:
    d = _with_prefix(mtp_dir, tmp_path / "ck", prefix)
    ck = load_file(str(mtp_dir / "model.safetensors"))
    target = _Target()
    prev = torch.get_default_dtype()
    mtp = load_mtp(d, _cfg(1), target, torch.float64, 64, torch.device("cpu"))
    assert torch.get_default_dtype() == prev
    assert mtp.fc.weight.dtype == torch.float64
    for name in ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden",
                 "layers.0.input_layernorm", "layers.0.mlp.down_proj"):
        got = mtp.get_parameter(f"{name}.weight")
        assert torch.equal(got, ck[f"mtp.{name}.weight"].double()), name
    assert not mtp.training
    assert not any(p.requires_grad for p in mtp.parameters())
    ids = torch.tensor([1, 5])
    assert torch.equal(mtp.embed(ids), target.model.token_embedding.weight[ids])
    prop = MtpProposer(mtp, target)
    assert prop.mtp is mtp and prop.target is target and prop.head is mtp
    assert prop.logits == target.compute_logits and prop.aux_layers is None


def test_a_config_without_mtp_layers_is_refused(mtp_dir) -> None:
    with pytest.raises(ValueError) as e:
        load_mtp(mtp_dir, _cfg(0), _Target(), torch.float32, 64, torch.device("cpu"))
    assert str(e.value) == "the config declares no MTP layers (mtp_num_hidden_layers)"


def test_a_checkpoint_missing_an_mtp_tensor_is_refused_by_name(mtp_dir, tmp_path) -> None:
    d = _with_prefix(mtp_dir, tmp_path / "ck", "mtp.", drop="mtp.norm.weight")
    with pytest.raises(ValueError) as e:
        load_mtp(d, _cfg(1), _Target(), torch.float32, 64, torch.device("cpu"))
    assert str(e.value) == (
        f"speculative method 'mtp' needs the checkpoint's multi-token-prediction weights "
        f"(mtp.* tensors); {d} lacks 1 of them, e.g. mtp.norm.weight. Use "
        f'{{"method": "ngram", ...}} or a draft \'model\' instead.')
    assert torch.get_default_dtype() == torch.float32
