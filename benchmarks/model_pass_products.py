"""Few-row bf16 products over a whole model's weights, as a decode or verify step meets them.

    python -m benchmarks.model_pass_products [--layers 30] [--rows 1 2 5 8 16] [--reps 5]

One "pass" is every linear of a SmolLM2-135M-shaped model once (per layer qkv 960x576, o
576x576, gate/up 3072x576, down 576x1536; then the tied head 49152x576): distinct weight
tensors, ~270 MB in bf16, so they stream from memory as in a real step instead of sitting in
the last-level cache (the single-shape ``benchmarks.bf16_gemv`` measures cache-resident
products). Per number of rows M, the best pass time in ms of each product this CPU has:

  * ``dpbf16``: the AVX512-BF16 dot-product GEMV (``pf_linear_bf16``);
  * ``amx``: the AMX tile kernel (``pf_linear_bf16_amx``, gemv_amx.cpp; up to 32 rows);
  * ``fma``: the AVX2 + FMA kernel (``pf_linear_bf16_fma``);
  * ``onednn``: oneDNN with the weights reordered once (what linears of more rows take);
  * ``F.linear``: oneDNN as torch calls it (reordering the weight on every call).

Columns are absent where the CPU or build lacks the product. A pass at M rows costing about
what one row costs is what makes a verify step of 1 + k tokens nearly free.

``--gguf``: also the same pass over GGUF weights kept quantized as SmolLM2's Q4_1 file holds
them (Q4_1 layers, a Q8_0 tied head; random blocks, ~98 MB), through
``GGUFWeight.product``: ``q8mm`` (the AMX-INT8 tile form, from 16 rows) and ``q8`` (the
int8-activation GEMV). ``--cpu``: process CPU time instead of wall time (steadier on a shared
machine; run with one thread).

    python -m benchmarks.model_pass_products --rows 16 32 --gguf --cpu
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def _run_c(fn, ws, xs, ys, m: int, nt: int) -> None:
    for w, y in zip(ws, ys):
        n, k = w.shape
        fn(xs[k].data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, m, n, k, nt)


def _run_onednn(ws, packed, xs) -> None:
    for w, p in zip(ws, packed):
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")


def _run_f(ws, xs) -> None:
    for w in ws:
        F.linear(xs[w.shape[1]], w)


def _gguf_weights(shapes: list[tuple[int, int]]) -> list:
    """SmolLM2's Q4_1 file's types over ``shapes`` (the last, the head, Q8_0): random codes,
    float16 scales 0.01 and Q4_1 mins -0.08, in the layout ``GGUFWeight`` keeps."""
    import numpy as np

    from pagefold.quantization.gguf_kernel import GGUFWeight

    rng = np.random.default_rng(0)
    out = []
    for i, (n, k) in enumerate(shapes):
        kind, size = ("Q8_0", 34) if i == len(shapes) - 1 else ("Q4_1", 20)
        b = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
        b[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if kind == "Q4_1":
            b[:, :, 2:4] = np.frombuffer(np.float16(-0.08).tobytes(), np.uint8)
        out.append(GGUFWeight([(kind, torch.from_numpy(b.reshape(n, -1)))], k))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gguf", action="store_true", help="also Q4_1 / Q8_0 GGUF weights")
    ap.add_argument("--cpu", action="store_true", help="CPU time, not wall time")
    args = ap.parse_args(argv)

    from pagefold.csrc import cpu_ops

    lib = cpu_ops.kernels()
    if lib is None:
        raise SystemExit("the CPU kernels are not available (no C++ compiler?)")
    kinds = lib.pf_gemv_kinds()
    fns = {}
    if kinds & 1:
        fns["dpbf16"] = (lib.pf_linear_bf16, 1 << 30)
    if lib.pf_amx_ready():
        fns["amx"] = (lib.pf_linear_bf16_amx, 32)
    if kinds & 2:
        fns["fma"] = (lib.pf_linear_bf16_fma, 1 << 30)
    torch.manual_seed(0)
    shapes = LAYER * args.layers + [HEAD]
    ws = [(torch.randn(n, k) * k**-0.5).bfloat16() for n, k in shapes]
    # oneDNN's packed bf16 weights need AVX512 or AVX-NE-CONVERT (None elsewhere: no column).
    packed = [cpu_ops.prepack(w) for w in ws]
    nt = torch.get_num_threads()
    names = [*fns, *(["onednn"] if all(p is not None for p in packed) else []), "F.linear"]
    gw = _gguf_weights(shapes) if args.gguf else []
    if gw:
        kernels = gw[0].kernel_names()
        names += [k for k in ("q8mm", "q8") if k in kernels]
    clock = time.process_time if args.cpu else time.perf_counter
    print(f"{len(ws)} weights, {sum(w.numel() * 2 for w in ws) / 2**20:.0f} MiB bf16"
          + (f", {sum(w.nbytes for w in gw) / 2**20:.0f} MiB GGUF" if gw else "")
          + f", {nt} threads; best pass of {args.reps}, ms ({'CPU' if args.cpu else 'wall'})")
    print(f"{'M':>3} " + " ".join(f"{n:>9}" for n in names))
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16) for w in ws]

        runs = {name: (lambda f=f, xs=xs, ys=ys, m=m: _run_c(f, ws, xs, ys, m, nt))
                if m <= limit else None for name, (f, limit) in fns.items()}
        if "onednn" in names:
            runs["onednn"] = lambda xs=xs: _run_onednn(ws, packed, xs)
        runs["F.linear"] = lambda xs=xs: _run_f(ws, xs)
        xf = {k: v.float() for k, v in xs.items()}
        for name in ("q8mm", "q8"):
            runs[name] = lambda xf=xf, name=name: [w.product(xf[w.k], name) for w in gw]
        cells = []
        for name in names:
            fn = runs[name]
            if fn is None:
                cells.append(f"{'-':>9}")
                continue
            fn()
            best = float("inf")
            for _ in range(args.reps):
                t0 = clock()
                fn()
                best = min(best, clock() - t0)
            cells.append(f"{best * 1e3:9.2f}")
        print(f"{m:>3} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
