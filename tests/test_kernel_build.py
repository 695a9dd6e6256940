"""The compiled kernels build for every x86 level we support, not only for this host's CPU.

The real build uses ``-march=native``, so code guarded by one ISA's macros (AVX-512, AVX512-BF16,
AMX) can leave the others broken without any test on this host noticing: every caller then
silently takes its torch path. Each level is compiled here with ``-fsyntax-only`` (seconds).
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from pagefold.csrc import build

LEVELS = ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "sapphirerapids", "znver4"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", LEVELS)
def test_sources_compile_for_every_x86_level(march: str) -> None:
    cxx = build._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in build._FLAGS if f not in ("-march=native", "-shared")]
    res = subprocess.run([cxx, *flags, f"-march={march}", "-fsyntax-only",
                          *map(str, build._SOURCES)], capture_output=True, text=True,
                         timeout=300)
    if "unrecognized" in res.stderr or "bad value" in res.stderr:
        pytest.skip(f"this compiler does not know -march={march}")
    assert res.returncode == 0, res.stderr[-3000:]
