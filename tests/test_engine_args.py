"""The command line generated from EngineConfig, and the chat text parsers (no server)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagefold.config import EngineConfig
from pagefold.entrypoints import engine_args
from pagefold.entrypoints.cli import main
from pagefold.entrypoints.openai.chat_parsing import (
    parse_tool_calls,
    split_reasoning,
    tool_constraint,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_args.add_engine_args(p)
    return p


def test_every_config_field_is_a_flag_with_help_and_default():
    p = _parser()
    text = p.format_help()
    for f in dataclasses.fields(EngineConfig):
        if f.name in engine_args.SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in p._option_string_actions, flag
        action = p._option_string_actions[flag]
        assert action.help and "%(default)" not in action.help
    assert "(default: auto)" in text and "(default: 256)" in text
    # Parsing nothing gives EngineConfig's own defaults (one source of truth).
    kw = engine_args.engine_kwargs(p.parse_args([]))
    assert EngineConfig(model="m", **kw) == EngineConfig(model="m")


def test_vllm_spellings_and_boolean_pairs():
    p = _parser()
    a = p.parse_args(["--enable-prefix-caching", "--gpu-memory-utilization", "0.9",
                      "--max-model-len", "4096", "--generation-config", "auto",
                      "--max-num-seqs", "64", "--enforce-eager", "--trust-remote-code",
                      "--max-logprobs", "5", "--kv-cache-memory", "2GiB", "--no-warm-up"])
    kw = engine_args.engine_kwargs(a)
    assert kw["enable_prefix_caching"] is True and kw["gpu_memory_utilization"] == 0.9
    assert kw["max_model_len"] == 4096 and kw["max_num_seqs"] == 64 and kw["max_logprobs"] == 5
    assert kw["warm_up"] is False and kw["kv_cache_memory"] == "2GiB"
    assert engine_args.log_ignored(a) == ["--enforce-eager", "--trust-remote-code"]
    assert engine_args.engine_kwargs(
        p.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_args.engine_kwargs(
        p.parse_args(["--max-model-len", "none"]))["max_model_len"] is None
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-seqs", "many"])


def test_new_config_fields_become_flags(monkeypatch):
    """A field another change adds to EngineConfig is a flag with no edit here."""

    @dataclasses.dataclass
    class Grown(EngineConfig):
        # Speculative tokens per step.
        num_speculative_tokens: int = 0
        speculative_config: dict | None = None
        fast_mode: bool = False

    monkeypatch.setattr(engine_args, "EngineConfig", Grown)
    p = _parser()
    a = p.parse_args(["--num-speculative-tokens", "3", "--speculative-config",
                      '{"method": "ngram"}', "--fast-mode"])
    kw = engine_args.engine_kwargs(a)
    assert kw["num_speculative_tokens"] == 3 and kw["speculative_config"] == {"method": "ngram"}
    assert kw["fast_mode"] is True
    assert p._option_string_actions["--num-speculative-tokens"].help == (
        "Speculative tokens per step.")


def test_version_and_serve_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("pagefold ")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--enable-prefix-caching", "--gpu-memory-utilization", "--generation-config",
                 "--disable-log-requests", "--enable-log-requests", "--trust-remote-code",
                 "--enforce-eager", "--max-logprobs", "--model", "--tool-call-parser",
                 "--reasoning-parser", "--access-log"):
        assert flag in out, flag


@pytest.mark.parametrize("text,parser,content,calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes", None,
     [("f", {"a": 1})]),
    ('hi <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
     '"arguments": {"b": "x"}}</tool_call>', "hermes", "hi", [("f", {}), ("g", {"b": "x"})]),
    ("no calls here", "hermes", "no calls here", []),
    ('<tool_call>{"name": broken</tool_call>', "hermes",
     '<tool_call>{"name": broken</tool_call>', []),
    ('[f(a=1, b="x"), g()]', "pythonic", None, [("f", {"a": 1, "b": "x"}), ("g", {})]),
    ("[not python", "pythonic", "[not python", []),
    ('{"name": "f", "parameters": {"q": [1]}}', "json", None, [("f", {"q": [1]})]),
    ('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]', "json", None,
     [("f", {}), ("g", {})]),
])
def test_tool_parsers(text, parser, content, calls):
    import json

    got_content, got = parse_tool_calls(text, parser)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_reasoning_split():
    assert split_reasoning("<think>a</think>\nb", "qwen3", final=True) == ("a", "b")
    assert split_reasoning("a</think>b", "deepseek_r1", final=True) == ("a", "b")
    assert split_reasoning("plain", "qwen3", final=True) == (None, "plain")
    assert split_reasoning("<think>partial</th", "qwen3", final=False) == ("partial", "")
    assert split_reasoning("still thinking", "deepseek_r1", final=False) == (
        "still thinking", "")
    assert split_reasoning("<thi", "qwen3", final=False) == (None, "")


def test_tool_constraints():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    named = tool_constraint(tools, {"type": "function", "function": {"name": "f"}})
    assert named.json == tools[0]["function"]["parameters"]
    req = tool_constraint(tools, "required", parallel=False)
    assert req.json["maxItems"] == 1 and req.json["items"]["properties"]["name"]["enum"] == ["f"]
    assert tool_constraint(tools, "auto") is None
    with pytest.raises(ValueError, match="not in tools"):
        tool_constraint(tools, {"type": "function", "function": {"name": "zz"}})
