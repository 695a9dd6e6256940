"""``spec_decode/verify.py``, ``drafting.py`` and ``proposers.py`` without a model (issue 44:
mutation testing): a stand-in runner whose "model" returns its hidden rows as logits, a
stand-in forward context that records the states committed, a stand-in proposer that records
what it is told. Every expected token, row and state index is worked out by hand from the
documented rules: a greedy request accepts drafts while they equal the argmax of their row
and then emits that row's argmax; the state kept is the one after token ``cu[s] + keep[s] - 1``;
a temperature draft is a draw from ``softmax(logits / T)``."""

from __future__ import annotations

import math

import pytest
import torch

import pagefold.spec_decode.proposers as proposers
import pagefold.spec_decode.verify as verify
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import VerifiedTokens
from pagefold.executor.runner_state import CachedRequestState, StepBatch
from pagefold.sampling_params import SAMPLING_EPS, SamplingParams
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.drafting import (
    PLACEHOLDER,
    DraftResult,
    Proposer,
    draft_tokens,
    forward_pass,
)

# Tiny tensors: one torch thread (spinning pool threads read as timeouts under mutmut).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 8


def _state(rid: str, prompt: list[int], sp: SamplingParams, out: list[int] = ()) -> \
        CachedRequestState:
    return CachedRequestState(rid, list(prompt), list(prompt) + list(out), list(out), sp, None,
                              [[1, 2], [3, 4]])


def _row(top: int, second: int | None = None, v: float = 5.0) -> list[float]:
    """A logits row whose argmax is ``top`` (10), ``second`` next (``v``), the rest 0."""
    r = [0.0] * V
    r[top] = 10.0
    if second is not None:
        r[second] = v
    return r


def _z(v: float = 5.0) -> float:
    """log-sum-exp of a ``_row`` with a second token: its logprobs are ``x - z``."""
    return math.log(math.exp(10) + math.exp(v) + V - 2)


class Model:
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.clone()


class Runner:
    def __init__(self, proposer=None, gens: dict | None = None) -> None:
        self.model, self.proposer, self.device = Model(), proposer, torch.device("cpu")
        self.gens = gens or {}

    def generator_for(self, st):
        return self.gens.get(st.req_id)


class Ctx:
    """The forward context's seams the verify step uses."""

    def __init__(self, n: int) -> None:
        self.spec_states = {"layers.1": {"s": torch.arange(n) * 10, "c": torch.arange(n)}}
        self.stored: list[tuple[str, dict]] = []

    def store_states(self, layer: str, states: dict) -> None:
        self.stored.append((layer, {k: v.tolist() for k, v in states.items()}))

    def drafter_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, :2]


class Inp:
    def __init__(self, sample: list[int]) -> None:
        self.sample_req_idx = sample


class RecordingProposer(Proposer):
    def __init__(self) -> None:
        self.calls: list = []

    def commit(self, runner, batch, res, keep, inp, hidden, emitted) -> None:
        self.calls.append((res, list(keep), inp, hidden.shape, dict(emitted)))
        self.seen = (runner, batch)


def _greedy_batch():
    """Three requests: a prefill chunk (4 tokens, not sampled), a decode with drafts [5, 6]
    (3 tokens) and a decode without drafts (1 token); 8 flat rows, cu = [0, 4, 7, 8]."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    reqs = [_state("pre", [1, 2, 3, 4, 5, 6], greedy),
            _state("a", [1, 2], greedy, out=[3, 4]),
            _state("b", [1, 2], SamplingParams(temperature=0.0, logprobs=1), out=[3])]
    batch = StepBatch(reqs, [0, 3, 2], [4, 3, 1])
    drafts = [[], [5, 6], []]
    rows = [_row(7)] * 4 + [_row(5), _row(2, 6), _row(1)] + [_row(3, 4)]
    return batch, drafts, torch.tensor(rows)


def test_greedy_drafts_are_accepted_while_they_match_and_the_kept_states_committed():
    batch, drafts, hidden = _greedy_batch()
    prop = RecordingProposer()
    ctx = Ctx(8)
    drafted = DraftResult(drafts, [None, None, None])
    runner, inp = Runner(prop), Inp([1, 2])
    out = verify.verify_drafts(runner, batch, drafts, drafted, inp, ctx, hidden)
    # a: row 4's argmax 5 accepts draft 5, row 5's argmax 2 rejects 6 and is emitted.
    # b: row 7's argmax 3; logprobs of 3 and the top 1: log_softmax of (10, 5, 0 x 6).
    z = math.log(math.exp(10) + math.exp(5) + 6)
    assert set(out) == {"a", "b"}
    assert (out["a"].token_ids, out["a"].num_accepted, out["a"].logprobs) == ([5, 2], 1, None)
    (lp,) = out["b"].logprobs
    assert lp[0] == [3, 3] and lp[2] == 1
    assert lp[1] == pytest.approx([10 - z, 10 - z], abs=1e-5)
    assert out["b"].token_ids == [3] and out["b"].num_accepted == 0
    # States after flat tokens 0 + 4 - 1, 4 + 2 - 1, 7 + 1 - 1.
    assert ctx.stored == [("layers.1", {"s": [30, 50, 70], "c": [3, 5, 7]})]
    # The accepted draft is written after a's last token (position 3 + 1).
    assert batch.reqs[1].token_ids == [1, 2, 3, 4, 5] and batch.reqs[1].output_token_ids == [
        3, 4, 5]
    assert batch.reqs[2].token_ids == [1, 2, 3]
    ((res, keep, seen_inp, shape, emitted),) = prop.calls
    assert res is drafted and keep == [4, 2, 1] and shape == (8, 2)
    assert seen_inp is inp and prop.seen[0] is runner and prop.seen[1] is batch
    assert emitted == {1: [5, 2], 2: [3]}


def test_every_draft_accepted_takes_the_bonus_and_logprobs_follow_each_token():
    greedy = SamplingParams(temperature=0.0, logprobs=0)
    reqs = [_state("a", [1], greedy, out=[2])]
    batch = StepBatch(reqs, [1], [3])
    rows = torch.tensor([_row(4, 0), _row(5, 0), _row(6, 0)])
    ctx = Ctx(3)
    out = verify.verify_drafts(Runner(), batch, [[4, 5]], None, Inp([0]), ctx, rows)
    assert out == {"a": VerifiedTokens([4, 5, 6], 2, out["a"].logprobs)}
    z = math.log(math.exp(10) + math.exp(5) + 6)
    assert [(ids, rank) for ids, _, rank in out["a"].logprobs] == [([4], 1), ([5], 1), ([6], 1)]
    assert all(lps == pytest.approx([10 - z], abs=1e-5) for _, lps, _ in out["a"].logprobs)
    assert ctx.stored == [("layers.1", {"s": [20], "c": [2]})]
    assert reqs[0].token_ids == [1, 2, 4, 5]


def test_a_step_that_samples_nothing_commits_whole_chunks():
    greedy = SamplingParams(temperature=0.0)
    reqs = [_state("x", list(range(9)), greedy), _state("y", list(range(9)), greedy)]
    batch = StepBatch(reqs, [0, 0], [3, 2])
    prop = RecordingProposer()
    ctx = Ctx(5)
    runner, inp, drafted = Runner(prop), Inp([]), DraftResult([[], []], [None, None])
    assert verify.verify_drafts(runner, batch, [[], []], drafted, inp, ctx,
                                torch.zeros(5, V)) == {}
    assert ctx.stored == [("layers.1", {"s": [20, 40], "c": [2, 4]})]
    ((res, keep, seen_inp, shape, emitted),) = prop.calls
    assert (res, keep, seen_inp, shape, emitted) == (drafted, [3, 2], inp, (5, 2), {})
    assert res is drafted and seen_inp is inp
    assert prop.seen[0] is runner and prop.seen[1] is batch
    empty = Ctx(5)
    empty.spec_states = {}
    verify.verify_drafts(Runner(), batch, [[], []], None, Inp([]), empty, torch.zeros(5, V))
    assert empty.stored == []  # no state layer: nothing to commit


def test_draft_distributions_reach_the_acceptance_test():
    # p = q = (1/2, 1/2) on tokens 0 and 1 for every draft row: min(1, p / q) = 1, every
    # draft is accepted. Without q (a one-hot proposal) a draft would be accepted with p = 1/2.
    sp = SamplingParams(temperature=1.0, seed=3)
    n = 24
    reqs = [_state(f"r{i}", [1], sp, out=[2]) for i in range(n)]
    batch = StepBatch(reqs, [1] * n, [2] * n)
    half = [0.0] * V
    half[0] = half[1] = 50.0  # softmax: 1/2 each (e^-50 for the rest)
    rows = torch.tensor([half] * (2 * n))
    q = torch.zeros(1, V)
    q[0, 0] = q[0, 1] = 0.5
    drafts = [[i % 2] for i in range(n)]
    drafted = DraftResult(drafts, [q] * n)
    out = verify.verify_drafts(Runner(), batch, drafts, drafted, Inp(list(range(n))), Ctx(2 * n),
                               rows)
    assert all(out[f"r{i}"].num_accepted == 1 for i in range(n))


def test_a_seeded_request_verifies_with_its_own_generator():
    sp = SamplingParams(temperature=1.0, seed=5)
    rows = torch.zeros(2, V)

    def once() -> list[int]:
        reqs = [_state("a", [1], sp, out=[2])]
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(int(torch.randint(0, 1 << 30, (1,))))  # the global stream moves
        out = verify.verify_drafts(Runner(gens={"a": gen}), StepBatch(reqs, [1], [2]), [[3]],
                                   None, Inp([0]), Ctx(2), rows)
        return out["a"].token_ids

    assert all(once() == once() for _ in range(4))


def test_tensor_parallel_ranks_take_rank_zeros_verdict(monkeypatch):
    batch, drafts, hidden = _greedy_batch()
    sent = []

    def rank0(values):  # rank 0 accepted none of a's drafts, sampled 1 for a and 6 for b
        sent.append(list(values))
        return [0, 0, 1, 6]

    monkeypatch.setattr(verify, "tp_size", lambda: 2)
    monkeypatch.setattr(verify, "broadcast_ints", rank0)
    ctx = Ctx(8)
    out = verify.verify_drafts(Runner(), batch, drafts, None, Inp([1, 2]), ctx, hidden)
    assert sent == [[1, 0, 2, 3]]  # this rank's accepted counts, then its last tokens
    assert (out["a"].token_ids, out["a"].num_accepted) == ([1], 0)
    assert out["b"].token_ids == [6]
    # b's logprobs are read at its own row (7), for rank 0's token 6: logit 0.
    z = math.log(math.exp(10) + math.exp(5) + 6)
    ((ids, lps, rank),) = out["b"].logprobs
    assert ids == [6, 3] and lps == pytest.approx([-z, 10 - z], abs=1e-5) and rank == 3
    assert ctx.stored == [("layers.1", {"s": [30, 40, 70], "c": [3, 4, 7]})]
    assert batch.reqs[1].token_ids == [1, 2, 3, 4]  # nothing accepted: nothing written


def test_penalties_read_the_prompt_and_min_tokens_bans_the_eos():
    # "rp": repetition penalty 2 on its prompt's token 3 (10 -> 5): 4 (6) wins. "mt": one
    # output token of min_tokens 3, so its EOS 5 (10) is banned: 6 (6) wins.
    rp = CachedRequestState("rp", [3, 1], [3, 1], [], SamplingParams(
        temperature=0.0, repetition_penalty=2.0), None, [[1], [2, 3]])
    mt = CachedRequestState("mt", [1], [1, 7], [7], SamplingParams(
        temperature=0.0, min_tokens=3), 5, [[4], [5, 6]])
    rows = [_row(3, 4, 6.0), _row(5, 6, 6.0)]
    out = verify.verify_drafts(Runner(), StepBatch([rp, mt], [2, 1], [1, 1]), [[], []], None,
                               Inp([0, 1]), Ctx(2), torch.tensor(rows))
    assert out["rp"].token_ids == [4] and out["mt"].token_ids == [6]


def test_each_requests_logprobs_are_read_at_its_own_rows_and_top_k():
    # r0 (top 0) drafts [1], accepted: rows 0-1; r1 (top 2) no draft: row 2; r2 (top 1)
    # drafts [3, 4], accepted: rows 3-5. Each row's second token has its own logit v.
    reqs = [_state("r0", [1], SamplingParams(temperature=0.0, logprobs=0), out=[2]),
            _state("r1", [1], SamplingParams(temperature=0.0, logprobs=2), out=[2]),
            _state("r2", [1], SamplingParams(temperature=0.0, logprobs=1), out=[2])]
    vs = [1.0, 2.0, 3.0, 4.0, 6.0, 7.0]
    tops = [1, 5, 6, 3, 4, 7]
    rows = torch.tensor([_row(t, 0, v) for t, v in zip(tops, vs)])
    out = verify.verify_drafts(Runner(), StepBatch(reqs, [1, 1, 1], [2, 1, 3]),
                               [[1], [], [3, 4]], None, Inp([0, 1, 2]), Ctx(6), rows)
    assert [out[r].token_ids for r in ("r0", "r1", "r2")] == [[1, 5], [6], [3, 4, 7]]

    def lp(row: int, k: int) -> tuple:
        z = _z(vs[row])
        ids = [tops[row]] + [tops[row], 0][:k]
        return ids, [10 - z] + [10 - z, vs[row] - z][:k], 1

    for rid, rows_k in (("r0", [(0, 0), (1, 0)]), ("r1", [(2, 2)]),
                        ("r2", [(3, 1), (4, 1), (5, 1)])):
        got = out[rid].logprobs
        want = [lp(row, k) for row, k in rows_k]
        assert [(ids, rank) for ids, _, rank in got] == [(ids, rank) for ids, _, rank in want]
        for (_, lps, _), (_, wl, _) in zip(got, want):
            assert lps == pytest.approx(wl, abs=1e-5)


def test_rank_zeros_verdict_keeps_the_rows_of_every_accepted_draft(monkeypatch):
    # Locally row 1's argmax (2) rejects draft 6; rank 0 accepted both drafts and sampled 0:
    # tokens 5, 6, 0 from rows 0, 1, 2 with ranks 1, 2, 3.
    monkeypatch.setattr(verify, "tp_size", lambda: 2)
    monkeypatch.setattr(verify, "broadcast_ints", lambda values: [2, 0])
    a = _state("a", [1], SamplingParams(temperature=0.0, logprobs=2), out=[2])
    rows = torch.tensor([_row(5, 3), _row(2, 6), _row(4, 1)])
    out = verify.verify_drafts(Runner(), StepBatch([a], [1], [3]), [[5, 6]], None, Inp([0]),
                               Ctx(3), rows)
    z = _z()
    assert (out["a"].token_ids, out["a"].num_accepted) == ([5, 6, 0], 2)
    got = out["a"].logprobs
    assert [(ids, rank) for ids, _, rank in got] == [([5, 5, 3], 1), ([6, 2, 6], 2),
                                                     ([0, 4, 1], 3)]
    for (_, lps, _), want in zip(got, [[10 - z, 10 - z, 5 - z], [5 - z, 10 - z, 5 - z],
                                       [-z, 10 - z, 5 - z]]):
        assert lps == pytest.approx(want, abs=1e-5)


# ---------------------------------------------------------------- drafting
def test_drafts_are_the_argmax_when_greedy_and_a_draw_from_the_tempered_softmax_else():
    greedy = _state("g", [1], SamplingParams(temperature=0.0))
    hot = _state("h", [1], SamplingParams(temperature=0.5))
    edge = _state("e", [1], SamplingParams(temperature=SAMPLING_EPS))  # not greedy: a draw
    # Row 1 at T = 1/2: logits (0, ln 3 / 2) -> softmax(0, ln 3) = (1/4, 3/4).
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, math.log(3) / 2, -1e9], [0.0, 1.0, 0.5]])
    gens = {"h": torch.Generator().manual_seed(0), "e": torch.Generator().manual_seed(1)}
    toks, probs = draft_tokens(logits, [greedy, hot, edge], lambda r: gens.get(r.req_id))
    assert toks[0] == 1 and probs[0] is None and toks[1] in (0, 1)
    assert probs[1].dtype == torch.float32
    assert probs[1].tolist() == pytest.approx([0.25, 0.75, 0.0], abs=1e-6)
    assert toks[2] == 1 and probs[2] is not None  # softmax(x / 1e-5): all mass on the max
    # q = (0.7, 0.2, 0.1) at T = 1/2 (logits ln(q) / 2): 4000 draws follow q (a draw is the
    # exponential race argmax q / e; q * e would give about (0.74, 0.19, 0.07)).
    n, q = 4000, [0.7, 0.2, 0.1]
    many = torch.tensor([[math.log(x) / 2 for x in q]] * n)
    toks, _ = draft_tokens(many, [hot] * n, lambda r: gens.get(r.req_id))
    assert [toks.count(i) / n for i in range(3)] == pytest.approx(q, abs=0.02)


def test_each_request_draws_from_its_own_generator():
    hot = [_state(rid, [1], SamplingParams(temperature=1.0)) for rid in ("a", "b")]
    logits = torch.zeros(2, 50)

    def draw(which: list[int]) -> list[int]:
        gens = {"a": torch.Generator().manual_seed(11), "b": torch.Generator().manual_seed(12)}
        torch.manual_seed(int(torch.randint(0, 1 << 30, (1,))))  # the global stream moves
        return draft_tokens(logits[which], [hot[i] for i in which],
                            lambda r: gens[r.req_id])[0]

    both = draw([0, 1])
    assert both == draw([0]) + draw([1]) and both == draw([0, 1])


def test_the_proposer_interface_defaults():
    p = Proposer()
    assert p.reads_sampled is False and p.forget(["a"]) is None
    for call in (lambda: p.propose(None, None, []),
                 lambda: p.commit(None, None, None, [], None, None, {}),
                 lambda: p.sync(None, None, None, None, {})):
        with pytest.raises(NotImplementedError):
            call()
    assert PLACEHOLDER == -1


class Recorder:
    def __init__(self) -> None:
        self.seen = None

    def __call__(self, input_ids, positions, ctx, **kw):
        self.seen = (input_ids.tolist(), positions.tolist(), ctx, kw)
        return torch.zeros(len(input_ids), 2)


@pytest.mark.parametrize("verify_flag", [False, True])
def test_a_forward_pass_runs_the_model_over_the_requests_tokens(verify_flag):
    attn = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
    state = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))
    cfg = plan_pagefold({"layers.0": attn, "layers.1": state}, 4, 16 * 128)

    class R:
        kv_config, cache, device = cfg, object(), torch.device("cpu")

    sp = SamplingParams()
    a = CachedRequestState("a", [1, 2, 3], [1, 2, 3, 9], [9], sp, None, [[1, 2], [3, 4]])
    b = CachedRequestState("b", [5], [5], [], sp, None, [[5], [6, 7]])
    model = Recorder()
    initial = {"layers.1": {"ssm": torch.ones(1)}}
    hidden, inp, ctx = forward_pass(model, R, [a, b], [[9, 4], [5]], [3, 0],
                                    verify=verify_flag, initial=initial, extra=1)
    ids, pos, seen_ctx, kw = model.seen
    assert (ids, pos, kw) == ([9, 4, 5], [3, 4, 0], {"extra": 1}) and seen_ctx is ctx
    assert hidden.shape == (3, 2) and inp.sample_req_idx == [0, 1]
    assert ctx.cache is R.cache and ctx.initial_states is initial
    meta = inp.state_meta[1]
    assert meta.page_ids.tolist() == [[3, 4], [6, 7]]
    if verify_flag:
        assert ctx.spec_states == {} and meta.spec_rows.tolist() == [True, True]
        assert meta.spec_rows.dtype == torch.bool
    else:
        assert ctx.spec_states is None and getattr(meta, "spec_rows", None) is None


def test_a_forward_pass_stores_states_unless_told_to_verify():
    attn = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
    state = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))

    class R:
        kv_config = plan_pagefold({"layers.0": attn, "layers.1": state}, 4, 16 * 128)
        cache, device = None, torch.device("cpu")

    a = CachedRequestState("a", [1, 2], [1, 2], [], SamplingParams(), None, [[1], [2, 3]])
    _, inp, ctx = forward_pass(Recorder(), R, [a], [[1, 2]], [0])
    assert ctx.spec_states is None and ctx.initial_states is None
    assert ctx.attn_meta is inp.attn_meta and ctx.state_meta is inp.state_meta
    with pytest.raises(ValueError):  # one start per request
        forward_pass(Recorder(), R, [a], [[1, 2]], [0, 0])


# ---------------------------------------------------------------- proposers
@pytest.mark.parametrize("method, model, made", [
    ("mtp", None, "mtp"),
    ("eagle", "e", "eagle"),
    ("eagle3", "e", "eagle3"),
    ("draft_model", "d", "draft"),
])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_build_proposer_loads_and_wraps_the_methods_head(monkeypatch, method, model, made,
                                                         device):
    calls = []

    def rec(name, ret=None):
        def f(*a, **k):
            calls.append((name, a))
            return ret
        return f

    monkeypatch.setattr(proposers, "text_config", lambda cfg: cfg["text"])
    monkeypatch.setattr(proposers, "load_mtp", rec("load_mtp", "H"))
    monkeypatch.setattr(proposers, "load_eagle", rec("load_eagle", "H"))
    monkeypatch.setattr(proposers, "load_draft_model", rec("load_draft", ("H", "cfg")))
    monkeypatch.setattr(proposers, "load_eagle_config", rec("eagle_config", "ECFG"))
    monkeypatch.setattr(proposers, "aux_layer_ids", rec("aux", (1, 2)))
    monkeypatch.setattr(proposers.cpu_ops, "use_fast_linears", rec("fast"))
    monkeypatch.setattr(proposers, "MtpProposer", rec("mtp", "MTP"))
    monkeypatch.setattr(proposers, "EagleProposer", rec("eagle", "EAGLE"))
    monkeypatch.setattr(proposers.DraftModelProposer, "for_specs", rec("draft", "DRAFT"))

    class T:
        num_hidden_layers = 6

    tcfg = T()
    sc = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(sc, "method", method)
    object.__setattr__(sc, "model", model)
    dev = torch.device(device)
    out = proposers.build_proposer(sc, "/m", "target", {"text": tcfg}, torch.bfloat16, 64, dev,
                                   {"s": 1})
    loads = {"mtp": ("load_mtp", ("/m", tcfg, "target", torch.bfloat16, 64, dev)),
             "eagle": ("load_eagle", ("e", "eagle", "target", tcfg, torch.bfloat16, 64, dev)),
             "eagle3": ("load_eagle", ("e", "eagle3", "target", tcfg, torch.bfloat16, 64,
                                       dev)),
             "draft": ("load_draft", ("d", {"text": tcfg}, torch.bfloat16, 64, dev))}
    wraps = {"mtp": [("mtp", ("H", "target"))],
             "eagle": [("eagle", ("H", "target", tcfg, None))],
             "eagle3": [("eagle_config", ("e",)), ("aux", ("ECFG", 6)),
                        ("eagle", ("H", "target", tcfg, (1, 2)))],
             "draft": [("draft", ("H", {"s": 1}))]}
    fast = [("fast", ("H",))] if device == "cpu" else []
    assert calls == [loads[made]] + fast + wraps[made]
    assert out == {"mtp": "MTP", "eagle": "EAGLE", "eagle3": "EAGLE", "draft": "DRAFT"}[made]


def test_ngram_and_no_speculation_build_no_proposer():
    sc = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(sc, "method", "ngram")
    args = ("/m", None, {}, torch.float32, 8, torch.device("cpu"), {})
    assert proposers.build_proposer(sc, *args) is None
    assert proposers.build_proposer(None, *args) is None

