#!/usr/bin/env bash
# The speed loop of docs/results/speed.md, balanced against the machine's drift: every setting once per
# repetition, the order reversed every other repetition, and the single-core GEMM rate measured before
# every run and after the last (a run's GEMM limit takes the mean of the rates either side of it).
# tpbench's runs go to DB; minimind-tron's steps (benchmarks/tron_step.py, from TRON's own venv) and the
# rates go to the log on stdout. benchmarks/speed_table.py makes its table from both.
#
#   bash benchmarks/speed_loop.sh > runs/speed.log      # REPS=4 SEED0=10 TRON=/tmp/tron DB=runs/speed.db
#   .venv/bin/python benchmarks/speed_table.py runs/speed.log runs/speed.db
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-4} SEED0=${SEED0:-10} TRON=${TRON:-/tmp/tron} DB=${DB:-runs/speed.db}
[[ -e $DB ]] && { echo "$DB exists: the loop wants a database of its own (a sweep skips what is in it)" >&2; exit 2; }
export OMP_NUM_THREADS=1
shape="model=minimind layers=4 seq=512 micro_batch=2 dtype=float32 train.fused_optimizer=true"
settings=("tp overlap=false" "tp overlap=true" "tp compile=true" "tp_sp overlap=false" "tp_sp overlap=true"
  "tp_vp overlap=false" "tp_vp overlap=true" "tp_vp compile=true" "tron 0 0" "tron 0 1" "tron 1 0" "tron 1 1")
rate() { echo "RATE $(.venv/bin/python benchmarks/gemm_rate.py | tail -1 | awk '{print $4}')"; }
for ((rep = 0; rep < REPS; rep++)); do
  seed=$((SEED0 + rep))
  order=$(seq 0 $((${#settings[@]} - 1)))
  if ((rep % 2)); then order=$(echo "$order" | tac); fi
  for i in $order; do
    read -r what a b <<< "${settings[$i]}"
    rate
    if [[ $what == tron ]]; then
      step=$("$TRON/venv/bin/torchrun" --nproc-per-node 2 benchmarks/tron_step.py --tron "$TRON" --sp "$a" \
        --async-comm "$b" --hidden 768 --layers 4 --seq 512 --batch 2 --seed "$seed" 2> /dev/null | tail -1)
      echo "RUN rep=$rep seed=$seed tron sp=$a async=$b $step"
    else
      rc=0
      .venv/bin/tpbench sweep kind=throughput train.seed="$seed" $shape mode="$what" "$a" \
        --name speed_loop db.url="sqlite:///$DB" > /dev/null 2>&1 || rc=$?
      echo "RUN rep=$rep seed=$seed tpbench $what $a rc=$rc"
    fi
  done
done
rate
