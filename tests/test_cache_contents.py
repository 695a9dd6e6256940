"""What each cache page holds, followed through every step by a stand-in model (issue 44).

The fake-model scheduler tests check block counts and schedules; they cannot tell a state
restored from the wrong checkpoint, or an attention block cached under the wrong prefix, from
the right one. Here a stand-in runner keeps the *contents* of every page, as a model would
write them, and checks every read:

* an attention page slot for position ``p`` holds the key of ``tokens[:p + 1]`` (a key depends
  on its whole prefix), written by whoever computed it; a step starting at ``s`` reads every
  earlier position it attends to (a sliding window: the last ``window - 1`` of them);
* page ``i`` of a state holds ``(i, tokens[:s])`` when a step starts at ``s > 0`` (the state
  after exactly the tokens consumed); the step writes ``(i, tokens[:s + n])``, and a capture
  inside the step writes ``(i, tokens[:t])`` to its pages.

Page copies and swaps move contents exactly as the step message orders them (swap-outs, then
copies in list order, then swap-ins; see ``core/sched_output.py``). The oracle is the model's
semantics, not the managers' bookkeeping: a hit restored from the checkpoint one block off, a
checkpoint registered under a neighbouring key, a copy that goes the wrong way or is dropped,
a block cached before it is full: each makes some read disagree.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.core.sched_output import SampledToken, SchedulerOutput
from pagefold.core.scheduler import Scheduler
from pagefold.core.swap import PreemptionCost
from pagefold.executor.runner_state import RunnerRequests
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 128-byte page
WINDOW = 6
SWA = SlidingWindowSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, window=WINDOW)
# 64 floats: two attention pages.
STATE = StateSpec("gdn", (StateComponent("conv", (2, 8), torch.float32),
                          StateComponent("ssm", (48,), torch.float32)))


def _sample(rid: str, toks: list[int]) -> int:
    """A token that depends on the request (forked siblings part ways, as sampling does)."""
    return 10 + (sum(toks) + sum(map(ord, rid))) % 37


def _copy(v):
    return list(v) if isinstance(v, list) else v  # an attention page's slots are mutable


class PageModel:
    """The stand-in runner: page contents, host rows, and the checks on every read."""

    def __init__(self, s: Scheduler, kinds: list[str]) -> None:
        self.s = s
        self.kinds = kinds  # per cache group: "attn", "swa" or "state"
        self.dev: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.runner = RunnerRequests()
        self.reads = {"attn": 0, "state": 0, "restored": 0}

    def _moves(self, out: SchedulerOutput) -> None:
        for op in out.swaps:
            if op.to_host:
                for d, h in zip(op.device, op.host, strict=True):
                    self.host[h] = _copy(self.dev.get(d))
        for c in out.copies:
            assert len(c.src) == len(c.dst)
            vals = [self.dev.get(b) for b in c.src]
            for b, v in zip(c.dst, vals):
                self.dev[b] = _copy(v)
        for op in out.swaps:
            if not op.to_host:
                for d, h in zip(op.device, op.host, strict=True):
                    self.dev[d] = _copy(self.host[h])

    def _slot(self, page: int) -> list:
        v = self.dev.get(page)
        if not isinstance(v, list):
            v = self.dev[page] = [None] * BS
        return v

    def step(self) -> SchedulerOutput:
        s = self.s
        out = s.schedule()
        self._moves(out)
        batch = self.runner.apply(out)
        restored = {r.req_id for r in out.new_reqs if r.num_computed_tokens}
        rows = list(zip(batch.reqs, batch.starts, batch.counts))
        # Every read sees the pages as the step's moves left them: a batched forward must not
        # depend on what another request of the same step writes.
        for st, start, _ in rows:
            self._check_reads(st.req_id, st.token_ids, st.block_ids, start,
                              st.req_id in restored)
        sampled = {}
        for row, (st, start, n) in enumerate(rows):
            toks = st.token_ids
            for g, (kind, table) in enumerate(zip(self.kinds, st.block_ids)):
                if kind == "state":
                    for i, page in enumerate(table):
                        self.dev[page] = (g, i, tuple(toks[:start + n]))
                    for r, t, pages in batch.captures.get(g, ()):
                        if r == row:
                            assert start < t < start + n
                            for i, page in enumerate(pages):
                                self.dev[page] = (g, i, tuple(toks[:t]))
                    continue
                for p in range(start, start + n):
                    self._slot(table[p // BS])[p % BS] = (g, tuple(toks[:p + 1]))
            if start + n >= len(toks):
                sampled[st.req_id] = SampledToken(_sample(st.req_id, toks))
        s.update_from_output(out, sampled)
        return out

    def _check_reads(self, rid: str, toks: list[int], tables: list[list[int]], start: int,
                     restored: bool) -> None:
        for g, (kind, table) in enumerate(zip(self.kinds, tables)):
            if kind == "state":
                if start:  # (a step from position 0 starts from the zero state)
                    for i, page in enumerate(table):
                        assert self.dev.get(page) == (g, i, tuple(toks[:start])), (
                            f"{rid}: state page {i} of group {g} at {start} holds "
                            f"{self._describe(page)}")
                    self.reads["state"] += 1
                    self.reads["restored"] += restored
                continue
            first = 0 if kind == "attn" else max(0, start - WINDOW + 1)
            for p in range(first, start):
                got = self._slot(table[p // BS])[p % BS]
                assert got == (g, tuple(toks[:p + 1])), (
                    f"{rid}: group {g} position {p} holds {got}")
                self.reads["attn"] += 1

    def _describe(self, page: int) -> str:
        v = self.dev.get(page)
        if isinstance(v, tuple) and len(v) == 3:
            return f"the state after {len(v[2])} tokens"
        return repr(v)

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def _scheduler(specs: dict, num_blocks: int, *, budget: int = 64, interval: int = BS,
               capture: bool = False, swap: bool = False) -> Scheduler:
    page = ATTN.page_bytes(BS)
    probe = plan_pagefold(specs, BS, page * 64)
    cfg = plan_pagefold(specs, BS, num_blocks * probe.layers_per_group * page)
    assert cfg.num_blocks == num_blocks
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=interval,
                        capture_in_kernel=capture)
    if swap:
        kv.attach_swap(64, "swap", PreemptionCost(flops_per_token=1.0))
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=256)


def _kinds(s: Scheduler) -> list[str]:
    out = []
    for g in s.kv.config.groups:
        spec = g.spec
        out.append("state" if isinstance(spec, StateSpec)
                   else "swa" if isinstance(spec, SlidingWindowSpec) else "attn")
    return out


def _add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, t: float, **kw) -> None:
    s.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True),
                          arrival_time=t, **kw))


HYBRID = {"attn": ATTN, "state": STATE}
TRIPLE = {"attn": ATTN, "swa": SWA, "state": STATE}
# Two state groups before the attention group: a hit's first group allocates its pages while
# the others' cached blocks and checkpoints must stay where the hit found them.
STATES_FIRST = {"s0": STATE, "s1": STATE, "attn": ATTN}
SPECS = pytest.mark.parametrize("specs", [HYBRID, TRIPLE, STATES_FIRST],
                                ids=["hybrid", "triple", "states_first"])


def test_the_state_holds_two_pages():
    cfg = plan_pagefold(HYBRID, BS, 64 * ATTN.page_bytes(BS))
    assert [g.pages_per_state for g in cfg.groups if isinstance(g.spec, StateSpec)] == [2]


@pytest.mark.parametrize("budget", [64, 3, 6])
@pytest.mark.parametrize("capture", [False, True], ids=["cut", "captured"])
@SPECS
def test_hits_one_block_apart_restore_their_own_checkpoint(specs, capture, budget):
    """Prompts sharing 1, 2, 3, 4 and 5 blocks of a first prompt: each hit lands on a
    different checkpoint, one block from the next; a restore from its neighbour (or from
    the first prompt's deepest one) is a state with the wrong tokens. A step budget under a
    block (3) or across a boundary (6) leaves partly written blocks behind every chunk."""
    s = _scheduler(specs, 200, budget=budget, capture=capture)
    model = PageModel(s, _kinds(s))
    base = list(range(100, 124))  # 6 blocks
    _add(s, "base", base, 3, 0.0)
    model.run()
    n_state = sum(k == "state" for k in model.kinds)
    # A checkpoint at every 4 tokens of the prompt (the interval), per state group.
    assert s.kv.pool.checkpoint_stats() == (6 * n_state, 6 * n_state * 2)
    assert s.kv.pool.stats.checkpoints_saved == 6 * n_state
    for k in range(1, 6):
        _add(s, f"q{k}", base[:k * BS] + [200 + k, 201, 202], 2, float(k))
        model.run()
        assert s.requests.get(f"q{k}") is None
    # Each follow-up hit exactly its k shared blocks (the last token is always computed).
    assert s.kv.stats.hits == sum(k * BS for k in range(1, 6))
    assert s.kv.pool.stats.checkpoint_hits == 5 * n_state
    assert model.reads["restored"] >= 5
    s.kv.check_whole()


@pytest.mark.parametrize("capture", [False, True], ids=["cut", "captured"])
def test_the_last_boundary_of_a_prompt_is_saved(capture):
    """A 13-token prompt in one chunk: its last block boundary (12) is a checkpoint target
    strictly inside the chunk, so the next prompt sharing 12 tokens hits all of them."""
    s = _scheduler(HYBRID, 200, capture=capture, interval=64)
    model = PageModel(s, _kinds(s))
    a = list(range(500, 513))
    _add(s, "a", a, 1, 0.0)
    model.run()
    _add(s, "b", a[:12] + [600, 601], 1, 1.0)
    b = s.requests["b"]
    model.run()
    assert b.num_cached_tokens == 12
    s.kv.check_whole()


@pytest.mark.parametrize("capture", [False, True], ids=["cut", "captured"])
def test_conversation_turns_resume_from_the_newest_checkpoint(capture):
    """Each turn's prompt is the last turn's prompt, its answer and a new question: the hit is
    the previous turn's decode checkpoint (the request's own newest one), checked by content."""
    s = _scheduler(HYBRID, 200, capture=capture)
    model = PageModel(s, _kinds(s))
    prompt = list(range(300, 309))
    hits = []
    for turn in range(4):
        _add(s, f"t{turn}", prompt, 5 + turn, float(turn))
        r = s.requests[f"t{turn}"]
        model.run()
        hits.append(r.num_cached_tokens)
        prompt = r.all_token_ids + [400 + turn] * (2 + turn)
    assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
    s.kv.check_whole()


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("capture", [False, True], ids=["cut", "captured"])
@SPECS
def test_contents_survive_pool_pressure(specs, capture, swap):
    """A pool too small for the batch: preemptions, evictions of checkpoints and blocks,
    restores after recompute with credit, swaps, forks that copy states; every read is right."""
    s = _scheduler(specs, 40, budget=13, capture=capture, swap=swap)
    model = PageModel(s, _kinds(s))
    system = list(range(20, 33))
    for i in range(8):
        prompt = system + [50 + i] * (2 + 3 * (i % 4))
        kw = {"fork_children": 2, "fork_at": len(prompt) - 1} if i in (2, 5) else {}
        _add(s, f"r{i}", prompt, 6 + 2 * i, float(i), **kw)
    model.run()
    assert s.num_preemptions > 0 and s.kv.stats.hits > 0 and s.num_forks > 0
    assert model.reads["state"] > 0 and model.reads["attn"] > 0
    s.kv.check_whole()


@pytest.mark.parametrize("budget", [3, 5])
@pytest.mark.parametrize("specs", [{"attn": ATTN}, HYBRID], ids=["attention", "hybrid"])
def test_a_prompt_arriving_mid_prefill_hits_only_finished_blocks(specs, budget):
    """``b`` arrives while ``a`` prefills the same 16 tokens a few at a time: it may reuse a
    block only once every slot of it was written by an earlier step."""
    s = _scheduler(specs, 200, budget=budget)
    model = PageModel(s, _kinds(s))
    a = list(range(700, 716))
    _add(s, "a", a + [716], 2, 0.0)
    model.step()
    _add(s, "b", a + [800, 801], 2, 1.0)
    model.run()
    assert s.kv.stats.hits == 16
    s.kv.check_whole()


@pytest.mark.parametrize("budget", [4, 64])
def test_only_checkpoint_targets_are_saved(budget):
    """Interval 64 on a 24-token prompt: the targets are the last boundary a later prompt
    can continue from (20: the last token is always computed), the one 3 blocks before (8)
    and the prompt's end (24, where decoding starts); chunks of 4 tokens end on every
    boundary, but save only there."""
    s = _scheduler(HYBRID, 200, budget=budget, interval=64)
    model = PageModel(s, _kinds(s))
    _add(s, "a", list(range(900, 924)), 1, 0.0)
    model.run()
    assert s.kv.pool.checkpoint_stats() == (3, 6)
    s.kv.check_whole()


def test_a_replaced_token_that_completes_a_block_is_not_cached_under_the_old_one():
    """Beam search replaces a sampled token before it is computed. Here that token completes
    a block: the block must be cached under the new token's prefix, so a prompt continuing
    with the *old* token does not reuse it."""
    s = _scheduler({"attn": ATTN}, 200)
    model = PageModel(s, _kinds(s))
    prompt = list(range(40, 47))  # 7 tokens: the first sample is position 7, ending block 1
    _add(s, "a", prompt, 3, 0.0)
    model.step()
    a = s.requests["a"]
    old = a.output_token_ids[-1]
    s.replace_last_token("a", 99)
    assert a.output_token_ids == [99] and a.all_token_ids == prompt + [99]
    model.run()
    _add(s, "b", prompt + [old, 1, 2], 1, 1.0)
    b = s.requests["b"]
    model.run()
    assert b.num_cached_tokens == BS  # block 0 only
    s.kv.check_whole()
