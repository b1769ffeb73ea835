#!/usr/bin/env bash
# What only a GPU shows, in one short run on a machine with one GPU, beside what the CPU emulation
# and the theory say of the same configs. Not part of CI (CI has no GPU: tests/test_cuda_path.py runs
# every mode's training step on fake CUDA tensors there instead).
#   bash benchmarks/gpu-check.sh [OUT_DIR]          (PYTHON=... to pick the interpreter that has CUDA torch)
#   bash benchmarks/gpu-check.sh --dry [OUT_DIR]    its python parts on the CPU at a tiny shape, no GPU
#                                                   (steps 1 and 3 and the table; about 4 minutes on the
#                                                   project's 2-core EPYC, 3 of them compiling)
# Needs the project's dependencies importable (hydra-core, omegaconf, sqlalchemy, typer besides torch);
# runs on torch 2.11 too (the guards in tpbench/run/launch.py and tpbench/parallel/collectives.py).
# GPU_CHECK_SECONDS=N: stop each step still running N s after the start (a step cut short reads
# "timed out" in the log, its run in progress INTERRUPTED, and the runs after it are not in the
# table); default 840, so that the whole check stays within 15 minutes of a lease (start not included):
# the memory sweeps, last, are what a deadline cuts (--dry: 2400).
# About 7 minutes on one H200 before step 3 had a compiled run and profiles (docs/results/gpu-check.md,
# 2026-12-04: with GPU_CHECK_SECONDS=330 it stopped at 332 s with 5 of the 24 memory runs on the GPU
# left, which took 98 s more): steps 1, 4 and 3 75 s, then 10 to 20 s per memory run. Step 3 now
# compiles (inductor's first compile of a block: not measured on a GPU yet) and may profile twice:
# give GPU_CHECK_SECONDS 840 or more to run it whole.
# The fake-tensor sweep (step 2's emulated columns) runs on the CPU beside the GPU steps and ends
# before them: 24 runs in 315 s there (129 s alone on the project's 2-core AMD EPYC), so it cuts
# none of its configs.
# 1. every kind (validate, memory, throughput) at T = 1 on CUDA;
# 2. the busiest rank of every mode at T = 2, 4 and 8 (DTensor's at 2 and 4; DDP: one replica), the
#    seed's memory preset at L 8, emulated with real CUDA tensors on the GPU (launch.emulate=real: the
#    other ranks are the fake backend's): the real caching allocator's max_memory_allocated beside the
#    allocator model's prediction (tpbench.predict.theory with tpbench.predict.allocator, for this GPU), beside
#    MemTracker's live-tensor peak, and beside the same config emulated with fake tensors on the CPU
#    (its allocation trace replayed through the allocator model: run at the same time, on the CPU);
# 3. MFU at H 2048, L 8, heads 16/8, S 2048, micro-batch 2, bf16, T = 1 with CUDA timing (its record
#    says timing_cuda_events 1), compiled (train.compile=true: each block) and eager, against the goals
#    of issue 57 (MFU 40% compiled, 30% eager, of the GPU's dense bf16 peak; host_bound 0 compiled);
#    for each that misses one, benchmarks/mfu_profile.py: the host's issue time beside the device's
#    step and torch.profiler's breakdown of where the device's time goes, in OUT_DIR/profile-*.txt;
# 4. benchmarks/cuda_timing_check.py: CUDA-event times of a one-rank NCCL group's collectives (blocking,
#    hidden behind compute, waited at once) against NCCL's own per-work duration, printed at the end.
# The short steps (1, 4, 3) run first, the memory sweeps (2) last.
# What one GPU cannot show: NCCL between ranks (every collective here is the fake backend's, which
# moves no bytes and takes no time), hence neither the collectives' times and bandwidth, nor how much
# of them overlap hides, nor NCCL's own buffers, nor the values of a T > 1 job (validate at T > 1):
# the TP comparison on GPUs stays a prediction until a node of several GPUs is available.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
if [[ ${1:-} == --dry ]]; then
  dry=1
  shift
fi
out=${1:-runs/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4
# issue 57's goals for step 3: MFU compiled and eager, of the GPU's dense peak in train.dtype
export GOAL_MFU_COMPILED=0.40 GOAL_MFU_EAGER=0.30
started=$SECONDS
deadline=$((started + ${GPU_CHECK_SECONDS:-$((dry ? 2400 : 840))}))
exec 3>&2  # the script's own stderr: what say() writes goes there, whatever a step's stderr is
say() { echo "gpu-check [$((SECONDS - started)) s] $*" >&3; }
bounded() {  # COMMAND...: run it, stopped at the deadline (exit 124, as timeout says)
  local left=$((deadline - SECONDS))
  if ((left < 5)); then
    say "skipped, out of time: $*"
    return 124
  fi
  local rc=0
  timeout -k 10 "$left" "$@" || rc=$?
  ((rc != 124 && rc != 137)) || say "timed out: $*"
  return $rc
}
tpbench() { bounded "$py" -m tpbench "$@"; }

if ((dry)); then
  device=cpu gpu=-
  # step 3's shape, tiny: the python parts run as on the GPU, on the CPU's clock, and profile always
  mfu_shape=(hidden=64 heads=4 kv_heads=2 layers=2 seq=32 micro_batch=2 dtype=bfloat16)
  say "dry: no GPU, steps 1 and 3 on the CPU at a tiny shape; steps 2 and 4 skipped"
else
  device=cuda
  mfu_shape=(model=seed_memory hidden=2048 heads=16 kv_heads=8 layers=8 seq=2048 micro_batch=2
             dtype=bfloat16)
  # the machine, as the driver and torch see it
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true; } |
    sed 's/^/nvidia-smi: /' >&2
  "$py" - >&2 <<'PY' || true
import sys

import torch

p = torch.cuda.get_device_properties(0)
print(f"python {sys.version.split()[0]} | torch {torch.__version__} | CUDA {torch.version.cuda} | NCCL",
      torch.cuda.nccl.version(), f"| {p.name} | {p.multi_processor_count} SMs | {p.total_memory / 2**30:.1f} GiB")
PY
  gpu=$("$py" -c "import torch; from tpbench.predict.allocator import gpu_of; print(gpu_of(torch.cuda.get_device_name(0)) or 'H100')")
  # the time model's host term, probed on this host (the sourced figure it replaces: 8 us an op)
  "$py" -c "from tpbench.predict import host_probe; print(f'host: {host_probe.host_op_probe() * 1e6:.2f} us to issue an op')" >&2 || true
fi
memory() {  # FLAVOUR: the seed preset at L 8, every mode at T 2, 4, 8 and DDP, emulated (one db each)
  local flavour=$1 db="db.url=sqlite:///$out/memory-$1.db" rc=0
  local args=(+preset=seed_tp_memory layers=8 launch.device=cuda launch.emulate="$flavour"
              launch.emulate_gpu="$gpu" "$db" --force --json --name "memory-$flavour")
  # FSDP2 (ZeRO-2, FSDP) over 4 ranks, bf16 mixed: its streams and storage resizes against the real
  # allocator's max_memory_reserved (issue 59 item 4), first, as the deadline cuts the last runs
  tpbench sweep "${args[@]}" mode=ddp dp=4 dp_shard=grads,full precision=mixed || rc=1
  tpbench sweep "${args[@]}" mode=tp,tp_sp,tp_sp_linear,tp_vp,tp_sp_vp tp=2,4,8 || rc=1
  # DTensor's ColwiseParallel cannot replicate the seed's 4 KV heads over 8 ranks
  tpbench sweep "${args[@]}" mode=dtensor_tp,dtensor_tp_sp,dtensor_tp_vp,dtensor_tp_sp_vp tp=2,4 || rc=1
  tpbench sweep "${args[@]}" mode=ddp || rc=1
  say "memory $flavour: done (exit $rc)"
  return $rc
}
missed() {  # FLAVOUR: whether step 3's run of FLAVOUR missed a goal (or has no MFU: a dry run, a failure)
  "$py" - "$out/mfu-$1.jsonl" "$1" <<'PY'
import json, os, sys
from pathlib import Path

path, flavour = Path(sys.argv[1]), sys.argv[2]
text = path.read_text() if path.exists() else ""
runs = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
m = runs[0].get("metrics", {}) if runs else {}
goal = float(os.environ[f"GOAL_MFU_{flavour.upper()}"])
host_bound = flavour == "compiled" and m.get("host_bound", 0) >= 1
sys.exit(0 if m.get("mfu", 0.0) < goal or host_bound else 1)
PY
}

# Every step runs whatever an earlier one did; the table shows each run's status, and the script
# exits 1 if any failed.
failed=0
fake=
if ((!dry)); then
  # the fake-tensor emulation needs no GPU: on the CPU cores while the GPU runs the rest
  memory fake >"$out/memory-fake.jsonl" 2>"$out/memory-fake.log" &
  fake=$!
fi
db="db.url=sqlite:///$out/gpu-check.db"
say "1. every kind at T = 1 on $device${fake:+ (the fake-tensor sweep runs beside, on the CPU)}"
tpbench run tp=1 device="$device" "$db" --json >"$out/t1.jsonl" || failed=1
if ((!dry)); then
  say "4. the CUDA-event timing of collectives against NCCL's own duration, on a one-rank NCCL group"
  bounded "$py" benchmarks/cuda_timing_check.py >"$out/cuda-timing.txt" 2>&1 || failed=1
fi
for flavour in compiled eager; do
  compile=$([[ $flavour == compiled ]] && echo true || echo false)
  say "3. MFU $flavour (train.compile=$compile) at ${mfu_shape[*]}, T = 1, on $device"
  tpbench run kind=throughput tp=1 "${mfu_shape[@]}" compile="$compile" train.steps=30 device="$device" \
    "$db" --json >"$out/mfu-$flavour.jsonl" || failed=1
  if missed "$flavour"; then
    say "3. $flavour missed a goal: where the time goes, in $out/profile-$flavour.txt"
    bounded "$py" benchmarks/mfu_profile.py "$out/profile-$flavour.txt" "${mfu_shape[@]}" compile="$compile" \
      device="$device" >/dev/null 2>"$out/profile-$flavour.log" || failed=1
  fi
done
if ((!dry)); then
  say "2. the busiest rank of every mode on real CUDA tensors"
  memory real >"$out/memory-real.jsonl" || failed=1
  say "waiting for the fake-tensor sweep"
  wait "$fake" || { failed=1; echo "the fake-tensor emulation failed: see $out/memory-fake.log" >&2; }
fi

"$py" - "$out" "$gpu" "$((SECONDS - started))" "$device" <<'PY' | tee "$out/table.txt" || failed=1
import json, os, sys
from pathlib import Path

out, gpu, seconds, device = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].upper()


def rows(name):
    path = out / name
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]


def key(r):
    shard = r.get("config", {}).get("parallel", {}).get("dp_shard", "none")
    return r["mode"] + ("" if shard == "none" else f" dp {r['dp']} {shard}"), r["tp"]


mib = lambda v: f"{v / 2**20:,.1f}" if v is not None else "-"
pct = lambda a, b: f"{(a - b) / b:+.2%}" if a is not None and b else "-"
ms = lambda m, k: f"{m[k] * 1e3:.2f}" if k in m else "-"
fake = {key(r): r for r in rows("memory-fake.jsonl")}
table = [("check", "mode", "T", "status", "GPU allocated MiB", "model MiB", "model - GPU",
          "GPU live MiB", "emulated live MiB", "emulated allocated MiB", "emulated - GPU",
          "GPU reserved MiB", "emulated reserved MiB", "predicted reserved MiB", "predicted - GPU")]
for r in rows("t1.jsonl"):
    table.append((f"{r['kind']} on {device}", r["mode"], "1", r["status"], *["-"] * 11))
for r in rows("memory-real.jsonl"):
    m, f = r.get("metrics", {}), fake.get(key(r), {}).get("metrics", {})
    gpu_bytes = m.get("max_memory_allocated_bytes")
    model = m.get("predicted_max_memory_allocated_bytes")
    replay = f.get("modelled_max_memory_allocated_bytes")
    reserved, predicted = m.get("max_memory_reserved_bytes"), m.get("predicted_max_memory_reserved_bytes")
    table.append(("memory, busiest rank", key(r)[0], str(key(r)[1]), r["status"], mib(gpu_bytes), mib(model),
                  pct(model, gpu_bytes), mib(m.get("peak_bytes")), mib(f.get("peak_bytes")), mib(replay),
                  pct(replay, gpu_bytes), mib(reserved), mib(f.get("modelled_max_memory_reserved_bytes")),
                  mib(predicted), pct(predicted, reserved)))
real = {key(r) for r in rows("memory-real.jsonl")}
for k, r in fake.items():  # a config the GPU did not run (failed to launch, or cut by the deadline)
    if k not in real:
        f = r.get("metrics", {})
        table.append(("memory, fake only", k[0], str(k[1]), r["status"], "-", "-", "-", "-",
                      mib(f.get("peak_bytes")), mib(f.get("modelled_max_memory_allocated_bytes")), "-", "-",
                      mib(f.get("modelled_max_memory_reserved_bytes")),
                      mib(f.get("predicted_max_memory_reserved_bytes")), "-"))
wide = []  # rows whose fourth cell runs to the end of the line
for flavour in ("compiled", "eager"):
    goal = float(os.environ[f"GOAL_MFU_{flavour.upper()}"])
    if not rows(f"mfu-{flavour}.jsonl"):
        wide.append((f"throughput, {flavour}", "tp", "1", "no run recorded: see the log above"))
    for r in rows(f"mfu-{flavour}.jsonl"):
        m = r.get("metrics", {})
        # the step's time as the throughput experiment measures it on CUDA, any CUDA-timed figure, and
        # the host's issue time and host_bound where the run records them
        cuda = ", ".join(f"{k} {v:.4g}" for k, v in sorted(m.items()) if "cuda" in k or "event" in k)
        host = ", ".join(f"{k} {v:.4g}" for k, v in sorted(m.items()) if k.startswith("host") or "issue" in k)
        mfu = m.get("mfu")
        verdict = "no MFU (not on a GPU)" if mfu is None else (
            f"goal {goal:.0%} {'met' if mfu >= goal else f'missed by {(goal - mfu) * 100:.1f} points ({mfu / goal:.2f}x)'}")
        if flavour == "compiled" and "host_bound" in m:
            verdict += f", host_bound {m['host_bound']:.0f} (goal 0 {'met' if m['host_bound'] < 1 else 'missed'})"
        profiled = out / f"profile-{flavour}.txt"
        wide.append((f"throughput, {flavour}", r["mode"], "1",
                     f"{r['status']}: MFU {mfu if mfu is not None else float('nan'):.3f}, {verdict} (predicted "
                     f"{m.get('predicted_mfu', float('nan')):.3f}), {m.get('tokens_per_s', 0):,.0f} tokens/s, "
                     f"step {ms(m, 'step_time_s')} ms (p10 {ms(m, 'step_time_p10_s')}, p90 {ms(m, 'step_time_p90_s')};"
                     f" predicted {ms(m, 'predicted_step_time_s')}), first step (compiling) {m.get('first_step_s', float('nan')):.1f} s, "
                     f"{m.get('model_flops_per_step', 0) / 1e12:.3g} TFLOP per step"
                     + (f"; {host}" if host else "; no host issue time recorded") + (f"; {cuda}" if cuda else "")
                     + (f"; where the time goes: {profiled}" if profiled.exists() else "")
                     + (f"; {r['error']}" if r.get("error") else "")))
for r in rows("t1.jsonl") + rows("memory-real.jsonl") + rows("memory-fake.jsonl") + rows("mfu-compiled.jsonl") + rows("mfu-eager.jsonl"):
    if r.get("error"):
        wide.append(("error", r["mode"], str(key(r)[1]), f"{r['kind']}: {r['error']}"))
widths = [max(len(str(row[i])) for row in table + [w[:3] for w in wide] if i < len(row)) for i in range(len(table[0]))]
for row in table:
    print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
for row in wide:
    print(" | ".join(str(c).ljust(w) for c, w in zip(row[:3], widths)) + " | " + row[3])
print(f"{gpu} allocator model; {seconds} s in all. Not shown by one GPU: NCCL between ranks (the other "
      "ranks are the fake backend's: no bytes moved, no time taken), so neither collective times, "
      "bandwidth, overlap's hiding, NCCL's buffers, nor a T > 1 job's values: the TP comparison on GPUs "
      "stays a prediction until a node of several GPUs is available.")
PY
if [[ -f $out/cuda-timing.txt ]]; then
  echo "CUDA-event timing of collectives (benchmarks/cuda_timing_check.py, one rank, NCCL):" | tee -a "$out/table.txt"
  tee -a "$out/table.txt" <"$out/cuda-timing.txt"
fi
exit $failed
