"""Per-step cost of structured output: the batch bitmask (xgrammar matchers) plus the sampler's
masking, against the plain sampler, for B rows over a real-size vocabulary.

    python -m benchmarks.structured_output [--tokenizer DIR] [--batch 1 8 64] [--steps 50]

Without ``--tokenizer`` a 49,152-token vocabulary is built from the tiny test tokenizer's
vocabulary plus padding (grammar work depends on the vocabulary size and contents).
The table gives milliseconds per step; the model forward is not included.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagefold.executor.sampler import Sampler, SamplingMetadata
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams
from pagefold.structured_output import StructuredOutputsParams
from pagefold.structured_output.manager import StructuredOutputManager

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]}


def run(tokenizer, vocab: int, batch: int, steps: int) -> tuple[float, float]:
    mgr = StructuredOutputManager(lambda: tokenizer, vocab, [tokenizer.eos_token_id or 0])
    so = StructuredOutputsParams(json=SCHEMA)
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i,
                                                 structured_outputs=so))
            for i in range(batch)]
    plain = [SamplingParams(temperature=1.0, seed=i) for i in range(batch)]
    sampler = Sampler()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    t_plain = t_so = 0.0
    mgr.bitmask(reqs, vocab)  # compile outside the timing
    for _ in range(steps):
        t = time.perf_counter()
        sampler(logits, SamplingMetadata.build(plain, [[] for _ in plain]))
        t_plain += time.perf_counter() - t
        t = time.perf_counter()
        meta = SamplingMetadata.build([r.sampling_params for r in reqs],
                                      [r.output_token_ids for r in reqs])
        meta.token_bitmask = mgr.bitmask(reqs, vocab)
        toks = sampler(logits, meta).sampled_token_ids.tolist()
        for r, tok in zip(reqs, toks):
            r.append_token(tok)
            mgr.accept(r, tok)
        t_so += time.perf_counter() - t
    return 1e3 * t_plain / steps, 1e3 * t_so / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        import tempfile

        from pagefold.testing.tiny_models import build_tokenizer

        tok = build_tokenizer(tempfile.mkdtemp(), vocab_size=512)
    vocab = len(tok)
    torch.set_num_threads(1)
    print(f"vocab {vocab}, JSON schema {json.dumps(SCHEMA)[:60]}..., {args.steps} steps")
    print(f"{'batch':>6} {'plain ms':>9} {'json ms':>9} {'overhead ms':>12} {'ratio':>6}")
    for b in args.batch:
        p, s = run(tok, vocab, b, args.steps)
        print(f"{b:>6} {p:>9.2f} {s:>9.2f} {s - p:>12.2f} {s / p:>6.2f}")


if __name__ == "__main__":
    main()
