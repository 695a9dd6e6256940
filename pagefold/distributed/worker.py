"""One tensor-parallel rank (of one pipeline stage): a model shard, its share of every cache
page, and a runner.

The engine process starts ``size`` of these (``executor.py``) and sends each the same step
message; every rank applies it to its own request state and runs the forward, whose
collectives (all-reduce after row-parallel layers, vocabulary gathers) go over
``torch.distributed``. Under pipeline parallelism a rank builds only its stage's layers over
its stage's pool and hands its hidden states on to the next stage (``layers/decoder_stack``).
Tensor-parallel rank 0 of the last stage alone samples and answers with the tokens
(``sampling_rank``); the other ranks answer ``None``. A rank that fails answers with the error
text and exits. Under pipeline parallelism a rank reads the engine's messages ahead
(``read_ahead``): several are in flight, each answered in turn.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagefold.checkpoint import load_hf_config
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import LayerSpec
from pagefold.csrc import gemv_choice
from pagefold.distributed.parallel_state import (
    close_tensor_parallel,
    init_tensor_parallel,
    set_expert_parallel,
    set_pipeline_stage,
)
from pagefold.executor.model_runner import ModelRunner
from pagefold.executor.runner_builder import build_runner
from pagefold.lora.manager import LoRAModelManager
from pagefold.offload.setup import OffloadPlan, build_store
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.proposers import build_proposer
from pagefold.transfer.setup import TransferPlan, build_transfer_worker

logger = logging.getLogger("pagefold")


@dataclass(frozen=True)
class WorkerInit:
    """Everything a rank needs to build its shard (plain data: it crosses a process start)."""

    model: str
    arch: str
    dtype: torch.dtype
    max_positions: int
    device: str
    kv_config: KVCacheConfig
    cache_fill: float | None
    num_host_blocks: int
    threads: int
    warm_up_tokens: int
    warm_up_seq_len: int
    quantization: str | None = None  # the quantization option (see ``load_model``)
    cpu_gemv_kernel: str | None = None  # EngineConfig's, for this rank's process
    offload: OffloadPlan | None = None  # offload tiers: this rank keeps its shard of them
    expert_parallel: bool = False  # enable_expert_parallel: whole experts on the ranks
    pipeline_parallel_size: int = 1
    # Per stage: its decoder layers [start, end) and its pool (``plan_stages``); empty at 1.
    stage_layers: tuple[tuple[int, int], ...] = ()
    stage_kv_configs: tuple[KVCacheConfig, ...] = ()
    transfer: TransferPlan | None = None  # P/D: this rank exports / pulls its shard
    lora: tuple[int, int, int] | None = None  # (max_loras, max_lora_rank, max_cpu_loras)
    # Speculation with a draft model: each rank builds its shard of the draft (proposers.py).
    speculative: SpeculativeConfig | None = None
    spec_specs: dict[str, LayerSpec] = field(default_factory=dict)


def sampling_rank(world: int, pipeline_parallel_size: int) -> int:
    """The global rank that samples: tensor-parallel rank 0 of the last stage."""
    return world - world // pipeline_parallel_size


def build_rank_runner(init: WorkerInit, rank: int = 0, stage: int = 0) -> ModelRunner:
    """This rank's runner (``executor/runner_builder``, as the engine builds it at TP 1),
    over its pipeline ``stage``'s pool, warmed up when ``init`` asks."""
    _, hf_config = load_hf_config(init.model)
    gemv_choice.set_forced(init.cpu_gemv_kernel)  # before the linears are routed
    kv_config = init.stage_kv_configs[stage] if init.stage_kv_configs else init.kv_config
    runner = build_runner(init.model, hf_config, init.arch, init.dtype, init.max_positions,
                          torch.device(init.device), kv_config,
                          cache_fill=init.cache_fill, num_host_blocks=init.num_host_blocks,
                          quantization=init.quantization)
    if init.lora is not None:  # this rank's slots, its own host cache (read by path)
        max_loras, rank_max, cpu = init.lora
        runner.lora = LoRAModelManager(runner.model, max_loras=max_loras,
                                       max_lora_rank=rank_max, max_cpu_loras=cpu)
    runner.proposer = build_proposer(init.speculative, init.model, runner.model, hf_config,
                                     init.dtype, init.max_positions, torch.device(init.device),
                                     init.spec_specs)
    if init.offload is not None:
        build_store(init.offload, runner, rank)
    if init.transfer is not None:
        build_transfer_worker(init.transfer, runner, rank)
    if init.warm_up_tokens:
        runner.warm_up(init.warm_up_tokens, init.warm_up_seq_len)
    return runner


def read_ahead(conn) -> Callable[[], bytes]:
    """A reader thread that takes the engine's messages off ``conn`` as they come; returns the
    call that hands them out in order (``b""`` once the engine is gone).

    Under pipeline parallelism the engine sends message k+1 while this rank still runs k; were
    both that message and this rank's answer to k larger than the socket's buffer, each side
    would block in its send. Reading ahead keeps the engine's sends from ever waiting on us."""
    inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def pump() -> None:
        try:
            while True:
                data = conn.recv_bytes()
                inbox.put(data)
                if not data:
                    return
        except (EOFError, OSError):
            inbox.put(b"")

    threading.Thread(target=pump, name="pagefold-step-reader", daemon=True).start()
    return inbox.get


def worker_main(rank: int, size: int, conn) -> None:
    """Serve one rank: read the ``WorkerInit``, join the group, build the shard, then run the
    step messages until an empty message (or the engine's end of the connection)."""
    runner = None
    try:
        init: WorkerInit = conn.recv()
        torch.set_num_threads(max(1, init.threads))
        backend = "nccl" if init.device.startswith("cuda") else "gloo"
        pp = init.pipeline_parallel_size
        tp = size // pp
        init_tensor_parallel(rank, tp, backend, pipeline_size=pp)
        set_expert_parallel(init.expert_parallel)
        stage = rank // tp
        if pp > 1:
            set_pipeline_stage(stage, pp, init.stage_layers[stage])
        runner = build_rank_runner(init, rank, stage)
        sampler = sampling_rank(size, pp)
        pool = {"num_blocks": runner.kv_config.num_blocks,
                "pool_bytes": sum(t.numel() * t.element_size() for t in runner.cache.shared)}
        conn.send(("ready", runner.weight_elements, pool, runner.captures_in_kernel,
                   runner.encoders is not None))
        recv = read_ahead(conn) if pp > 1 else conn.recv_bytes
        while True:
            data = recv()
            if not data:
                break
            out = pickle.loads(data)
            sampled = runner.execute(out)
            # Every rank reports its KV connector work (a page may be bad on one rank only).
            report = getattr(sampled, "kv_connector_output", None)
            conn.send(("ok", sampled if rank == sampler else None, runner.num_forward_tokens,
                       report))
    except EOFError:
        pass  # the engine went away
    except BaseException as e:  # noqa: BLE001 - report every failure to the engine, then exit
        try:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if runner is not None and runner.connector is not None:
            runner.connector.close()  # queued disk writes land before the rank exits
        try:
            close_tensor_parallel()
        except Exception:  # noqa: BLE001
            pass


def main() -> None:
    """``python -m pagefold.distributed.worker ADDRESS RANK SIZE``; the authentication key
    comes in ``PAGEFOLD_TP_AUTHKEY`` (hex), the rendezvous in the ``env://`` variables."""
    import sys
    from multiprocessing.connection import Client

    address, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    logging.basicConfig(level=os.environ.get("PAGEFOLD_LOG_LEVEL", "WARNING"))
    conn = Client(address, family="AF_UNIX",
                  authkey=bytes.fromhex(os.environ.pop("PAGEFOLD_TP_AUTHKEY")))
    conn.send(rank)
    worker_main(rank, size, conn)


if __name__ == "__main__":
    main()
