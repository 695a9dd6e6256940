"""Data parallelism: the load balancer's rules, then two engine cores behind one client."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagefold.config import EngineConfig
from pagefold.engine.client import EngineDeadError
from pagefold.engine.dp_client import DPEngineClient, LoadBalancer, ReplicaLoad
from pagefold.sampling_params import SamplingParams
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.tiny_models import random_prompts


def _loads(*busy: int, usage: tuple[float, ...] = ()) -> list[ReplicaLoad]:
    usage = usage or (0.0,) * len(busy)
    return [ReplicaLoad(in_flight=b, kv_usage=u) for b, u in zip(busy, usage)]


def test_least_loaded_then_kv_usage():
    lb = LoadBalancer(3, block_size=4)
    assert lb.pick([1, 2, 3], _loads(2, 0, 1)) == 1
    assert lb.pick([9, 8, 7], _loads(1, 1, 1, usage=(0.5, 0.2, 0.9))) == 1
    # waiting requests count as load too
    loads = _loads(0, 0)
    loads[0].waiting = 3
    assert LoadBalancer(2).pick([5], loads) == 1


def test_prefix_goes_where_it_was_served_unless_that_replica_is_much_busier():
    lb = LoadBalancer(2, block_size=4, prefix_slack=2)
    shared = list(range(100, 120))
    first = lb.pick(shared + [1, 2], _loads(0, 1))
    assert first == 0
    # Same prefix, replica 0 slightly busier: the prefix wins.
    assert lb.pick(shared + [3, 4], _loads(2, 0)) == 0
    # Replica 0 far busier: load wins, and the prefix now also lives on replica 1.
    assert lb.pick(shared + [5, 6], _loads(5, 0)) == 1
    assert lb.pick(shared + [7], _loads(1, 1)) == 1
    # A prompt shorter than one block plus a token has no prefix to follow.
    assert lb.pick([100, 101, 102], _loads(1, 0)) == 1


def test_prefix_memory_is_bounded():
    lb = LoadBalancer(2, block_size=2, max_prefixes=5)
    for i in range(20):
        lb.pick([i, i + 1, i + 2, i + 3, i + 4], _loads(0, 0))
    assert len(lb._owner) == 5


@pytest.mark.slow
def test_two_replicas_serve_exactly_and_a_dead_one_is_an_error(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    prompts = random_prompts(6, 5, 40, 500, seed=11)
    ref = hf_greedy(model_dir, prompts, 6)
    from pagefold.checkpoint import load_tokenizer

    config = EngineConfig(model=str(model_dir), max_model_len=128, kv_cache_memory=1 << 22,
                          warm_up=False)
    client = DPEngineClient(config, 2, load_tokenizer(str(model_dir)), log_level="WARNING")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        await client.start()
        try:
            async def one(i: int):
                last = None
                async for out in client.generate(None, prompts[i], params, request_id=f"r{i}"):
                    last = out
                return last.outputs[0].token_ids

            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            stats = await client.utility("pool_stats")
            os.kill(client.core_pids[1], signal.SIGKILL)
            await asyncio.sleep(1.0)
            with pytest.raises(EngineDeadError, match="replica 1"):
                async for _ in client.generate(None, prompts[0], params, request_id="late"):
                    pass
            return got, stats
        finally:
            await client.shutdown()

    got, stats = asyncio.run(run())
    assert got == ref
    assert client.routed[0] > 0 and client.routed[1] > 0  # both replicas served
    assert stats["whole"] and len(stats["replicas"]) == 2
