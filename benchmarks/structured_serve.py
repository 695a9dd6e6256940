"""Structured output and tool calls through ``pagefold serve`` on SmolLM2-135M-Instruct, with the
official ``openai`` client.

    python -m benchmarks.structured_serve [--model DIR]

Rows: the 20 ``json_schema`` cases of :mod:`pagefold.testing.structured_cases` sent at once,
first with every grammar still to compile (cold) and then again (cached); named and
``required`` tool calls, plain and streamed; and a plain stream's largest gap between chunks
(median of 3), alone, while another request's heavy schema compiles (compiling runs in a
thread of the engine-core process, off its step loop) and with that schema cached.
``valid`` counts answers that parse and validate (``jsonschema``). Greedy, float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

from benchmarks.common import print_table
from benchmarks.serve_compare import REPO, _free_port, stop, wait_ready
from pagefold.testing.structured_cases import ASK, CASES, MAX_TOKENS, TOOLS


def heavy_schema(k: int) -> dict:
    """A schema that takes xgrammar a good fraction of a second to compile on a 49k vocab."""
    props = {f"f{k}_{i}": {"type": ["string", "integer", "number", "boolean"][i % 4]}
             for i in range(30)}
    props["rows"] = {"type": "array", "items": {"type": "object", "properties": {
        f"g{j}": {"type": "string", "pattern": "^[a-z]{2,9}[0-9]*$"} for j in range(10)}}}
    return {"type": "object", "properties": props, "required": list(props)}


def schema_batch(client: openai.OpenAI) -> tuple[float, int]:
    def ask(case):
        k, (prompt, schema) = case
        r = client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": prompt + " Reply in JSON."}],
            max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"case{k}", "schema": schema, "strict": True}})
        try:
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            return 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return 0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(CASES)) as pool:
        valid = sum(pool.map(ask, enumerate(CASES)))
    return time.perf_counter() - t0, valid


def tool_call(client: openai.OpenAI, choice, stream: bool) -> tuple[float, int]:
    fns = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kw = dict(model="bench", messages=ASK, max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
              tool_choice=choice, parallel_tool_calls=False)
    t0 = time.perf_counter()
    if stream:
        with client.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            msg = s.get_final_completion().choices[0].message
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
    secs = time.perf_counter() - t0
    ok = 0
    for call in msg.tool_calls or ():
        jsonschema.validate(json.loads(call.function.arguments), fns[call.function.name])
        ok = 1
    return secs, ok


def stream_gaps(client: openai.OpenAI, heavy: dict | None) -> float:
    """Largest gap (s) between a plain stream's chunks after its 5th; with ``heavy``, a
    request with that schema is sent at the 5th chunk (its compile overlaps the stream)."""
    times: list[float] = []
    started = threading.Event()

    def other():
        started.wait()
        client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": "A record, please."}],
            max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                "name": "heavy", "schema": heavy}})

    t = threading.Thread(target=other) if heavy else None
    if t:
        t.start()
    for _chunk in client.completions.create(model="bench", prompt="Once upon a time",
                                           max_tokens=60, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        times.append(time.perf_counter())
        if len(times) == 5:
            started.set()
    if t:
        t.join()
    return max(b - a for a, b in zip(times[5:], times[6:]))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    args = p.parse_args(argv)
    if args.model is None:
        from pagefold.models.smollm2 import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    port = _free_port()
    cmd = [sys.executable, "-m", "pagefold.entrypoints.cli", "serve", args.model, "--port",
           str(port), "--dtype", "float32", "--kv-cache-memory", "192MiB", "--max-model-len",
           "1024", "--max-num-batched-tokens", "512", "--no-warm-up", "--served-model-name",
           "bench", "--uvicorn-log-level", "warning"]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 - the server writes to it
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(port, proc)
            print(f"server ready in {time.perf_counter() - t0:.1f} s", flush=True)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                   max_retries=0, timeout=600)
            for label in ("20 json_schema at once, cold (compile)",
                          "20 json_schema at once, cached"):
                secs, valid = schema_batch(client)
                rows.append({"case": label, "s": secs, "valid": f"{valid}/{len(CASES)}"})
            named = {"type": "function", "function": {"name": "get_weather"}}
            for label, choice in (("named", named), ("required", "required")):
                for stream in (False, True):
                    secs, ok = tool_call(client, choice, stream)
                    rows.append({"case": f"tool_choice {label}{', streamed' if stream else ''}",
                                 "s": secs, "valid": f"{ok}/1"})
            # Medians of 3 (the gaps are noisy on a shared machine).
            for label, schemas in (
                    ("plain stream: largest chunk gap, alone", [None] * 3),
                    ("same, a new heavy schema compiling meanwhile",
                     [heavy_schema(k) for k in range(3)]),
                    ("same, that heavy schema cached", [heavy_schema(0)] * 3)):
                gaps = sorted(stream_gaps(client, sch) for sch in schemas)
                rows.append({"case": label, "s": gaps[1]})
        finally:
            stop(proc)
            log.close()
    from pagefold.checkpoint import load_tokenizer
    from pagefold.structured_output import StructuredOutputsParams
    from pagefold.structured_output.backend import GrammarCompiler

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(load_tokenizer(args.model), vocab, [2])
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=heavy_schema(1)))
    rows.append({"case": "the heavy schema's compile alone (in-process)",
                 "s": time.perf_counter() - t0})
    print_table(rows, ["case", "s", "valid"])
    return rows


if __name__ == "__main__":
    main()
