"""pagefold against llama.cpp on the same weights, batch 1: decode and prompt speed, in turn.

    python -m benchmarks.llama_compare --llama-python /tmp/llama-venv/bin/python
    python -m benchmarks.llama_compare --llama-python ... --models smollm2 --rounds 5
    python -m benchmarks.llama_compare --llama-python ... --models qwen3_5-h1024-l24-i5120

One command, conversion included. Models:

* ``smollm2``: the trained SmolLM2-135M-Instruct; pagefold reads its bf16 conversion and
  llama.cpp the shipped Q4_1 GGUF requantized to bf16 (``llama_model_quantize``): the same
  weights. ``--q4``: both engines also run the shipped Q4_1 file itself (pagefold keeps it
  quantized); ``--quant q8_0 q4_0``: both run that file as llama.cpp's quantizer writes it
  from the bf16 requantization (rows ``pagefold-q8_0`` / ``llama.cpp-q8_0``, the ratio
  against llama.cpp on the same file). A llama.cpp worker that crashes is reported as such,
  the other rows kept (llama-cpp-python 0.3.36 segfaults on every quantized file on an AMX
  Xeon unless ``--no-extra-bufts`` turns its CPU repack buffers off).
* ``ARCH-hH-lL[-iI][-eE]``: a random model built from a config (``benchmarks.common.bench_model``:
  hybrids 3 Gated DeltaNet layers to 1 attention, ``-iI`` the MLP width, ``-eE`` (Qwen3-Next)
  E experts of H / 4, top 8, a shared expert of H / 2; 16k tied vocabulary),
  converted to a bf16 GGUF by llama.cpp's own ``convert_hf_to_gguf.py``. The converter comes
  from the llama-cpp-python source package (``vendor/llama.cpp``), fetched once with
  ``pip download`` and kept under the pagefold cache; it runs under this interpreter (it needs
  torch and transformers) with the vendored ``gguf-py`` first on the path. Its pre-tokenizer
  table does not know a locally trained tokenizer, so it is told ``default``.

Each (system, model, round) is its own subprocess, one after another, the order flipping every
round so the neighbours' load falls on both. A worker runs batch 1, greedy, EOS ignored:
``--requests`` prompts of 16 tokens decoding ``--out`` tokens (decode tok/s = tokens after the
first / time after the first), then one prompt of ``--prompt-len`` tokens (prompt tok/s =
prompt tokens / time to its first token). Both use 2 threads unless ``--threads``.

Columns: medians over the rounds, ``ratio`` = pagefold / llama.cpp per round (min-max, then the
median), ``of read`` = bytes a decode step reads (pagefold: every weight but the untied input
table; llama.cpp: the GGUF's tensor bytes) times tok/s over the read bandwidth (a 2-thread sum
of a 512 MiB buffer) measured right after each worker exits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
MODELS = ("smollm2", "qwen3_5-h1024-l24-i5120", "qwen3_5-h256-l4", "qwen3_next-h256-l4")
VOCAB = 16384  # the locally trained tokenizer reaches ~20k tokens on its corpus


# ----------------------------------------------------------------------------- workers
def _prompts(spec: dict) -> tuple[list[list[int]], list[int]]:
    v = spec["vocab"]
    short = [[(97 * i + 31 * j) % (v - 10) + 5 for j in range(16)]
             for i in range(spec["requests"])]
    long = [(13 * j + 7) % (v - 10) + 5 for j in range(spec["prompt_len"])]
    return short, long


def worker_pagefold(spec: dict) -> dict:
    import torch

    from benchmarks.decode_b1 import step_bytes
    from pagefold import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["model"], dtype="bfloat16", max_model_len=spec["prompt_len"] + 512,
              kv_cache_memory=1 << 30, seed=0, enable_prefix_caching=False)
    short, long = _prompts(spec)

    def run(ids: list[int], n: int) -> tuple[float, float, int]:
        llm.add_request({"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        first = None
        got = 0
        while llm.engine.has_unfinished():
            for o in llm.step():
                got = len(o.outputs[0].token_ids) if o.outputs else 0
                if first is None and got:
                    first = time.perf_counter()
        return first - t0, time.perf_counter() - first, got

    run(short[0], 8)  # warm-up
    dec = [run(ids, spec["out"]) for ids in short]
    ttft, _, _ = run(long, 1)
    return {"decode": sum(r[2] - 1 for r in dec) / sum(r[1] for r in dec),
            "prompt": len(long) / ttft, "bytes": step_bytes(llm)}


def worker_llamacpp(spec: dict) -> dict:
    import llama_cpp
    import llama_cpp.llama
    from llama_cpp import Llama

    if spec.get("no_extra_bufts"):  # the CPU repack buffers off (see --no-extra-bufts)
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    threads = spec["threads"]
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["prompt_len"] + 512, n_batch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    short, long = _prompts(spec)

    def run(ids: list[int], n: int) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        first, got = 0.0, 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got += 1
            if got == 1:
                first = time.perf_counter()
            if got >= n:
                break
        return first - t0, time.perf_counter() - first, got

    run(short[0], 8)
    dec = [run(ids, spec["out"]) for ids in short]
    ttft, _, _ = run(long, 1)
    return {"decode": sum(r[2] - 1 for r in dec) / sum(r[1] for r in dec),
            "prompt": len(long) / ttft, "bytes": gguf_tensor_bytes(spec["gguf"])}


def gguf_tensor_bytes(path: str) -> int:
    """The GGUF's size: its tensors plus a header and metadata of a few hundred KB at most,
    within the noise of a bandwidth figure."""
    return os.path.getsize(path)


# ----------------------------------------------------------------------------- models
def cache_root() -> Path:
    from pagefold.entrypoints.cli import default_cache_dir

    return default_cache_dir() / "bench"


def hf_model(name: str) -> Path:
    if name == "smollm2":
        from pagefold.models.smollm2 import smollm2_checkpoint

        return Path(smollm2_checkpoint())
    from benchmarks.common import bench_model

    parts = name.split("-")
    arch, hidden, layers = parts[0], int(parts[1][1:]), int(parts[2][1:])
    over: dict = {"vocab_size": VOCAB, "tie_word_embeddings": True}
    for part in parts[3:]:
        if part[0] == "i":
            over["intermediate_size"] = int(part[1:])
        elif part[0] == "e":  # MoE: E experts of hidden / 4, top 8, a shared expert of hidden / 2
            over.update(num_experts=int(part[1:]), num_experts_per_tok=8,
                        moe_intermediate_size=hidden // 4,
                        shared_expert_intermediate_size=hidden // 2)
        else:
            raise SystemExit(f"unknown model part {part!r} in {name!r} (iI: MLP width, eE: "
                             "experts)")
    return bench_model(arch, hidden, layers, **over)


def converter(llama_python: str) -> Path:
    """llama.cpp's ``vendor/llama.cpp`` from the llama-cpp-python source package (once)."""
    root = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    if (root / "conversion").is_dir():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([llama_python, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
                       check=True, stdout=subprocess.DEVNULL)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            top = tf.getnames()[0].split("/")[0]
            prefix = f"{top}/vendor/llama.cpp/"
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)
                       and (m.name == prefix + "convert_hf_to_gguf.py"
                            or m.name.startswith((prefix + "gguf-py/", prefix + "conversion/")))]
            tf.extractall(tmp, members=members, filter="data")
        part = root.with_name(root.name + f".tmp-{os.getpid()}")
        os.replace(Path(tmp) / top / "vendor" / "llama.cpp", part)
        os.replace(part, root)
    return root


_CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
import convert_hf_to_gguf as c
from conversion.base import TextModel
# A locally trained tokenizer's hash is in no table: it splits text as the default one does.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
c.main()
"""


def bf16_gguf(name: str, llama_python: str) -> Path:
    if name == "smollm2":
        from benchmarks.compare import smollm2_ggufs

        return Path(smollm2_ggufs(llama_python)["llamacpp-bf16"])
    src = hf_model(name)
    out = src.with_name(src.name + ".bf16.gguf")
    if out.exists():
        return out
    root = converter(llama_python)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "gguf-py")]))
    # Qwen3.5 / Qwen3-Next classes expect multi-token-prediction layers unless told none.
    no_mtp = ["--no-mtp"] if name.startswith(("qwen3_5", "qwen3_next")) else []
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), "--outtype", "bf16",
                    "--outfile", str(tmp), *no_mtp], env=env, check=True, cwd=str(root),
                   stdout=subprocess.DEVNULL)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------- driver
def run_worker(system: str, python: str, spec: dict, tmp: Path) -> dict | None:
    out = tmp / f"{system}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    fn = "worker_pagefold" if system == "pagefold" else "worker_llamacpp"
    code = (f"import json,sys; from benchmarks.llama_compare import {fn} as w; "
            f"json.dump(w(json.loads(sys.argv[1])), open({str(out)!r}, 'w'))")
    proc = subprocess.run([python, "-c", code, json.dumps(spec)], env=env, cwd=str(REPO))
    if proc.returncode != 0:
        if system == "pagefold":
            raise subprocess.CalledProcessError(proc.returncode, proc.args)
        return None  # llama.cpp crashed (reported in the table)
    res = json.loads(out.read_text())
    from benchmarks.compare import stream_read_gbps

    res["read_gbps"] = stream_read_gbps(spec["threads"])
    return res


def _quantized_systems(args, spec: dict) -> list[tuple[str, str, dict]]:
    """SmolLM2's quantized rows: the shipped Q4_1 (``--q4``) and llama.cpp's own
    quantizations (``--quant``), each file run by both engines."""
    files = {}
    if args.q4:
        from pagefold.models.smollm2 import smollm2_gguf

        files["q4_1"] = str(smollm2_gguf())
    from benchmarks.compare import smollm2_requantized

    for kind in args.quant:
        files[kind] = smollm2_requantized(args.llama_python, kind)
    out = []
    for kind, path in files.items():
        out += [(f"pagefold-{kind}", sys.executable, dict(spec, model=path)),
                (f"llama.cpp-{kind}", args.llama_python, dict(spec, gguf=path))]
    return out


def _rows(name: str, got: dict[str, list[dict | None]]) -> list[dict]:
    """A row per system: medians over its rounds, and for pagefold rows the ratios per round
    against llama.cpp on the same file (bf16 for ``pagefold``)."""
    rows = []
    for system, runs in got.items():
        ok = [x for x in runs if x]
        row: dict = {"model": name, "system": system}
        if len(ok) < len(runs):
            row["note"] = f"crashed in {len(runs) - len(ok)} of {len(runs)} rounds"
        if ok:
            row.update({"decode tok/s": statistics.median(x["decode"] for x in ok),
                        "prompt tok/s": statistics.median(x["prompt"] for x in ok),
                        "of read": statistics.median(x["bytes"] * x["decode"] / 1e9
                                                     / x["read_gbps"] for x in ok)})
        if system.startswith("pagefold"):
            base = got[system.replace("pagefold", "llama.cpp", 1)]
            pairs = [(a, b) for a, b in zip(runs, base) if a and b]
            if pairs:
                row["decode ratio"] = _span([a["decode"] / b["decode"] for a, b in pairs])
                row["prompt ratio"] = _span([a["prompt"] / b["prompt"] for a, b in pairs])
        rows.append(row)
    return rows


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f} (med {statistics.median(xs):.2f})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", required=True,
                   help="python of a venv with llama-cpp-python (see benchmarks/README.md)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--out", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--q4", action="store_true",
                   help="smollm2: both engines also on the shipped Q4_1 GGUF")
    p.add_argument("--no-extra-bufts", action="store_true",
                   help="llama.cpp without its CPU repack buffers (use_extra_bufts = false): "
                        "with them llama-cpp-python 0.3.36 segfaults on every quantized file "
                        "on an AMX Xeon (bf16 runs)")
    p.add_argument("--quant", nargs="+", default=[], metavar="TYPE",
                   help="smollm2: both engines also on llama.cpp's quantization to TYPE "
                        "(q8_0, q4_0, ...)")
    args = p.parse_args(argv)

    from pagefold.csrc import cpu_ops  # noqa: F401 - import check before minutes of work

    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.models:
            cfg = json.loads((hf_model(name) / "config.json").read_text())
            vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
            spec = {"model": str(hf_model(name)), "gguf": str(bf16_gguf(name, args.llama_python)),
                    "vocab": int(vocab), "requests": args.requests, "out": args.out,
                    "prompt_len": args.prompt_len, "threads": args.threads,
                    "no_extra_bufts": args.no_extra_bufts}
            systems = [("pagefold", sys.executable, spec),
                       ("llama.cpp", args.llama_python, spec)]
            if name == "smollm2":
                systems += _quantized_systems(args, spec)
            got: dict[str, list[dict | None]] = {s[0]: [] for s in systems}
            for r in range(args.rounds):
                order = systems if r % 2 == 0 else systems[::-1]
                for system, python, sp in order:
                    res = run_worker(system.split("-")[0], python, sp, tmp)
                    got[system].append(res)
                    print(f"{name} round {r + 1} {system}: " + (
                        f"decode {res['decode']:.1f} tok/s, prompt {res['prompt']:.1f} tok/s, "
                        f"read {res['read_gbps']:.1f} GB/s" if res else "crashed"), flush=True)
            rows += _rows(name, got)
    from benchmarks.common import print_table

    print()
    print_table(rows, ["model", "system", "decode tok/s", "prompt tok/s", "of read",
                       "decode ratio", "prompt ratio", "note"])


if __name__ == "__main__":
    main()
