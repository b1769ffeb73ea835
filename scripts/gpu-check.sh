#!/usr/bin/env bash
# What only a GPU shows, in one short run on a machine with one GPU, beside what the CPU emulation
# and the theory say of the same configs. Not part of CI (CI has no GPU: tests/test_cuda_path.py runs
# every mode's training step on fake CUDA tensors there instead).
#   bash scripts/gpu-check.sh [OUT_DIR]          (PYTHON=... to pick the interpreter that has CUDA torch)
# Needs the project's dependencies importable (hydra-core, omegaconf, sqlalchemy besides torch).
# Estimated 4-5 minutes on one H200 (not yet timed on one: the table prints the time it took).
# 1. every kind (validate, memory, throughput) at T = 1 on CUDA;
# 2. the busiest rank of every mode at T = 2, 4 and 8 (DTensor's at 2 and 4; DDP: one replica), the
#    seed's memory preset at L 8, emulated with real CUDA tensors on the GPU (launch.emulate=real: the
#    other ranks are the fake backend's): the real caching allocator's max_memory_allocated beside the
#    allocator model's prediction (tpbench.predict.theory with tpbench.predict.allocator, for this GPU), beside
#    MemTracker's live-tensor peak, and beside the same config emulated with fake tensors on the CPU
#    (its allocation trace replayed through the allocator model: run at the same time, on the CPU);
# 3. one throughput run with CUDA timing: MFU at H 2048, bf16, T = 1 (its record says timing_cuda_events 1);
# 4. scripts/cuda_timing_check.py: CUDA-event times of a one-rank NCCL group's collectives (blocking,
#    hidden behind compute, waited at once) against NCCL's own per-work duration, printed at the end.
# What one GPU cannot show: NCCL between ranks (every collective here is the fake backend's, which
# moves no bytes and takes no time), hence neither the collectives' times and bandwidth, nor how much
# of them overlap hides, nor NCCL's own buffers, nor the values of a T > 1 job (validate at T > 1).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4
started=$SECONDS
tpbench() { "$py" -m tpbench "$@"; }
gpu=$("$py" -c "import torch; from tpbench.predict.allocator import gpu_of; print(gpu_of(torch.cuda.get_device_name(0)) or 'H100')")
memory() {  # FLAVOUR: the seed preset at L 8, every mode at T 2, 4, 8 and DDP, emulated (one db each)
  local flavour=$1 db="db.url=sqlite:///$out/memory-$1.db" rc=0
  local args=(+preset=seed_tp_memory layers=8 launch.device=cuda launch.emulate="$flavour"
              launch.emulate_gpu="$gpu" "$db" --force --json --name "memory-$flavour")
  tpbench sweep "${args[@]}" mode=tp,tp_sp,tp_sp_linear,tp_vp,tp_sp_vp tp=2,4,8 || rc=1
  # DTensor's ColwiseParallel cannot replicate the seed's 4 KV heads over 8 ranks
  tpbench sweep "${args[@]}" mode=dtensor_tp,dtensor_tp_sp,dtensor_tp_vp,dtensor_tp_sp_vp tp=2,4 || rc=1
  tpbench sweep "${args[@]}" mode=ddp || rc=1
  return $rc
}

# Every step runs whatever an earlier one did; the table shows each run's status, and the script
# exits 1 if any failed.
failed=0
# the fake-tensor emulation needs no GPU: on the CPU cores while the GPU runs the rest
memory fake >"$out/memory-fake.jsonl" 2>"$out/memory-fake.log" &
fake=$!
db="db.url=sqlite:///$out/gpu-check.db"
tpbench run tp=1 device=cuda "$db" --json >"$out/t1.jsonl" || failed=1
memory real >"$out/memory-real.jsonl" || failed=1
tpbench run kind=throughput tp=1 model=seed_memory hidden=2048 heads=16 kv_heads=8 dtype=bfloat16 \
  device=cuda "$db" --json >"$out/mfu.jsonl" || failed=1
# the CUDA-event timing of collectives against NCCL's own duration, on a one-rank NCCL group
"$py" scripts/cuda_timing_check.py >"$out/cuda-timing.txt" 2>&1 || failed=1
wait "$fake" || { failed=1; echo "the fake-tensor emulation failed: see $out/memory-fake.log" >&2; }

"$py" - "$out" "$gpu" "$((SECONDS - started))" <<'PY'
import json, sys
from pathlib import Path

out, gpu, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


def rows(name):
    path = out / name
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]


def key(r):
    return r["mode"], r["tp"]


mib = lambda v: f"{v / 2**20:,.1f}" if v is not None else "-"
pct = lambda a, b: f"{(a - b) / b:+.2%}" if a is not None and b else "-"
ms = lambda m, k: f"{m[k] * 1e3:.2f}" if k in m else "-"
fake = {key(r): r for r in rows("memory-fake.jsonl")}
table = [("check", "mode", "T", "status", "GPU allocated MiB", "model MiB", "model - GPU",
          "GPU live MiB", "emulated live MiB", "emulated allocated MiB", "emulated - GPU")]
for r in rows("t1.jsonl"):
    table.append((f"{r['kind']} on CUDA", r["mode"], "1", r["status"], *["-"] * 7))
for r in rows("memory-real.jsonl"):
    m, f = r.get("metrics", {}), fake.get(key(r), {}).get("metrics", {})
    gpu_bytes = m.get("max_memory_allocated_bytes")
    model = m.get("predicted_max_memory_allocated_bytes")
    replay = f.get("modelled_max_memory_allocated_bytes")
    table.append(("memory, busiest rank", r["mode"], str(key(r)[1]), r["status"], mib(gpu_bytes), mib(model),
                  pct(model, gpu_bytes), mib(m.get("peak_bytes")), mib(f.get("peak_bytes")), mib(replay),
                  pct(replay, gpu_bytes)))
wide = []  # rows whose fourth cell runs to the end of the line
for r in rows("mfu.jsonl"):
    m = r.get("metrics", {})
    # the step's time as the throughput experiment measures it on CUDA, and any CUDA-timed figure
    cuda = ", ".join(f"{k} {v:.4g}" for k, v in sorted(m.items()) if "cuda" in k or "event" in k)
    wide.append(("throughput, H 2048 bf16", r["mode"], "1",
                 f"{r['status']}: MFU {m.get('mfu', float('nan')):.3f}, {m.get('tokens_per_s', 0):,.0f} tokens/s, "
                 f"step {ms(m, 'step_time_s')} ms (p10 {ms(m, 'step_time_p10_s')}, p90 {ms(m, 'step_time_p90_s')})"
                 + (f"; {cuda}" if cuda else "")))
widths = [max(len(str(row[i])) for row in table + [w[:3] for w in wide] if i < len(row)) for i in range(len(table[0]))]
for row in table:
    print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
for row in wide:
    print(" | ".join(str(c).ljust(w) for c, w in zip(row[:3], widths)) + " | " + row[3])
print(f"{gpu} allocator model; {seconds} s in all. Not shown by one GPU: NCCL between ranks (the other "
      "ranks are the fake backend's: no bytes moved, no time taken), so neither collective times, "
      "bandwidth, overlap's hiding, NCCL's buffers, nor a T > 1 job's values.")
PY
echo "CUDA-event timing of collectives (scripts/cuda_timing_check.py, one rank, NCCL):"
cat "$out/cuda-timing.txt"
exit $failed
