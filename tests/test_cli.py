"""The ``pagefold`` console script, driven through ``cli.main(argv)`` in-process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagefold import LLM
from pagefold.entrypoints.cli import main
from pagefold.testing.oracle import hf_greedy


def test_generate_prints_output(llama_dir: Path, capsys: pytest.CaptureFixture):
    rc = main(["generate", str(llama_dir), "--prompt", "hi", "--max-tokens", "4",
               "--max-model-len", "64", "--kv-cache-memory", "1MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- prompt: 'hi'" in out
    m = re.search(r"\((\d+) tokens, finish: (\w+)\)", out)
    assert m and 1 <= int(m.group(1)) <= 4 and m.group(2) in ("length", "stop")
    # The printed text is the greedy continuation (eos honoured, as the CLI does).
    llm_tok = LLM(str(llama_dir), max_model_len=64, kv_cache_memory=1 << 20).get_tokenizer()
    prompt_ids = llm_tok.encode("hi", add_special_tokens=True)
    ids = hf_greedy(llama_dir, [prompt_ids], 4, ignore_eos=False)[0]
    assert repr(llm_tok.decode(ids, skip_special_tokens=True)) in out
    assert int(m.group(1)) == len(ids)


def test_generate_reports_bad_memory(llama_dir: Path, capsys: pytest.CaptureFixture):
    rc = main(["generate", str(llama_dir), "--prompt", "hi", "--kv-cache-memory", "64KiB"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "error: kv_cache_memory" in err and "max_model_len" in err


def test_capacity_text_and_json_agree_with_engine(llama_dir: Path,
                                                  capsys: pytest.CaptureFixture):
    args = ["capacity", str(llama_dir), "--kv-cache-memory", "1MiB", "--max-model-len", "128"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "LlamaForCausalLM" in text and "127 usable" in text
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["usable_blocks"] == 127 and report["blocks_per_request"] == 8
    assert report["kv_cache_size_tokens"] == 127 * 16
    # The engine builds the pool the report describes.
    llm = LLM(str(llama_dir), max_model_len=128, kv_cache_memory=1 << 20)
    assert llm.engine.kv.pool.num_usable == report["usable_blocks"]
    assert llm.engine.kv_config.page_bytes == report["page_size_bytes"]


def test_capacity_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert main(["capacity", str(tmp_path / "nothing"), "--kv-cache-memory", "1MiB"]) == 1
    assert "no config.json" in capsys.readouterr().err
