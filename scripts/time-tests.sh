#!/usr/bin/env bash
# The suite's CPU, per test file: each file in a pytest of its own (its own launches; files that share a
# torchrun job pay for all of it alone), with the CPU time of pytest and every process it waited for.
#   bash scripts/time-tests.sh [FILE...] > times.tsv     (default: every tests/test_*.py but test_slurm.py)
#   columns: file, wall s, user s, sys s, user+sys s, pytest's last line
# CPU time (user+sys) is what compares between runs on a shared machine; wall time does not.
set -u
cd "$(dirname "$0")/.."
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    mapfile -t files < <(ls tests/test_*.py | grep -v test_slurm.py)
fi
printf "file\twall_s\tuser_s\tsys_s\tcpu_s\tresult\n"
for f in "${files[@]}"; do
    log=$(mktemp)
    /usr/bin/time -f "%e %U %S" -o "$log.time" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q \
        -p no:cacheprovider "$f" > "$log" 2>&1
    read -r wall user sys < "$log.time"
    printf "%s\t%s\t%s\t%s\t%.1f\t%s\n" "$f" "$wall" "$user" "$sys" "$(echo "$user + $sys" | bc)" \
        "$(tail -1 "$log")"
    rm -f "$log" "$log.time"
done
