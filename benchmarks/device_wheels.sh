#!/usr/bin/env bash
# Run HERE (not on the device): fetch the pure-Python wheels the device image may lack, in the
# versions this checkout is tested with, into .whl/ (git-ignored via .git/info/exclude), to be
# carried by the device call (64 MiB per call in all). See the device README's wheel notes.
set -euo pipefail
EX="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$EX" || echo '/.whl/' >> "$EX"
PY=${PY:-python3}
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
for pkg in transformers huggingface_hub; do
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d .whl "$pkg==$(ver "$pkg")"
done
du -sh .whl
