"""Offline engine reliability: Ctrl-C in the middle of ``LLM.generate`` frees the pool and
leaves the engine usable."""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_models import random_prompts


@pytest.fixture(scope="module")
def llm(qwen3_5_dir):
    return LLM(str(qwen3_5_dir), max_model_len=256, kv_cache_memory="8MiB",
               state_checkpoint_interval=32)


@pytest.mark.parametrize("where", ["execute", "after_step", "schedule"])
def test_keyboard_interrupt_mid_step_frees_the_pool(llm, monkeypatch, where):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 40, 90, 512, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    target = {"execute": llm.engine.runner, "after_step": llm.engine.kv,
              "schedule": llm.engine.scheduler}[where]
    real = getattr(target, where)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:  # mid-prefill of some, decoding for others
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    llm.engine.kv.check_whole()
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.requests
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == want
    llm.engine.kv.check_whole()


# ----------------------------------------------------------------------------- item 3
def test_max_model_len_checked_against_positions(qwen3_dir, monkeypatch):
    from pagefold.engine.core import EngineCore

    monkeypatch.delenv("PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    from pagefold.config import EngineConfig

    cfg = dict(model=str(qwen3_dir), kv_cache_memory="8MiB", warm_up=False)
    with pytest.raises(ValueError, match=r"max_model_len 4097 .* 4096 positions.*"
                                         r"--allow-long-max-model-len"):
        EngineCore(EngineConfig(max_model_len=4097, **cfg))
    assert EngineCore(EngineConfig(max_model_len=4096, **cfg)).max_model_len == 4096
    assert EngineCore(EngineConfig(**cfg)).max_model_len == 4096
    core = EngineCore(EngineConfig(max_model_len=5000, allow_long_max_model_len=True, **cfg))
    assert core.max_model_len == 5000
    monkeypatch.setenv("PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert EngineCore(EngineConfig(max_model_len=5000, **cfg)).max_model_len == 5000


@pytest.mark.parametrize("rope,limit", [
    ({"rope_type": "default", "rope_theta": 1e4}, 4096),
    ({"rope_type": "linear", "factor": 2.0}, 8192),
    ({"rope_type": "dynamic", "factor": 4.0}, 16384),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "yarn", "factor": 2.0}, 8192),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),
    ({"rope_type": "longrope", "factor": 4.0}, 4096),
    (None, 4096),
])
def test_derived_positions_follow_rope_scaling(rope, limit):
    from types import SimpleNamespace

    from pagefold.core.model_len import derived_max_positions, resolve_max_model_len

    cfg = SimpleNamespace(max_position_embeddings=4096, rope_parameters=rope)
    assert derived_max_positions(cfg) == limit
    assert resolve_max_model_len(None, cfg) == limit
    assert resolve_max_model_len(limit, cfg) == limit
    with pytest.raises(ValueError, match=f"{limit} positions"):
        resolve_max_model_len(limit + 1, cfg)


# ----------------------------------------------------------------------------- item 6
def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_config_names_the_file(qwen3_dir, tmp_path):
    d = _copy_model(qwen3_dir, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        LLM(str(d), max_model_len=64, kv_cache_memory="1MiB")


def test_truncated_safetensors_names_the_file(qwen3_dir, tmp_path):
    d = _copy_model(qwen3_dir, tmp_path / "m")
    (f,) = sorted(d.glob("*.safetensors"))
    data = f.read_bytes()
    for cut in (len(data) // 2, 20):  # inside the tensors, inside the header
        f.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{f.name}.*truncated"):
            LLM(str(d), max_model_len=64, kv_cache_memory="1MiB", warm_up=False)


def test_serve_reports_a_corrupt_config_by_name(qwen3_dir, tmp_path):
    import subprocess
    import sys

    d = _copy_model(qwen3_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "pagefold.entrypoints.cli", "serve", str(d),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config.json is not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_preemptions_logged_once_per_step(qwen3_dir, caplog):
    import logging

    small = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="312KiB",
                preemption_mode="recompute", warm_up=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 30, 40, 512, seed=5)]
    with caplog.at_level(logging.DEBUG, logger="pagefold"):
        small.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)
    per_request = [r for r in caplog.records if r.getMessage().startswith("preempting ")]
    summaries = [r for r in caplog.records if "request(s) this step" in r.getMessage()]
    total = small.engine.scheduler.num_preemptions
    assert total >= 2 and len(per_request) == total
    assert all(r.levelno == logging.DEBUG for r in per_request)
    assert all(r.levelno == logging.INFO for r in summaries)
    assert 1 <= len(summaries) <= total
    counted = sum(int(r.getMessage().split()[1]) for r in summaries)
    assert counted == total
    small.engine.kv.check_whole()


def test_aborted_requests_count_in_metrics(qwen3_dir):
    from pagefold.config import EngineConfig
    from pagefold.engine.client import AsyncEngineClient, _Tracked
    from pagefold.metrics import ServerMetrics

    m = ServerMetrics("m")
    client = AsyncEngineClient(EngineConfig(model=str(qwen3_dir)), metrics=m)

    def value(name: str, **labels) -> float:
        return m.registry.get_sample_value(name, dict(model_name="m", **labels)) or 0.0

    client._reqs["a"] = _Tracked(None, 0.0, 37)  # left before its first token
    client._reqs["b"] = _Tracked(None, 0.0, 11, num_tokens=3)  # counted at its first token
    client.abort("a")
    client.abort("b")
    client.abort("never-seen")
    assert value("pagefold:prompt_tokens_total") == 37
    assert value("pagefold:request_success_total", finished_reason="abort") == 2


# ----------------------------------------------------------------------------- item 7
def test_cache_salt_isolates_blocks_and_checkpoints(llm):
    """A hybrid (attention + GDN states): a hit needs both the attention blocks and a state
    checkpoint, and both are keyed by the salted chain."""
    (prompt,) = random_prompts(1, 100, 100, 512, seed=21)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(salt=None, in_prompt=False):
        p = {"prompt_token_ids": prompt}
        if in_prompt:
            p["cache_salt"] = salt
            salt = None
        (out,) = llm.generate(p, params, use_tqdm=False, cache_salt=salt)
        return out.num_cached_tokens, out.outputs[0].token_ids

    hit0, ref = run("tenant-a")
    assert hit0 == 0
    hit, toks = run("tenant-a")
    assert hit >= 64 and toks == ref  # same salt: shares blocks and the checkpoint
    for other in ("tenant-b", None):
        hit, toks = run(other)
        assert hit == 0 and toks == ref, other  # never crosses salts (or unsalted)
    hit, toks = run("tenant-b", in_prompt=True)  # the prompt dict's key, vLLM-style
    assert hit >= 64 and toks == ref
    llm.engine.kv.check_whole()
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, cache_salt="")
    llm.engine.kv.check_whole()


# ----------------------------------------------------------------------------- item 2 (engine)
def test_engine_max_logprobs(qwen3_dir):
    from pagefold.config import EngineConfig

    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(model=str(qwen3_dir), max_logprobs=21)
    small = LLM(str(qwen3_dir), max_model_len=64, kv_cache_memory="1MiB", max_logprobs=2,
                warm_up=False)
    with pytest.raises(ValueError, match=r"logprobs 3 is above this engine's max_logprobs \(2\)"):
        small.generate("hi", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    (out,) = small.generate("hi", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert all(len(e) >= 2 for e in out.outputs[0].logprobs)
    small.engine.kv.check_whole()
