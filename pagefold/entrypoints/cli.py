"""``pagefold`` console script: generate, serve, capacity (bench joins as it lands)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pagefold.entrypoints import capacity_cmd


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "fp8"])
    p.add_argument("--kv-cache-memory", default=None, help="pool bytes, e.g. 2GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="accept a --max-model-len above the model's max_position_embeddings "
                        "(rope scaling included); outputs past it may be garbage")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=True)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                   help="how a preempted request gives its blocks back: recompute it later, "
                        "swap its blocks to host memory, or pick the cheaper per request "
                        "(swap needs --swap-space)")
    p.add_argument("--swap-space", default="0",
                   help="host memory for swapped-out blocks, e.g. 4GiB (default 0: no swap)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top logprobs a request may ask for (0-20, default 20)")
    p.add_argument("--state-checkpoint-interval", type=int, default=256,
                   help="tokens between cached recurrent-state checkpoints of hybrid models "
                        "(rounded down to a multiple of --block-size)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, seed=args.seed,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        state_checkpoint_interval=args.state_checkpoint_interval, max_logprobs=args.max_logprobs,
        allow_long_max_model_len=args.allow_long_max_model_len)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAGEFOLD_CACHE", Path.home() / ".cache" / "pagefold"))


def _generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagefold import LLM, SamplingParams

    model = args.model
    if model is None:
        from pagefold.testing.tiny_models import build_demo_model

        model = str(build_demo_model(default_cache_dir()))
        print(f"no model given: using the built-in demo model at {model} "
              "(random weights: the text is noise, the engine is real)")
    llm = LLM(model, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["The quick brown fox", "def fibonacci(n):",
                              "import os\nimport sys\n", "class Scheduler:"]
    outs = llm.generate(prompts, params)
    for o in outs:
        c = o.outputs[0]
        print(f"--- prompt: {o.prompt!r}\n{c.text!r}\n({len(c.token_ids)} tokens, "
              f"finish: {c.finish_reason})")
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags of ``pagefold serve`` (engine flags come from :func:`add_engine_args`)."""
    p.add_argument("model", help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGEFOLD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(and /metrics, see --metrics-require-key) (default: $PAGEFOLD_API_KEY)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="put /metrics behind the API key too (open by default for scrapers)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish (new ones "
                        "get 503) before the rest are ended with 503 / an SSE error event")
    p.add_argument("--max-request-output-tokens", type=int, default=2**18,
                   help="most output a request may ask for, counted as samples (n or best_of) "
                        "x max_tokens x (1 + logprobs): every sampled token and every logprob "
                        "entry is held until the response is sent (default 262144)")
    p.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                   help="largest request body accepted (413 above it, checked while reading, "
                        "before parsing); 0 = no limit (default 32 MiB)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model path)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: model)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or template text) overriding the "
                        "tokenizer's")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _serve(args: argparse.Namespace) -> int:
    # Imported here: fastapi/uvicorn are only needed by the server.
    from pagefold.entrypoints.openai.server import run_server

    code = run_server(args, engine_kwargs(args))
    # The engine core is gone and every response is written: skip the interpreter's slow
    # teardown of torch & co (seconds), so a SIGTERM exits within --shutdown-timeout + 2 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagefold", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline from prompts")
    g.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model directory (default: built-in demo model)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine in its own process)")
    add_serve_args(s)
    add_engine_args(s)
    s.set_defaults(func=_serve)

    capacity_cmd.add_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
