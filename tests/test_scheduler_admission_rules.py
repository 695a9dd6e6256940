"""What a step admits and how far each request's chunk goes, without a model (issue 44:
mutmut's survivors in ``Scheduler.schedule``): the vision encoder's budget on running and
waiting requests, a chunk cut to nothing and a paused request (both skipped, the rest run),
adapter slots, drafts (read only for a decoding request, capped at ``max_model_len``,
dropped with a victim), no admission on a step that preempted, and loading requests holding
seats. Each expected schedule is worked out by hand from the documented rules
(``core/scheduler.py``, ``core/encoder_budget.py``)."""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams
from pagefold.transfer.index import TransferIndex
from tests.test_scheduler_loads_rules import loading_request

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _sched(budget: int = 64, blocks: int = 32, seqs: int = 8, model_len: int = 64,
           policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, (blocks + 1) * ATTN.page_bytes(BS)),
                        enable_prefix_caching=False)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=seqs,
                     max_model_len=model_len, policy=policy)


def _req(rid: str, n: int, images: list[tuple[int, int]] | None = None,
         bidirectional: bool = False, **kw) -> Request:
    """An ``n``-token prompt; ``images``: ``(offset, length)`` placeholder spans."""
    mm = None
    if images is not None:
        mm = MultiModalInputs([ImageFeature(off, ln, f"{rid}{i}", b"", [0], [1, 1, 1])
                               for i, (off, ln) in enumerate(images)],
                              bidirectional=bidirectional)
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8, ignore_eos=True),
                   mm_inputs=mm, **kw)


def _add(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.add_request(r)


def _apply(s: Scheduler, out, sampled: tuple[str, ...] = ()) -> None:
    """Apply a step whose requests in ``sampled`` finished their prompt (token 50 each)."""
    s.update_from_output(out, {rid: SampledToken(50) for rid in sampled})


# ------------------------------------------------------------------ the encoder budget
def test_an_image_a_running_chunk_reaches_uses_up_the_encoder_budget_of_a_waiting_one():
    """Budget 16 tokens (the encoder's too). Step 1: r's images p (0-1) and q (2-16):
    p fits (14 left), q (15) does not after it: r's chunk stops before q, [0, 2).
    Step 2: r, running, reaches q, the step's first image: [2, 17), 1 encoder token and 1
    token left. w (image at 0-1) arrives: its first token reaches its image, 2 > 1: cut to
    nothing. It is admitted (no block needed yet) and its image starts the next step."""
    s = _sched(budget=16)
    r = _req("r", 17, images=[(0, 2), (2, 15)])
    _add(s, r)
    out = s.schedule()
    assert out.num_scheduled == {"r": 2}
    assert r.mm_encoded == {0}
    _apply(s, out)
    w = _req("w", 4, images=[(0, 2)])
    _add(s, w)
    out = s.schedule()
    assert out.num_scheduled == {"r": 15}
    assert s.running == [r, w] and w.status == RequestStatus.RUNNING
    assert (r.mm_encoded, w.mm_encoded) == ({0, 1}, set())
    _apply(s, out, ("r",))
    # Step 3: r decodes (1 token); w's image (2) fits the fresh budget: its whole prompt.
    out = s.schedule()
    assert out.num_scheduled == {"r": 1, "w": 4}
    assert w.mm_encoded == {0}


def test_an_image_admitted_this_step_counts_against_the_next_admission():
    """Budget 16. a (6 tokens, image at 0-3) takes 4 of the encoder's 16: 12 left, 10
    tokens left. b's image (2-14, 13 tokens) does not fit in 12: b's chunk stops before it."""
    s = _sched(budget=16)
    a, b = _req("a", 6, images=[(0, 4)]), _req("b", 16, images=[(2, 13)])
    _add(s, a, b)
    out = s.schedule()
    assert out.num_scheduled == {"a": 6, "b": 2}
    assert (a.mm_encoded, b.mm_encoded) == ({0}, set())


def test_a_running_chunk_cut_to_nothing_is_skipped_and_the_rest_still_run():
    """Budget 16; a's image (2-16) is bidirectional: a chunk never ends inside it.
    Step 1: x (6), y (6), a (4 tokens left: [0, 4) ends inside the image, cut to [0, 2)),
    z (2). Step 2: x, y, z decode; a's next chunk ([2, 16), 14 tokens left) would end inside
    the image, so it is cut to nothing and a is skipped: z after it still decodes, and the
    budget it left (13) admits d (5 tokens)."""
    s = _sched(budget=16)
    x, y, z = _req("x", 6), _req("y", 6), _req("z", 2)
    a = _req("a", 20, images=[(2, 15)], bidirectional=True)
    _add(s, x, y, a, z)
    out = s.schedule()
    assert out.num_scheduled == {"x": 6, "y": 6, "a": 2, "z": 2}
    _apply(s, out, ("x", "y", "z"))
    _add(s, _req("d", 5))
    out = s.schedule()
    assert out.num_scheduled == {"x": 1, "y": 1, "z": 1, "d": 5}
    assert [c.req_id for c in out.cached_reqs] == ["x", "y", "z"]
    assert a.num_computed_tokens == 2 and a.mm_encoded == set()


def test_a_paused_request_leaves_its_share_to_the_requests_after_it():
    """x, y, p, z decode; p is paused (its driver holds it): x, y and z take one token each,
    and the budget left admits d, the same step."""
    s = _sched()
    reqs = [_req(rid, 3) for rid in "xypz"]
    _add(s, *reqs)
    _apply(s, s.schedule(), tuple("xypz"))
    s.set_paused("p", True)
    _add(s, _req("d", 5))
    out = s.schedule()
    assert out.num_scheduled == {"x": 1, "y": 1, "z": 1, "d": 5}


# ------------------------------------------------------------------ adapter slots
def test_a_new_adapter_waits_for_a_slot_and_the_requests_behind_it_still_run():
    """One adapter slot. p takes it (adapter 1); q (adapter 2) must wait; t (no adapter)
    and p2 (adapter 1, already resident) run. Once p and p2 end, q gets the slot."""
    s = _sched()
    s.max_loras = 1
    one, two = LoRARequest("one", 1, "/one"), LoRARequest("two", 2, "/two")
    p, q = _req("p", 3, lora_request=one), _req("q", 3, lora_request=two)
    t, p2 = _req("t", 3), _req("p2", 3, lora_request=one)
    p.sampling_params.max_tokens = p2.sampling_params.max_tokens = 1
    _add(s, p, q, t, p2)
    out = s.schedule()
    assert out.num_scheduled == {"p": 3, "t": 3, "p2": 3}
    assert list(s.waiting) == [q]
    _apply(s, out, ("p", "t", "p2"))  # p and p2 reach max_tokens = 1
    assert s.running == [t]
    out = s.schedule()
    assert out.num_scheduled == {"t": 1, "q": 3}


def test_two_slots_hold_two_adapters_admitted_in_the_same_step():
    """Two slots, nothing running: adapters 1 and 2 are admitted and fill them; adapter 3
    waits, though it arrived in the same step."""
    s = _sched()
    s.max_loras = 2
    reqs = [_req(f"l{i}", 3, lora_request=LoRARequest(f"ad{i}", i, "/x")) for i in (1, 2, 3)]
    _add(s, *reqs)
    out = s.schedule()
    assert out.num_scheduled == {"l1": 3, "l2": 3}
    assert [r.request_id for r in s.waiting] == ["l3"]


# ------------------------------------------------------------------ drafts
def test_drafts_are_read_only_for_a_request_with_one_token_to_compute():
    """Drafts continue a request's last token: a request mid-prompt takes none, even when
    the drafter's dict names it. Budget 4: r's 10-token prompt runs 4 tokens a step."""
    s = _sched(budget=4)
    r = _req("r", 10)
    _add(s, r)
    _apply(s, s.schedule())
    s.spec_token_ids = {"r": [7, 8]}
    out = s.schedule()
    assert out.num_scheduled == {"r": 4} and out.spec_token_ids == {}
    assert [(c.req_id, c.num_computed_tokens, c.new_token_ids) for c in out.cached_reqs] == \
        [("r", 4, [5, 6, 7, 8])]


def test_a_verify_chunk_stops_at_max_model_len():
    """max_model_len 8; r has 6 tokens, 5 computed. Its last token and 3 drafts would
    write positions 5-8; position 8 is past the model's length: 3 tokens, 2 drafts."""
    s = _sched(model_len=8)
    r = _req("r", 5)
    _add(s, r)
    _apply(s, s.schedule(), ("r",))
    s.spec_token_ids = {"r": [7, 8, 9]}
    out = s.schedule()
    assert out.num_scheduled == {"r": 3} and out.spec_token_ids == {"r": [7, 8]}


def test_a_victim_scheduled_earlier_in_the_step_takes_its_drafts_out_of_the_message():
    """Priority policy, 4 blocks of 4. b (priority 1, 3 tokens) runs first; a (priority 0,
    4 tokens) arrives at step 2, when b decodes position 3: each holds one block, 2 free.
    Step 3: b verifies 5 drafts (6 tokens, positions 4-9: two more blocks, the last free
    ones); a, after it, needs a second block for its position 4: the victim is b (the worse
    priority), already scheduled: its tokens and drafts leave the message, its 3 blocks
    return, a takes one. A step that preempts admits nothing: b (5 tokens, 2 blocks) waits,
    though 2 blocks are free."""
    s = _sched(policy="priority", blocks=4)
    b = _req("b", 3, priority=1, arrival_time=0.0)
    _add(s, b)
    _apply(s, s.schedule(), ("b",))
    a = _req("a", 4, priority=0, arrival_time=1.0)
    _add(s, a)
    out = s.schedule()
    assert out.num_scheduled == {"b": 1, "a": 4} and s.kv.pool.num_free == 2
    _apply(s, out, ("b", "a"))
    s.spec_token_ids = {"b": [7, 8, 9, 10, 11]}
    out = s.schedule()
    assert out.preempted_ids == ["b"]
    assert out.num_scheduled == {"a": 1} and out.spec_token_ids == {}
    assert s.running == [a] and list(s.waiting) == [b] and s.kv.pool.num_free == 2


# ------------------------------------------------------------------ loading requests
def test_loading_requests_hold_their_seats():
    """Two seats: a and b are admitted as loading (they compute nothing yet) and take both;
    t, behind them, waits."""
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, 21 * ATTN.page_bytes(BS)),
                        enable_prefix_caching=True)
    index = TransferIndex(engine_id="d", layout="L", block_size=BS, host="d-host", port=7,
                          producer=False, consumer=True)
    kv.attach_connector(index)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64)
    _add(s, loading_request("a", 10, index), loading_request("b", 30, index), _req("t", 3))
    out = s.schedule()
    assert out.num_scheduled == {} and list(s.loading) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["t"]
