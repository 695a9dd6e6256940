"""Pipeline parallelism with step messages in flight (``engine/batch_queue.py``).

Without a model: the batch queue over the real scheduler and a stand-in executor that
keeps what every rank keeps (``RunnerRequests``, built from the messages in order) and checks
that each request's chunk starts where its previous one ended. The tokens must be those of
the queue of depth 1 (no pipeline), under chunked prefill, prefix hits with state checkpoints,
preemption and an abort in flight.

With tiny models at PP=2 (dense, GDN, Mamba-2, MoE, with TP=2 too), the same against
transformers, with an abort in flight: ``test_pipeline_parallel.py``.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from pagefold import SamplingParams
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken, decode_step, encode_step
from pagefold.core.scheduler import Scheduler
from pagefold.engine.batch_queue import ENV_IN_FLIGHT, BatchQueue, batches_in_flight
from pagefold.executor.runner_state import RunnerRequests
from pagefold.request import Request, RequestStatus

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
STATE = StateSpec("gdn", (StateComponent("conv", (4, 2), torch.float32),
                          StateComponent("ssm", (2, 16, 16), torch.float32)))


def _fake_sample(tokens: list[int]) -> int:
    return 10 + sum(t * (i + 1) for i, t in enumerate(tokens)) % 37


class FakeStages:
    """The executor's ``submit`` / ``collect`` without ranks: each message is applied (wire
    format) to one ``RunnerRequests`` in submission order, as every rank applies it."""

    def __init__(self) -> None:
        self.runner = RunnerRequests()
        self.ends: dict[str, int] = {}  # request -> where its last chunk ended
        self.pending: deque = deque()
        self.sent: list = []

    def submit(self, out) -> None:
        wire = decode_step(encode_step(out))
        self.sent.append(wire)
        batch = self.runner.apply(wire)
        for rid in wire.finished_ids + wire.preempted_ids:
            self.ends.pop(rid, None)
        fresh = {nr.req_id for nr in wire.new_reqs}
        sampled = {}
        for st, start, n in zip(batch.reqs, batch.starts, batch.counts):
            if st.req_id not in fresh:
                assert start == self.ends[st.req_id], f"{st.req_id} computed twice or skipped"
            self.ends[st.req_id] = start + n
            if start + n >= len(st.token_ids):
                sampled[st.req_id] = SampledToken(_fake_sample(st.token_ids[: start + n]))
        self.pending.append((out, sampled))

    def collect(self, out):
        sent, sampled = self.pending.popleft()
        assert sent is out, "collected out of order"
        return sampled


def _scheduler(num_blocks: int) -> Scheduler:
    specs = {"l0": ATTN, "l1": STATE}
    page = ATTN.page_bytes(BS)
    probe = plan_pagefold(specs, BS, page)
    cfg = plan_pagefold(specs, BS, num_blocks * probe.layers_per_group * page)
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=8)
    return Scheduler(kv, max_num_batched_tokens=11, max_num_seqs=8, max_model_len=200)


def _run(depth: int, num_blocks: int, abort_at: int | None = None):
    """Six requests sharing a prefix through a queue of ``depth``; returns (tokens per
    request, scheduler, queue, aborted id). With ``abort_at``: after that step, abort a request
    that is in flight and add a new request under its id."""
    s = _scheduler(num_blocks)
    q = BatchQueue(s, FakeStages(), depth)
    system = list(range(20, 41))
    for i in range(6):
        s.add_request(Request(f"r{i}", system + [50 + i] * (1 + 5 * i),
                              SamplingParams(max_tokens=6 + i), arrival_time=float(i)))
    got: dict[str, list[int]] = {}
    aborted, step = None, 0
    while s.has_unfinished() or len(q):
        for o in q.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
        assert step < 500, "no progress"
        if step == abort_at:
            aborted = next(r for r in s.in_flight if r in s.requests)
            s.finish_request(aborted, RequestStatus.FINISHED_ABORTED)
            got.pop(aborted, None)
            s.add_request(Request(aborted, [7, 8, 9] * 5, SamplingParams(max_tokens=4),
                                  arrival_time=99.0))
    s.kv.check_whole()
    return got, s, q, aborted


@pytest.mark.parametrize("num_blocks", [80, 26], ids=["roomy", "tight"])
def test_queue_of_two_gives_the_tokens_of_one(num_blocks, monkeypatch):
    """Two messages in flight, every chunk computed once and in order, the same tokens as
    without a pipeline; in the tight pool requests are preempted, never while in flight."""
    ref, s1, _, _ = _run(1, num_blocks)
    preempt = Scheduler._preempt

    def checked(self, req):
        assert not self.in_flight, "preempted while messages are in flight"
        preempt(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", checked)
    got, s2, q, _ = _run(2, num_blocks)
    assert got == ref and len(got) == 6
    assert q.peak == 2
    assert not s2.in_flight
    assert s2.kv.stats.hits > 0
    if num_blocks == 26:
        assert s1.num_preemptions > 0 and s2.num_preemptions > 0


def test_abort_in_flight_drops_its_result_and_frees_once():
    """A request aborted while its message is in flight: its blocks go back at once, its
    result is dropped when collected, and a new request reusing its id waits for that
    message, then gets its own tokens."""
    ref, _, _, _ = _run(1, 80)
    got, s, _, aborted = _run(2, 80, abort_at=6)
    assert aborted is not None
    fresh = [7, 8, 9] * 5
    want = []
    for _ in range(4):
        want.append(_fake_sample(fresh + want))
    assert got.pop(aborted) == want
    assert got == {k: v for k, v in ref.items() if k != aborted}


def test_decoding_requests_split_over_the_messages():
    """Four decoding requests and two messages in flight: each message takes two of them
    (its share), so neither stage waits for the other's requests."""
    s = _scheduler(80)
    stages = FakeStages()
    q = BatchQueue(s, stages, 2)
    for i in range(4):
        s.add_request(Request(f"r{i}", [30 + i, 31, 32], SamplingParams(max_tokens=12)))
    while s.has_unfinished() or len(q):
        q.step()
    decode_only = [o for o in stages.sent[3:-3] if o.num_scheduled and not o.new_reqs]
    assert len(decode_only) > 10
    assert {len(o.num_scheduled) for o in decode_only} == {2}
    assert q.peak == 2
    s.kv.check_whole()


def test_in_flight_depth_override(monkeypatch):
    monkeypatch.delenv(ENV_IN_FLIGHT, raising=False)
    assert batches_in_flight(3) == 3
    monkeypatch.setenv(ENV_IN_FLIGHT, "1")
    assert batches_in_flight(2) == 1
    for bad in ("0", "x"):
        monkeypatch.setenv(ENV_IN_FLIGHT, bad)
        with pytest.raises(ValueError, match=ENV_IN_FLIGHT):
            batches_in_flight(2)
