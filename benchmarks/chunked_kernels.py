"""Prefill throughput of the chunked Triton GDN / SSD kernels against the token-loop ones, on
the same inputs (states in pages, in place), with a FLOPs figure against the bf16 matmul rate.

    python -m benchmarks.chunked_kernels --out /tmp/out       # on a GPU (the device check)
    python -m benchmarks.chunked_kernels --quick              # CPU smoke: Triton interpreter

Shapes (``--quick``: tiny ones): Gated DeltaNet as Qwen3-Next's layer (16 key heads serving 32
value heads, Dk = Dv = 128), Mamba-2 SSD as Nemotron-H's (64 heads of 64 channels, 8 groups,
state 128); 4 sequences x 4096 prompt tokens, bf16 inputs, float32 states. For each kernel and
form: milliseconds per call (best of 5 after a compiling warm-up), prompt tokens/s, and the
FLOP/s of the form's own arithmetic (:func:`gdn_flops`, :func:`ssd_flops`) as a share of the
measured bf16 matmul rate. ``max |d|`` is the largest difference of the form's outputs from
the token loop's (both float32 inside; a sanity check, not a test).

Writes ``chunked_kernels.json`` / ``chunked_kernels.md`` to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {"gdn": dict(hk=16, h=32, dk=128, dv=128), "ssd": dict(h=64, p=64, g=8, n=128)}
QUICK = {"gdn": dict(hk=1, h=2, dk=16, dv=16), "ssd": dict(h=2, p=16, g=1, n=16)}


def gdn_flops(tokens: int, h: int, dk: int, dv: int, chunk: int | None) -> float:
    """Arithmetic of the two GDN forms, per value head: the token loop does ~4 Dk Dv
    multiply-adds a token (decay, S^T k, rank-1 write, S^T q); the chunked form its chunk
    matmuls (K K^T, X V, X K, W S, Q S, Q K^T, (Q K^T) Delta, K^T Delta) and the forward
    substitution (C^3 / 6 multiply-adds a chunk)."""
    if chunk is None:
        return tokens * h * 2 * 4 * dk * dv
    c = chunk
    per_tok = 2 * (3 * c * dk + 2 * c * dv + 3 * dk * dv) + c * c / 3
    return tokens * h * per_tok


def ssd_flops(tokens: int, h: int, p: int, n: int, chunk: int | None) -> float:
    """Token loop: ~3 P N multiply-adds a token (decay, rank-1, read); chunked: C B^T,
    (C B^T * L)(dt x), C h^T and the state passing (dt x)^T B."""
    if chunk is None:
        return tokens * h * 2 * 3 * p * n
    return tokens * h * 2 * (chunk * n + chunk * p + 2 * p * n)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev: torch.device, reps: int) -> float:
    fn()  # compile / warm up
    _sync(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_tflops(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    from benchmarks.device_check import matmul_tflops

    return matmul_tflops()


def run(quick: bool, seqs: int, seq_len: int, reps: int) -> dict:
    from pagefold.ops.common.triton import PagedState
    from pagefold.ops.gdn.triton import gdn_paged
    from pagefold.ops.gdn.triton_chunked import gdn_chunked_paged
    from pagefold.ops.ssd.triton import ssd_paged
    from pagefold.ops.ssd.triton_chunked import ssd_chunked_paged

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = QUICK if quick else SHAPES
    t = seqs * seq_len
    cu = torch.arange(0, t + 1, seq_len, dtype=torch.int64, device=dev)
    init = torch.ones(seqs, dtype=torch.bool, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rows = []

    c = shapes["gdn"]
    q, k = rnd(t, c["hk"], c["dk"]).to(dtype), rnd(t, c["hk"], c["dk"]).to(dtype)
    v = rnd(t, c["h"], c["dv"]).to(dtype)
    g = -torch.rand(t, c["h"], generator=gen, device=dev) * 0.1
    beta = torch.rand(t, c["h"], generator=gen, device=dev)
    s0 = rnd(seqs, c["h"], c["dk"], c["dv"]) * 0.1
    outs = {}
    for form, chunk in (("token loop", None), ("chunked", 64)):
        st = s0.clone()
        out = torch.empty_like(v)

        def call(st=st, out=out, chunk=chunk):
            st.copy_(s0)
            if chunk is None:
                gdn_paged(q, k, v, g, beta, PagedState.dense(st), cu, init, out,
                          scale=c["dk"] ** -0.5)
            else:
                gdn_chunked_paged(q, k, v, g, beta, PagedState.dense(st), cu, init, out,
                                  scale=c["dk"] ** -0.5, chunk_size=chunk)

        sec = _time(call, dev, reps)
        outs[form] = out.float()
        rows.append({"kernel": "gdn", "form": form, "seconds": sec,
                     "flops": gdn_flops(t, c["h"], c["dk"], c["dv"], chunk),
                     "max_diff": float((out.float() - outs["token loop"]).abs().max())})

    c = shapes["ssd"]
    x = rnd(t, c["h"], c["p"]).to(dtype)
    dt = torch.nn.functional.softplus(rnd(t, c["h"]) - 2)
    A = -torch.rand(c["h"], generator=gen, device=dev) - 0.5
    B, C = rnd(t, c["g"], c["n"]).to(dtype), rnd(t, c["g"], c["n"]).to(dtype)
    D = rnd(c["h"])
    s0 = rnd(seqs, c["h"], c["p"], c["n"]) * 0.1
    outs = {}
    for form, chunk in (("token loop", None), ("chunked", 64)):
        st = s0.clone()
        y = torch.empty(x.shape, dtype=torch.float32, device=dev)

        def call(st=st, y=y, chunk=chunk):
            st.copy_(s0)
            if chunk is None:
                ssd_paged(x, dt, A, B, C, D, PagedState.dense(st), cu, init, y)
            else:
                ssd_chunked_paged(x, dt, A, B, C, D, PagedState.dense(st), cu, init, y,
                                  chunk_size=chunk)

        sec = _time(call, dev, reps)
        outs[form] = y.clone()
        rows.append({"kernel": "ssd", "form": form, "seconds": sec,
                     "flops": ssd_flops(t, c["h"], c["p"], c["n"], chunk),
                     "max_diff": float((y - outs["token loop"]).abs().max())})

    mm = _matmul_tflops(dev)
    for r in rows:
        r["tok_s"] = t / r["seconds"]
        r["tflops"] = r["flops"] / r["seconds"] / 1e12
        r["matmul_frac"] = r["tflops"] / mm if mm else None
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu "
            "(Triton interpreter)", "dtype": str(dtype), "seqs": seqs, "seq_len": seq_len,
            "shapes": shapes, "matmul_tflops": mm, "rows": rows,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def table(res: dict) -> str:
    mm = res["matmul_tflops"]
    lines = [f"Chunked vs token-loop Triton prefill kernels, {res['date']}, {res['device']}, "
             f"{res['seqs']} x {res['seq_len']} tokens, {res['dtype']} inputs"
             + (f", bf16 matmul {mm:.0f} TFLOP/s" if mm else ""), "",
             "| kernel | form | ms | prompt tok/s | TFLOP/s | % matmul | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        frac = f"{100 * r['matmul_frac']:.1f}%" if r["matmul_frac"] is not None else "-"
        lines.append(f"| {r['kernel']} | {r['form']} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['tok_s']:.3g} | {r['tflops']:.3g} | {frac} | {r['max_diff']:.2e} |")
    by = {(r["kernel"], r["form"]): r for r in res["rows"]}
    for kern in ("gdn", "ssd"):
        ratio = by[kern, "token loop"]["seconds"] / by[kern, "chunked"]["seconds"]
        lines.append(f"\n{kern}: chunked / token loop speed {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--seqs", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        a.quick = True
    seqs = a.seqs or (2 if a.quick else 4)
    seq_len = a.seq_len or (40 if a.quick else 4096)
    res = run(a.quick, seqs, seq_len, 1 if a.quick else a.reps)
    text = table(res)
    print(text, flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "chunked_kernels.json").write_text(json.dumps(res, indent=1))
        (out / "chunked_kernels.md").write_text(text + "\n")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
