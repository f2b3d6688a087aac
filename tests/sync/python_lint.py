"""The python_lint test: ruff over the fsdpx_sync package (python/fsdpx_sync), the Python sync tests
(tests/sync/*.py), the pytest checkpoint tests (tests/checkpoint: conftest.py, python_*_test.py) and the FSDP2
interop test with its helper (tests/models/dcp_interop_test.py, tests/support/gloo_ranks.py) and the docs' snippet
extractor (tests/docs/extract_snippets.py), mypy --strict over
the package and those tests, both with python/pyproject.toml's settings. Fails on
any finding; exits 77 (CTest: skipped) when ruff or mypy is not installed (tools/setup.sh installs both
into .venv).

    python_lint.py [--cache <dir>]      (ruff's and mypy's caches; default: none kept)
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
CONFIG = os.path.join(PYTHON, "pyproject.toml")
SKIPPED = 77


def run(what: str, command: list[str]) -> bool:
    started = time.monotonic()
    done = subprocess.run(command, cwd=PYTHON)
    print(f"python_lint: {what} {'passed' if done.returncode == 0 else 'FAILED'} in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return done.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="a folder for ruff's and mypy's caches (the build folder's)")
    args = ap.parse_args()
    missing = [m for m in ("ruff", "mypy") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"SKIPPED: {' and '.join(missing)} not installed in {sys.executable} (tools/setup.sh installs them)")
        return SKIPPED
    ruff_cache = ["--cache-dir", os.path.join(args.cache, "ruff")] if args.cache else ["--no-cache"]
    mypy_cache = ["--cache-dir", os.path.join(args.cache, "mypy") if args.cache else os.devnull]
    package = os.path.join(PYTHON, "fsdpx_sync")
    checkpoint = os.path.join(HERE, "..", "checkpoint")
    # with the helper they share with tests/models' FSDP2 interop test, and that test
    checkpoint_tests = sorted([os.path.join(checkpoint, "conftest.py"),
                               *glob.glob(os.path.join(checkpoint, "python_*_test.py")),
                               os.path.join(HERE, "..", "support", "gloo_ranks.py"),
                               os.path.join(HERE, "..", "models", "dcp_interop_test.py"),
                               os.path.join(HERE, "..", "docs", "extract_snippets.py")])
    ruff = run("ruff", [sys.executable, "-m", "ruff", "check", "--config", CONFIG, *ruff_cache, package,
                        *sorted(glob.glob(os.path.join(HERE, "*.py"))), *checkpoint_tests])
    mypy = run("mypy", [sys.executable, "-m", "mypy", "--config-file", CONFIG, *mypy_cache, package,
                        *checkpoint_tests])
    return 0 if ruff and mypy else 1


if __name__ == "__main__":
    sys.exit(main())
