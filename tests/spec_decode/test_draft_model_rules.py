"""The draft-model proposer's bookkeeping without running the engine (issue 44: mutmut over
``spec_decode/draft_model.py``).

A recording stand-in draft model returns the row ``[token, position]`` and its logits put all
their mass on ``(token + position) % V``; as a state layer it leaves, after every token, the
state ``[token, position]`` (and its negation as a second component). So every draft, every
pass's tokens, positions and initial states, and the state :meth:`commit` stores are worked out
by hand from the module's docstring: pass 0 runs each request's step tokens (a drafted one:
its last token ``t`` at ``s``) and drafts ``d_1`` from its last row; pass ``j`` runs ``d_j``
at ``s + j`` from the state after ``d_{j-1}`` and drafts ``d_{j+1}`` (pass ``k`` only writes
caches); commit stores the state after the last kept token."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.executor.runner_state import CachedRequestState, StepBatch
from pagefold.sampling_params import SamplingParams
from pagefold.spec_decode.draft_model import (
    DRAFT_PREFIX,
    DraftModelProposer,
    draft_layer_specs,
    load_draft_model,
    prefix_layer_names,
)
from pagefold.spec_decode.drafting import PLACEHOLDER

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 40
P = PLACEHOLDER
LAYER = "draft.layers.0"


def _state_spec() -> StateSpec:
    return StateSpec("gdn", (StateComponent("conv", (2,), torch.float32),
                             StateComponent("ssm", (2,), torch.float32)))


class _Draft(nn.Module):
    """Records each forward; the hidden row and the state after a token are [token, pos]."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, input_ids, positions, ctx):
        rows = torch.stack([input_ids.float(), positions.float()], dim=1)
        init = ctx.initial_states
        self.calls.append(dict(ids=input_ids.tolist(), pos=positions.tolist(), ctx=ctx,
                               initial=None if init is None else init[LAYER]["conv"].tolist()))
        if ctx.spec_states is not None:
            ctx.spec_states[LAYER] = {"conv": rows.clone(), "ssm": -rows}
        return rows

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(h.shape[0], V)
        for n, (t, p) in enumerate(h.tolist()):
            out[n, int(t + p) % V] = 5.0
        return out


class _View:
    """A state layer's pages: records what is scattered where."""

    def __init__(self) -> None:
        self.stored: list[tuple[list, dict]] = []

    def scatter(self, page_ids, states, written=()):
        self.stored.append((page_ids.tolist(), {c: t.tolist() for c, t in states.items()}))


class _Runner:
    def __init__(self, state: bool) -> None:
        spec = _state_spec() if state else None
        self.kv_config = SimpleNamespace(
            groups=[SimpleNamespace(spec=spec, pages_per_state=1)], block_size=4)
        self.view = _View()
        self.cache = SimpleNamespace(state={LAYER: self.view}, layer_group={LAYER: 0})
        self.device = torch.device("cpu")
        self.asked: list[str] = []

    def generator_for(self, r):
        self.asked.append(r.req_id)
        return torch.Generator().manual_seed(11)


def _req(rid: str, tokens: list[int], *pages: int, temperature: float = 0.0):
    return CachedRequestState(rid, list(tokens), list(tokens), [],
                              SamplingParams(temperature=temperature), None, [list(pages)])


def _step(a_pages=(5,)):
    """a: t = 13 at 3 with 3 drafts; b: a 3-token chunk from 1; c: t = 31 at 1, 1 draft."""
    reqs = [_req("a", [10, 11, 12, 13], *a_pages), _req("b", [20, 21, 22, 23, 24], 6),
            _req("c", [30, 31], 7)]
    return StepBatch(reqs, starts=[3, 1, 1], counts=[4, 3, 2]), [[P, P, P], [], [P]]


def test_a_state_draft_chains_its_passes_from_the_state_after_the_previous_token() -> None:
    model, runner = _Draft(), _Runner(state=True)
    prop = DraftModelProposer(model, has_state=True)
    batch, drafts_in = _step()
    res = prop.propose(runner, batch, drafts_in)
    # d1: a from (13 at 3), c from (31 at 1); d2: a from (16 at 4); d3: a from (20 at 5).
    assert res.drafts == [[16, 20, 25], [], [32]]
    assert drafts_in == [[P, P, P], [], [P]]
    assert res.probs == [None, None, None] and runner.asked == []
    assert [(c["ids"], c["pos"]) for c in model.calls] == [
        ([13, 21, 22, 23, 31], [3, 1, 2, 3, 1]),  # pass 0: the step's tokens
        ([16, 32], [4, 2]),                       # pass 1: d1 (c's last pass: caches only)
        ([20], [5]), ([25], [6])]                 # passes 2, 3: d2, d3 (pass 3: caches only)
    # Every pass runs in verify mode; a chained pass starts from the state after the previous
    # token of its request (pass 0's rows 0 and 4, then pass 1's row 0, pass 2's row 0).
    assert all(c["ctx"].spec_states is not None for c in model.calls)
    assert [c["initial"] for c in model.calls] == [
        None, [[13.0, 3.0], [31.0, 1.0]], [[16.0, 4.0]], [[20.0, 5.0]]]
    # State pages are not written during the passes (their metadata marks verify rows).
    assert runner.view.stored == []
    assert model.calls[0]["ctx"].state_meta[0].spec_rows.tolist() == [True, True, True]


@pytest.mark.parametrize("keep_a, after_a, keep_c, after_c", [
    (1, [13.0, 3.0], 1, [31.0, 1.0]),  # every draft rejected: the state after t (pass 0)
    (2, [16.0, 4.0], 2, [32.0, 2.0]),  # d1 kept: pass 1's rows (a's row 0, c's row 1)
    (3, [20.0, 5.0], 1, [31.0, 1.0]),  # a: d1, d2 (pass 2's)
    (4, [25.0, 6.0], 2, [32.0, 2.0]),  # a: all three (pass 3's)
])
def test_commit_stores_the_state_after_the_last_kept_token(keep_a: int, after_a,
                                                          keep_c: int, after_c) -> None:
    model, runner = _Draft(), _Runner(state=True)
    prop = DraftModelProposer(model, has_state=True)
    batch, drafts_in = _step()
    res = prop.propose(runner, batch, drafts_in)
    prop.commit(runner, batch, res, [keep_a, 3, keep_c], None, None, {})
    # b (no drafts): after its chunk's last token.
    conv = [after_a, [23.0, 3.0], after_c]
    assert runner.view.stored == [([[5], [6], [7]],
                                   {"conv": conv, "ssm": [[-x for x in r] for r in conv]})]


def test_an_attention_only_draft_runs_no_verify_mode_and_commits_nothing() -> None:
    model, runner = _Draft(), _Runner(state=False)
    prop = DraftModelProposer(model, has_state=False)
    batch, drafts_in = _step(a_pages=(5, 8))
    res = prop.propose(runner, batch, drafts_in)
    assert res.drafts == [[16, 20, 25], [], [32]]
    assert all(c["ctx"].spec_states is None and c["initial"] is None for c in model.calls)
    # Each pass writes KV at its tokens' own positions (4 tokens a block, slot = block * 4 +
    # offset): a's t at 3 in block 5, then d1, d2, d3 at 4, 5, 6 in block 8; b at 1..3 in
    # block 6; c's t at 1, d1 at 2 in block 7.
    slots = [c["ctx"].attn_meta[0].slot_mapping.tolist() for c in model.calls]
    assert slots == [[23, 25, 26, 27, 29], [32, 30], [33], [34]]
    prop.commit(runner, batch, res, [4, 3, 1], None, None, {})
    assert runner.view.stored == []


def _q_of(token: int) -> torch.Tensor:
    """softmax of the stand-in logits at temperature 1, written out."""
    z = math.exp(5.0) + (V - 1)
    q = torch.full((V,), 1 / z)
    q[token] = math.exp(5.0) / z
    return q


def test_sampled_drafts_keep_their_distributions() -> None:
    model, runner = _Draft(), _Runner(state=False)
    prop = DraftModelProposer(model, has_state=False)
    reqs = [_req("g", [1, 2, 3], 1, 3), _req("s", [4, 5, 6], 2, 4, temperature=1.0)]
    res = prop.propose(runner, StepBatch(reqs, [2, 2], [3, 3]), [[P, P], [P, P]])
    assert runner.asked == ["s", "s"]  # each sampled draft from the request's own generator
    assert res.drafts[0] == [5, 8] and res.probs[0] is None
    d1 = res.drafts[1][0]
    assert res.probs[1].shape == (2, V)
    torch.testing.assert_close(res.probs[1][0], _q_of((6 + 2) % V))
    torch.testing.assert_close(res.probs[1][1], _q_of((d1 + 3) % V))


def test_sync_runs_the_steps_tokens_through_the_runners_cache() -> None:
    model, runner = _Draft(), _Runner(state=False)
    inp = SimpleNamespace(input_ids=torch.tensor([4, 5]), positions=torch.tensor([7, 8]),
                          attn_meta=[None], state_meta=[None])
    DraftModelProposer(model, False).sync(runner, None, inp, None, {})
    (call,) = model.calls
    assert call["ids"] == [4, 5] and call["pos"] == [7, 8]
    ctx = call["ctx"]
    assert ctx.cache is runner.cache and ctx.attn_meta is inp.attn_meta
    assert ctx.state_meta is inp.state_meta and ctx.spec_states is None


def test_for_specs_sees_state_layers() -> None:
    m = _Draft()
    full = FullAttentionSpec(2, 8, torch.float32)
    assert DraftModelProposer.for_specs(m, {"a": full, "s": _state_spec()}).has_state is True
    prop = DraftModelProposer.for_specs(m, {"a": full})
    assert prop.has_state is False and prop.model is m


def test_prefix_layer_names_renames_each_cached_layer_once() -> None:
    root = nn.Module()
    root.a, root.b, root.c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    root.a.layer_name, root.b.layer_name, root.c.layer_name = "layers.0", "draft.layers.1", 7
    prefix_layer_names(root, DRAFT_PREFIX)
    prefix_layer_names(root, DRAFT_PREFIX)
    assert (root.a.layer_name, root.b.layer_name, root.c.layer_name) == (
        "draft.layers.0", "draft.layers.1", 7)
    assert not hasattr(root, "layer_name")


BF = torch.bfloat16


def test_draft_specs_are_renamed_and_share_the_targets_page() -> None:
    target = {"layers.0": FullAttentionSpec(2, 32, BF), "layers.1": _state_spec()}
    window = SlidingWindowSpec(2, 32, BF, 8)  # the same page as the target's attention
    draft = {"layers.0": window, "layers.1": _state_spec()}
    got = draft_layer_specs(target, draft, 16)
    assert got == {"draft.layers.0": window, "draft.layers.1": _state_spec()}
    # A state-only draft, and a draft for a state-only target, need no attention page.
    assert list(draft_layer_specs(target, {"s": _state_spec()}, 16)) == ["draft.s"]
    assert list(draft_layer_specs({"s": _state_spec()}, {"a": window}, 16)) == ["draft.a"]


def test_a_draft_with_another_attention_page_is_refused() -> None:
    target = {"layers.0": FullAttentionSpec(2, 32, BF)}
    draft = {"layers.0": FullAttentionSpec(4, 32, BF)}
    with pytest.raises(ValueError) as e:
        draft_layer_specs(target, draft, 16)
    # K and V x heads x head_dim x 16 tokens x 2 bytes: 4096 and 8192 bytes.
    assert str(e.value) == (
        "the draft model's attention pages (4 kv heads x head_dim 32, torch.bfloat16: 8192 "
        "bytes per block) differ from the target's (4096 bytes); pagefold keeps one page size "
        "per pool, so a draft model needs the target's num_key_value_heads x head_dim")


def test_a_draft_state_that_cannot_fill_the_pages_is_refused() -> None:
    # An 8-byte attention page (1 head x 1 dim x K, V x 1 token x float32) holds no whole
    # 16-byte unit of a state.
    with pytest.raises(ValueError, match="cannot be split into pages of 8 bytes"):
        draft_layer_specs({"a": FullAttentionSpec(1, 1, torch.float32)},
                          {"s": _state_spec()}, 1)


def test_a_draft_path_that_is_no_folder_is_refused(tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError) as e:
        load_draft_model(missing, None, torch.float32, 16, torch.device("cpu"))
    assert str(e.value) == (f"speculative_config 'model' {missing!r} is not a local model "
                            f"folder")


def _rope_rows(model: nn.Module) -> set[int]:
    return {m.cos.shape[0] for m in model.modules()
            if isinstance(getattr(m, "cos", None), torch.Tensor)}


def test_a_draft_model_loads_with_prefixed_layers_and_the_longer_rope(tiny_model_factory
                                                                       ) -> None:
    import json

    from transformers import AutoConfig

    d = tiny_model_factory("llama")
    target_cfg = AutoConfig.from_pretrained(str(d))
    cfg_max = json.loads((d / "config.json").read_text())["max_position_embeddings"]
    model, cfg = load_draft_model(str(d), target_cfg, torch.float64, 16, torch.device("cpu"))
    names = [m.layer_name for m in model.modules() if isinstance(getattr(m, "layer_name", None),
                                                                    str)]
    assert names and all(n.startswith("draft.") and not n.startswith("draft.draft.")
                         for n in names)
    assert cfg.vocab_size == target_cfg.vocab_size
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert _rope_rows(model) == {cfg_max}  # the draft's own limit, above the 16 asked
    model, _ = load_draft_model(str(d), target_cfg, torch.float32, cfg_max + 8,
                                torch.device("cpu"))
    assert _rope_rows(model) == {cfg_max + 8}
    # A draft whose config has no max_position_embeddings (Mamba-2) takes the limit asked.
    m2 = tiny_model_factory("mamba2")
    model, _ = load_draft_model(str(m2), AutoConfig.from_pretrained(str(m2)), torch.float32,
                                16, torch.device("cpu"))
    assert any(getattr(m, "layer_name", "").startswith("draft.") for m in model.modules())
    other = AutoConfig.from_pretrained(str(d), vocab_size=target_cfg.vocab_size + 1)
    with pytest.raises(ValueError) as e:
        load_draft_model(str(d), other, torch.float32, 16, torch.device("cpu"))
    assert str(e.value) == (
        f"the draft model's vocab_size {target_cfg.vocab_size} differs from the target's "
        f"{target_cfg.vocab_size + 1}; a draft model must share the target's tokenizer")
