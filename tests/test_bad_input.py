"""Bad input is refused up front with a ValueError that names the limit or the choices, and a
refused request leaves the engine serving with a whole pool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy

MAX_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=MAX_LEN, kv_cache_memory=1 << 20)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=-3), "max_tokens must be at least 1"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_too_long_names_max_model_len(llm: LLM):
    for n in (MAX_LEN, MAX_LEN + 50):
        with pytest.raises(ValueError, match=f"prompt has {n} tokens but max_model_len is 64"):
            llm.generate({"prompt_token_ids": [7] * n}, GREEDY, use_tqdm=False)
    llm.engine.kv.check_whole()


def test_rejected_request_in_a_batch_leaves_engine_serving(llm: LLM, llama_dir: Path):
    good = [[11, 12, 13, 14, 15], list(range(20, 50))]
    batch = [{"prompt_token_ids": good[0]}, {"prompt_token_ids": [9] * 100},
             {"prompt_token_ids": good[1]}]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    # Nothing of the rejected batch stays queued or holds blocks.
    assert not llm.engine.has_unfinished()
    llm.engine.kv.check_whole()
    with pytest.raises(ValueError, match=r"out of range \[0, 512\)"):
        llm.generate([{"prompt_token_ids": good[0]}, {"prompt_token_ids": [3, 512]}], GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([{"prompt_token_ids": g} for g in good], [GREEDY], use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": g} for g in good], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, good, 5)
    llm.engine.kv.check_whole()


def test_unknown_model_path(tmp_path: Path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="does not exist") as e:
        LLM(str(missing))
    assert str(missing) in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture_lists_choices(llama_dir: Path, tmp_path: Path):
    foo = tmp_path / "foo"
    shutil.copytree(llama_dir, foo)
    cfg = json.loads((foo / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (foo / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        LLM(str(foo))
    assert "FooForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_memory_too_small_for_one_request(llm: LLM, llama_dir: Path):
    cfg = llm.engine.kv_config
    block = cfg.layers_per_group * cfg.page_bytes
    need_blocks = -(-256 // cfg.block_size)
    short = need_blocks * block  # misses the null block: one usable block short
    with pytest.raises(ValueError, match="kv_cache_memory") as e:
        LLM(str(llama_dir), max_model_len=256, kv_cache_memory=short)
    msg = str(e.value)
    assert "max_model_len 256" in msg
    # The bytes the message asks for are enough.
    need = int(msg.split("(")[1].split(" bytes")[0])
    assert need > short
    ok = LLM(str(llama_dir), max_model_len=256, kv_cache_memory=need)
    assert ok.engine.kv.pool.num_usable >= need_blocks


@pytest.mark.parametrize("memory", [1000, 1])
def test_memory_smaller_than_a_block(llama_dir: Path, memory: int):
    with pytest.raises(ValueError, match="kv_cache_memory") as e:
        LLM(str(llama_dir), max_model_len=MAX_LEN, kv_cache_memory=memory)
    assert "max_model_len" in str(e.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be 'fcfs' or 'priority'"),
        (dict(block_size=12), "block_size must be"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(kv_cache_memory="lots"), "cannot parse a memory size"),
    ],
)
def test_bad_engine_options(llama_dir: Path, kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), max_model_len=MAX_LEN, **kwargs)
