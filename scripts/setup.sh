#!/usr/bin/env bash
# Set up tpbench from nothing: a venv in .venv, torch, the project and its test tools. Idempotent.
# torch comes first so the project's unpinned `torch` requirement does not pull another build:
# with no GPU, the CPU build (TPBENCH_TORCH, default torch==2.13.0); with nvidia-smi, PyPI's CUDA build.
# `--tests` adds what the test suite needs from the system (scripts/system-packages.sh).
#
# Debian's packages need root (or passwordless sudo). `tpbench run` needs none of them; without root
# they are skipped with one line saying what goes without them, and the tests that need them skip.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    *) echo "setup.sh: unknown option $arg (accepted: --tests)" >&2; exit 2 ;;
  esac
done

bash scripts/system-packages.sh $([ "$tests" = 1 ] && echo --tests)

# -- The venv ---------------------------------------------------------------------------------------
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
if ! $py -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $py -m pip install -q "${TPBENCH_TORCH:-torch}"
  else
    $py -m pip install -q "${TPBENCH_TORCH:-torch==2.13.0}"
  fi
fi
$py -m pip install -q -e ".[test]"

# The project's bytecode, once: an editable install compiles none of it, and where
# PYTHONDONTWRITEBYTECODE is set (as on this machine) no process writes it either, so
# every process (each rank of every run) compiled tpbench's modules again: 0.15-0.2 CPU s each.
# A module edited since is compiled afresh (its .pyc is stale), as without this.
$py -m compileall -q -j 0 tpbench tests benchmarks scripts >/dev/null
