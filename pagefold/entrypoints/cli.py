"""``pagefold`` console script: generate, serve, capacity (bench joins as it lands)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pagefold import __version__
from pagefold.entrypoints import capacity_cmd, chat_cmd, engine_args, proxy
from pagefold.llm import LLM
from pagefold.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine: one per EngineConfig
    field, generated (see :mod:`pagefold.entrypoints.engine_args`)."""
    engine_args.add_engine_args(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return engine_args.engine_kwargs(args)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAGEFOLD_CACHE", Path.home() / ".cache" / "pagefold"))


DEMO_CHATS = ["What is the capital of France?",
              "Name three primary colors.",
              "Write a haiku about the sea."]


def _generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = chat_cmd.resolve_cli_model(args.model, getattr(args, "quantization", None))
    engine_args.log_ignored(args)
    kw = engine_kwargs(args)
    kw.pop("model", None)
    llm = LLM(model, **kw)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    chats = args.chat or ([] if args.prompt else DEMO_CHATS)
    if chats:  # one conversation per message, through the checkpoint's chat template
        outs = llm.chat([[{"role": "user", "content": c}] for c in chats], params,
                        use_tqdm=False)
        for c, o in zip(chats, outs):
            print(f"--- user: {c}\nassistant: {o.outputs[0].text}\n"
                  f"({len(o.outputs[0].token_ids)} tokens, finish: "
                  f"{o.outputs[0].finish_reason})")
    if args.prompt:
        outs = llm.generate(args.prompt, params)
        for o in outs:
            c = o.outputs[0]
            print(f"--- prompt: {o.prompt!r}\n{c.text!r}\n({len(c.token_ids)} tokens, "
                  f"finish: {c.finish_reason})")
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags of ``pagefold serve`` (engine flags come from :func:`add_engine_args`)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="model",
                   help="local Hugging Face model directory or .gguf file, or give --model "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None,
                   help="local Hugging Face model directory (vLLM's spelling)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
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
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients send; none: the model path; the first is "
                        "reported")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) a request's model field may name, "
                        "as NAME=PATH or JSON {\"name\": ..., \"path\": ...}; needs "
                        "--enable-lora")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or template text) overriding the "
                        "tokenizer's")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level")
    p.add_argument("--enable-log-requests", dest="log_requests", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="log every request (id, prompt length, sampling params) on arrival "
                        "and its outcome on completion")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log requests (the default; vLLM's spelling)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="most prompt characters/ids printed per logged request")
    p.add_argument("--disable-log-stats", dest="log_stats", default=True, action="store_false",
                   help="no periodic stats line")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats lines (throughput, running/waiting, KV usage, "
                        "prefix-cache hit rate)")
    p.add_argument("--access-log", dest="access_log", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="uvicorn's per-HTTP-request access log")
    p.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="no access log (the default; vLLM's spelling)")
    p.add_argument("--enable-auto-tool-choice", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="allow tool_choice 'auto' (tool calls parsed from the model's text "
                        "with --tool-call-parser)")
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from generated text: hermes (<tool_call> "
                        "JSON, Qwen), pythonic ([f(a=1)]), json (a bare JSON object/list)")
    p.add_argument("--reasoning-parser", default=None,
                   help="split <think>...</think> into reasoning_content: deepseek_r1, qwen3 "
                        "or think")
    p.add_argument("--enable-force-include-usage", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="every streamed chunk carries usage so far and the stream ends with a "
                        "usage chunk, whatever stream_options say")
    p.add_argument("--return-tokens-as-token-ids", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="logprobs name tokens 'token_id:N' (a request's "
                        "return_tokens_as_token_ids overrides this)")
    p.add_argument("--enable-tokenizer-info-endpoint", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat "
                        "template)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores (each with its own pool and scheduler) behind this "
                        "server; requests go to the least loaded, prefix-aware")


def _serve(args: argparse.Namespace) -> int:
    # Imported here: fastapi/uvicorn are only needed by the server.
    from pagefold.entrypoints.openai.server import run_server

    if args.model_tag and args.model_flag and args.model_tag != args.model_flag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model_flag!r}")
    args.model = chat_cmd.resolve_cli_model(args.model_tag or args.model_flag,
                                            getattr(args, "quantization", None))
    engine_args.log_ignored(args)
    kw = engine_kwargs(args)
    kw.pop("model", None)
    kw.pop("tokenizer", None)
    code = run_server(args, kw)
    # The engine core is gone and every response is written: skip the interpreter's slow
    # teardown of torch & co (seconds), so a SIGTERM exits within --shutdown-timeout + 2 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="pagefold", description=__doc__, formatter_class=fmt)
    parser.add_argument("--version", "-V", action="version",
                        version=f"pagefold {__version__}")
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline from prompts",
                       formatter_class=fmt)
    g.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model directory or .gguf file "
                        "(default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", action="append", help="a raw text prompt (repeatable)")
    g.add_argument("--chat", action="append",
                   help="a user message answered through the chat template (repeatable); "
                        "with neither --prompt nor --chat a few demo questions are asked")
    g.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine in its own process)",
                       formatter_class=fmt)
    add_serve_args(s)
    add_engine_args(s)
    s.set_defaults(func=_serve)

    capacity_cmd.add_parser(sub)
    chat_cmd.add_parser(sub)
    proxy.add_parser(sub)

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
