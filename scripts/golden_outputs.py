"""Greedy tokens and logprobs on every architecture, for before/after comparisons of a refactor.

    python scripts/golden_outputs.py --out before.json           # at the old commit
    python scripts/golden_outputs.py --out after.json            # at the new one
    python scripts/golden_outputs.py --compare before.json after.json

Each case builds a tiny random model (``pagefold.testing.tiny_models``, every architecture, plus
the sweep's hybrid shapes at reduced depth) and runs ``LLM.generate`` greedily with top-5
logprobs in bfloat16 (the compiled CPU paths: native decode steps, GEMV, state kernels) and in
float32 (the module path), over batches that mix prefill chunks at an odd budget, decode rows
and prefix-cache hits. The comparison demands bit equality: the same token ids and the same
logprob floats (``float.hex``), case by case; a case only the second file has (an architecture
added in between) is listed as new, not counted as a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Run from the checkout under test (PYTHONPATH=$PWD): its pagefold and benchmarks are used.
sys.path.insert(0, os.getcwd())

# (name, arch, overrides): the tiny test models, and the sweep's shapes cut to a few layers.
SWEEP_SHAPES = [
    ("sweep-dense-h512-gqa4-d128", "qwen3",
     dict(hidden=512, layers=3, attn=(4, 1, 128))),
    ("sweep-gdn-h512-gqa4-d128", "qwen3_5", dict(hidden=512, layers=4, attn=(4, 1, 128))),
    ("sweep-mamba2-h512", "nemotron_h", dict(hidden=512, layers=4)),
    ("sweep-moe-h512", "qwen3_next", dict(hidden=512, layers=4)),
]


def _cases(only: list[str] | None) -> list[tuple[str, str, dict]]:
    from benchmarks.common import bench_shape
    from pagefold.testing.tiny_models import ARCHS

    out = [(a, a, {}) for a in ARCHS]
    for name, arch, o in SWEEP_SHAPES:
        kw = bench_shape(arch, o["hidden"], o["layers"])
        if "attn" in o:
            h, kv, d = o["attn"]
            kw.update(num_attention_heads=h, num_key_value_heads=kv, head_dim=d)
        out.append((name, arch, kw))
    return [c for c in out if not only or c[0] in only]


def _prompts(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(1234)
    shared = [rng.randrange(10, vocab) for _ in range(40)]
    ps = [shared + [rng.randrange(10, vocab) for _ in range(n)] for n in (3, 17)]
    ps += [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 29)]
    return ps


def _run_case(wide: bool, dtype: str, model_dir: Path) -> list[dict]:
    import random

    from pagefold import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory="64MiB", max_model_len=256,
              max_num_batched_tokens=23 if not wide else 61, max_num_seqs=48, block_size=16,
              enable_prefix_caching=True)
    prompts = _prompts(400)  # the tiny models' vocabularies hold 512 ids
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
    rows = []
    rng = random.Random(99)
    batches = [prompts, prompts]  # the second pass hits the prefix cache (blocks, checkpoints)
    if wide:  # decode steps of more rows than the GEMV takes (40 rows)
        batches.append([[rng.randrange(10, 400) for _ in range(6)] for _ in range(40)])
    for rnd, batch in enumerate(batches):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            lps = [sorted((int(t), float(lp.logprob).hex()) for t, lp in d.items())
                   for d in (c.logprobs or [])]
            rows.append({"round": rnd, "prompt": i, "tokens": list(c.token_ids),
                         "logprobs": lps})
    del llm
    return rows


def record(out: str, only: list[str] | None) -> None:
    import torch
    from tqdm import tqdm

    from pagefold.testing.tiny_models import build_tiny_model

    torch.manual_seed(0)
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, kw in tqdm(_cases(only), desc="golden"):
            d = build_tiny_model(arch, Path(tmp) / name, seed=0, **kw)
            for dtype in ("bfloat16", "float32"):
                try:
                    result[f"{name}/{dtype}"] = _run_case(name.startswith("sweep"), dtype, d)
                except Exception as e:  # an architecture refusing a dtype is recorded too
                    result[f"{name}/{dtype}"] = f"error: {type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(result, indent=0, sort_keys=True))
    print(f"wrote {len(result)} cases to {out}")


def compare(a: str, b: str) -> int:
    ra, rb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    bad = 0
    # A case only AFTER has (an architecture added since BEFORE) has nothing to compare with.
    new = sorted(set(rb) - set(ra))
    for k in new:
        print(f"NEW {k} (not in {a})")
    for k in sorted(set(ra) | set(rb)):
        if k in new:
            continue
        if ra.get(k) != rb.get(k):
            bad += 1
            va, vb = ra.get(k), rb.get(k)
            why = "missing" if va is None or vb is None else "differs"
            if isinstance(va, list) and isinstance(vb, list):
                for x, y in zip(va, vb, strict=False):
                    if x != y:
                        why = (f"round {x['round']} prompt {x['prompt']}: tokens "
                               f"{x['tokens']} vs {y['tokens']}"
                               if x["tokens"] != y["tokens"] else
                               f"round {x['round']} prompt {x['prompt']}: logprobs differ")
                        break
            elif va != vb:
                why = f"{str(va)[:80]} vs {str(vb)[:80]}"
            print(f"DIFF {k}: {why}")
    print(f"{len(set(ra) | set(rb)) - bad - len(new)} identical, {bad} different, "
          f"{len(new)} new")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*", help="case names (architectures or sweep shapes)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out or --compare")
    record(args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
