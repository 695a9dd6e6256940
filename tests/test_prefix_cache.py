"""Prefix caching: exactness with the cache on and off, hybrid hit rates, pool invariants."""

from __future__ import annotations

import random

import pytest

from pagefold import LLM, SamplingParams
from pagefold.core.block_pool import BlockPool
from pagefold.core.prefix_cache import hash_block, root_hash, update_block_hashes
from pagefold.request import Request
from pagefold.testing.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# ---------------------------------------------------------------------------- unit level
def test_hash_chain_names_the_whole_prefix():
    a = Request("a", list(range(40)), GREEDY)
    b = Request("b", list(range(40)), GREEDY)
    c = Request("c", [99] + list(range(1, 40)), GREEDY)
    ha, hb, hc = (update_block_hashes(r, 16) for r in (a, b, c))
    assert len(ha) == 2 and ha == hb
    assert hc[0] != ha[0] and hc[1] != ha[1]  # a change in block 0 changes every later hash
    salted = Request("d", list(range(40)), GREEDY, extra_keys=("salt",))
    assert update_block_hashes(salted, 16)[0] != ha[0]
    assert ha[0] == hash_block(root_hash(), list(range(16)))
    a.append_token(7)  # 41 tokens: still two full blocks
    assert len(update_block_hashes(a, 16)) == 2


def test_pool_keeps_cached_blocks_until_needed_and_evicts_by_score():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.cache(("a",), [blocks[0]], saved_tokens=16)
    pool.cache(("ckpt",), blocks[1:3], saved_tokens=400, is_checkpoint=True)
    pool.free(blocks)
    assert pool.num_free == 5  # cached blocks count as free
    # Plain blocks go first; then the entry saving the least per page (the attention block).
    got = pool.allocate(2)
    assert {b.block_id for b in got}.isdisjoint({b.block_id for b in blocks})
    assert ("a",) in pool.entries and ("ckpt",) in pool.entries
    more = pool.allocate(1)
    assert more[0] is blocks[0] and ("a",) not in pool.entries
    assert ("ckpt",) in pool.entries and pool.stats.evictions == 1
    pool.free(got + more)
    pool.check_whole()


def test_hit_on_free_entry_removes_it_from_eviction():
    pool = BlockPool(4)
    b = pool.allocate(1)
    pool.cache(("x",), b, saved_tokens=16)
    pool.free(b)
    pool.touch([pool.lookup(("x",))])  # a prefix hit revives it
    assert pool.num_free == 2
    rest = pool.allocate(2)
    assert pool.lookup(("x",)) is b[0]  # not evicted while held
    pool.free(rest + b)
    pool.check_whole()


# ---------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "nemotron_h"])
def test_cache_on_off_identical_and_second_pass_hits(arch, tiny_model_factory, random_prompts):
    model = tiny_model_factory(arch)
    prompts = random_prompts(16, 5, 90, 512, seed=3)
    ref = hf_greedy(model, prompts, 10)
    off = LLM(str(model), enable_prefix_caching=False, max_num_batched_tokens=33)
    assert _ids(_run(off, prompts)) == ref
    off.engine.kv.check_whole()
    on = LLM(str(model), max_num_batched_tokens=33)
    first = _run(on, prompts)
    second = _run(on, prompts)
    assert _ids(first) == ref and _ids(second) == ref
    assert all(o.num_cached_tokens == 0 for o in first)
    for p, o in zip(prompts, second):  # every prompt hits up to its last full block
        assert o.num_cached_tokens == ((len(p) - 1) // 16) * 16
    if arch != "qwen3":
        n_ckpt, _ = on.engine.kv.pool.checkpoint_stats()
        assert n_ckpt > 0 and on.engine.kv.pool.stats.checkpoint_hits > 0
    on.engine.kv.check_whole()


def test_hybrid_shared_system_prompt_and_conversation(qwen3_5_dir):
    rng = random.Random(0)
    system = [rng.randrange(5, 512) for _ in range(500)]
    llm = LLM(str(qwen3_5_dir), max_model_len=2048, kv_cache_memory="64MiB")
    cached = []
    for _ in range(5):
        q = [rng.randrange(5, 512) for _ in range(rng.randint(10, 40))]
        cached.append(_run(llm, [system + q])[0].num_cached_tokens)
    assert cached[0] == 0
    assert all(c >= 0.9 * 500 for c in cached[1:]), cached  # from the second request on
    # Second turn: previous prompt + answer + new message reuses the whole previous turn up to
    # its last 16-token boundary (the answer's last token is never computed, hence the - 1).
    conv = [rng.randrange(5, 512) for _ in range(300)]
    first = _run(llm, [conv], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    turn2 = conv + first.outputs[0].token_ids + [rng.randrange(5, 512) for _ in range(30)]
    prev = len(conv) + len(first.outputs[0].token_ids)
    assert _run(llm, [turn2])[0].num_cached_tokens == ((prev - 1) // 16) * 16
    stats = llm.engine.kv.stats
    assert stats.hits > 0 and 0 < stats.hit_rate < 1
    llm.engine.kv.check_whole()


@pytest.mark.slow
def test_hybrid_1500_700_split_hits_concurrently(qwen3_5_dir):
    rng = random.Random(1)
    shared = [rng.randrange(5, 512) for _ in range(1500)]
    prompts = [shared + [rng.randrange(5, 512) for _ in range(700)] for _ in range(64)]
    llm = LLM(str(qwen3_5_dir), max_model_len=4096, kv_cache_memory="256MiB")
    outs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 60
    assert min(o.num_cached_tokens for o in outs[1:]) >= 1024
    llm.engine.kv.check_whole()


def test_full_pool_evicts_cache_before_preempting(qwen3_5_dir, random_prompts):
    prompts = random_prompts(12, 60, 90, 512, seed=5)
    llm = LLM(str(qwen3_5_dir), kv_cache_memory=200_000, max_model_len=128)
    usable = llm.engine.kv.pool.num_usable
    for p in prompts:  # one at a time: each alone fits, their cached leftovers do not
        assert _ids(_run(llm, [p])) == hf_greedy(qwen3_5_dir, [p], 10)
        assert llm.engine.kv.pool.num_free == usable  # cached entries count as free
    pool = llm.engine.kv.pool
    assert pool.entries and pool.stats.evictions > 0
    assert llm.engine.scheduler.num_preemptions == 0
    llm.engine.kv.check_whole()
