"""The hidden-state proposer's bookkeeping without a model (issue 44: mutmut over
``spec_decode/hidden_proposer.py``, shared by MTP and EAGLE / EAGLE-3).

A recording head stands in for the drafter: its output row is ``g = [token, position,
hidden[2] + 1]`` and the stand-in logits put all their mass (a logit of 5) on
``(token + position) % V``, so every draft, every fed row and every kept ``g`` is worked out
by hand from the module's docstring: the head's row at position ``p`` is fed ``t_{p+1}`` with
the target's hidden state at ``p``; a chained draft ``d_{j+1}`` comes from the row at
``s + j - 1`` fed ``d_j`` and the previous ``g``; after a step the head reruns every row with
the target's hidden states and keeps, per sampled request, the draft of its last kept row."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagefold.executor.runner_state import CachedRequestState, StepBatch
from pagefold.sampling_params import SamplingParams
from pagefold.spec_decode.drafting import PLACEHOLDER
from pagefold.spec_decode.hidden_proposer import HiddenStateProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 40
P = PLACEHOLDER


class _Head(nn.Module):
    """Records what it is fed; ``g = [token, position, hidden[:, 2] + 1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], list[int], torch.Tensor, int]] = []
        self.ctxs: list = []

    def forward(self, input_ids, positions, ctx, *, hidden, step):
        self.calls.append((input_ids.tolist(), positions.tolist(), hidden.clone(), step))
        self.ctxs.append(ctx)
        return torch.stack([input_ids.float(), positions.float(), hidden[:, 2] + 1], dim=1)


def _logits(g: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(g.shape[0], V)
    for n, row in enumerate(g.tolist()):
        out[n, int(row[0] + row[1]) % V] = 5.0
    return out


def _q_of(token: int) -> torch.Tensor:
    """softmax of the stand-in logits at temperature 1, written out."""
    z = math.exp(5.0) + (V - 1)
    q = torch.full((V,), 1 / z)
    q[token] = math.exp(5.0) / z
    return q


class _Runner:
    """What ``forward_pass`` and ``draft_tokens`` read: one attention cache group of 4-token
    blocks, the CPU, and the sampling generators (recorded)."""

    def __init__(self) -> None:
        self.kv_config = SimpleNamespace(groups=[SimpleNamespace(spec=None)], block_size=4)
        self.cache = object()
        self.device = torch.device("cpu")
        self.asked: list[str] = []

    def generator_for(self, r):
        self.asked.append(r.req_id)
        return torch.Generator().manual_seed(7)


def _req(rid: str, tokens: list[int], temperature: float = 0.0,
         blocks: tuple[int, ...] = (1, 2)) -> CachedRequestState:
    return CachedRequestState(rid, list(tokens), list(tokens), [],
                              SamplingParams(temperature=temperature), None, [list(blocks)])


def _proposer(aux=None) -> tuple[HiddenStateProposer, _Head]:
    head = _Head()
    return HiddenStateProposer(head, _logits, aux), head


def test_the_proposer_reads_sampled_tokens_and_keeps_its_head() -> None:
    prop, head = _proposer((2, 5, 9))
    assert HiddenStateProposer.reads_sampled is True
    assert prop.head is head and prop.logits is _logits and prop.aux_layers == (2, 5, 9)
    assert _proposer()[0].aux_layers is None
    assert prop.pending == {}


def test_propose_chains_drafts_from_the_kept_g() -> None:
    prop, head = _proposer()
    ga, ge, gd = (torch.tensor([1.0, 2.0, 10.0]), torch.tensor([3.0, 4.0, 20.0]),
                  torch.tensor([0.0, 0.0, 30.0]))
    prop.pending = {"a": (7, None, ga), "e": (9, None, ge), "d": (4, None, gd)}
    reqs = [_req("a", [10, 11, 12, 13], blocks=(5, 6)), _req("b", [5, 6, 8]), _req("c", [1, 2]),
            _req("d", [3, 3]), _req("e", [2, 4, 6], blocks=(9,))]
    batch = StepBatch(reqs, starts=[3, 2, 1, 1, 2], counts=[4, 3, 2, 2, 3])
    drafts_in = [[P, P, P], [P, P], [], [P], [P, P]]
    res = prop.propose(_Runner(), batch, drafts_in)
    # a: d1 = 7 held; d2 from (7 at 3) = 10; d3 from (10 at 4) = 14.
    # b: nothing held: its last token (at its start) repeated.  c: no drafts.
    # d: k = 1, d1 alone.  e: d1 = 9 held; d2 from (9 at 2) = 11.
    assert res.drafts == [[7, 10, 14], [8, 8], [], [4], [9, 11]]
    assert drafts_in[0] == [P, P, P]  # the caller's lists are not written
    assert res.probs == [None] * 5  # greedy drafts: one-hot, passed as None
    assert [(c[0], c[1], c[3]) for c in head.calls] == [([7, 9], [3, 2], 1), ([10], [4], 2)]
    assert torch.equal(head.calls[0][2], torch.stack([ga, ge]))
    # The second pass is fed the first pass's g of request a, not the target's.
    assert torch.equal(head.calls[1][2], torch.tensor([[7.0, 3.0, 11.0]]))
    # Each chained row writes its head KV into its own request's blocks (4 tokens a block):
    # a at 3 -> block 5 slot 3, e at 2 -> block 9 slot 2; then a at 4 -> block 6 slot 0.
    assert [c.attn_meta[0].slot_mapping.tolist() for c in head.ctxs] == [[23, 38], [24]]


def test_propose_without_anything_held_runs_no_head() -> None:
    prop, head = _proposer()
    reqs = [_req("x", [4, 5, 6, 7])]
    res = prop.propose(_Runner(), StepBatch(reqs, [2], [3]), [[P, P]])
    assert res.drafts == [[6, 6]] and res.probs == [None] and head.calls == []


def test_sampled_drafts_keep_their_distributions() -> None:
    prop, head = _proposer()
    q1 = torch.full((V,), 1 / V)
    prop.pending = {"s": (3, q1, torch.tensor([0.0, 0.0, 1.0])),
                    "g": (5, None, torch.tensor([0.0, 0.0, 2.0]))}
    reqs = [_req("s", [1, 2, 3], temperature=1.0), _req("g", [1, 2, 3])]
    runner = _Runner()
    res = prop.propose(runner, StepBatch(reqs, [2, 2], [3, 3]), [[P, P], [P, P]])
    assert runner.asked == ["s"]  # only the sampled request draws, from its own generator
    assert res.drafts[1] == [5, 7]
    assert res.drafts[0][0] == 3 and 0 <= res.drafts[0][1] < V
    assert res.probs[1] is None  # greedy
    assert res.probs[0].shape == (2, V)
    assert torch.equal(res.probs[0][0], q1)
    torch.testing.assert_close(res.probs[0][1], _q_of((3 + 2) % V))


def _inputs(ids_len: int, positions: list[int]) -> SimpleNamespace:
    return SimpleNamespace(input_ids=torch.zeros(ids_len, dtype=torch.long),
                           positions=torch.tensor(positions), attn_meta=[None],
                           state_meta=[None])


def test_commit_feeds_every_row_its_next_token_and_keeps_the_last_kept_rows_draft() -> None:
    prop, head = _proposer()
    prop.pending = {"old": (1, None, torch.zeros(3))}
    reqs = [_req("a", [10, 11, 12, 13]), _req("c", [20, 21, 22, 23, 24]),
            _req("g", [30, 31, 32], temperature=1.0), _req("h", [40, 41])]
    batch = StepBatch(reqs, starts=[3, 0, 1, 0], counts=[4, 3, 2, 2])
    res = SimpleNamespace(drafts=[[7, 10, 14], [], [], []])
    positions = [3, 4, 5, 6, 0, 1, 2, 1, 2, 0, 1]
    hidden = torch.zeros(11, 3)
    hidden[:, 2] = torch.arange(11, dtype=torch.float) * 10
    runner = _Runner()
    inp = _inputs(11, positions)
    # a kept t, d1 = 7, d2 = 10 and then sampled 21; g's last chunk sampled 33; c and h sample
    # none.
    prop.commit(runner, batch, res, [3, 3, 2, 2], inp, hidden, {0: [7, 10, 21], 2: [33]})
    assert len(head.calls) == 1
    ids, pos, hid, step = head.calls[0]
    # a: d1 and d2 at the rows before them, then the sampled token at d2's row, the rejected
    # row fed d3; c: the prompt's next tokens; g: its next token, then the sampled one;
    # h: nothing sampled, its last token stands in.
    assert ids == [7, 10, 21, 14, 21, 22, 23, 32, 33, 41, 41]
    assert pos == positions and step == 0 and torch.equal(hid, hidden)
    ctx = head.ctxs[0]  # the step's own metadata and the runner's cache
    assert ctx.cache is runner.cache and ctx.attn_meta is inp.attn_meta
    assert ctx.state_meta is inp.state_meta
    assert runner.asked == ["g"]
    assert set(prop.pending) == {"old", "a", "g"}
    # a: row 2 (start 0 + keep 3 - 1): g = [21, 5, 21], draft (21 + 5) % V.
    tok, q, g = prop.pending["a"]
    assert (tok, q) == (26, None) and g.tolist() == [21.0, 5.0, 21.0]
    # g: row 8 (start 7 + keep 2 - 1): g = [33, 2, 81], sampled from q.
    tok, q, g = prop.pending["g"]
    assert g.tolist() == [33.0, 2.0, 81.0] and 0 <= tok < V
    torch.testing.assert_close(q, _q_of((33 + 2) % V))


def test_sync_runs_the_step_rows_and_updates_only_sampled_requests() -> None:
    prop, head = _proposer()
    reqs = [_req("p", [1, 2, 3, 4, 5]), _req("q", [6, 7, 8])]
    batch = StepBatch(reqs, starts=[1, 2], counts=[3, 1])
    hidden = torch.zeros(4, 3)
    prop.sync(_Runner(), batch, _inputs(4, [1, 2, 3, 2]), hidden, {1: [9]})
    assert head.calls[0][0] == [3, 4, 5, 9] and head.calls[0][3] == 0
    assert list(prop.pending) == ["q"]
    tok, q, g = prop.pending["q"]  # row 3 (start 3 + count 1 - 1): g = [9, 2, 1]
    assert (tok, q) == (11, None) and g.tolist() == [9.0, 2.0, 1.0]
    # A step that samples nothing (a prefill chunk): the head still writes its rows.
    prop.sync(_Runner(), StepBatch([_req("r", [1, 2, 3])], [0], [2]), _inputs(2, [0, 1]),
              torch.zeros(2, 3), {})
    assert head.calls[1][0] == [2, 3] and list(prop.pending) == ["q"]
    # An empty list of emitted tokens: the last known token stands in, nothing is kept.
    prop.sync(_Runner(), StepBatch([_req("t", [4, 6])], [0], [2]), _inputs(2, [0, 1]),
              torch.zeros(2, 3), {0: []})
    assert head.calls[2][0] == [6, 6]


def test_forget_drops_only_the_named_requests() -> None:
    prop, _ = _proposer()
    prop.pending = {"a": (1, None, torch.zeros(3)), "b": (2, None, torch.zeros(3))}
    prop.forget(["a", "unknown"])
    assert list(prop.pending) == ["b"]
