#!/usr/bin/env bash
# What only a GPU shows, in one short run on a machine with one GPU (about 5 minutes on an H200), beside
# what the CPU emulation says of the same configs. Not part of CI (CI has no GPU).
#   bash scripts/gpu-check.sh [OUT_DIR]          (PYTHON=... to pick the interpreter that has CUDA torch)
# Needs the project's dependencies importable (hydra-core, omegaconf, sqlalchemy besides torch).
# 1. every kind (validate, memory, throughput) at T = 1 on CUDA;
# 2. rank 0 of T = 2 for the seed's memory preset at L 8, emulated with real tensors on the GPU: the real
#    caching allocator's max_memory_allocated beside MemTracker's live-tensor peak; and the same config
#    emulated with fake tensors on the CPU (the allocator model), to compare;
# 3. MFU at H 2048, bf16, T = 1.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4
db="db.url=sqlite:///$out/gpu-check.db"
tpbench() { "$py" -m tpbench "$@"; }

tpbench run tp=1 device=cuda "$db" --json >"$out/t1.jsonl"
for flavour in real fake; do
  tpbench sweep +preset=seed_tp_memory layers=8 launch.device=cuda launch.emulate=$flavour "$db" --force \
    --name "seed-$flavour" --json >"$out/seed-$flavour.jsonl"
done
tpbench run kind=throughput tp=1 model=seed_memory hidden=2048 heads=16 kv_heads=8 dtype=bfloat16 \
  device=cuda "$db" --json >"$out/mfu.jsonl"

"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]
mib = lambda v: f"{v / 2**20:,.1f}" if v is not None else "-"
print("T = 1 on CUDA:", ", ".join(f"{r['kind']} {r['status']}" for r in rows("t1.jsonl")))
real = {r["mode"]: r["metrics"] for r in rows("seed-real.jsonl")}
fake = {r["mode"]: r["metrics"] for r in rows("seed-fake.jsonl")}
print("seed preset, L 8, rank 0 (MiB): mode | GPU max_memory_allocated | GPU live (MemTracker) |"
      " emulated live | allocator model | model - GPU")
for mode, m in real.items():
    f = fake.get(mode, {})
    gpu, model = m.get("max_memory_allocated_bytes"), f.get("modelled_max_memory_allocated_bytes")
    diff = f"{(model - gpu) / gpu:+.2%}" if gpu and model else "-"
    print(f"  {mode} | {mib(gpu)} | {mib(m.get('peak_bytes'))} | {mib(f.get('peak_bytes'))} | {mib(model)} | {diff}")
(mfu,) = rows("mfu.jsonl")
print(f"MFU at H 2048 bf16, T = 1: {mfu['metrics'].get('mfu', float('nan')):.3f} "
      f"({mfu['metrics'].get('tokens_per_s', 0):,.0f} tokens/s)")
PY
