"""The scheduler's side of asynchronous KV loads without a model (issue 44: mutmut's
survivors in ``Scheduler._apply_loads`` and ``finish_request``). A consumer engine's
scheduler over a small attention pool with the transfer index: a request whose prompt
blocks another engine computed is admitted as *loading* (it computes nothing until the
runner reports its loads), then runs from its hit, or starts over when a page was bad."""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.kv_connector import ConnectorOutput, key_name
from pagefold.core.prefix_cache import hash_block, root_hash
from pagefold.core.sched_output import RunnerOutput
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams
from pagefold.transfer.index import TransferIndex

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _consumer() -> tuple[Scheduler, TransferIndex]:
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, 21 * ATTN.page_bytes(BS)),
                        enable_prefix_caching=True)
    index = TransferIndex(engine_id="d", layout="L", block_size=BS, host="d-host", port=7,
                          producer=False, consumer=True)
    kv.attach_connector(index)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), index


def loading_request(rid: str, base: int, index: TransferIndex) -> Request:
    """A 10-token prompt whose two full blocks the producer computed (8 tokens to load), known
    to ``index`` as the engine core makes it known on arrival (shared with
    ``test_scheduler_admission_rules.py``)."""
    prompt = list(range(base, base + 10))
    h0 = hash_block(root_hash(()), prompt[:4])
    names = [key_name((0, h0)), key_name((0, hash_block(h0, prompt[4:8])))]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
              "remote_host": "p-host", "remote_port": 7, "remote_request_id": rid,
              "remote_block_keys": names, "num_tokens": 9, "layout": "L", "block_size": BS,
              "remote_tp_size": 1, "model_layout": "", "page_bytes": 0, "pages_per_state": []}
    req = Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True,
                                              extra_args={"kv_transfer_params": params}))
    assert index.expect(req, params)  # as the engine core does on arrival
    return req


def _add(s: Scheduler, index: TransferIndex, rid: str, base: int) -> Request:
    req = loading_request(rid, base, index)
    s.add_request(req)
    return req


def _apply(s: Scheduler, out, report: ConnectorOutput | None = None) -> None:
    sampled = RunnerOutput({})
    sampled.kv_connector_output = report
    s.update_from_output(out, sampled)


def test_loads_land_one_request_runs_from_its_hit_one_starts_over_one_was_aborted():
    s, index = _consumer()
    a, b, c = _add(s, index, "a", 10), _add(s, index, "b", 30), _add(s, index, "c", 50)
    out = s.schedule()
    assert out.num_scheduled == {} and list(s.loading) == ["a", "b", "c"]
    assert sorted({ld.req_id for ld in out.kv_ops.loads}) == ["a", "b", "c"]
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)  # the client left mid-load
    assert list(s.loading) == ["b", "c"] and a.status == RequestStatus.FINISHED_ABORTED
    bad = [ld.key for ld in out.kv_ops.loads if ld.req_id == "c"][:1]
    _apply(s, out, ConnectorOutput(finished=["a", "b", "c"], failed={"c": bad}))
    # b runs from its 8 loaded tokens; c (a bad page) waits again, from scratch.
    assert s.running == [b] and b.status == RequestStatus.RUNNING and s.loading == {}
    assert b.num_computed_tokens == 8 and c.num_computed_tokens == 0
    assert list(s.waiting) == [c]
    out = s.schedule()
    assert out.num_scheduled == {"b": 2, "c": 10}
