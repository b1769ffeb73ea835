#!/usr/bin/env bash
# Set up tpbench from nothing: a venv in .venv, torch, the project and its test tools. Idempotent.
# torch comes first so the project's unpinned `torch` requirement does not pull another build:
# with no GPU, the CPU build (TPBENCH_TORCH, default torch==2.13.0); with nvidia-smi, PyPI's CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Graphviz's dot lays out `tpbench diagram` (the Python binding only calls it), in DejaVu Sans.
if ! command -v dot >/dev/null 2>&1 || ! fc-list 2>/dev/null | grep -q "DejaVu Sans"; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz fonts-dejavu-core >/dev/null
fi
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
