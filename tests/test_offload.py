"""Offload tiers for the prefix cache (issue 38): a host tier and a checksummed disk tier.

The reference for exactness is the same engine with a pool large enough to keep every prefix
(prefix caching on, no tier): its second pass hits the pool at the same lengths, so a tier hit
must give bit-identical greedy tokens *and* logprobs (the pages come back byte for byte).
"""

from __future__ import annotations

import errno
import struct
import threading
from pathlib import Path

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.kv_connector import (
    ConnectorOutput,
    KVLoad,
    KVOps,
    KVSave,
    ReportMerger,
    key_name,
)
from pagefold.core.prefix_cache import hash_block, root_hash
from pagefold.engine.core_proc import core_stats
from pagefold.metrics import ServerMetrics
from pagefold.offload import store as offload_store
from pagefold.offload.index import OffloadIndex
from pagefold.offload.page_file import (
    PageFileError,
    PageGeometry,
    read_page_file,
    scan,
    write_page_file,
)
from pagefold.request import Request
from pagefold.testing.tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
# Pools that hold about two requests of max_model_len 128 (dense) or a few (hybrids), so that
# running six prompts one after another evicts the earlier prompts' blocks and checkpoints.
SMALL_POOL = {"qwen3": 400_000, "qwen3_5": 300_000, "nemotron_h": 150_000}


def _run(llm: LLM, prompts):
    # One at a time: every request meets the same pool state in every engine.
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in prompts]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs):
    return [[sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs]
            for o in outs]


def _engine(model: Path, arch: str, **kw) -> LLM:
    return LLM(str(model), dtype="float32", max_model_len=128, **kw)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 60, 90, 512, seed=5)


@pytest.fixture(scope="module")
def reference(tiny_model_factory, prompts):
    """Per architecture: (first pass, second pass) of an engine whose pool keeps everything."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            llm = _engine(tiny_model_factory(arch), arch, kv_cache_memory="64MiB")
            cache[arch] = (_run(llm, prompts), _run(llm, prompts))
            assert llm.engine.kv.pool.stats.evictions == 0
            llm.engine.kv.check_whole()
        return cache[arch]

    return get


# ---------------------------------------------------------------------------- the disk format
def test_page_file_round_trip_and_every_kind_of_damage_is_detected(tmp_path):
    geom = PageGeometry(layers=2, pages=3, page_bytes=64)
    payload = bytes(i * 7 % 251 for i in range(geom.payload_bytes))
    path = tmp_path / "a0-00.kvpage"
    write_page_file(path, key="a0-00", group=0, layout="L1", geom=geom, saved_tokens=16,
                    payload=memoryview(payload))
    assert bytes(read_page_file(path, key="a0-00", layout="L1", geom=geom)) == payload
    good = path.read_bytes()
    header_len = struct.unpack_from("<I", good, 12)[0]
    payload_start = 20 + header_len
    damages = {
        "flip in the last page row": lambda b: b[:-1] + bytes([b[-1] ^ 1]),
        "flip in the first page row": lambda b: (b[:payload_start]
                                                 + bytes([b[payload_start] ^ 0x80])
                                                 + b[payload_start + 1:]),
        "truncated": lambda b: b[:-7],
        "padded": lambda b: b + b"\0",
        "header flipped": lambda b: b[:25] + bytes([b[25] ^ 4]) + b[26:],
        "empty": lambda b: b"",
    }
    for what, damage in damages.items():
        path.write_bytes(damage(good))
        with pytest.raises(PageFileError):
            read_page_file(path, key="a0-00", layout="L1", geom=geom)
        assert what
    path.write_bytes(good)
    with pytest.raises(PageFileError, match="does not match"):
        read_page_file(path, key="a0-00", layout="another model", geom=geom)
    with pytest.raises(PageFileError, match="does not match"):
        read_page_file(path, key="a0-01", layout="L1", geom=geom)
    with pytest.raises(PageFileError, match="cannot read"):
        read_page_file(tmp_path / "missing.kvpage", key="x", layout="L1", geom=geom)
    (tmp_path / "half.kvpage.123.tmp").write_bytes(b"x")
    assert scan(tmp_path) == [("a0-00", len(good))]
    assert not (tmp_path / "half.kvpage.123.tmp").exists()  # crash leftovers are removed


# ---------------------------------------------------------------------------- the index
def test_index_lru_caps_and_pins():
    idx = OffloadIndex(host_slots=3, page_bytes=10, group_layers=[2, 1])
    k = [(0, bytes([i])) for i in range(5)]
    for key in k[:3]:
        idx.record_save(key, 0, [7], 16)
    assert [s.host_slots for s in idx.take_ops().saves] == [[0], [1], [2]]
    idx.record_load("r", k[0], 0, [9])  # refreshes k[0] and pins it for this step
    idx.record_save(k[3], 0, [8], 16)  # evicts the least recently used unpinned: k[1]
    ops = idx.take_ops()
    assert ops.loads == [KVLoad("r", key_name(k[0]), 0, [9], [0])]
    assert ops.saves == [KVSave(key_name(k[3]), 0, [8], 16, [1], False)]
    assert not idx.contains(k[1]) and idx.contains(k[0]) and idx.contains(k[3])
    # A checkpoint of 3 pages needs every slot; none pinned now, so all go.
    idx.record_save(("ckpt", 1, b"s"), 1, [1, 2, 3], 64)
    assert sorted(idx.take_ops().saves[0].host_slots) == [0, 1, 2] and len(idx.host) == 1
    idx.check_whole()

    disk = OffloadIndex(host_slots=0, page_bytes=10, group_layers=[2],
                        disk_dir=Path("/nonexistent"), disk_bytes=60)
    for key in k[:3]:  # 20 bytes each: the cap holds 3
        disk.record_save(key, 0, [1], 16)
    disk.take_ops()
    disk.record_load("r", k[0], 0, [4])
    disk.record_save(k[3], 0, [5], 16)
    ops = disk.take_ops()
    assert ops.drops == [key_name(k[1])] and ops.saves[0].to_disk  # LRU, the pinned k[0] kept
    assert disk.disk_used == 60
    disk.record_save(k[4], 0, [1, 2, 3, 4], 16)  # 80 bytes: above the cap, not offloaded
    assert not disk.take_ops() and not disk.contains(k[4])
    disk.check_whole()


def test_a_tier_hit_pins_its_keys_before_its_own_allocations_evict():
    """A's blocks live only in a 4-slot host tier; re-admitting A evicts B's cached blocks from
    the pool, whose saves want host slots: they must not take A's (about to be loaded)."""
    spec = FullAttentionSpec(2, 16, torch.float32)
    kv = KVCacheManager(plan_pagefold({"layers.0": spec}, 16, 6 * spec.page_bytes(16)),
                        enable_prefix_caching=True)
    index = OffloadIndex(host_slots=4, page_bytes=kv.config.page_bytes, group_layers=[1])
    kv.attach_connector(index)

    def compute(req: Request) -> None:
        assert kv.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        kv.after_step(req)
        kv.take_copies()
        kv.release_pins()
        kv.free(req)

    params = SamplingParams(max_tokens=1)
    a_tokens = list(range(100, 165))
    compute(Request("a", a_tokens, params))
    compute(Request("b", list(range(200, 265)), params))  # evicts A's 4 blocks to the host
    assert len(index.host) == 4 and len(index.take_ops().saves) == 4
    again = Request("a2", a_tokens, params)
    assert kv.find_hit(again) == 4
    assert kv.allocate_slots(again, 1, 4)  # allocates 4 blocks: B's entries are evicted
    ops = index.take_ops()
    assert sorted(ld.key for ld in ops.loads) == sorted(key_name(k) for k in index.host)
    assert len(ops.loads) == 4 and all(ld.host_slots for ld in ops.loads)
    assert all(not s.host_slots for s in ops.saves)  # B's pages found no room: A's pinned
    kv.apply_connector_output(ConnectorOutput(finished=["a2"]))
    assert kv.finish_load(again, []) and again.num_computed_tokens == 64
    kv.free(again)
    kv.take_kv_ops()  # the cancel-free ops of that step
    kv.check_whole()


def test_a_full_pool_captures_checkpoints_into_staging_pages_for_the_tiers():
    """No free page for a checkpoint: the deepest target of the chunk is captured into a
    staging set, saved to the host tier with the next step (never a pool entry), and the set
    is free again once that step ran; a later request of the prompt hits it in the tier."""
    from pagefold.core.spec_families import mamba2_state

    state = mamba2_state(heads=2, head_dim=4, groups=1, state=4, kernel=4, tp=1, num_spec=0,
                         conv_dtype=torch.float32, ssm_dtype=torch.float32)
    attn = FullAttentionSpec(2, 8, torch.float32)
    cfg = plan_pagefold({"layers.0": attn, "layers.1": state}, 16, 64 * 1024)
    kv = KVCacheManager(cfg, enable_prefix_caching=True, capture_in_kernel=True)
    usable = kv.pool.num_usable
    index = OffloadIndex(host_slots=64, page_bytes=cfg.page_bytes,
                         group_layers=[len(g.layer_names) for g in cfg.groups])
    kv.attach_connector(index)
    kv.enable_capture_staging()
    reserved = kv.pool.reserved
    assert reserved and kv.pool.num_usable == usable - len(reserved)
    g = next(i for i, grp in enumerate(cfg.groups) if grp.pages_per_state)
    req = Request("a", list(range(1, 71)), SamplingParams(max_tokens=1))
    assert kv.find_hit(req) == 0  # plans its targets: 16 and 64 inside the chunk
    assert kv.allocate_slots(req, 70)
    hog = kv.pool.allocate(kv.pool.num_free)  # every other page held: the pool is full
    (cap,) = kv.plan_captures([req], [70])  # the deepest only: staging sets are few
    assert cap.num_tokens == 64 and cap.group == g and set(cap.pages) <= reserved
    req.num_computed_tokens = 70
    kv.after_step(req)
    key = ("ckpt", g, req.block_hashes[3])
    assert key not in kv.pool.entries and index.contains(key)
    kv.take_copies()
    (save,) = [sv for sv in kv.take_kv_ops().saves if sv.key == key_name(key)]
    assert save.pages == cap.pages and save.host_slots  # read at the start of this step
    kv.release_pins()  # the step ran: the set is free again
    assert kv.staging.staged == 1
    kv.pool.free(hog)
    kv.free(req)
    again = Request("b", list(range(1, 71)), SamplingParams(max_tokens=1))
    assert kv.find_hit(again) == 4  # attention blocks in the pool, the checkpoint in the tier
    kv.take_kv_ops()
    kv.check_whole()


def test_rank_reports_merge_across_steps():
    merger = ReportMerger(2)
    r0 = ConnectorOutput(finished=["a", "b"], failed={"b": ["a0-01"]}, bytes_loaded=10)
    r1 = ConnectorOutput(finished=["b"], bytes_loaded=10)
    out = merger.merge([r0, r1], [])
    assert out.finished == ["b"] and out.failed == {"b": ["a0-01"]} and out.bytes_loaded == 20
    # Rank 1 finishes "a" a step later, with a bad page only it saw.
    out = merger.merge([None, ConnectorOutput(finished=["a"], failed={"a": ["s1-02"]})], [])
    assert out.finished == ["a"] and out.failed == {"a": ["s1-02"]}
    # A request aborted after one rank reported it is forgotten.
    merger.merge([ConnectorOutput(finished=["c"]), ConnectorOutput()], [])
    out = merger.merge([ConnectorOutput(), ConnectorOutput(finished=["d"])], ["c"])
    assert out.finished == [] and not merger._done.get("c")


# ---------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "nemotron_h"])
def test_evicted_prefixes_come_back_from_the_host_tier_bit_exact(arch, tiny_model_factory,
                                                                 prompts, reference, tmp_path):
    ref_first, ref_second = reference(arch)
    llm = _engine(tiny_model_factory(arch), arch, kv_cache_memory=SMALL_POOL[arch],
                  kv_offloading_size=0.01)
    first, second = _run(llm, prompts), _run(llm, prompts)
    stats, pool = llm.engine.offload.stats, llm.engine.kv.pool
    assert pool.stats.evictions > 0 and stats.saves_host > 0
    assert _tokens(first) == _tokens(ref_first) and _logprobs(first) == _logprobs(ref_first)
    assert _tokens(second) == _tokens(ref_second)
    assert _logprobs(second) == _logprobs(ref_second)  # same hit lengths, same bytes
    cached = [o.num_cached_tokens for o in second]
    assert cached == [o.num_cached_tokens for o in ref_second] and min(cached) >= 48
    # The hits came from the host tier: the small pool had evicted those prefixes.
    assert stats.loads_host > 0 and stats.loads_disk == 0 and stats.load_failures == 0
    assert stats.tokens_loaded >= 0.5 * sum(cached)
    if arch != "qwen3":  # state checkpoints travelled too
        assert any(key[0] == "ckpt" for key in llm.engine.offload.host)
    llm.engine.kv.check_whole()


def test_a_host_tier_smaller_than_the_working_set_stays_exact(tiny_model_factory, prompts,
                                                              reference):
    """A host tier that turns over (it holds under half of what two passes save): LRU
    eviction inside the tier, hits on what it kept, the same tokens."""
    ref_first, ref_second = reference("qwen3_5")
    model = tiny_model_factory("qwen3_5")
    probe = _engine(model, "qwen3_5", kv_cache_memory=SMALL_POOL["qwen3_5"], warm_up=False)
    kvc = probe.engine.kv_config
    row = kvc.layers_per_group * kvc.page_bytes
    slots = 40  # under half of what the two passes save
    llm = _engine(model, "qwen3_5", kv_cache_memory=SMALL_POOL["qwen3_5"],
                  kv_offloading_size=slots * row / 2**30)
    assert llm.engine.offload.host_slots == slots
    first, second = _run(llm, prompts), _run(llm, prompts)
    stats = llm.engine.offload.stats
    assert _tokens(first) == _tokens(ref_first) and _tokens(second) == _tokens(ref_second)
    assert stats.saves_host > slots and stats.loads_host > 0  # the tier turned over, and hit
    llm.engine.kv.check_whole()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_restarted_engine_serves_old_prefixes_from_disk(arch, tiny_model_factory, prompts,
                                                        reference, tmp_path):
    ref_first, ref_second = reference(arch)
    model = tiny_model_factory(arch)
    kw = dict(kv_cache_memory=SMALL_POOL[arch], kv_offloading_dir=str(tmp_path),
              kv_offloading_disk_size="64MiB")
    llm = _engine(model, arch, **kw)
    assert _tokens(_run(llm, prompts)) == _tokens(ref_first)
    llm.engine.shutdown()  # what the pool still caches goes to disk too
    llm.engine.kv.check_whole()
    files = list(tmp_path.rglob("*.kvpage"))
    assert files and llm.engine.offload.disk_used == sum(f.stat().st_size - _header(f)
                                                        for f in files)

    again = _engine(model, arch, **kw)  # a new engine on the same directory
    assert len(again.engine.offload.disk) == len(files)
    second = _run(again, prompts)
    stats = again.engine.offload.stats
    assert _tokens(second) == _tokens(ref_second) and _logprobs(second) == _logprobs(ref_second)
    assert [o.num_cached_tokens for o in second] == [o.num_cached_tokens for o in ref_second]
    assert stats.loads_disk > 0 and stats.load_failures == 0
    assert stats.tokens_loaded == sum(o.num_cached_tokens for o in second)  # all from disk
    again.engine.kv.check_whole()

    # Another model (here: another dtype, so other page bytes) never opens these files.
    other = LLM(str(model), dtype="bfloat16", max_model_len=128, **kw)
    assert len(other.engine.offload.disk) == 0


def _header(path: Path) -> int:
    return 20 + struct.unpack_from("<I", path.read_bytes(), 12)[0]


def test_bad_disk_pages_are_detected_and_recomputed(tiny_model_factory, prompts, reference,
                                                    tmp_path):
    ref_first, _ = reference("qwen3")
    model = tiny_model_factory("qwen3")
    kw = dict(kv_cache_memory=SMALL_POOL["qwen3"], kv_offloading_dir=str(tmp_path))
    llm = _engine(model, "qwen3", **kw)
    _run(llm, prompts)
    llm.engine.shutdown()
    # The first block of prompts 0, 1, 2 (attention group 0): one flipped byte, one truncated,
    # one deleted after the next engine indexed it.
    names = [f"a0-{hash_block(root_hash(), p[:16]).hex()}.kvpage" for p in prompts[:3]]
    paths = [next(tmp_path.rglob(n)) for n in names]
    data = paths[0].read_bytes()
    damaged = [data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:],
               paths[1].read_bytes()[:-3]]
    for path, bad in zip(paths, damaged):
        path.write_bytes(bad)

    again = _engine(model, "qwen3", **kw)
    paths[2].unlink()
    outs = _run(again, prompts)
    stats = again.engine.offload.stats
    # Same tokens as an engine that never offloaded; the bad pages were caught, not used.
    assert _tokens(outs) == _tokens(ref_first)
    assert stats.load_failures == 3
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0]  # recomputed from scratch
    assert all(o.num_cached_tokens >= 48 for o in outs[3:])  # the good pages still serve
    for path, bad in zip(paths, damaged):  # removed (and maybe saved again, whole)
        assert not path.exists() or path.read_bytes() != bad
    again.engine.kv.check_whole()


def test_salted_prefixes_never_meet_in_the_tier(tiny_model_factory, prompts, tmp_path):
    llm = _engine(tiny_model_factory("qwen3"), "qwen3", kv_cache_memory=SMALL_POOL["qwen3"],
                  kv_offloading_size=0.01)
    for salt in ("tenant-a", "tenant-b"):
        for p in prompts:
            out = llm.generate([{"prompt_token_ids": p, "cache_salt": salt}], GREEDY,
                               use_tqdm=False)[0]
            assert out.num_cached_tokens == 0  # the other tenant's pages are not a hit
    again = [llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-a"}], GREEDY,
                          use_tqdm=False)[0] for p in prompts]
    assert all(o.num_cached_tokens >= 48 for o in again)
    stats = llm.engine.offload.stats
    assert stats.loads_host > 0
    llm.engine.kv.check_whole()
    # The counters reach /metrics through the core's stats.
    metrics = ServerMetrics("m")
    metrics.record_core_stats(core_stats(llm.engine))
    text = metrics.render().decode()

    def value(sample: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(sample)).split()[-1])

    assert value('pagefold:kv_offload_loads_total{model_name="m",tier="host"}') \
        == stats.loads_host
    assert value('pagefold:kv_offload_saves_total{model_name="m",tier="host"}') \
        == stats.saves_host > 0
    assert value('pagefold:kv_offload_loads_total{model_name="m",tier="disk"}') == 0
    assert value('pagefold:kv_offload_tokens_loaded_total{model_name="m"}') \
        == stats.tokens_loaded == sum(o.num_cached_tokens for o in again)


def test_offloading_needs_prefix_caching(qwen3_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(qwen3_dir), enable_prefix_caching=False, kv_offloading_size=1)


def test_tensor_parallel_ranks_keep_their_shards(tiny_model_factory, prompts, reference,
                                                 tmp_path):
    """TP 2 on a GDN hybrid: each rank saves and loads its own shard (host slots and its own
    rank folder); a restarted TP 2 engine hits from both ranks' files."""
    ref_first, ref_second = reference("qwen3_5")
    model = tiny_model_factory("qwen3_5")
    kw = dict(tensor_parallel_size=2, threads_per_rank=1, kv_cache_memory=150_000,
              kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path))
    llm = _engine(model, "qwen3_5", **kw)
    try:
        first, second = _run(llm, prompts), _run(llm, prompts)
        stats = llm.engine.offload.stats
        assert llm.engine.kv.pool.stats.evictions > 0 and stats.loads_host > 0
        assert _tokens(first) == _tokens(ref_first) and _tokens(second) == _tokens(ref_second)
        assert [o.num_cached_tokens for o in second] == \
            [o.num_cached_tokens for o in ref_second]
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()
    ranks = sorted(p.name for p in tmp_path.rglob("rank*"))
    assert ranks == ["rank0-of-2", "rank1-of-2"]
    names = [sorted(f.name for f in d.iterdir()) for d in sorted(tmp_path.rglob("rank*"))]
    assert names[0] == names[1] and names[0]
    again = _engine(model, "qwen3_5", **kw)
    try:
        third = _run(again, prompts)
        assert again.engine.offload.stats.loads_disk > 0
        assert _tokens(third) == _tokens(ref_second)
        assert _logprobs(third) == _logprobs(second)  # disk pages = host pages, per rank
        again.engine.kv.check_whole()
    finally:
        again.engine.shutdown()


def test_disk_loads_overlap_compute_and_an_abort_never_lands(tiny_model_factory, prompts,
                                                            reference, tmp_path):
    """A disk read runs in the store's I/O thread: while it is held back, the request waits
    (loading, computing nothing) and another request computes; a request aborted while loading
    never gets its late pages written into blocks that now belong to someone else."""
    _, ref_second = reference("qwen3")
    model = tiny_model_factory("qwen3")
    kw = dict(kv_cache_memory=SMALL_POOL["qwen3"], kv_offloading_dir=str(tmp_path))
    llm = _engine(model, "qwen3", **kw)
    _run(llm, prompts)
    llm.engine.shutdown()

    again = _engine(model, "qwen3", **kw)
    store, sched = again.engine.runner.connector, again.engine.scheduler
    gate = threading.Event()
    read = store._do_read

    def held_read(*args):
        gate.wait(60)
        read(*args)

    store._do_read = held_read
    fresh = random_prompts(1, 40, 50, 512, seed=11)[0]  # in no tier: it computes
    held = again.add_request({"prompt_token_ids": prompts[0]}, GREEDY)  # loads from disk
    other = again.add_request({"prompt_token_ids": fresh}, GREEDY)
    done = {}
    for _ in range(40):
        for o in again.step():
            if o.finished:
                done[o.request_id] = o
        if other in done:
            break
    assert other in done and held in sched.loading  # computed while the load was held back
    held_blocks = set(again.engine.kv.block_ids(held)[0])
    again.abort([held])  # its reads are still queued; its blocks go back to the pool
    # Requests in no tier take those blocks and compute into them while the reads wait.
    late = [again.add_request({"prompt_token_ids": p}, GREEDY)
            for p in random_prompts(3, 70, 90, 512, seed=12)]
    reused: set[int] = set()
    while any(rid not in done for rid in late):
        for rid in late:
            reused.update(b for b in again.engine.kv.block_ids(rid)[0] if b in held_blocks)
        for o in again.step():
            if o.finished:
                done[o.request_id] = o
    assert reused  # the aborted request's blocks served others at once
    rows = sorted(reused)
    before = [t[rows].clone() for t in again.engine.runner.cache.shared]
    gate.set()
    store.drain()
    store.run(KVOps(poll=True))  # lands what is left (the aborted request's reads): dropped
    assert not store._pending  # no load left in flight
    after = [t[rows] for t in again.engine.runner.cache.shared]
    assert all(a.equal(b) for a, b in zip(after, before))  # nothing landed in them
    # The disk tier still serves exactly after all this.
    store._do_read = read
    out = _run(again, [prompts[1]])
    assert _tokens(out) == _tokens([ref_second[1]]) and out[0].num_cached_tokens >= 48
    again.engine.kv.check_whole()


def test_a_full_disk_stops_offloading_and_serving_goes_on(tiny_model_factory, prompts,
                                                          reference, tmp_path, monkeypatch):
    ref_first, _ = reference("qwen3")

    def full(path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_store, "write_page_file", full)
    llm = _engine(tiny_model_factory("qwen3"), "qwen3", kv_cache_memory=SMALL_POOL["qwen3"],
                  kv_offloading_dir=str(tmp_path))
    first, second = _run(llm, prompts), _run(llm, prompts)
    llm.engine.shutdown()  # drains the refused writes' reports
    stats, index = llm.engine.offload.stats, llm.engine.offload
    assert _tokens(first) == _tokens(ref_first) and _tokens(second) == _tokens(ref_first)
    assert stats.store_failures > 0 and stats.loads_disk == stats.load_failures
    assert not list(tmp_path.rglob("*.kvpage")) and not list(tmp_path.rglob("*.tmp"))
    # The index forgot every page it could not write (the shutdown's drain reported the last).
    assert not index.disk and index.disk_used == 0
    llm.engine.kv.check_whole()


def test_issue_criterion_twenty_600_token_prompts_twice_then_after_restart(tiny_model_factory,
                                                                          tmp_path):
    """Issue 38's offload criterion on a GDN hybrid: 20 distinct 600-token prompts sent twice
    with a pool too small to keep them; the second pass takes >= 90% of its prompt tokens from
    the tiers with identical tokens; a restarted engine on the same directory does the same
    from disk alone."""
    model = tiny_model_factory("qwen3_5")
    prompts = random_prompts(20, 600, 600, 512, seed=21)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(llm):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    # All 20 in flight: the pool (about 7 requests) is full while most prompts prefill, so
    # their checkpoints (a hybrid hit needs one) reach the tiers through staging pages
    # (``core/capture_staging.py``), not the pool.
    kw = dict(dtype="float32", max_model_len=640, kv_cache_memory="3MiB", max_num_seqs=20,
              kv_offloading_dir=str(tmp_path), kv_offloading_disk_size="256MiB")
    llm = LLM(str(model), kv_offloading_size=0.05, **kw)
    first = run(llm)
    second = run(llm)
    total = sum(len(p) for p in prompts)
    assert all(o.num_cached_tokens == 0 for o in first)  # nothing shared: all computed
    assert _tokens(second) == _tokens(first)
    assert llm.engine.offload.stats.tokens_loaded >= 0.9 * total
    assert llm.engine.kv.pool.stats.evictions > 0
    assert llm.engine.kv.staging.staged > 0  # some checkpoints went through staging pages
    llm.engine.shutdown()
    llm.engine.kv.check_whole()

    again = LLM(str(model), **kw)  # disk only
    third = run(again)
    stats = again.engine.offload.stats
    assert _tokens(third) == _tokens(first)
    assert stats.tokens_loaded >= 0.9 * total and stats.loads_host == 0
    again.engine.kv.check_whole()
