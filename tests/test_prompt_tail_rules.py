"""The prompt tail of prefill/decode disaggregation (``core/prompt_tail.py`` and the
``KVCacheManager`` paths that plan, capture, export and take it) without a model: a stand-in
producer and consumer, each a ``Scheduler`` over a small ``KVCacheManager`` with the transfer
connector's scheduler side (``TransferIndex``), stepped by a stand-in runner that samples a
token at the end of the prompt and reports every queued load as landed.

Every expected value is worked out by hand from the documented rules (block size 4; a state
takes 2 pages; a fresh pool hands out pages 1, 2, 3, ... in order):

* a prompt of ``L`` tokens: the producer's pages cover ``L - 1`` tokens, ``n = (L - 1) // 4``
  full blocks travel under their prefix keys, the partial block ``n`` (when ``(L - 1) % 4``)
  and the state after ``L - 1`` tokens under ``("tail", group, h)`` with ``h`` the chain's
  hash extended by the partial block's tokens;
* without a whole tail (no room for the state's tail pages) the export falls back to the
  blocks and the deepest checkpoint at or below block ``n``, covering ``4 n`` tokens;
* a consumer whose index holds the whole tail loads it with the blocks before it and
  computes only the last prompt token, unless its own pool already serves ``L - 1`` tokens
  (it then releases the producer's export untouched).

The pool is whole after every scenario (``check_whole``: no page held, nothing queued).
"""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.kv_connector import ConnectorOutput, key_name
from pagefold.core.managers import PageCopy, StateCapture
from pagefold.core.prefix_cache import hash_block, root_hash
from pagefold.core.sched_output import RunnerOutput, SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams
from pagefold.transfer.index import TransferIndex

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 128-byte page
STATE = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))  # 256 B: two pages
PAGE = ATTN.page_bytes(BS)
HYBRID = {"layers.0": ATTN, "layers.1": STATE}  # group 0 attention, group 1 the state


def _chain(prompt: list[int], salt: tuple = ()) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks, by the documented chain."""
    out, parent = [], root_hash(salt)
    for i in range(len(prompt) // BS):
        parent = hash_block(parent, prompt[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


def _tail_hash(prompt: list[int], salt: tuple = ()) -> bytes:
    """The chain over the first ``L - 1`` tokens, the partial block's tokens hashed last."""
    end = len(prompt) - 1
    n = end // BS
    parent = _chain(prompt, salt)[n - 1] if n else root_hash(salt)
    return hash_block(parent, prompt[n * BS:end])


class Engine:
    """A scheduler over a small pool with the transfer index, stepped without a model."""

    def __init__(self, role: str, blocks: int, *, specs: dict = HYBRID, capture: bool = False,
                 budget: int = 64, connector: bool = True, interval: int = 256) -> None:
        self.kv = KVCacheManager(plan_pagefold(specs, BS, (blocks + 1) * PAGE),
                                 enable_prefix_caching=True, capture_in_kernel=capture,
                                 checkpoint_interval=interval)
        assert self.kv.pool.num_free == blocks
        self.index = TransferIndex(engine_id=role, layout="L", block_size=BS,
                                   host=f"{role}-host", port=7, producer=role == "p",
                                   consumer=role == "d")
        if connector:
            self.kv.attach_connector(self.index)
        self.s = Scheduler(self.kv, max_num_batched_tokens=budget, max_num_seqs=8,
                           max_model_len=64)
        self.steps: list = []  # every step's SchedulerOutput
        self.params: dict[str, dict | None] = {}  # finished request -> its kv_transfer_params

    def add(self, rid: str, prompt: list[int], max_tokens: int = 1, salt: tuple = (),
            **params) -> Request:
        req = Request(rid, list(prompt), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params}),
            extra_keys=salt)
        if params and not params.get("do_remote_decode"):
            assert self.index.expect(req, params)  # as the engine core does on arrival
        self.s.add_request(req)
        return req

    def step(self):
        out = self.s.schedule()
        self.steps.append(out)
        reqs = self.s.requests
        sampled = RunnerOutput({rid: SampledToken(7) for rid, n in out.num_scheduled.items()
                                if reqs[rid].num_computed_tokens + n == reqs[rid].num_tokens})
        if out.kv_ops.loads:
            sampled.kv_connector_output = ConnectorOutput(
                finished=list(dict.fromkeys(ld.req_id for ld in out.kv_ops.loads)))
        for eo in self.s.update_from_output(out, sampled):
            if eo.finish_reason is not None:
                self.params[eo.request_id] = eo.kv_transfer_params
        return out

    def run(self, limit: int = 20) -> None:
        for _ in range(limit):
            if not self.s.has_unfinished():
                break
            self.step()
        assert not self.s.has_unfinished()
        self.kv.check_whole()  # nothing held: every page free or cached, nothing queued

    def scheduled(self, rid: str) -> list[int]:
        return [o.num_scheduled[rid] for o in self.steps if rid in o.num_scheduled]

    def exports(self) -> list[tuple[str, str, int, list[int]]]:
        return [(e.req_id, e.key, e.group, e.pages) for o in self.steps for e in o.kv_ops.exports]

    def loads(self) -> list[tuple[str, str, int, list[int]]]:
        return [(ld.req_id, ld.key, ld.group, ld.pages) for o in self.steps
                for ld in o.kv_ops.loads]


PROMPT = list(range(10, 20))  # L = 10: 9 tokens travel, 2 full blocks and 1 token of block 2
H = _chain(PROMPT)
T = _tail_hash(PROMPT)
A0, A1 = key_name((0, H[0])), key_name((0, H[1]))
T0, T1 = key_name(("tail", 0, T)), key_name(("tail", 1, T))


def _params(names: list[str], rid: str = "p", num_tokens: int = 9) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
            "remote_host": "p-host", "remote_port": 7, "remote_request_id": rid,
            "remote_block_keys": names, "num_tokens": num_tokens, "layout": "L",
            "block_size": BS, "remote_tp_size": 1, "model_layout": "", "page_bytes": 0,
            "pages_per_state": []}


# ---------------------------------------------------------------- producer
def test_a_producer_cuts_a_chunk_at_the_tail_and_copies_its_state_into_tail_pages():
    p = Engine("p", 10)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    # Chunks end at the last block boundary (8: a checkpoint target) and at L - 1 = 9.
    assert p.scheduled("p") == [8, 1, 1]
    # Pages 1, 2: blocks 0-1; 3, 4: the state; 5, 6: the checkpoint at 8; 7: block 2;
    # 8, 9: the tail state, copied from the state after the step that ended at 9.
    assert [o.copies for o in p.steps[1:3]] == [[PageCopy(1, [3, 4], [5, 6])],
                                                [PageCopy(1, [3, 4], [8, 9])]]
    assert not any(o.captures for o in p.steps)
    assert p.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2]), ("p", T0, 0, [7]),
                           ("p", T1, 1, [8, 9])]  # the checkpoint stays home: the tail is whole
    assert p.params["p"] == _params([A0, A1, T0, T1])
    assert (p.index.stats.exports, p.index.stats.pages_exported) == (1, 4)


def test_a_producer_without_room_for_the_tail_exports_block_aligned_pages():
    # 7 pages: blocks 1-2, state 3-4, checkpoint 5-6, block 2 of the prompt takes page 7;
    # nothing is left for the tail's two state pages.
    p = Engine("p", 7)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [8, 1, 1]
    assert [o.copies for o in p.steps[1:3]] == [[PageCopy(1, [3, 4], [5, 6])], []]
    s1 = key_name(("ckpt", 1, H[1]))
    assert p.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2]), ("p", s1, 1, [5, 6])]
    assert p.params["p"]["num_tokens"] == 8 and p.params["p"]["remote_block_keys"] == [
        A0, A1, s1]


def test_the_fallback_exports_the_deepest_checkpoint_at_or_below_the_last_full_block():
    # L = 18, a checkpoint every 4 tokens: chunks end at 4, 8, 12, 16 and 17 (the tail). 10
    # pages: when the step ending at 17 ran, the request holds 5 blocks, its state and its
    # newest checkpoint (at 16): 9 pages, 1 left (older checkpoints were evicted for them),
    # no room for the tail's 2. The export: blocks 0-3 and the checkpoint at 16 (block 4).
    prompt = list(range(30, 48))
    h = _chain(prompt)
    p = Engine("p", 10, interval=4)
    p.add("p", prompt, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [4, 4, 4, 4, 1, 1]
    assert [e[1] for e in p.exports()] == [key_name((0, x)) for x in h[:4]] + [
        key_name(("ckpt", 1, h[3]))]
    assert p.params["p"]["num_tokens"] == 16


def test_a_producer_with_captures_takes_the_tail_inside_the_chunk():
    p = Engine("p", 10, capture=True)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [10]  # no chunk is cut
    # Block pages 1-3, the state 4-5; the tail capture (at 9) takes 6-7 before the
    # checkpoint at 8 takes 8-9.
    assert p.steps[0].captures == [StateCapture("p", 1, 9, [6, 7]),
                                   StateCapture("p", 1, 8, [8, 9])]
    assert p.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2]), ("p", T0, 0, [3]),
                           ("p", T1, 1, [6, 7])]
    assert p.params["p"]["num_tokens"] == 9


def test_a_capture_at_a_chunk_end_is_a_copy_and_no_capture_runs_in_a_later_chunk():
    # Budget 9: the first chunk ends exactly at L - 1 (no capture: the position is not
    # inside it): the state is copied after it; the last chunk (9..10) captures nothing.
    p = Engine("p", 10, capture=True, budget=9)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [9, 1]
    # Pages: blocks 1-3, state 4-5, the checkpoint at 8 captured into 6-7; the tail copied
    # into 8-9 after the step.
    assert [o.captures for o in p.steps[:2]] == [[StateCapture("p", 1, 8, [6, 7])], []]
    assert p.steps[1].copies == [PageCopy(1, [4, 5], [8, 9])]
    assert [e[1:] for e in p.exports()][-1] == (T1, 1, [8, 9])


def test_a_later_chunk_captures_the_tail_where_it_lies_inside():
    # Budget 5: chunks 0..5 and 5..10; 8 and 9 lie inside the second. Pages: blocks 1-2,
    # the state 3-4, block 2 takes 5; then the tail capture 6-7, the checkpoint 8-9.
    p = Engine("p", 10, capture=True, budget=5)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [5, 5]
    assert [o.captures for o in p.steps[:2]] == [[], [StateCapture("p", 1, 9, [6, 7]),
                                                      StateCapture("p", 1, 8, [8, 9])]]
    assert p.exports()[-1] == ("p", T1, 1, [6, 7])


def test_a_capture_producer_short_of_pages_falls_back():
    # 7 pages: blocks 1-3, state 4-5; the tail capture takes 6-7 first, so the checkpoint at
    # 8 finds no room: the tail is whole, and only it leaves with the blocks.
    p = Engine("p", 7, capture=True)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.steps[0].captures == [StateCapture("p", 1, 9, [6, 7])]
    assert p.exports()[-1] == ("p", T1, 1, [6, 7])
    # 6 pages: no room for the tail either: blocks only, covering 8 tokens (no checkpoint).
    q = Engine("p", 6, capture=True)
    q.add("p", PROMPT, do_remote_decode=True)
    q.run()
    assert q.steps[0].captures == []
    assert q.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2])]
    assert q.params["p"]["num_tokens"] == 8


def test_only_a_producers_own_prompt_takes_a_tail():
    # Without the connector, without do_remote_decode, or a family's child: no target at 9,
    # no tail pages; chunks end at the checkpoint target (8) only.
    plain = Engine("p", 10, connector=False)
    plain.add("p", PROMPT, do_remote_decode=True)
    plain.run()
    assert plain.scheduled("p") == [8, 2] and plain.params["p"] is None
    local = Engine("p", 10)
    local.add("x", PROMPT)
    local.run()
    assert local.scheduled("x") == [8, 2] and local.exports() == []
    child = Engine("p", 10)
    r = child.add("c", PROMPT, do_remote_decode=True)
    r.parent_id = "family"
    child.run()
    assert child.scheduled("c") == [8, 2] and child.exports() == []
    cap = Engine("p", 10, capture=True)
    r = cap.add("c", PROMPT, do_remote_decode=True)
    r.parent_id = "family"
    cap.run()
    assert cap.steps[0].captures == [StateCapture("c", 1, 8, [6, 7])]


def test_an_attention_only_producer_exports_the_partial_block_or_nothing_more():
    attn = {"layers.0": ATTN}
    p = Engine("p", 8, specs=attn)
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [10]  # nothing to cut a chunk for
    assert p.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2]), ("p", T0, 0, [3])]
    assert p.params["p"]["num_tokens"] == 9
    # L = 9: L - 1 ends on a block boundary: no tail page, the blocks cover all 8 tokens.
    q = Engine("p", 8, specs=attn)
    q.add("p", PROMPT[:9], do_remote_decode=True)
    q.run()
    assert q.exports() == [("p", A0, 0, [1]), ("p", A1, 0, [2])]
    assert q.params["p"]["num_tokens"] == 8


# ---------------------------------------------------------------- consumer
def test_a_consumer_loads_the_tail_and_computes_only_the_last_token():
    d = Engine("d", 10)
    d.add("d", PROMPT, max_tokens=2, **_params([A0, A1, T0, T1]))
    d.run()
    # Step 1 only loads: blocks 0-1 into pages 1-2, block 2 (the partial one) into 3, the
    # tail state into the request's own pages 4-5. Then 1 token (position 9), 1 decode.
    assert d.scheduled("d") == [1, 1]
    assert d.steps[0].num_scheduled == {}
    assert d.loads() == [("d", A0, 0, [1]), ("d", A1, 0, [2]), ("d", T0, 0, [3]),
                         ("d", T1, 1, [4, 5])]
    (remote,) = d.steps[0].kv_ops.remotes
    assert (remote.host, remote.port, remote.remote_request_id, remote.keys) == (
        "p-host", 7, "p", [A0, A1, T0, T1])
    assert (d.kv.stats.hits, d.kv.stats.local_hits) == (9, 0)
    assert d.index.stats.tokens_loaded == 9 and d.index.stats.requests_loaded == 1
    assert not any(o.kv_ops.releases for o in d.steps)  # pulled: nothing to release


def test_a_consumer_without_the_whole_tail_takes_the_blocks_only():
    d = Engine("d", 10)
    d.add("d", PROMPT, **_params([A0, A1, T1]))  # the partial block's page is missing
    d.run()
    # No checkpoint travelled: the state group serves no hit, so nothing is loaded at all.
    assert d.loads() == [] and d.scheduled("d") == [8, 2]
    e = Engine("d", 10)
    e.add("d", PROMPT, **_params([A0, T0, T1]))  # block 1 missing: the tail is unusable
    e.run()
    # The index serves block 0 only: a target where that attention hit ended (4), then 8.
    assert e.loads() == [] and e.scheduled("d") == [4, 4, 2]
    # The whole tail but a foreign key list order: still taken (the groups match).
    f = Engine("d", 10)
    f.add("d", PROMPT, **_params([T1, T0, A1, A0]))
    f.run()
    assert [ld[1] for ld in f.loads()] == [A0, A1, T0, T1] and f.scheduled("d") == [1]


def test_a_consumer_whose_pool_serves_all_but_the_last_token_releases_the_export():
    prompt = PROMPT[:9]  # L - 1 = 8: a block boundary, the tail is the state only
    h = _chain(prompt)
    t1 = key_name(("tail", 1, _tail_hash(prompt)))
    names = [key_name((0, h[0])), key_name((0, h[1])), t1]
    d = Engine("d", 12)
    d.add("x", prompt)  # the same prompt, computed here: blocks and the checkpoint at 8
    d.run()
    d.steps.clear()
    d.add("d", prompt, **_params(names, num_tokens=8))
    d.run()
    assert d.loads() == [] and d.scheduled("d") == [1]
    (rel,) = [r for o in d.steps for r in o.kv_ops.releases]
    assert (rel.req_id, rel.remote_request_id, rel.keys) == ("d", "p", [])
    # A fresh consumer takes the same tail: blocks 1-2, the state 3-4, computes 1 token.
    f = Engine("d", 12)
    f.add("d", prompt, **_params(names, num_tokens=8))
    f.run()
    assert f.loads() == [("d", names[0], 0, [1]), ("d", names[1], 0, [2]), ("d", t1, 1, [3, 4])]
    assert f.scheduled("d") == [1] and f.index.stats.tokens_loaded == 8


def test_a_tail_is_taken_over_a_checkpoint_that_only_another_export_holds():
    # Two exports of one prompt (L = 9) reach the consumer: "d0"'s block-aligned one (blocks
    # and the checkpoint at 8), "d"'s with the tail. The index then serves 8 tokens either
    # way, but the pool alone serves none: "d" takes its tail, loading the tail state.
    prompt = PROMPT[:9]
    h = _chain(prompt)
    blocks = [key_name((0, h[0])), key_name((0, h[1]))]
    t1 = key_name(("tail", 1, _tail_hash(prompt)))
    d = Engine("d", 12)
    d.index.expect(Request("d0", prompt, SamplingParams()),
                   _params(blocks + [key_name(("ckpt", 1, h[1]))], rid="p0", num_tokens=8))
    d.add("d", prompt, **_params(blocks + [t1], num_tokens=8))
    d.step()
    assert [ld[1:3] for ld in d.loads()] == [(blocks[0], 0), (blocks[1], 0), (t1, 1)]
    d.index.release("d0")
    d.run()


def test_a_consumer_hit_in_its_own_pool_short_of_the_tail_loads_only_the_tail():
    # The consumer computed a longer prompt sharing blocks 0-1 (its checkpoints at 12 only):
    # the blocks come from its pool, the state needs the tail.
    prompt = PROMPT[:9]
    h = _chain(prompt)
    t1 = key_name(("tail", 1, _tail_hash(prompt)))
    d = Engine("d", 12)
    d.add("x", prompt + [1, 2, 3, 4])
    d.run()
    d.steps.clear()
    d.add("d", prompt, **_params([key_name((0, h[0])), key_name((0, h[1])), t1],
                                 num_tokens=8))
    d.run()
    # Blocks 1-2 hold x's blocks 0-1; the state takes the first free pages after x's.
    (load,) = d.loads()
    assert load[:3] == ("d", t1, 1) and len(load[3]) == 2
    assert d.scheduled("d") == [1]
    assert d.index.stats.tokens_loaded == 8  # the pool alone served no hit (no checkpoint)


def test_a_consumer_with_no_room_waits_and_later_hits_its_own_pool():
    prompt = PROMPT[:9]
    h = _chain(prompt)
    t1 = key_name(("tail", 1, _tail_hash(prompt)))
    kv = KVCacheManager(plan_pagefold(HYBRID, BS, 13 * PAGE), enable_prefix_caching=True)
    index = TransferIndex(engine_id="d", layout="L", block_size=BS, host="d-host", port=7,
                          producer=False, consumer=True)
    kv.attach_connector(index)
    d = Request("d", prompt, SamplingParams(max_tokens=1))
    assert index.expect(d, _params([key_name((0, h[0])), key_name((0, h[1])), t1],
                                   num_tokens=8))
    hog = kv.pool.allocate(kv.pool.num_free - 4)  # 4 free; 5 needed: 3 blocks, the state's 2
    assert kv.find_hit(d) == 2  # the tail: 8 tokens
    assert not kv.allocate_slots(d, 1, 2)
    kv.pool.free(hog)
    # Meanwhile the same prompt is computed here: blocks 0-1 and the checkpoint at 8.
    x = Request("x", prompt, SamplingParams(max_tokens=1))
    assert kv.find_hit(x) == 0 and kv.allocate_slots(x, 8)
    x.num_computed_tokens = 8
    kv.after_step(x)
    kv.take_copies()
    kv.release_pins()
    kv.free(x)
    assert kv.find_hit(d) == 2  # now its own pool's: no tail, nothing to load
    assert kv.allocate_slots(d, 1, 2)
    assert not kv.is_loading("d") and d.num_computed_tokens == 8
    assert kv.take_kv_ops().loads == []
    (restore,) = kv.take_copies()
    assert restore.group == 1  # the checkpoint at 8 restored into the state
    kv.release_pins()
    kv.free(d)
    ops = kv.take_kv_ops()
    assert [(r.req_id, r.keys) for r in ops.releases] == [("d", [])]
    kv.check_whole()


# ---------------------------------------------------------------- edges
def test_chunks_end_on_the_last_boundary_and_three_blocks_before_it():
    # L = 12: the last boundary before the last token is 8 (not 12: position 11 is the last
    # a later prompt can continue after); L = 18: 16 and 16 - 12 = 4.
    e = Engine("p", 20)
    e.add("a", list(range(100, 112)))
    e.add("b", list(range(200, 218)))
    e.run()
    assert e.scheduled("a") == [8, 4] and e.scheduled("b") == [4, 12, 2]


def test_a_state_group_before_the_attention_group_skips_only_itself():
    # Group 0 the state, group 1 attention: pages 1-2 the state, 3-4 blocks 0-1, 5-6 the
    # checkpoint at 8, 7 block 2, 8-9 the tail state.
    p = Engine("p", 10, specs={"layers.0": STATE, "layers.1": ATTN})
    p.add("p", PROMPT, do_remote_decode=True)
    p.run()
    assert p.exports() == [("p", key_name((1, H[0])), 1, [3]), ("p", key_name((1, H[1])), 1, [4]),
                           ("p", key_name(("tail", 0, T)), 0, [8, 9]),
                           ("p", key_name(("tail", 1, T)), 1, [7])]


def test_a_prompt_shorter_than_a_block_and_a_cache_salt_name_their_tail():
    prompt = [5, 6, 7, 8]  # n = 0 full blocks travel: the tail is block 0's first 3 tokens
    for salt in ((), ("cache_salt", "s")):
        p = Engine("p", 8, specs={"layers.0": ATTN})
        p.add("p", prompt, salt=salt, do_remote_decode=True)
        p.run()
        tail = key_name(("tail", 0, hash_block(root_hash(salt), prompt[:3])))
        assert p.exports() == [("p", tail, 0, [1])] and p.params["p"]["num_tokens"] == 3


def test_an_image_in_the_partial_block_is_part_of_the_tail_name():
    def image(offset: int, length: int) -> MultiModalInputs:
        return MultiModalInputs([ImageFeature(offset, length, "img", b"", [0], [1, 1, 1])])

    def accepts(prompt: list[int], mm: MultiModalInputs, h: bytes) -> bool:
        index = TransferIndex(engine_id="d", layout="L", block_size=BS, host="d", port=7,
                              producer=False, consumer=True)
        req = Request("d", prompt, SamplingParams(), mm_inputs=mm)
        ok = index.expect(req, _params([key_name(("tail", 1, h))]))
        index.release("d")
        return ok

    # L = 10, an image at 8-9: the tail (positions 8 .. 8) names it; blocks 0-1 do not.
    h1 = _chain(PROMPT)[1]
    assert accepts(PROMPT, image(8, 2), hash_block(h1, PROMPT[8:9], ["img"]))
    assert not accepts(PROMPT, image(8, 2), hash_block(h1, PROMPT[8:9]))
    # L = 9, an image at 6-9: block 1 names it; the tail has no token of its own (8 = 2
    # blocks), so its name is the chain's extended by nothing.
    p9 = PROMPT[:9]
    h1 = hash_block(hash_block(root_hash(), p9[:4]), p9[4:8], ["img"])
    assert accepts(p9, image(6, 4), hash_block(h1, []))
    assert not accepts(p9, image(6, 4), hash_block(h1, [], ["img"]))


def test_a_producer_that_hits_its_own_cache_up_to_the_tail_exports_the_checkpoint():
    # L = 9 computed here before: blocks 0-1 and the checkpoint at 8 cached. The producer's
    # request starts at 8 = L - 1: no step runs past L - 1 nor ends there, so no tail is
    # taken; the export is the block-aligned one (8 tokens).
    p = Engine("p", 12, capture=True)
    prompt = PROMPT[:9]
    h = _chain(prompt)
    p.add("x", prompt)
    p.run()
    p.steps.clear()
    p.add("p", prompt, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [1] and not any(o.captures for o in p.steps)
    assert [e[1] for e in p.exports()] == [key_name((0, h[0])), key_name((0, h[1])),
                                          key_name(("ckpt", 1, h[1]))]
    assert p.params["p"]["num_tokens"] == 8


def test_a_two_token_chunk_captures_a_target_inside_it():
    # L = 9, budget 7: chunks 0..7 and 7..9; 8 (the tail and the last boundary) is inside
    # the second. Pages: blocks 1-2, the state 3-4, block 2 takes 5, the tail 6-7, the
    # checkpoint 8-9.
    p = Engine("p", 10, capture=True, budget=7)
    prompt = PROMPT[:9]
    p.add("p", prompt, do_remote_decode=True)
    p.run()
    assert p.scheduled("p") == [7, 2]
    assert [o.captures for o in p.steps[:2]] == [[], [StateCapture("p", 1, 8, [6, 7]),
                                                      StateCapture("p", 1, 8, [8, 9])]]
    assert p.exports()[-1][1:] == (key_name(("tail", 1, _tail_hash(prompt))), 1, [6, 7])


def test_a_request_without_targets_does_not_stop_the_next_ones_captures():
    # "s" (L = 3) has no boundary before its last token; "x" (L = 10) has 8. Pages: s's block
    # 1 and state 2-3, x's blocks 4-6 and state 7-8, the checkpoint 9-10.
    e = Engine("p", 12, capture=True)
    e.add("s", [60, 61, 62])
    e.add("x", PROMPT)
    e.run()
    assert e.steps[0].num_scheduled == {"s": 3, "x": 10}
    assert e.steps[0].captures == [StateCapture("x", 1, 8, [9, 10])]


def test_a_chunk_ending_on_a_target_leaves_it_to_a_copy():
    # Budget 8: the chunk 0..8 ends on the target 8 (not strictly inside): after the step the
    # state (3-4) is copied into the checkpoint's pages (5-6).
    e = Engine("p", 10, capture=True, budget=8)
    e.add("x", PROMPT)
    e.run()
    assert [o.captures for o in e.steps[:2]] == [[], []]
    assert e.steps[1].copies == [PageCopy(1, [3, 4], [5, 6])]


def test_the_targets_of_one_chunk_are_captured_shallowest_first():
    # L = 18, a checkpoint every 4 tokens, one chunk: blocks 1-5, the state 6-7, then the
    # checkpoints at 4, 8, 12, 16 in that order.
    e = Engine("p", 20, capture=True, interval=4)
    e.add("x", list(range(30, 48)))
    e.run()
    assert e.steps[0].captures == [StateCapture("x", 1, 4 * (i + 1), [8 + 2 * i, 9 + 2 * i])
                                   for i in range(4)]


def test_a_target_at_a_chunks_start_is_not_captured():
    # L = 18: targets 4 and 16. The chunk 0..4 ends on 4 with the pool full (no checkpoint);
    # the next chunk 4..10 starts there: nothing strictly inside it.
    kv = KVCacheManager(plan_pagefold(HYBRID, BS, 21 * PAGE), enable_prefix_caching=True,
                        capture_in_kernel=True)
    x = Request("x", list(range(30, 48)), SamplingParams(max_tokens=1))
    assert kv.find_hit(x) == 0 and kv.allocate_slots(x, 4)
    assert kv.plan_captures([x], [4]) == []
    hog = kv.pool.allocate(kv.pool.num_free)
    x.num_computed_tokens = 4
    kv.after_step(x)
    assert kv.take_copies() == []  # no room for the checkpoint at 4
    kv.release_pins()
    kv.pool.free(hog)
    assert kv.allocate_slots(x, 6)
    assert kv.plan_captures([x], [6]) == []
    kv.free(x)
    kv.check_whole()
