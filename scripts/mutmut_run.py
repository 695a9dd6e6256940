"""Run ``mutmut`` (generated mutants) on a few pagefold modules with the tests that cover them.

``scripts/mutate.py`` holds hand-written, semantic mutants; this runs mutmut's mechanical ones
(operators, constants, arguments) beside them. The repository is copied to a temporary
directory (the working tree is never touched; mutmut writes its ``mutants/`` tree there), a
``setup.cfg`` names what to mutate and which tests to run, and the survivors are printed with
their diffs for docs/TESTING.md, where each is killed by a test or argued equivalent.

    python scripts/mutmut_run.py pagefold/core/kv_cache_planner.py \\
        --tests tests/test_capacity.py tests/test_capacity_reality.py
    make mutants PKG=pagefold/core/kv_cache_planner.py TESTS="tests/test_capacity.py"
    make mutants PKG=pagefold/core/capacity.py TESTS="tests/test_capacity.py" \
        ONLY="*capacity_report__mutmut_*"

A mutant that loops forever is counted a timeout (a kill) after ``--timeout-multiplier`` x 2
times its tests' CPU time. ``--only`` keeps the mutants whose names match the glob patterns
(mutmut 3 names a method's mutants ``module.xǁClassǁmethod__mutmut_N`` and a function's
``module.x_function__mutmut_N``):
a large module is then tested where it is most at risk, with the tests that reach it.

Exit status: 0 when no mutant survived, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutate import ROOT, copy_repo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="+", help="files to mutate, e.g. pagefold/core/capacity.py")
    p.add_argument("--tests", nargs="+", required=True, help="test files or node ids to run")
    p.add_argument("--only", nargs="+", default=[], help="mutant name globs to run "
                   "(default: every mutant of the modules)")
    p.add_argument("--max-children", type=int, default=1, help="mutants run in parallel")
    p.add_argument("--timeout-multiplier", type=float, default=3.0, help="a mutant times out "
                   "after (its tests' time + 1 s) x this x 2 of CPU time (mutmut's default, 15, "
                   "let each mutant that loops forever spin for minutes on a 20 s selection)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy (its path "
                   "is printed) to inspect with `mutmut browse`")
    args = p.parse_args(argv)
    for m in args.modules:
        if not (ROOT / m).is_file():
            raise SystemExit(f"no such module: {m}")
    tmp = tempfile.mkdtemp(prefix="pagefold-mutmut-")
    root = Path(tmp)
    copy_repo(root)
    # mutmut reads [tool.mutmut] from pyproject.toml, else [mutmut] from setup.cfg.
    lines = ["[mutmut]", "source_paths=pagefold", f"timeout_multiplier={args.timeout_multiplier}",
             "only_mutate="]
    lines += [f"    {m}" for m in args.modules]
    lines += ["also_copy=", "    tests", "pytest_add_cli_args=", "    -p", "    no:cacheprovider",
              "pytest_add_cli_args_test_selection="]
    lines += [f"    {t}" for t in args.tests]
    (root / "setup.cfg").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # mutmut puts its mutants/ tree first on the path
    mutmut = [sys.executable, "-m", "mutmut"]
    run = subprocess.run([*mutmut, "run", "--max-children", str(args.max_children),
                          *args.only], cwd=root, env=env)
    results = subprocess.run([*mutmut, "results"], cwd=root, env=env, capture_output=True,
                             text=True)
    print(results.stdout)
    survivors = [ln.split(":")[0].strip() for ln in results.stdout.splitlines()
                 if ln.strip().endswith("survived")
                 and (not args.only or any(fnmatch(ln.split(":")[0].strip(), pat)
                                           for pat in args.only))]
    for name in survivors:
        diff = subprocess.run([*mutmut, "show", name], cwd=root, env=env, capture_output=True,
                              text=True)
        print(f"--- {name}\n{diff.stdout}")
    print(f"{len(survivors)} survived" + (f"; the copy is kept at {root}" if args.keep else ""))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(root)])
    return 0 if run.returncode == 0 and not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
