"""The host allocator setting: applied once per process on glibc, opt-out by environment."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import ctypes, ctypes.util, platform
from pagefold.executor import host_malloc
first = host_malloc.keep_freed_memory()
print(first, host_malloc.keep_freed_memory(), platform.libc_ver()[0])
"""


def _run(env_value: str | None) -> list[str]:
    import os

    env = dict(os.environ)
    env.pop("PAGEFOLD_HOST_MALLOC", None)
    if env_value is not None:
        env["PAGEFOLD_HOST_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_set_once_on_glibc_and_opt_out():
    first, again, libc = _run(None)
    assert first == again  # the second call reports the first call's outcome
    if libc == "glibc":
        assert first == "True"
    assert _run("0")[:2] == ["False", "False"]
