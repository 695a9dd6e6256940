"""``python -m benchmarks.compare --sweep``: pagefold vs vLLM vs transformers over a grid of
model shapes, so that a change that helps one shape and hurts another shows.

    python -m benchmarks.compare --sweep --vllm-python /tmp/vllm-venv/bin/python
    python -m benchmarks.compare --sweep --quick ...           # 4 shapes, smaller workloads
    python -m benchmarks.compare --sweep --quick --shapes all  # every shape, smaller workloads
    python -m benchmarks.compare --sweep --real-model DIR ...  # + a trained checkpoint

Shapes (random weights, bf16): hidden 256-1024, 4-24 layers, GQA ratios 1-8, head_dim 64 and
128, dense (Qwen3), Gated DeltaNet hybrid (Qwen3.5), Mamba-2 hybrid (Nemotron-H) and MoE
(Qwen3-Next: GDN hybrid with sparse experts); ``--real-model`` appends a trained model
directory (SmolLM2-135M, once it is in the project). Workloads per shape (token ids generated
once, the same for every system; greedy, ``ignore_eos``):

* ``tput``: N prompts x 256 in, 64-128 out, all at once (output tok/s);
* ``b1``: batch-1 decode, requests one after another, 256 in (TPOT; bandwidth table);
* ``long``: 3,000+ token prompts, a few requests at once (output tok/s, TTFT dominated);
* ``sys``: a 1,000-token system prompt + 20-60 token questions: the first request alone,
  then the rest at once (wall time; prefix caching on in both engines);
* ``conv``: conversations x turns, each turn = previous prompt + the system's own answer +
  a new 20-60 token message (wall time; prefix caching on in both engines).

Ratios are pagefold's speed-ups over the best vLLM row (``vllm`` / ``vllm-r0``, whichever was
faster on that workload) and over transformers (``tput``, ``b1``, ``long``; it has no prefix
cache), with the geometric mean of each column. The bandwidth table divides the bytes one
batch-1 decode step reads by pagefold's TPOT, against a STREAM-like copy measured in the run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    hidden: int
    layers: int
    overrides: dict = field(default_factory=dict)
    big: bool = False  # smaller request counts for the slow shapes


def _attn(heads: int, kv: int, head_dim: int) -> dict:
    return dict(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)


# GQA ratio = heads / kv heads. Overrides go to benchmarks.common.bench_shape's config.
SHAPES = [
    Shape("dense-h256-l4-gqa2-d64", "qwen3", 256, 4),
    Shape("dense-h512-l8-gqa4-d128", "qwen3", 512, 8, _attn(4, 1, 128)),
    Shape("dense-h768-l12-gqa1-d64", "qwen3", 768, 12, _attn(12, 12, 64)),
    Shape("dense-h1024-l24-gqa8-d128", "qwen3", 1024, 24, _attn(16, 2, 128), big=True),
    Shape("dense-h1024-l16-gqa8-d64", "qwen3", 1024, 16, _attn(16, 2, 64), big=True),
    Shape("gdn-h256-l4", "qwen3_5", 256, 4),
    Shape("gdn-h512-l16-gqa4-d128", "qwen3_5", 512, 16, _attn(4, 1, 128)),
    Shape("gdn-h1024-l12", "qwen3_5", 1024, 12, big=True),
    Shape("mamba2-h512-l8", "nemotron_h", 512, 8),
    Shape("mamba2-h1024-l12-gqa8", "nemotron_h", 1024, 12, _attn(16, 2, 64), big=True),
    Shape("moe-h512-l8", "qwen3_next", 512, 8),
    # Issue 45's ~0.5B Qwen3.5-style hybrid (532M parameters, the llama_compare model): not in
    # the default grid (its tput cell alone takes minutes); ask for it with --shapes.
    Shape("gdn-h1024-l24-i5120", "qwen3_5", 1024, 24,
          dict(intermediate_size=5120, tie_word_embeddings=True, vocab_size=16384), big=True),
    # A Qwen3-Next-style MoE hybrid whose experts are many and wide enough that expert runs
    # take the grouped path's tile GEMV and oneDNN (the grid's moe-h512-l8 has 4 experts of
    # 32): 64 experts of 256, top 8, a shared expert of 512. Opt-in.
    Shape("moe-h1024-l12-e64", "qwen3_next", 1024, 12,
          dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
               shared_expert_intermediate_size=512), big=True),
    # A wider dense model (Qwen3-1.7B's layer: hidden 2,048, 16 heads of 128 over 8 kv heads,
    # MLP 6,144; 8 of its 28 layers, a 16k vocabulary: ~0.45B parameters): products with K up
    # to 6,144 and N up to 12,288, wider than any default shape's. Opt-in.
    Shape("dense-h2048-l8-i6144", "qwen3", 2048, 8,
          dict(_attn(16, 8, 128), intermediate_size=6144, vocab_size=16384), big=True),
]
OPT_IN = {"gdn-h1024-l24-i5120", "moe-h1024-l12-e64", "dense-h2048-l8-i6144"}
QUICK = ["dense-h512-l8-gqa4-d128", "gdn-h256-l4", "mamba2-h512-l8", "moe-h512-l8"]

# workload -> (requests, (in lo, in hi), (out lo, out hi), mode) at full size
WORK = {
    "tput": (32, (256, 256), (64, 128), False),
    "b1": (2, (256, 256), (96, 96), True),
    "long": (4, (3000, 3200), (32, 32), False),
    "sys": (16, (20, 60), (32, 32), "lead"),
    "conv": (8, (20, 60), (32, 32), "conv"),
}
SYSTEM_PROMPT, CONV_TURNS, CONV_OPENING = 1000, 4, (150, 250)
MAX_LEN = 4096


def _scaled(n: int, quick: bool, big: bool) -> int:
    return max(2, n // (2 if quick else 1) // (2 if big else 1))


def make_sweep_work(vocab: int, seed: int, quick: bool, big: bool) -> dict:
    """``{workload: (work, mode)}`` as ``benchmarks.compare._drive`` takes them."""
    out = {}
    for name, (n, (ilo, ihi), (olo, ohi), mode) in WORK.items():
        rng = random.Random(f"{name}-{seed}")

        def ids(k: int, rng: random.Random = rng) -> list[int]:
            return [rng.randrange(5, vocab) for _ in range(k)]

        n = n if name == "b1" else _scaled(n, quick, big)
        if name == "conv":
            work = {"first": [ids(rng.randint(*CONV_OPENING)) for _ in range(n)],
                    "msgs": [[ids(rng.randint(ilo, ihi)) for _ in range(n)]
                             for _ in range(CONV_TURNS - 1)],
                    "out": olo}
        elif name == "sys":
            system = ids(SYSTEM_PROMPT)
            work = [{"ids": system + ids(rng.randint(ilo, ihi)), "out": olo} for _ in range(n)]
        else:
            work = [{"ids": ids(rng.randint(ilo, ihi)), "out": rng.randint(olo, ohi)}
                    for _ in range(n)]
        out[name] = (work, mode)
    return out


def _gmean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def run_sweep(args, systems: list[str], run_one, tmp: Path) -> None:
    """``run_one(system, spec) -> worker result or None`` (compare.py's subprocess runner)."""
    from transformers import AutoConfig

    from benchmarks.common import bench_model
    from benchmarks.compare import decode_step_bytes, measure_bandwidth

    default = [s.name for s in SHAPES if s.name not in OPT_IN]
    wanted = QUICK if args.quick else default
    if args.shapes:
        wanted = default if args.shapes == ["all"] else args.shapes
    # --row-workloads vllm=b1: that row runs only those workloads (see compare.py's --help).
    rows_only = {k: v.split(",") for k, v in (x.split("=", 1) for x in args.row_workloads or [])}
    shapes = [s for s in SHAPES if s.name in wanted]
    models = [(s.name, str(bench_model(s.arch, s.hidden, s.layers, **s.overrides)), s.big)
              for s in shapes]
    if args.real_model:  # a trained checkpoint: a directory, or "smollm2" (the shipped one)
        real = args.real_model
        if real == "smollm2":
            from pagefold.models.smollm2 import smollm2_checkpoint

            real = str(smollm2_checkpoint())
        models.append((f"real:{Path(real).name}", real, False))
    rows, bw_rows, raw = [], [], []
    for name, model, big in models:
        vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
        work = make_sweep_work(vocab, args.seed, args.quick, big)
        if args.sweep_workloads:
            work = {w: v for w, v in work.items() if w in args.sweep_workloads}
        spec = {"model": model, "max_len": MAX_LEN, "work": work}
        print(f"{name}: {model}", flush=True)
        got: dict[str, dict] = {}
        for _ in range(args.repeat):
            for system in systems:
                only = rows_only.get(system)
                r = run_one(system, spec if only is None else dict(
                    spec, work={w: v for w, v in spec["work"].items() if w in only}))
                if r is None:
                    continue
                if system == "pagefold":
                    measure_bandwidth(r)
                keep = got.setdefault(system, r)
                for w, res in r["results"].items():
                    old = keep["results"].get(w)
                    if old is None or res["seconds"] < old["seconds"]:
                        keep["results"][w] = res
        row = {"shape": name}
        for w in WORK:
            res = {s: r["results"].get(w) for s, r in got.items() if w in r["results"]}
            pf = res.get("pagefold")
            vl = [v for s, v in res.items() if s.startswith("vllm")]
            hf = res.get("transformers")
            base = res.get("pagefold-base")
            if pf is None:
                continue
            if base:  # this tree against another revision (--base): > 1, this tree faster
                key = "tpot" if w == "b1" else "seconds"
                row[f"{w} /base"] = base[key] / pf[key] if base[key] and pf[key] else None
            if w == "b1":  # decode speed: TPOT
                best = min((v["tpot"] for v in vl if v["tpot"]), default=None)
                row["b1 TPOT ms"] = pf["tpot"] * 1e3
                row["b1 /vLLM"] = best / pf["tpot"] if best else None
                row["b1 /HF"] = hf["tpot"] / pf["tpot"] if hf and hf["tpot"] else None
                nbytes = decode_step_bytes(model, WORK["b1"][1][1] + WORK["b1"][2][1] // 2)
                copy, rd = got["pagefold"]["copy_gbps"], got["pagefold"]["read_gbps"]
                ach = nbytes / pf["tpot"] / 1e9
                bw_rows.append({"shape": name, "MB/step": nbytes / 1e6,
                                "TPOT ms": pf["tpot"] * 1e3, "GB/s": ach, "copy GB/s": copy,
                                "% of copy": 100 * ach / copy, "read GB/s": rd,
                                "% of read": 100 * ach / rd,
                                "vLLM TPOT ms": best * 1e3 if best else None})
            else:  # whole-workload wall time (same tokens for every system)
                best = min((v["seconds"] for v in vl), default=None)
                row[f"{w} /vLLM"] = best / pf["seconds"] if best else None
                if w in ("tput", "long") and hf:
                    row[f"{w} /HF"] = hf["seconds"] / pf["seconds"]
        rows.append(row)
        # Each shape's row as soon as it is measured (a long sweep that stops keeps them), and
        # the seconds behind its ratios: a ratio alone cannot say which side moved.
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), flush=True)
        for system, r in got.items():
            for w, res in r["results"].items():
                raw.append({"shape": name, "system": system, "workload": w,
                            "seconds": res["seconds"], "ttft": res.get("ttft"),
                            "tpot": res.get("tpot")})
                print(f"  {system} {w}: {res['seconds']:.2f} s"
                      + (f", TTFT {res['ttft'] * 1e3:.0f} ms" if res.get("ttft") else "")
                      + (f", TPOT {res['tpot'] * 1e3:.1f} ms" if res.get("tpot") else ""),
                      flush=True)
        _report(args, rows, bw_rows, raw, final=False)
    _report(args, rows, bw_rows, raw, final=True)


def _report(args, rows: list[dict], bw_rows: list[dict], raw: list[dict], final: bool) -> None:
    """The tables (``final``) and ``--json`` (after every shape)."""
    from benchmarks.common import print_table

    cols = ["shape", "tput /vLLM", "b1 /vLLM", "long /vLLM", "sys /vLLM", "conv /vLLM",
            "tput /HF", "b1 /HF", "long /HF", "tput /base", "b1 /base", "long /base",
            "sys /base", "conv /base", "b1 TPOT ms"]
    cols = [c for c in cols if any(r.get(c) for r in rows)]
    gm = {"shape": "geometric mean"}
    for c in cols[1:]:
        if c != "b1 TPOT ms":
            gm[c] = _gmean([r.get(c) for r in rows])
    worst = {"shape": "worst cell"}
    for c in cols[1:]:
        if c != "b1 TPOT ms":
            vals = [r[c] for r in rows if r.get(c)]
            worst[c] = min(vals) if vals else None
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"sweep": rows, "geomean": gm, "worst": worst,
                                               "bandwidth": bw_rows, "raw": raw},
                                              indent=1))
    if not final:
        return
    print("\nsweep: pagefold's speed-up (> 1: faster) over the best vLLM row and transformers;"
          " wall time of the same tokens (tput, long, sys, conv), TPOT (b1)")
    print_table(rows + [gm, worst], cols)
    print("\nbatch-1 decode: bytes per step / pagefold's TPOT vs a STREAM-like copy")
    print_table(bw_rows, ["shape", "MB/step", "TPOT ms", "GB/s", "copy GB/s", "% of copy",
                          "read GB/s", "% of read",
                          "vLLM TPOT ms"])
