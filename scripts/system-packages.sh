#!/usr/bin/env bash
# Debian's packages that tpbench's commands and tests use, each installed only when missing; called by
# setup.sh. `tpbench run` needs none of them: without root (or passwordless sudo) they are skipped with
# one line saying what goes without them, and the tests that need them skip (with the reason).
set -euo pipefail
tests=0
[ "${1:-}" = --tests ] && tests=1
# graphviz, fonts-dejavu-core: `tpbench diagram` (Graphviz's dot lays it out, in DejaVu Sans).
# g++: inductor (train.compile) builds its CPU kernels with it.
# --tests: chromium (the HTML report and the diagram opened in a real headless browser), postgresql (the
# database tests on a real server), slurm-wlm, slurmdbd, munge, mariadb-server (the one-node Slurm
# cluster, with the accounting that `sacct` needs).
missing=()
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
fc-list 2>/dev/null | grep "DejaVu Sans" >/dev/null || missing+=(fonts-dejavu-core)  # no -q: fc-list, cut off, fails the pipe
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if [ "$tests" = 1 ]; then
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 || missing+=(postgresql)
  for daemon in slurmctld:slurm-wlm slurmd:slurm-wlm slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server; do
    command -v "${daemon%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${daemon%%:*}" ] || missing+=("${daemon#*:}")
  done
fi
# What goes without each package: the command that fails and the tests that skip without it.
without() {
  local package what=()
  for package in "$@"; do
    case "$package" in
      graphviz|fonts-dejavu-core) what+=("tpbench diagram fails, its tests skip") ;;
      g++) what+=("train.compile fails, and so do its tests") ;;
      chromium) what+=("the browser tests of the HTML report and the diagram skip") ;;
      postgresql) what+=("the PostgreSQL tests skip") ;;
      *) what+=("the Slurm tests skip") ;;
    esac
  done
  printf '%s\n' "${what[@]}" | sort -u | paste -sd';' - | sed 's/;/; /g'
}
as_root=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as_root=(sudo -n); else as_root=(false); fi
fi
install_packages() {  # chromium with its recommended fonts; the rest without extras
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
if [ ${#missing[@]} != 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  if [ "${as_root[*]}" = false ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: not root and no passwordless sudo (or no apt-get): skipping Debian's ${missing[*]}" \
      "(tpbench run needs none of them): $(without "${missing[@]}")" >&2
  else
    echo "setup.sh: installing Debian's ${missing[*]}" >&2
    install_packages "${missing[@]}" || {
      echo "setup.sh: apt-get could not install ${missing[*]}: $(without "${missing[@]}")" >&2
    }
  fi
fi

