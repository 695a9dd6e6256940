"""N-gram speculative decoding on the real SmolLM2-135M-Instruct: speculation ON vs OFF.

    python -m benchmarks.spec_decode [--model DIR] [--max-tokens 160] [--repeats 2] [--cases ...]

Workloads (greedy, chat template):
  * ``edit b1``: the editing set ``EDITS``, six requests one after another, each stopping at
    its EOS (cap ``--edit-max-tokens``): code to repeat with one change and a note to
    rewrite, so the prompt holds most of the answer (what prompt lookup is for);
  * ``edit b1 fixed``: one of them run to a fixed ``--max-tokens`` with ``ignore_eos`` (the
    earlier row: past the answer's end the model wanders, and that tail has little to look
    up);
  * ``none accepted b1``: the same request with a drafter whose every draft is wrong (the
    worst case: each verify round costs 1 + k tokens and gains nothing; the per-request
    back-off then keeps the loss small), fixed length;
  * ``free b1``: an open question (little to look up), fixed length;
  * ``edit b32``: the editing set cycled to 32 requests at once (above the automatic
    cut-off, so speculation stays off: it must not be slower);
  * ``eagle3 random b1``: the open question with an EAGLE-3 head (``EAGLE_SPEC``) of random
    weights written for the model (``pagefold.testing.spec_models.write_eagle_head``, a
    32000-token draft vocabulary): it measures what the head costs (its passes, the
    layer-input capture, the verify rounds); its drafts are almost all rejected, so the real
    acceptance (and speed-up) needs a trained head, which this offline machine does not have.

Both engines live side by side (prefix caching off in both); each request of a b1 workload
(the whole batch of ``edit b32``) runs OFF and ON alternately ``--repeats`` times, and its best
time per engine is summed over the workload: tokens/s = tokens / summed best times. Columns:
output tokens/s of each, the ON/OFF ratio, acceptance rate and mean accepted length of the ON
runs, and whether ON's tokens equal OFF's. The machine is shared and noisy: compare ratios,
not absolute figures.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
STACK = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def is_empty(self):
        return len(self.items) == 0
'''
CONFIG = '''import json

def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if "name" not in config:
        config["name"] = "default"
    if "port" not in config:
        config["port"] = 8080
    return config
'''
NOTE = ("The meeting is scheduled for Monday at 10 am in room 4. Please bring your laptop, "
        "the quarterly report and a list of questions for the team. Lunch will be served "
        "after the meeting in the main hall.")
EDIT = f"Repeat this Python code exactly, but rename the variable total to running_sum:\n\n{CODE}"
# The editing set: six requests whose prompt holds most of the answer (code to repeat with
# one change, a note to rewrite). The 135M model does not always make the edit, and some of
# its answers wander off: the set is kept as it is (all six), not trimmed to the ones that
# copy best.
EDITS = [
    f"Rename `total` to `running_sum` in the following code. Output the complete code."
    f"\n\n```python\n{CODE}```",
    f"Rename the method `peek` to `top` in the following code. Output the complete code."
    f"\n\n```python\n{STACK}```",
    f"Change the default port from 8080 to 9000 in the following code. Output the complete "
    f"code.\n\n```python\n{CONFIG}```",
    EDIT,
    f"Rewrite the following text, changing Monday to Tuesday. Keep everything else the same."
    f"\n\n{NOTE}",
    f"Add a docstring to the `push` method in the following code. Output the complete code."
    f"\n\n```python\n{STACK}```",
]
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
EAGLE_SPEC = {"method": "eagle3", "num_speculative_tokens": 3}


def default_model() -> Path:
    root = Path.home() / ".cache" / "pagefold" / "gguf"
    found = sorted(root.glob("SmolLM2-135M-Instruct*/config.json"))
    if not found:
        raise SystemExit("no converted SmolLM2-135M-Instruct under ~/.cache/pagefold/gguf; "
                         "pass --model DIR")
    return found[0].parent


def _chat_ids(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def _wrong_drafts(req, k: int) -> list[int]:
    # Ids the model never emits after text (a few rarely used byte tokens): all rejected.
    return [(req.all_token_ids[-1] * 7 + 13 + j) % 200 + 10 for j in range(k)]


def _run(llm, prompts, params, wrong: bool = False):
    """One batch of prompts on one engine: (seconds, token ids per prompt, drafted, accepted,
    verify rounds)."""
    spec = llm.engine.spec
    if spec is not None:
        spec.metrics.num_drafts = spec.metrics.num_draft_tokens = 0
        spec.metrics.num_accepted_tokens = 0
        spec.propose_fn = (_wrong_drafts if wrong else spec._ngram
                           if spec.config.method == "ngram" else spec._in_runner)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t
    m = spec.metrics if spec is not None else None
    counts = (m.num_draft_tokens, m.num_accepted_tokens, m.num_drafts) if m else (0, 0, 0)
    return secs, [o.outputs[0].token_ids for o in outs], counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=160,
                    help="output length of the fixed-length workloads (ignore_eos)")
    ap.add_argument("--edit-max-tokens", type=int, default=400,
                    help="cap of the editing set's answers (they stop at EOS)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases",
                    default="edit b1,edit b1 fixed,none accepted b1,free b1,edit b32,"
                            "eagle3 random b1",
                    help="comma-separated workload names to run")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from pagefold import LLM, SamplingParams

    model = str(args.model or default_model())
    tok = AutoTokenizer.from_pretrained(model)
    edit, free = _chat_ids(tok, EDIT), _chat_ids(tok, FREE)
    edits = [_chat_ids(tok, e) for e in EDITS]
    # Prefix caching off: every repeat of a request computes the same thing (a hit would
    # change the prefill's cost and, in bf16, possibly the text).
    kw = dict(max_model_len=2048, max_num_batched_tokens=512, warm_up=False,
              enable_prefix_caching=False)
    off = LLM(model, **kw)
    on = LLM(model, speculative_config=SPEC, **kw)
    eagle = None
    if "eagle3 random b1" in args.cases:
        import tempfile

        from pagefold.testing.spec_models import write_eagle_head

        head = write_eagle_head(model, Path(tempfile.mkdtemp()) / "eagle3", "eagle3",
                                draft_vocab=32000)
        eagle = LLM(model, speculative_config=EAGLE_SPEC | {"model": str(head)}, **kw)
    fixed = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    natural = SamplingParams(temperature=0, max_tokens=args.edit_max_tokens)
    b32 = [edits[i % len(edits)] for i in range(32)]
    # (name, prompts, params, every draft wrong, one request at a time, the ON engine)
    cases = [("edit b1", edits, natural, False, True, on),
             ("edit b1 fixed", [edit], fixed, False, True, on),
             ("none accepted b1", [edit], fixed, True, True, on),
             ("free b1", [free], fixed, False, True, on),
             ("edit b32", b32, natural, False, False, on),
             ("eagle3 random b1", [free], fixed, False, True, eagle)]
    wanted = [c.strip() for c in args.cases.split(",")]
    cases = [c for c in cases if c[0] in wanted]
    print(f"model {model}\nspeculative_config {SPEC} (eagle3 rows: {EAGLE_SPEC})\n",
          flush=True)
    head = (f"{'workload':18} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} "
            f"{'accept':>7} {'mean len':>8} {'same':>5}")
    print(head)
    print("-" * len(head))
    for name, prompts, params, wrong, one_by_one, on_engine in cases:
        # Each unit (a request alone, or the whole batch) runs OFF and ON alternately
        # --repeats times; its best time per engine counts (noise on a shared machine only
        # adds time), summed over the units.
        units = [[p] for p in prompts] if one_by_one else [prompts]
        secs = {"off": 0.0, "on": 0.0}
        tokens, same = 0, True
        drafted = accepted = rounds = 0
        for unit in units:
            best = {"off": float("inf"), "on": float("inf")}
            for rep in range(args.repeats):
                order = [("off", off), ("on", on_engine)]
                if rep % 2:
                    order.reverse()
                res = {}
                for label, llm in order:
                    res[label] = _run(llm, unit, params, wrong and label == "on")
                    best[label] = min(best[label], res[label][0])
                same &= res["on"][1] == res["off"][1]
            tokens += sum(len(x) for x in res["off"][1])
            d, a, r = res["on"][2]
            drafted, accepted, rounds = drafted + d, accepted + a, rounds + r
            secs["off"] += best["off"]
            secs["on"] += best["on"]
        t_off, t_on = tokens / secs["off"], tokens / secs["on"]
        rate = 100 * accepted / drafted if drafted else 0.0
        mean = 1 + accepted / rounds if rounds else 0.0
        print(f"{name:18} {t_off:10.1f} {t_on:10.1f} {t_on / t_off:7.2f} "
              f"{rate:6.1f}% {mean:8.2f} {str(same):>5}", flush=True)
        for llm in (off, on_engine):
            llm.engine.kv.check_whole()


if __name__ == "__main__":
    main()
