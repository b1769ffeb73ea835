#!/usr/bin/env bash
# Set up tpbench from nothing: a venv in .venv, torch, the project and its test tools. Idempotent.
# torch comes first so the project's unpinned `torch` requirement does not pull another build:
# with no GPU, the CPU build (TPBENCH_TORCH, default torch==2.13.0); with nvidia-smi, PyPI's CUDA build.
# `--tests` adds what the test suite needs from the system (see the block at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
# Graphviz's dot lays out `tpbench diagram` (the Python binding only calls it), in DejaVu Sans.
if ! command -v dot >/dev/null 2>&1 || ! fc-list 2>/dev/null | grep -q "DejaVu Sans"; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz fonts-dejavu-core >/dev/null
fi
# A C++ compiler: inductor (train.compile) builds its CPU kernels with it.
if ! command -v g++ >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi
tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    *) echo "setup.sh: unknown option $arg (accepted: --tests)" >&2; exit 2 ;;
  esac
done
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

# -- The tests' system packages (--tests), from Debian -------------------------------------------------
# chromium: the HTML report opened in a real headless browser. postgresql: the database tests on a real
# server. slurm-wlm, slurmdbd, munge, mariadb-server: the one-node Slurm cluster (with accounting, which
# `sacct` needs) that the Slurm tests start. Each is installed only when missing; a test whose package
# could not be installed is skipped with the reason.
[ "$tests" = 1 ] || exit 0
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 || missing+=(postgresql)
for daemon in slurmctld:slurm-wlm slurmd:slurm-wlm slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server; do
  command -v "${daemon%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${daemon%%:*}" ] || missing+=("${daemon#*:}")
done
[ ${#missing[@]} = 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
as_root=()
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then as_root=(sudo -n); else as_root=(false); fi
fi
echo "setup.sh: installing Debian's ${missing[*]} (for the tests)" >&2
install_packages() {  # chromium with its recommended fonts; the daemons without extras
  local lean=() browser=()
  for package in "$@"; do
    if [ "$package" = chromium ]; then browser+=("$package"); else lean+=("$package"); fi
  done
  "${as_root[@]}" apt-get update -qq || return 1
  if [ ${#browser[@]} != 0 ]; then
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${browser[@]}" >/dev/null || return 1
  fi
  if [ ${#lean[@]} != 0 ]; then
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null || return 1
  fi
}
if ! command -v apt-get >/dev/null 2>&1 || [ "${as_root[*]}" = false ] || ! install_packages "${missing[@]}"; then
  echo "setup.sh: could not install ${missing[*]} (needs apt-get and root or passwordless sudo);" \
    "install them by hand, else the tests that need them are skipped with the reason" >&2
fi
